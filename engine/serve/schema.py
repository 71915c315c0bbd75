"""The API's request bodies, checked field by field, and its OpenAI-shaped errors.

Pydantic checks types and refuses fields we do not know; ranges are checked once, by
``SamplingParams`` and here, so each error names the field it is about.  Fields OpenAI clients send
at their defaults (``n``, the penalties, ``logprobs``...) are accepted at those values and refused
otherwise: we do not pretend to honour what we ignore.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import BaseModel, ConfigDict

from engine.runtime.decode.sampling import SamplingError, SamplingParams

MAX_STOPS = 4


class ApiError(Exception):
    """An error response: HTTP status, OpenAI's error type and code, the field it is about."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension
    repetition_penalty: float | None = None  # extension
    ignore_eos: bool = False  # extension (as vLLM's): generate max_tokens whatever the model says
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # accepted at OpenAI's defaults only
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | int | None = None
    logit_bias: dict | None = None


class ChatRequest(_Common):
    messages: list[Message]
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Common):
    prompt: str | list[str]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


@dataclasses.dataclass
class Call:
    """What the chat service is asked for."""

    messages: list[dict]
    chat: bool
    max_tokens: int | None
    stop: list[str]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    ignore_eos: bool = False


_DEFAULT_ONLY = {"n": (None, 1), "best_of": (None, 1), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
                 "logprobs": (None, False, 0), "top_logprobs": (None, 0), "logit_bias": (None, {}), "echo": (False,),
                 "suffix": (None, ""), "parallel_tool_calls": (None, True)}


def to_call(request: ChatRequest | CompletionRequest) -> Call:
    """The service call a request asks for, or an ``ApiError`` naming the first field we cannot honour."""
    for field, allowed in _DEFAULT_ONLY.items():
        if field in request.model_fields_set and getattr(request, field, None) not in allowed:
            raise ApiError(400, f"{field}: only {allowed[-1]!r} is supported by this server", field)
    if isinstance(request, ChatRequest):
        if not request.messages:
            raise ApiError(400, "messages: at least one message is required", "messages")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in request.messages]
        chat = True
        max_tokens = request.max_completion_tokens or request.max_tokens
        limit_field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    else:
        prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
        if len(prompts) != 1:
            raise ApiError(400, "prompt: exactly one prompt per request is supported", "prompt")
        if not prompts[0]:
            raise ApiError(400, "prompt: must not be empty (there is nothing to continue)", "prompt")
        messages, chat = [{"role": "user", "content": prompts[0]}], False
        max_tokens, limit_field = request.max_tokens, "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"{limit_field}: must be at least 1, not {max_tokens}", limit_field)
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if len(stop) > MAX_STOPS or not all(stop):
        raise ApiError(400, f"stop: up to {MAX_STOPS} non-empty strings", "stop")
    given = {f: getattr(request, f) for f in ("temperature", "top_p", "top_k", "repetition_penalty", "seed")
             if getattr(request, f) is not None}
    try:
        sampling = SamplingParams(**{"temperature": 1.0, **given})  # OpenAI's default temperature is 1
    except SamplingError as exc:
        raise ApiError(400, str(exc), exc.field) from None
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    if request.stream_options is not None and not request.stream:
        raise ApiError(400, "stream_options: only allowed when stream is true", "stream_options")
    return Call(messages, chat, max_tokens, stop, sampling, request.stream, include_usage, request.ignore_eos)


def validation_error(errors: list[dict]) -> ApiError:
    """Pydantic's first complaint as an OpenAI-shaped 400 naming the field (``messages[0].role``)."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    parts = [p for p in first.get("loc", ()) if p != "body"]
    # a union's failed branches add their type names to the path: keep the request's own fields
    parts = [p for p in parts if isinstance(p, int) or not any(c in str(p) for c in "[]") and p not in
             ("str", "int", "float", "bool", "list", "dict", "list[str]", "list[TextPart]")]
    param = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(parts))
    if first.get("type") == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {param}", param or None)
    if first.get("type") == "json_invalid" or not param:
        return ApiError(400, f"the request body is not a valid JSON object ({first.get('msg', '')})")
    return ApiError(400, f"{param}: {first.get('msg', 'invalid value')}", param)
