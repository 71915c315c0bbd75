"""The API's request bodies, checked field by field, and its OpenAI-shaped errors.

Pydantic checks types and refuses fields we do not know; ranges are checked once, by
``SamplingParams`` and here, so each error names the field it is about.  Fields OpenAI clients send
at their defaults (``n``, ``best_of``, ``echo``, ``suffix``) are accepted at those values and refused
otherwise: we do not pretend to honour what we ignore.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.runtime.decode.grammar import GrammarError, compile_grammar
from engine.runtime.decode.sampling import MAX_LOGPROBS, SamplingError, SamplingParams
from engine.serve.tools import ToolPlan, plan_tools

MAX_STOPS = 4
MAX_N = 8  # choices per request (``n``)
MAX_PROMPTS = 32  # prompts in one completions request


class ApiError(Exception):
    """An error response: HTTP status, OpenAI's error type and code, the field it is about, and
    headers to send with it (a 429's ``Retry-After``)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def body_for(self, path: str) -> dict:
        """The body in the shape of the API ``path`` belongs to: Ollama's ``{"error": message}`` under
        ``/api/``, Anthropic's under ``/v1/messages``, else OpenAI's."""
        if path.startswith("/api/"):
            return {"error": self.message}
        if path == "/v1/messages" or path.startswith("/v1/messages/"):
            kind = _ANTHROPIC_KINDS.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        return self.body()

    def renamed(self, names: dict[str, str]) -> "ApiError":
        """This error with its field as another API names it (``{"stop": "stop_sequences"}``)."""
        for old, new in names.items():
            if self.param is not None and (self.param == old or self.param.startswith((old + ".", old + "["))):
                param = new + self.param[len(old):]
                message = self.message
                if message.startswith(self.param):
                    message = param + message[len(self.param):]
                return ApiError(self.status, message, param, self.kind, self.code, self.headers)
        return self


_ANTHROPIC_KINDS = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class CalledFunction(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    refusal: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionSpec(_Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


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
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    documents: bool | None = None  # extension: false answers without the server's documents (``api_documents``)


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
    grammar: str | None = None  # the constraint of response_format or tool_choice (``compile_grammar``)
    tools: ToolPlan | None = None  # the tools the reply may call, and how its calls are parsed
    limit_field: str = "max_tokens"  # the field that asked for max_tokens (named by its errors)
    logprobs: int | None = None  # alternatives per token to report with its log-probability (None: none)
    n: int = 1  # choices per prompt
    prompts: list[list[dict]] | None = None  # completions: every prompt's conversation (``messages``: the first)
    echo: bool = False  # completions: the prompt leads the text (and its logprobs the logprobs)


_DEFAULT_ONLY = {"suffix": (None, "")}


def to_call(request: ChatRequest | CompletionRequest) -> Call:
    """The service call a request asks for, or an ``ApiError`` naming the first field we cannot honour."""
    for field, allowed in _DEFAULT_ONLY.items():
        if field in request.model_fields_set and getattr(request, field, None) not in allowed:
            raise ApiError(400, f"{field}: only {allowed[-1]!r} is supported by this server", field)
    if isinstance(request, ChatRequest):
        if not request.messages:
            raise ApiError(400, "messages: at least one message is required", "messages")
        messages = [_message(m) for m in request.messages]
        chat = True
        given = request.max_completion_tokens
        max_tokens = given if given is not None else request.max_tokens
        limit_field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    else:
        prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
        if not 1 <= len(prompts) <= MAX_PROMPTS:
            raise ApiError(400, f"prompt: 1 to {MAX_PROMPTS} prompts, not {len(prompts)}", "prompt")
        for i, prompt in enumerate(prompts):
            if not prompt:
                where = "prompt" if isinstance(request.prompt, str) else f"prompt[{i}]"
                raise ApiError(400, f"{where}: must not be empty (there is nothing to continue)", "prompt")
        messages, chat = [{"role": "user", "content": prompts[0]}], False
        max_tokens, limit_field = request.max_tokens, "max_tokens"
    if max_tokens is not None and max_tokens < (0 if not chat and request.echo else 1):  # 0: the echoed prompt alone
        least = "at least 1 (0 only with echo)" if not chat else "at least 1"
        raise ApiError(400, f"{limit_field}: must be {least}, not {max_tokens}", limit_field)
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if len(stop) > MAX_STOPS or not all(stop):
        raise ApiError(400, f"stop: up to {MAX_STOPS} non-empty strings", "stop")
    fields = ("temperature", "top_p", "top_k", "repetition_penalty", "seed", "presence_penalty", "frequency_penalty")
    given = {f: getattr(request, f) for f in fields if getattr(request, f) is not None}
    if request.logit_bias:
        given["logit_bias"] = tuple(sorted(_logit_bias(request.logit_bias).items()))
    try:
        sampling = SamplingParams(**{"temperature": 1.0, **given})  # OpenAI's default temperature is 1
    except SamplingError as exc:
        raise ApiError(400, str(exc), exc.field) from None
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    if request.stream_options is not None and not request.stream:
        raise ApiError(400, "stream_options: only allowed when stream is true", "stream_options")
    call = Call(messages, chat, max_tokens, stop, sampling, request.stream, include_usage, request.ignore_eos,
                limit_field=limit_field, logprobs=_logprobs(request))
    call.n = request.n if request.n is not None else 1
    if not 1 <= call.n <= MAX_N:
        raise ApiError(400, f"n: 1 to {MAX_N} choices, not {call.n}", "n")
    if isinstance(request, CompletionRequest):
        call.prompts = [[{"role": "user", "content": p}] for p in prompts]
        call.echo = request.echo
        if call.echo and call.stream and call.logprobs is not None:
            raise ApiError(400, "logprobs: with echo, only in a reply that is not streamed", "logprobs")
        if request.best_of is not None and request.best_of != call.n:
            raise ApiError(400, f"best_of: only equal to n ({call.n}) is supported, not {request.best_of}", "best_of")
    if isinstance(request, ChatRequest):
        _structure(request, call)
    return call


def _logit_bias(given: dict) -> dict[int, float]:
    """``logit_bias``'s token ids (JSON object keys are strings) and biases, checked."""
    bias = {}
    for key, value in given.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ApiError(400, f"logit_bias: keys must be token ids, not {key!r}", "logit_bias") from None
        if token < 0:
            raise ApiError(400, f"logit_bias: keys must be token ids (0 or more), not {key!r}", "logit_bias")
        bias[token] = value
    return bias


def _logprobs(request: ChatRequest | CompletionRequest) -> int | None:
    """How many alternatives per token to report (None: no log-probabilities): chat's ``logprobs``
    (true/false) and ``top_logprobs``; completions' ``logprobs`` (a number of alternatives)."""
    given = request.logprobs
    if isinstance(request, ChatRequest):
        top = request.top_logprobs
        if given is not None and not isinstance(given, bool):
            raise ApiError(400, f"logprobs: must be true or false, not {given!r}", "logprobs")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise ApiError(400, f"top_logprobs: must be 0 to {MAX_LOGPROBS}, not {top!r}", "top_logprobs")
        if top and not given:
            raise ApiError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
        return (top or 0) if given else None
    if given is None:
        return None
    if isinstance(given, bool) or not 0 <= given <= MAX_LOGPROBS:
        raise ApiError(400, f"logprobs: must be a whole number of 0 to {MAX_LOGPROBS}, not {given!r}", "logprobs")
    return given


def _message(m: Message) -> dict:
    message = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.tool_calls:
        message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.name is not None and m.role == "tool":
        message["name"] = m.name
    return message


def _structure(request: ChatRequest, call: Call) -> None:
    """The grammar a chat reply must follow (``response_format``, or tools the reply must call) and
    the tools it may call."""
    if request.tools is not None and not request.tools:
        raise ApiError(400, "tools: give at least one tool, or leave tools out", "tools")
    try:
        tools = [t.model_dump(exclude_none=True) for t in request.tools or []]
        choice = request.tool_choice
        choice = choice.function.name if isinstance(choice, NamedToolChoice) else choice
        call.tools = plan_tools(tools, choice, request.parallel_tool_calls is not False)
        fmt = request.response_format
        if fmt is not None and fmt.type != "text":
            if call.tools is not None and call.tools.forced:
                raise ApiError(400, "response_format: cannot be combined with a tool_choice that forces a call",
                               "response_format")
            if fmt.type == "json_schema":
                if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                    raise ApiError(400, "response_format.json_schema.schema: a json_schema format needs its schema",
                                   "response_format.json_schema.schema")
                call.grammar = compile_grammar("json_schema", fmt.json_schema.schema_,
                                               "response_format.json_schema.schema")
            else:
                call.grammar = compile_grammar("json_object")
        elif call.tools is not None:
            call.grammar = call.tools.grammar
    except GrammarError as exc:
        raise ApiError(400, str(exc), exc.field) from None


class InputPart(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list | None = None


class InputMessage(_Strict):
    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputPart]
    id: str | None = None
    status: str | None = None


class ResponsesRequest(_Strict):
    """The Responses API's minimum: text in (a string, or messages), text out."""

    model: str
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None  # accepted; nothing is stored (``previous_response_id`` is refused)
    metadata: dict | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None


def responses_call(request: ResponsesRequest) -> Call:
    """The service call a Responses request asks for (``instructions`` as the system message)."""
    if isinstance(request.input, str):
        messages = [{"role": "user", "content": request.input}]
    else:
        messages = [{"role": "system" if m.role == "developer" else m.role,
                     "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)}
                    for m in request.input]
    if not messages:
        raise ApiError(400, "input: at least one message is required", "input")
    if request.instructions:
        messages.insert(0, {"role": "system", "content": request.instructions})
    if request.max_output_tokens is not None and request.max_output_tokens < 1:
        raise ApiError(400, f"max_output_tokens: must be at least 1, not {request.max_output_tokens}",
                       "max_output_tokens")
    given = {f: getattr(request, f) for f in ("temperature", "top_p") if getattr(request, f) is not None}
    try:
        sampling = SamplingParams(**{"temperature": 1.0, **given})
    except SamplingError as exc:
        raise ApiError(400, str(exc), exc.field) from None
    return Call(messages, True, request.max_output_tokens, [], sampling, request.stream, False,
                limit_field="max_output_tokens")


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
