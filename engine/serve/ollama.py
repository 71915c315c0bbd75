"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/tags``, ``/api/show``, ``/api/version``) over
the chat service, for the tools that speak it.

A chat or generate request is translated into the OpenAI chat request the rest of the API serves
(``chat.call_of``): ``options`` (``temperature``, ``top_p``, ``top_k``, ``seed``, ``num_predict``,
``stop``, ``repeat_penalty``...) become its sampling fields, ``format`` (``"json"`` or a JSON schema) its
``response_format``, ``tools`` its tools (``auto``, unless the extension ``tool_choice``, OpenAI's, forces a
call: Ollama has none), and a call's ``arguments`` (an object in Ollama's messages) its JSON text.
Replies stream by default as Ollama streams them, NDJSON: one object per line, ``done: false``
pieces, then a ``done: true`` line with ``done_reason`` and the counts and durations (nanoseconds);
``stream: false`` gives that last object with the whole text.  A tool call comes as Ollama's
``tool_calls`` (arguments an object).
``/api/generate`` with ``raw`` is a plain completion of the prompt, without the chat template.
Options that only tune Ollama's own runtime (``num_ctx``, ``num_gpu``, ``num_thread``...) are
accepted and have no effect; options we cannot honour are a 400 naming them.  Errors come as
Ollama's ``{"error": "..."}`` (``ApiError.body_for``).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import time
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, ValidationError

from engine.export.compress import parameters
from engine.runtime.decode.service import ChatService, Handle, Reply
from engine.serve.chat import Pipe, answer, call_of, check_model, error_for, submit
from engine.serve.schema import ApiError, CompletionRequest, FunctionSpec, to_call, validation_error
from engine.serve.tools import CallStream, parse_reply

VERSION = "0.12.0"  # the Ollama API we answer as (clients check it before using newer fields)
DEFAULT_TEMPERATURE = 0.8  # Ollama's
# options -> the chat request's fields
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
           "num_predict": "max_tokens", "stop": "stop", "repeat_penalty": "repetition_penalty",
           "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
# options for Ollama's own runtime (context size, devices, threads, memory): nothing to do here
RUNTIME_OPTIONS = {"num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "numa", "low_vram", "use_mmap",
                   "use_mlock", "vocab_only", "embedding_only", "logits_all", "f16_kv", "num_keep"}
NEUTRAL_OPTIONS = {"typical_p": 1.0, "tfs_z": 1.0, "min_p": 0.0, "mirostat": 0}  # accepted at these values only
FIELDS = {**{field: f"options.{option}" for option, field in OPTIONS.items()}, "response_format": "format"}
NDJSON = "application/x-ndjson"
_BYTES_PER_WEIGHT = {"int4": 0.5, "int8": 1, "f16": 2, "fp16": 2, "bf16": 2, "f32": 4, "fp32": 4}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CalledFunction(_Strict):
    name: str
    arguments: dict
    index: int | None = None


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] | None = None
    function: CalledFunction


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    images: list | None = None
    thinking: str | None = None  # an earlier reply's reasoning: left out of the conversation
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionSpec


class _Generating(_Strict):
    model: str
    format: Literal["", "json"] | dict | None = None
    options: dict | None = None
    stream: bool = True
    keep_alive: float | str | None = None  # accepted: the model stays loaded while the server runs
    think: bool | str | None = None


class ChatBody(_Generating):
    messages: list[Message] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None  # extension: OpenAI's, to force a call


class GenerateBody(_Generating):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = None
    images: list | None = None


class ShowBody(_Strict):
    model: str | None = None
    name: str | None = None  # older clients' field
    verbose: bool | None = None


def router(service: ChatService, model_id: str) -> APIRouter:
    """Ollama's endpoints over ``service``, serving it as ``model_id`` (listed as ``model_id:latest``
    when it has no tag; either name is accepted)."""
    api = APIRouter(prefix="/api")
    name = model_id if ":" in model_id else f"{model_id}:latest"
    modified = datetime.datetime.now(datetime.timezone.utc).isoformat()

    def check(requested: str) -> None:
        check_model(requested, model_id, name)

    @api.get("/version")
    async def version():
        return {"version": VERSION}

    @api.get("/tags")
    async def tags():
        return {"models": [_card(service, name, modified)]}

    @api.post("/show")
    async def show(body: ShowBody):
        check(body.model or body.name or "")
        card = _card(service, name, modified)
        spec = service.chain.spec
        arch = spec.arch
        info = {"general.architecture": arch, "general.parameter_count": parameters(spec),
                f"{arch}.context_length": service.max_length, f"{arch}.embedding_length": spec.hidden_size,
                f"{arch}.block_count": spec.num_layers, f"{arch}.attention.head_count": spec.num_heads,
                f"{arch}.attention.head_count_kv": spec.num_kv_heads, f"{arch}.vocab_size": spec.vocab_size}
        return {"modelfile": f"# served by fleetshard\nFROM {name}\n", "parameters": "",
                "template": service.tokenizer.template or "", "details": card["details"], "model_info": info,
                "capabilities": ["completion", "tools"], "modified_at": card["modified_at"]}

    @api.post("/chat")
    async def chat(body: ChatBody, request: Request):
        started = time.monotonic_ns()
        check(body.model)
        if not body.messages:
            return _loaded(body.model, {"message": {"role": "assistant", "content": ""}})
        call = await call_of(_chat_of(body, [_message(m, i) for i, m in enumerate(body.messages)]), FIELDS)
        pipe, handle = await submit(service, call, request)
        shape = _Reply(body.model, started, chat=True, tool_names=call.tools.names if call.tools else None)
        return await _answer(shape, pipe, handle, request, call.stream)

    @api.post("/generate")
    async def generate(body: GenerateBody, request: Request):
        started = time.monotonic_ns()
        check(body.model)
        for field in ("suffix", "template", "images", "context"):
            if getattr(body, field):
                raise ApiError(400, f"{field}: {_UNSUPPORTED[field]}", field)
        if not body.prompt:
            return _loaded(body.model, {"response": ""})
        if body.raw:
            if body.format or body.system:
                field = "format" if body.format else "system"
                raise ApiError(400, f"{field}: not with raw (the prompt is continued as it is)", field)
            try:
                call = to_call(CompletionRequest(model=body.model, prompt=body.prompt, stream=body.stream,
                                                 **_options(body.options)))
            except ValidationError as exc:
                raise validation_error(list(exc.errors())).renamed(FIELDS) from None
            except ApiError as exc:
                raise exc.renamed(FIELDS) from None
            pipe, handle = await submit(service, call, request, chat=False)
        else:
            messages = ([{"role": "system", "content": body.system}] if body.system else []) + \
                [{"role": "user", "content": body.prompt}]
            call = await call_of(_chat_of(body, messages), FIELDS)
            pipe, handle = await submit(service, call, request)
        return await _answer(_Reply(body.model, started, chat=False), pipe, handle, request, call.stream)

    return api


_UNSUPPORTED = {"suffix": "fill-in-the-middle is not supported by this server",
                "template": "this server renders prompts with the model's own chat template",
                "images": "this server's models read text only",
                "context": "an earlier reply's context is not kept: send the conversation to /api/chat instead"}


def _card(service: ChatService, name: str, modified: str) -> dict:
    manifest = service.chain.manifest
    spec = manifest.spec
    count = parameters(spec)
    fingerprint = manifest.fingerprint
    digest = fingerprint if len(fingerprint) == 64 else hashlib.sha256(fingerprint.encode()).hexdigest()
    weights = manifest.weights.split("-")[0]
    size = int(count * _BYTES_PER_WEIGHT.get(weights, 1))  # the weights' size from their format: an estimate
    details = {"parent_model": "", "format": "openvino", "family": spec.arch, "families": [spec.arch],
               "parameter_size": _count(count), "quantization_level": manifest.weights.upper()}
    return {"name": name, "model": name, "modified_at": modified, "size": size, "digest": digest, "details": details}


def _count(n: int) -> str:
    """A parameter count as Ollama writes it: "135M", "1.5B"."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}".rstrip("0").rstrip(".") + unit
    return str(n)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _loaded(model: str, empty: dict) -> dict:
    """Ollama's answer to a request with nothing to reply to (clients send one to load the model)."""
    return {"model": model, "created_at": _now(), **empty, "done_reason": "load", "done": True}


def _options(options: dict | None) -> dict:
    """The chat request's sampling fields of Ollama's ``options``."""
    fields = {"temperature": DEFAULT_TEMPERATURE}
    for option, value in (options or {}).items():
        if option in OPTIONS:
            if value is not None:
                fields[OPTIONS[option]] = value
        elif option in NEUTRAL_OPTIONS:
            if value is not None and value != NEUTRAL_OPTIONS[option]:
                raise ApiError(400, f"options.{option}: only {NEUTRAL_OPTIONS[option]!r} (no effect) is supported "
                                    f"by this server, not {value!r}", f"options.{option}")
        elif option not in RUNTIME_OPTIONS:
            raise ApiError(400, f"options.{option}: not an option this server knows", f"options.{option}")
    if fields.get("max_tokens") in (-1, -2):  # Ollama's "until the end" and "fill the context"
        del fields["max_tokens"]
    if fields.get("top_k") == 0:
        del fields["top_k"]
    return fields


def _chat_of(body: ChatBody | GenerateBody, messages: list[dict]) -> dict:
    """The OpenAI chat request (as a dict for ``ChatRequest``) of an Ollama chat or generate request."""
    if body.think:
        raise ApiError(400, "think: this server's models do not think apart from their reply", "think")
    chat = {"model": body.model, "messages": messages, "stream": body.stream, **_options(body.options)}
    if body.format == "json":
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(body.format, dict):
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": body.format}}
    if isinstance(body, ChatBody) and body.tools:
        chat["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    if isinstance(body, ChatBody) and body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    return chat


def _message(m: Message, i: int) -> dict:
    """An Ollama message as an OpenAI one (a call's arguments as JSON text)."""
    if m.images:
        raise ApiError(400, f"messages[{i}].images: {_UNSUPPORTED['images']}", f"messages[{i}].images")
    message = {"role": m.role, "content": m.content or ""}
    if m.tool_calls:
        message["tool_calls"] = [{"id": c.id or f"call_{i}_{j}", "type": "function",
                                  "function": {"name": c.function.name, "arguments": json.dumps(c.function.arguments)}}
                                 for j, c in enumerate(m.tool_calls)]
    if m.role == "tool":
        if m.tool_name:
            message["name"] = m.tool_name
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
    return message


def _tool_calls(calls: list[dict], first: int = 0) -> list[dict]:
    return [{"id": c["id"], "function": {"index": first + i, "name": c["function"]["name"],
                                         "arguments": json.loads(c["function"]["arguments"])}}
            for i, c in enumerate(calls)]


async def _answer(shape: "_Reply", pipe: Pipe, handle: Handle, request: Request, stream: bool):
    return await answer(pipe, handle, request, stream, lambda: shape.lines(pipe, handle),
                        lambda reply: shape.last(reply, whole=True), NDJSON)


class _Reply:
    """Ollama's objects for one chat or generate reply."""

    def __init__(self, model: str, started_ns: int, chat: bool, tool_names: list[str] | None = None):
        self.model, self.started, self.chat, self.tool_names = model, started_ns, chat, tool_names

    def piece(self, text: str, calls: list[dict] | None = None) -> dict:
        if not self.chat:
            return {"model": self.model, "created_at": _now(), "response": text, "done": False}
        message = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        return {"model": self.model, "created_at": _now(), "message": message, "done": False}

    def last(self, reply: Reply, whole: bool = False) -> dict:
        """The ``done`` object: with the whole text (and calls) when nothing was streamed."""
        text, calls = (reply.text if whole else ""), None
        if whole and self.chat and self.tool_names:
            message, _ = parse_reply(reply.text, self.tool_names, reply.finish_reason)
            text, calls = message["content"] or "", _tool_calls(message.get("tool_calls") or [])
        doc = self.piece(text, calls)
        prompt_ns = int(reply.ttft_ms * 1e6)
        eval_ns = int((len(reply.tokens) - 1) / reply.decode_tok_s * 1e9) if reply.decode_tok_s else 0
        doc.update(done=True, done_reason="length" if reply.finish_reason == "length" else "stop",
                   total_duration=time.monotonic_ns() - self.started, load_duration=0,
                   prompt_eval_count=reply.prompt_tokens, prompt_eval_duration=prompt_ns,
                   eval_count=len(reply.tokens), eval_duration=eval_ns)
        return doc

    async def lines(self, pipe: Pipe, handle: Handle):
        calls = CallStream(self.tool_names) if self.tool_names else None

        def pieces(text: str | None):
            if calls is None:
                return [self.piece(text)] if text else []
            content, made = calls.push(text) if text is not None else calls.flush()
            out = [self.piece(content)] if content else []
            if made:
                out.append(self.piece("", _tool_calls(made, calls.called - len(made))))
            return out

        try:
            while True:
                item = await pipe.queue.get()
                if isinstance(item, Reply):
                    break
                for doc in pieces(item):
                    yield _line(doc)
            if item.error:
                yield _line({"error": error_for(item).message})
                return
            for doc in [*pieces(None), self.last(item)]:
                yield _line(doc)
        finally:  # the client went away (the server cancels this generator), or the reply is done
            if not handle.done:
                handle.cancel()


def _line(doc: dict) -> str:
    return json.dumps(doc, separators=(",", ":")) + "\n"
