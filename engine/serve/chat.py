"""The chat service's path that every API (OpenAI's, Ollama's, Anthropic's) shares: a request's
``Call`` made (schemas compiled off the event loop), submitted to the service with its tools rendered
into the conversation, and its text and reply carried from the scheduler thread to the event loop.
Each API shapes what comes out its own way; errors are ``ApiError``s, which the app's handlers put in
the shape of the API the request came to (``ApiError.body_for``).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from engine.errors import FleetError
from engine.runtime.decode.service import ChatService, ContextExceeded, Handle, Reply
from engine.serve.metrics import Metrics
from engine.serve.schema import ApiError, Call, ChatRequest, to_call, validation_error
from engine.serve.tools import prepare

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request checks that its client is still there
RETRY_AFTER_S = 2  # a 429's Retry-After: about a short reply's time, after which a stream has likely come free
# Schemas (response_format, tools) compile here, off the event loop: a large one takes seconds.  A
# pool of their own, so that hostile schemas queue behind each other, not before other requests'
# work in the loop's default executor.
_GRAMMARS = ThreadPoolExecutor(2, thread_name_prefix="api-grammar")


async def call_of(body: ChatRequest | dict, names: dict[str, str] | None = None) -> Call:
    """``to_call`` of a chat request (or of the dict of one another API translated), in the grammar
    pool when it has a schema to compile; ``names``: its errors' fields as that API names them."""
    try:
        if isinstance(body, dict):
            body = ChatRequest.model_validate(body)
        if body.tools or (body.response_format is not None and body.response_format.type != "text"):
            return await asyncio.get_running_loop().run_in_executor(_GRAMMARS, to_call, body)
        return to_call(body)
    except ValidationError as exc:
        error = validation_error(list(exc.errors()))
        raise error.renamed(names) if names else error from None
    except ApiError as exc:
        raise exc.renamed(names) if names else exc from None


def check_model(name: str, model_id: str, *also: str) -> None:
    if name != model_id and name not in also:
        raise ApiError(404, f"model: {name!r} is not served here; this server serves {model_id!r}", "model",
                       code="model_not_found")


class Pipe:
    """Carries a request's text pieces and its reply from the scheduler thread to the event loop."""

    def __init__(self, metrics: Metrics | None = None):
        self.metrics = metrics
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def text(self, piece: str, _tokens: int) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, piece)

    def done(self, reply: Reply) -> None:
        if self.metrics is not None:
            self.metrics.observe_reply(reply)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, reply)


def admit(service: ChatService, request: Request) -> None:
    """Refuses a request with 429 while the app's ``max_waiting`` requests (or more) wait for a
    stream, rather than queueing without bound.  Requests checked before the ones ahead reach the
    queue may pass together: at most the event loop's executor's threads, which submit them."""
    limit = request.app.state.max_waiting
    waiting = service.queued
    if waiting >= limit:
        raise ApiError(429, f"the server is busy: every stream is taken, and requests waiting for one: {waiting}, at "
                            f"most {limit} (the setting api_max_waiting); try again in a few seconds",
                       kind="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})


async def submit(service: ChatService, call: Call, request: Request, chat: bool = True) -> tuple[Pipe, Handle]:
    """Submits a single-choice ``call`` (a chat's tools rendered into its conversation): its text
    comes through the pipe when it streams, its reply always."""
    admit(service, request)
    pipe = Pipe(request.app.state.metrics)
    messages, template_tools = prepare(call.messages, call.tools, service.tokenizer) if chat else (call.messages, None)
    try:  # tokenizing a long conversation takes a while: off the event loop, which keeps serving
        handle = await asyncio.to_thread(
            service.submit, messages, call.max_tokens, pipe.text if call.stream else None, pipe.done,
            chat=call.chat, sampling=call.sampling, stop=call.stop, ignore_eos=call.ignore_eos, fit="refuse",
            grammar=call.grammar, tools=template_tools, logprobs=call.logprobs)
    except ContextExceeded as exc:
        raise ApiError(400, str(exc), ("messages" if chat else "prompt") if exc.prompt_full else call.limit_field,
                       code="context_length_exceeded") from None
    except FleetError as exc:
        raise ApiError(503, str(exc), kind="server_error", code="service_unavailable") from None
    return pipe, handle


async def wait(pipe: Pipe, handle: Handle, request: Request) -> Reply | None:
    """The reply of a request that does not stream; None (and the request cancelled) when its
    client has gone."""
    while True:
        try:
            return await asyncio.wait_for(pipe.queue.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                handle.cancel()
                return None


SSE = "text/event-stream"


async def answer(pipe: Pipe, handle: Handle, request: Request, stream: bool, events, whole, media_type: str = SSE):
    """The reply as the client asked for it: ``events()`` (what to send as it is made) streamed, or
    ``whole(reply)`` once it is done; 499 when the client has gone (nobody reads it)."""
    if stream:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"} if media_type == SSE else None
        return StreamingResponse(events(), media_type=media_type, headers=headers)
    reply = await wait(pipe, handle, request)
    if reply is None:
        return Response(status_code=499)
    raise_for(reply)
    return whole(reply)


def error_for(reply: Reply) -> ApiError:
    if reply.context_error:
        return ApiError(400, reply.error, "messages", code="context_length_exceeded")
    return ApiError(503, f"the fleet could not finish the reply: {reply.error}", kind="server_error",
                    code="fleet_error")


def raise_for(reply: Reply) -> None:
    if reply.error:
        raise error_for(reply)
