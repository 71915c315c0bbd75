"""The ASGI application: OpenAI's chat and text completion endpoints over a ``ChatService``.

Each request is submitted to the service, whose scheduler thread produces text; the callbacks hand
it to the request's event loop.  A streamed reply is sent as server-sent events as it is made; a
client that goes away (streamed or not) has its request cancelled, which the service carries out
at the stream's next round.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import FleetError
from engine.runtime.decode.service import ChatService, Reply
from engine.serve.schema import ApiError, Call, ChatRequest, CompletionRequest, to_call, validation_error

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request checks that its client is still there


def create_app(service: ChatService, model_id: str, api_key: str | None = None) -> FastAPI:
    """The API for ``service``, serving it as ``model_id``; with ``api_key`` every request but
    ``/health`` must carry it as a bearer token."""
    app = FastAPI(title="fleetshard", version="1", docs_url=None, redoc_url=None)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def api_error(_request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        error = ApiError(exc.status_code, str(exc.detail), kind=kind)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        error = validation_error(list(exc.errors()))
        return JSONResponse(error.body(), status_code=error.status)

    def authorize(request: Request) -> None:
        if api_key:
            given = request.headers.get("authorization", "")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), api_key.encode()):
                why = "a wrong API key" if token else "no API key"
                raise ApiError(401, f"this server needs its API key as a bearer token; the request carries {why}",
                               code="invalid_api_key")

    # (a dependency, not a middleware: Starlette's middleware hides a client's disconnect from the route)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_id, "busy": service.busy, "streams": service.streams}

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [_model_card(model_id, created)]}

    @v1.get("/models/{name}")
    async def model(name: str):
        _check_model(name, model_id)
        return _model_card(model_id, created)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        _check_model(body.model, model_id)
        return await _complete(service, to_call(body), request, model_id, chat=True)

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model, model_id)
        return await _complete(service, to_call(body), request, model_id, chat=False)

    app.include_router(v1)
    return app


def _model_card(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "fleetshard"}


def _check_model(name: str, model_id: str) -> None:
    if name != model_id:
        raise ApiError(404, f"model: {name!r} is not served here; this server serves {model_id!r}", "model",
                       code="model_not_found")


class _Pipe:
    """Carries a request's text pieces and its reply from the scheduler thread to the event loop."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def text(self, piece: str, _tokens: int) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, piece)

    def done(self, reply: Reply) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, reply)


async def _complete(service: ChatService, call: Call, request: Request, model_id: str, chat: bool):
    pipe = _Pipe()
    max_tokens = call.max_tokens or max(service.max_length // 4, 1)
    try:
        handle = service.submit(call.messages, max_tokens, pipe.text if call.stream else None, pipe.done,
                                chat=call.chat, sampling=call.sampling, stop=call.stop, ignore_eos=call.ignore_eos)
    except FleetError as exc:
        raise ApiError(503, str(exc), kind="server_error", code="service_unavailable") from None
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    shape = _Shape(ident, model_id, chat)
    if call.stream:
        return StreamingResponse(_events(pipe, handle, shape, call.include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    reply = await _wait(pipe, handle, request)
    if reply is None:
        return Response(status_code=499)  # the client has gone: nobody reads this
    _raise_for(reply)
    return shape.whole(reply)


async def _wait(pipe: _Pipe, handle, request: Request) -> Reply | None:
    while True:
        try:
            return await asyncio.wait_for(pipe.queue.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                handle.cancel()
                return None


async def _events(pipe: _Pipe, handle, shape: "_Shape", include_usage: bool):
    try:
        if shape.chat:
            yield shape.event(shape.chunk(role=True))
        while True:
            item = await pipe.queue.get()
            if isinstance(item, Reply):
                break
            yield shape.event(shape.chunk(text=item))
        if item.error:
            yield shape.event(_error_for(item).body())
        else:
            yield shape.event(shape.chunk(finish=item.finish_reason))
            if include_usage:
                yield shape.event({**shape.head("chunk"), "choices": [], "usage": _usage(item)})
        yield "data: [DONE]\n\n"
    finally:  # the client went away (the server cancels this generator), or the reply is done
        if not handle.done:
            handle.cancel()


def _error_for(reply: Reply) -> ApiError:
    if reply.context_error:
        return ApiError(400, reply.error, "messages", code="context_length_exceeded")
    return ApiError(503, f"the fleet could not finish the reply: {reply.error}", kind="server_error",
                    code="fleet_error")


def _raise_for(reply: Reply) -> None:
    if reply.error:
        raise _error_for(reply)


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

    def head(self, kind: str) -> dict:
        obj = ("chat.completion" if self.chat else "text_completion") + (".chunk" if kind == "chunk" and self.chat else "")
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
            choice = {"index": 0, "message": {"role": "assistant", "content": reply.text}, "logprobs": None,
                      "finish_reason": reply.finish_reason}
        else:
            choice = {"index": 0, "text": reply.text, "logprobs": None, "finish_reason": reply.finish_reason}
        return {**self.head("whole"), "choices": [choice], "usage": _usage(reply)}

    @staticmethod
    def event(doc: dict) -> str:
        return f"data: {json.dumps(doc, separators=(',', ':'))}\n\n"
