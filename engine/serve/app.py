"""The ASGI application: OpenAI's chat and text completion endpoints over a ``ChatService``, with
Anthropic's Messages API (``anthropic``) and Ollama's (``ollama``) beside them on the same path (``chat``).

Each request is submitted to the service, whose scheduler thread produces text; the callbacks hand
it to the request's event loop.  A streamed reply is sent as server-sent events as it is made; a
client that goes away (streamed or not) has its request cancelled, which the service carries out
at the stream's next round.

With a document collection (the setting ``api_documents``), a chat request is grounded in it as the
app's chat is (``engine.conversation.sources``): the passages that best match its last question go
in the prompt as numbered sources, and the reply lists them in a ``sources`` field (a streamed one
in its first chunk).  A request sends ``"documents": false`` to be answered without them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.config import Settings
from engine.conversation.sources import find_sources, last_question, with_sources
from engine.documents.collection import Collection
from engine.documents.readers import DocumentError
from engine.errors import FleetError
from engine.runtime.decode.service import ChatService, ContextExceeded, Reply
from engine.serve import anthropic, ollama
from engine.serve.chat import (DISCONNECT_POLL_S, Pipe, admit, answer, call_of, check_model, error_for, raise_for,
                               submit)
from engine.serve.guard import RequestGuard
from engine.serve.metrics import CONTENT_TYPE, Metrics
from engine.serve.request_log import BODY_CHARS, RequestLog
from engine.serve.schema import (ApiError, Call, ChatRequest, CompletionRequest, ResponsesRequest, responses_call,
                                 to_call, validation_error)
from engine.serve.tools import CallStream, parse_reply, prepare

MB = 1 << 20


def create_app(service: ChatService, model_id: str, api_key: str | None = None,
               max_body_mb: float = Settings.api_max_body_mb, local: bool = False,
               max_waiting: int = Settings.api_max_waiting, log: RequestLog | None = None,
               documents: Collection | None = None) -> FastAPI:
    """The API for ``service``, serving it as ``model_id``; with ``api_key`` every ``/v1`` and ``/api``
    request must carry it (``guard``); bodies up to ``max_body_mb``; ``local``: it listens on
    loopback, and answers only to loopback Host names (``guard``); with ``max_waiting`` requests
    waiting for a stream, the next is answered 429 (``chat.admit``); ``log``: every request is
    logged there once it ends (``request_log``); ``documents``: the collection that grounds chat
    completions (see above)."""
    app = FastAPI(title="fleetshard", version="1", docs_url=None, redoc_url=None)
    created = int(time.time())
    metrics = app.state.metrics = Metrics(service)
    app.state.max_waiting = max_waiting
    app.add_middleware(RequestGuard, api_key=api_key, max_body=int(max_body_mb * MB), local=local)
    app.add_middleware(_CountStatus, metrics=metrics, log=log)  # added last, outermost: it counts the guard's refusals

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body_for(request.url.path), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        error = ApiError(exc.status_code, str(exc.detail), kind=kind)
        return JSONResponse(error.body_for(request.url.path), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        error = validation_error(list(exc.errors()))
        return JSONResponse(error.body_for(request.url.path), status_code=error.status)

    v1 = APIRouter(prefix="/v1")  # the API key is the guard's to check, before the body is read

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_id, "busy": service.busy, "streams": service.streams}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [_model_card(model_id, created)]}

    @v1.get("/models/{name}")
    async def model(name: str):
        check_model(name, model_id)
        return _model_card(model_id, created)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        check_model(body.model, model_id)
        call = await call_of(body)
        sources = await _ground(call, documents, body.documents)
        return await _complete(service, call, request, model_id, chat=True, sources=sources)

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model, model_id)
        return await _complete(service, to_call(body), request, model_id, chat=False)

    @v1.post("/responses")
    async def responses(body: ResponsesRequest, request: Request):
        check_model(body.model, model_id)
        return await _respond(service, responses_call(body), body, request, model_id)

    app.include_router(v1)
    app.include_router(anthropic.router(service, model_id))
    app.include_router(ollama.router(service, model_id))
    return app


def _model_card(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "fleetshard"}


ENDPOINTS = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/responses",
             "/v1/messages", "/api/chat", "/api/generate", "/api/tags", "/api/show", "/api/version")


class _CountStatus:
    """Counts every response by endpoint and status, and with a ``log`` logs each request once it
    ends, with the first of its body (a plain ASGI middleware: it leaves the request's messages, and
    so a client's disconnect, to the route)."""

    def __init__(self, app, metrics: Metrics, log: RequestLog | None = None):
        self.app, self.metrics, self.log = app, metrics, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "/v1/models/{name}" if path.startswith("/v1/models/") else "other"
        started, status, body = time.perf_counter(), None, bytearray()

        async def counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                self.metrics.observe_status(endpoint, status)
            await send(message)

        async def read():
            message = await receive()
            if message["type"] == "http.request" and len(body) < BODY_CHARS * 4:
                body.extend(message.get("body", b"")[: BODY_CHARS * 4 - len(body)])
            return message

        try:
            await self.app(scope, receive if self.log is None else read, counted)
        finally:
            if self.log is not None:
                client = scope.get("client") or ("", 0)
                self.log.add(scope["method"], path, status, started, str(client[0]), bytes(body))


async def _ground(call: Call, documents: Collection | None, wanted: bool | None) -> list[dict]:
    """The sources of ``documents`` for the call's last question, put in its prompt (none when the
    server offers no documents or the request declines them)."""
    if wanted and documents is None:
        raise ApiError(400, "documents: this server offers no documents (the setting api_documents)", "documents")
    if documents is None or wanted is False:
        return []
    try:  # a search reads the index from disk: off the event loop
        sources = await asyncio.to_thread(find_sources, documents, last_question(call.messages))
    except DocumentError as exc:
        raise ApiError(503, f"the server's documents cannot be read: {exc}", kind="server_error") from None
    call.messages = with_sources(call.messages, sources)
    return sources


async def _complete(service: ChatService, call: Call, request: Request, model_id: str, chat: bool,
                    sources: list[dict] = ()):
    if call.sampling.logit_bias:
        vocab = service.chain.spec.vocab_size
        if any(token >= vocab for token, _ in call.sampling.logit_bias):
            raise ApiError(400, f"logit_bias: token ids go up to {vocab - 1} (this model's vocabulary)", "logit_bias")
    if call.n > 1 or (call.prompts and len(call.prompts) > 1) or call.echo:
        return await _complete_many(service, call, request, model_id, chat)
    pipe, handle = await submit(service, call, request, chat)
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    shape = _Shape(ident, model_id, chat)
    shape.tool_names = call.tools.names if call.tools else None
    shape.sources = list(sources)
    if call.logprobs is not None:
        shape.decode = service.tokenizer.decode
    return await answer(pipe, handle, request, call.stream, lambda: _events(pipe, handle, shape, call.include_usage),
                        shape.whole)


class _Tagged(Pipe):
    """A pipe of one choice among several, into a queue they share: items come as (choice, item)."""

    def __init__(self, metrics: Metrics, queue: asyncio.Queue, index: int):
        super().__init__(metrics)
        self.queue, self.index = queue, index

    def text(self, piece: str, _tokens: int) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, piece))

    def done(self, reply: Reply) -> None:
        if self.metrics is not None:
            self.metrics.observe_reply(reply)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, reply))


async def _complete_many(service: ChatService, call: Call, request: Request, model_id: str, chat: bool):
    """Several choices: ``n`` per prompt, for each of a completions request's prompts (choice
    ``i * n + j`` is prompt i's j-th, seeded ``seed + j``).  The prompts run at once on the service's
    streams, a prompt's choices one after another on one stream, so that its prompt is prefilled once
    (the others find it in the stream's cache; not with ``echo``'s log-probabilities, prefilled whole);
    ``echo`` puts the prompt (and its log-probabilities) first; ``max_tokens`` 0 gives the prompt alone."""
    prompts = call.prompts or [call.messages]
    template_tools = None
    if chat:
        prompts[0], template_tools = prepare(call.messages, call.tools, service.tokenizer)
    queue: asyncio.Queue = asyncio.Queue()
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    jobs, handles, shapes = [], [], []
    for i, messages in enumerate(prompts):
        for j in range(call.n):
            seed = call.sampling.seed
            sampling = call.sampling if not j or seed is None or seed == -1 else \
                dataclasses.replace(call.sampling, seed=seed + j)
            jobs.append((i, messages, sampling))
    alone = call.max_tokens == 0  # the echoed prompt alone: one token is made, and left out
    admit(service, request)
    try:
        echo_logprobs = call.echo and call.logprobs is not None
        for index, (i, messages, sampling) in enumerate(jobs):
            pipe = _Tagged(request.app.state.metrics, queue, index)
            after = handles[-1] if index % call.n and not echo_logprobs else None
            handles.append(await asyncio.to_thread(
                service.submit, messages, 1 if alone else call.max_tokens,
                pipe.text if call.stream and not alone else None, pipe.done, chat=call.chat, sampling=sampling,
                stop=call.stop, ignore_eos=call.ignore_eos, fit="refuse", grammar=call.grammar, tools=template_tools,
                logprobs=call.logprobs, prompt_logprobs=echo_logprobs, after=after))
            shape = _Shape(ident, model_id, chat)
            shape.tool_names = call.tools.names if call.tools else None
            shape.decode = service.tokenizer.decode if call.logprobs is not None else None
            shapes.append(shape)
    except (ContextExceeded, FleetError) as exc:
        for handle in handles:
            handle.cancel()
        if isinstance(exc, ContextExceeded):
            param = ("messages" if chat else "prompt") if exc.prompt_full else call.limit_field
            raise ApiError(400, str(exc), param, code="context_length_exceeded") from None
        raise ApiError(503, str(exc), kind="server_error", code="service_unavailable") from None
    echoes = [m[-1]["content"] if call.echo else "" for m in prompts]
    if call.stream:
        return StreamingResponse(_many_events(queue, handles, shapes, jobs, echoes, alone, call.include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    replies: list[Reply | None] = [None] * len(jobs)
    while any(r is None for r in replies):
        try:
            index, item = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                for handle in handles:
                    handle.cancel()
                return Response(status_code=499)
            continue
        if isinstance(item, Reply):
            replies[index] = _alone(item) if alone else item
    for reply in replies:
        raise_for(reply)
    choices = []
    for index, (reply, shape, (i, _, _)) in enumerate(zip(replies, shapes, jobs)):
        choice = shape.whole(reply)["choices"][0]
        choice["index"] = index
        if call.echo:
            choice["text"] = echoes[i] + choice["text"]
            if shape.decode is not None:
                shape._offset = 0
                choice["logprobs"] = shape.logprobs((reply.prompt_logprobs or []) + (reply.logprobs or []))
        choices.append(choice)
    return {**shapes[0].head("whole"), "choices": choices, "usage": _usage_of(replies, jobs)}


async def _respond(service: ChatService, call: Call, body, request: Request, model_id: str):
    """A Responses API reply: text in, one output message of text out (streamed as its events)."""
    admit(service, request)
    pipe = Pipe(request.app.state.metrics)
    try:
        handle = await asyncio.to_thread(service.submit, call.messages, call.max_tokens,
                                         pipe.text if call.stream else None, pipe.done, sampling=call.sampling,
                                         fit="refuse")
    except ContextExceeded as exc:
        raise ApiError(400, str(exc), "input" if exc.prompt_full else "max_output_tokens",
                       code="context_length_exceeded") from None
    except FleetError as exc:
        raise ApiError(503, str(exc), kind="server_error", code="service_unavailable") from None
    shape = _Response(f"resp_{uuid.uuid4().hex[:24]}", f"msg_{uuid.uuid4().hex[:24]}", model_id, body)
    return await answer(pipe, handle, request, call.stream, lambda: shape.events(pipe, handle), shape.whole)


class _Response:
    """The Responses API's bodies and stream events for one reply."""

    def __init__(self, ident: str, item: str, model_id: str, body):
        self.ident, self.item, self.model, self.body = ident, item, model_id, body
        self.created = int(time.time())
        self.sequence = 0

    def message(self, text: str, status: str) -> dict:
        content = [{"type": "output_text", "text": text, "annotations": []}] if status != "in_progress" else []
        return {"type": "message", "id": self.item, "status": status, "role": "assistant", "content": content}

    def whole(self, reply: Reply | None, text: str = "") -> dict:
        b = self.body
        doc = {"id": self.ident, "object": "response", "created_at": self.created, "model": self.model,
               "status": "in_progress", "output": [], "error": None, "incomplete_details": None,
               "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "metadata": b.metadata or {},
               "parallel_tool_calls": True, "temperature": b.temperature, "top_p": b.top_p, "tool_choice": "auto",
               "tools": [], "text": {"format": {"type": "text"}}, "truncation": "disabled", "usage": None,
               "user": b.user, "store": False}
        if reply is not None:
            cut = reply.finish_reason == "length"
            doc["status"] = "incomplete" if cut else "completed"
            doc["incomplete_details"] = {"reason": "max_output_tokens"} if cut else None
            doc["output"] = [self.message(reply.text, "incomplete" if cut else "completed")]
            doc["usage"] = {"input_tokens": reply.prompt_tokens, "output_tokens": len(reply.tokens),
                            "total_tokens": reply.prompt_tokens + len(reply.tokens),
                            "input_tokens_details": {"cached_tokens": reply.cached_tokens},
                            "output_tokens_details": {"reasoning_tokens": 0}}
        return doc

    def event(self, kind: str, **fields) -> str:
        doc = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(doc, separators=(',', ':'))}\n\n"

    async def events(self, pipe: Pipe, handle):
        where = {"item_id": self.item, "output_index": 0, "content_index": 0}
        try:
            yield self.event("response.created", response=self.whole(None))
            yield self.event("response.in_progress", response=self.whole(None))
            yield self.event("response.output_item.added", output_index=0, item=self.message("", "in_progress"))
            yield self.event("response.content_part.added", item_id=self.item, output_index=0, content_index=0,
                             part={"type": "output_text", "text": "", "annotations": []})
            while True:
                item = await pipe.queue.get()
                if isinstance(item, Reply):
                    break
                yield self.event("response.output_text.delta", **where, delta=item, logprobs=[])
            if item.error:
                error = error_for(item)
                yield self.event("error", code=error.code, message=error.message, param=error.param)
                return
            done = self.whole(item)
            yield self.event("response.output_text.done", **where, text=item.text, logprobs=[])
            yield self.event("response.content_part.done", item_id=self.item, output_index=0, content_index=0,
                             part=done["output"][0]["content"][0])
            yield self.event("response.output_item.done", output_index=0, item=done["output"][0])
            yield self.event("response.completed" if done["status"] == "completed" else "response.incomplete",
                             response=done)
        finally:
            if not handle.done:
                handle.cancel()


def _alone(reply: Reply) -> Reply:
    """A reply made for its prompt's log-probabilities (``max_tokens`` 0): its one token left out."""
    return dataclasses.replace(reply, text="", tokens=[], logprobs=[] if reply.logprobs is not None else None,
                               stopped_by="max_tokens")


def _usage_of(replies: list[Reply], jobs: list) -> dict:
    """Usage over several choices: each prompt counted once, every choice's tokens."""
    prompt = sum(r.prompt_tokens for r, (i, _, _), j in zip(replies, jobs, range(len(jobs)))
                 if j == 0 or jobs[j - 1][0] != i)
    made = sum(len(r.tokens) for r in replies)
    cached = sum(r.cached_tokens for r in replies)
    return {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _many_events(queue: asyncio.Queue, handles: list, shapes: list, jobs: list, echoes: list[str],
                       alone: bool, include_usage: bool):
    """The events of several choices, each chunk carrying its choice's index; an echoed prompt is
    each choice's first text."""
    replies: dict[int, Reply] = {}
    sent = [0] * len(jobs)
    calls = [CallStream(s.tool_names) if s.tool_names else None for s in shapes]

    def event(shape: _Shape, chunk: dict, index: int) -> str:
        chunk["choices"][0]["index"] = index
        return shape.event(chunk)

    try:
        for index, shape in enumerate(shapes):
            if shape.chat:
                yield event(shape, shape.chunk(role=True), index)
            elif echoes[jobs[index][0]]:
                yield event(shape, shape.chunk(text=echoes[jobs[index][0]]), index)
        while len(replies) < len(jobs):
            index, item = await queue.get()
            shape = shapes[index]
            if isinstance(item, Reply):
                replies[index] = reply = _alone(item) if alone else item
                if reply.error:
                    yield shape.event(error_for(reply).body())
                    continue
                chunks = shape.pieces(None, calls[index])
                called = calls[index] is not None and calls[index].called
                last = shape.chunk(finish="tool_calls" if called else reply.finish_reason)
                if shape.decode is not None and not alone:
                    shape.attach(last, handles[index].logprobs, sent[index])
                for chunk in [*chunks, last]:
                    yield event(shape, chunk, index)
                continue
            chunks = shape.pieces(item, calls[index])
            if chunks and shape.decode is not None:
                sent[index] = shape.attach(chunks[0], handles[index].logprobs, sent[index])
            for chunk in chunks:
                yield event(shape, chunk, index)
        if include_usage:
            ordered = [replies[i] for i in range(len(jobs))]
            yield shapes[0].event({**shapes[0].head("chunk"), "choices": [], "usage": _usage_of(ordered, jobs)})
        yield "data: [DONE]\n\n"
    finally:
        for handle in handles:
            if not handle.done:
                handle.cancel()


async def _events(pipe: Pipe, handle, shape: "_Shape", include_usage: bool):
    try:
        if shape.chat:
            first = shape.chunk(role=True)
            yield shape.event({**first, "sources": shape.sources} if shape.sources else first)
        calls = CallStream(shape.tool_names) if shape.tool_names else None
        sent = 0  # the tokens whose log-probabilities went out (with the first chunk after them)
        while True:
            item = await pipe.queue.get()
            if isinstance(item, Reply):
                break
            chunks = shape.pieces(item, calls)
            if chunks and shape.decode is not None:
                sent = shape.attach(chunks[0], handle.logprobs, sent)
            for chunk in chunks:
                yield shape.event(chunk)
        if item.error:
            yield shape.event(error_for(item).body())
        else:
            for chunk in shape.pieces(None, calls):
                yield shape.event(chunk)
            finish = "tool_calls" if calls is not None and calls.called else item.finish_reason
            last = shape.chunk(finish=finish)
            if shape.decode is not None:
                shape.attach(last, handle.logprobs, sent)
            yield shape.event(last)
            if include_usage:
                yield shape.event({**shape.head("chunk"), "choices": [], "usage": _usage(item)})
        yield "data: [DONE]\n\n"
    finally:  # the client went away (the server cancels this generator), or the reply is done
        if not handle.done:
            handle.cancel()


def _usage(reply: Reply) -> dict:
    usage = {"prompt_tokens": reply.prompt_tokens, "completion_tokens": len(reply.tokens),
             "total_tokens": reply.prompt_tokens + len(reply.tokens)}
    cached = getattr(reply, "cached_tokens", 0)
    usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


class _Shape:
    """The response bodies of one request, in the chat or the text-completion shape."""

    def __init__(self, ident: str, model_id: str, chat: bool):
        self.ident, self.model, self.chat = ident, model_id, chat
        self.created = int(time.time())
        self.tool_names: list[str] | None = None  # the tools a reply may call: its calls are parsed out
        self.decode = None  # the tokenizer's decode, when the request asked for log-probabilities
        self.sources: list[dict] = []  # the passages of the server's documents the prompt was given
        self._offset = 0  # text offset of the next token (completions' logprobs.text_offset)

    def token(self, token: int) -> tuple[str, list[int]]:
        text = self.decode([token])
        return text, list(text.encode("utf-8", "surrogatepass"))

    def logprobs(self, entries: list) -> dict:
        """OpenAI's ``logprobs`` of a choice for ``entries`` (``Reply.logprobs``): chat's ``content``
        list, or completions' parallel lists."""
        if self.chat:
            content = []
            for token, logprob, alternatives in entries:
                text, raw = self.token(token)
                top = [dict(zip(("token", "bytes"), self.token(t)), logprob=lp) for t, lp in alternatives]
                content.append({"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": top})
            return {"content": content, "refusal": None}
        doc = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, logprob, alternatives in entries:
            text = self.token(token)[0]
            doc["tokens"].append(text)
            doc["token_logprobs"].append(logprob)
            top = {self.token(t)[0]: lp for t, lp in alternatives}
            doc["top_logprobs"].append(top if logprob is not None else None)  # the first prompt token has none
            doc["text_offset"].append(self._offset)
            self._offset += len(text)
        return doc

    def attach(self, chunk: dict, entries: list, sent: int) -> int:
        """Puts the log-probabilities of the tokens made since ``sent`` on a streamed chunk."""
        new = entries[sent:]
        chunk["choices"][0]["logprobs"] = self.logprobs(new)
        return sent + len(new)

    def pieces(self, text: str | None, calls: CallStream | None) -> list[dict]:
        """The chunks of a streamed piece of text (None: the end of the reply): the text itself, or
        with tools, its text and its tool calls (one delta each, whole) once each call is closed."""
        if calls is None:
            return [self.chunk(text=text)] if text else []
        content, made = calls.push(text) if text is not None else calls.flush()
        chunks = [self.chunk(text=content)] if content else []
        for call in made:
            delta = {"tool_calls": [{"index": calls.called - len(made) + made.index(call), **call}]}
            chunks.append({**self.head("chunk"), "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                              "finish_reason": None}]})
        return chunks

    def head(self, kind: str) -> dict:
        obj = (("chat.completion" if self.chat else "text_completion")
               + (".chunk" if kind == "chunk" and self.chat else ""))
        return {"id": self.ident, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, text: str = "", role: bool = False, finish: str | None = None) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self.head("chunk"), "choices": [choice]}

    def whole(self, reply: Reply) -> dict:
        if self.chat:
            message, finish = parse_reply(reply.text, self.tool_names, reply.finish_reason)
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": reply.text, "logprobs": None, "finish_reason": reply.finish_reason}
        if reply.logprobs is not None and self.decode is not None:
            choice["logprobs"] = self.logprobs(reply.logprobs)
        whole = {**self.head("whole"), "choices": [choice], "usage": _usage(reply)}
        return {**whole, "sources": self.sources} if self.sources else whole

    @staticmethod
    def event(doc: dict) -> str:
        return f"data: {json.dumps(doc, separators=(',', ':'))}\n\n"
