"""Anthropic's Messages API (``POST /v1/messages``) over the chat service, for clients that speak it.

A request is translated into the OpenAI chat request the rest of the API serves (``chat.call_of``):
the system prompt (a string or text blocks) leads the conversation, ``tool_use`` blocks become an
assistant's tool calls and ``tool_result`` blocks tool messages; ``tools`` (``input_schema``) and
``tool_choice`` (``auto``, ``any``, ``tool``, ``none``) map to OpenAI's, so a forced call is held to its
schema by the same grammar, and ``output_config.format`` (a JSON schema) to ``response_format``.
``temperature``, ``top_p`` and ``top_k``, which older clients send (newer ones through ``extra_body``), are
honoured.  The reply is a ``message`` of ``text`` and ``tool_use`` blocks with its
``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence``, ``tool_use``) and usage; streamed, the
events Anthropic sends (``message_start``, ``ping``, ``content_block_start``/``_delta``/``_stop``,
``message_delta``, ``message_stop``), a tool call's input as one ``input_json_delta``.
Errors come in Anthropic's shape (``ApiError.body_for``).
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Literal, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from engine.runtime.decode.service import ChatService, Handle, Reply
from engine.serve.chat import Pipe, answer, call_of, check_model, error_for, submit
from engine.serve.schema import ApiError
from engine.serve.tools import CallStream, parse_reply

# OpenAI's field names in errors, as Anthropic's request names them
FIELDS = {"stop": "stop_sequences", "response_format.json_schema.schema": "output_config.format.schema",
          "response_format": "output_config.format"}
_STOP_REASONS = {"max_tokens": "max_tokens", "stop": "stop_sequence"}  # any other end: end_turn


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict | None = None  # accepted: the prefix cache reuses a shared prompt by itself
    citations: list | None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict
    cache_control: dict | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or [])
        return f"Error: {text}" if self.is_error else text


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock], Field(discriminator="type")]


class MessageParam(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolParam(_Strict):
    name: str
    description: str | None = None
    input_schema: dict
    type: Literal["custom"] | None = None
    cache_control: dict | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(_Strict):
    format: OutputFormat | None = None
    effort: None = None  # our models have no effort levels: only its absence is accepted


class Thinking(_Strict):
    type: Literal["disabled"]  # our models do not think apart from their reply


class MessagesRequest(_Strict):
    model: str
    max_tokens: int
    messages: list[MessageParam]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict | None = None  # accepted (a user id for abuse tracking): nothing is kept
    output_config: OutputConfig | None = None  # format: the reply held to a JSON schema
    thinking: Thinking | None = None
    cache_control: dict | None = None  # accepted: the prefix cache reuses a shared prompt by itself
    service_tier: Literal["auto", "standard_only"] | None = None  # accepted: there is one tier


def router(service: ChatService, model_id: str) -> APIRouter:
    """``POST /v1/messages`` over ``service``, serving it as ``model_id``."""
    api = APIRouter()

    @api.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        check_model(body.model, model_id)
        schemas = {f"tools[{i}].function.parameters": f"tools[{i}].input_schema" for i in range(len(body.tools or []))}
        call = await call_of(to_chat(body), {**FIELDS, **schemas})
        pipe, handle = await submit(service, call, request)
        shape = _Message(model_id, call.tools.names if call.tools else None)
        return await answer(pipe, handle, request, call.stream, lambda: shape.events(pipe, handle), shape.whole)

    return api


def to_chat(body: MessagesRequest) -> dict:
    """The OpenAI chat request (as a dict for ``ChatRequest``) a Messages request asks for."""
    messages = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "".join(b.text for b in body.system)
        messages.append({"role": "system", "content": system})
    for m in body.messages:
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            continue
        if m.role == "assistant":
            text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in m.content if isinstance(b, ToolUseBlock)]
            messages.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})})
            continue
        text = []  # a user turn: its tool results as tool messages, its text in order around them
        for block in m.content:
            if isinstance(block, ToolResultBlock):
                if text:
                    messages.append({"role": "user", "content": "".join(text)})
                    text = []
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
            elif isinstance(block, TextBlock):
                text.append(block.text)
            else:
                raise _bad(f"messages: a user turn cannot hold a {block.type} block", "messages")
        if text:
            messages.append({"role": "user", "content": "".join(text)})
    chat = {"model": body.model, "messages": messages, "max_tokens": body.max_tokens, "stream": body.stream,
            "stop": body.stop_sequences, "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in body.tools]
    if body.output_config is not None and body.output_config.format is not None:
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": body.output_config.format.schema_}}
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise _bad("tool_choice.name: a tool choice of type tool names the tool", "tool_choice.name")
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    return {k: v for k, v in chat.items() if v is not None}


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param)


def _usage(reply: Reply) -> dict:
    return {"input_tokens": reply.prompt_tokens - reply.cached_tokens, "output_tokens": len(reply.tokens),
            "cache_read_input_tokens": reply.cached_tokens, "cache_creation_input_tokens": 0}


def _tool_use(call: dict) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"])}


class _Message:
    """The Messages API's bodies and stream events for one reply."""

    def __init__(self, model_id: str, tool_names: list[str] | None):
        self.ident, self.model, self.tool_names = f"msg_{uuid.uuid4().hex[:24]}", model_id, tool_names

    def head(self) -> dict:
        return {"id": self.ident, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None}

    def stop_reason(self, reply: Reply, called: bool) -> str:
        return "tool_use" if called else _STOP_REASONS.get(reply.stopped_by, "end_turn")

    def whole(self, reply: Reply) -> dict:
        message, _ = parse_reply(reply.text, self.tool_names, reply.finish_reason)
        calls = message.get("tool_calls") or []
        content = [{"type": "text", "text": message["content"]}] if message["content"] else []
        content += [_tool_use(c) for c in calls]
        return {**self.head(), "content": content, "stop_reason": self.stop_reason(reply, bool(calls)),
                "stop_sequence": reply.stop_string, "usage": _usage(reply)}

    @staticmethod
    def event(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, separators=(',', ':'))}\n\n"

    async def events(self, pipe: Pipe, handle: Handle):
        calls = CallStream(self.tool_names) if self.tool_names else None
        index, text_open = 0, False

        def text(piece: str):
            nonlocal text_open
            if not text_open:
                text_open = True
                yield self.event("content_block_start", index=index, content_block={"type": "text", "text": ""})
            yield self.event("content_block_delta", index=index, delta={"type": "text_delta", "text": piece})

        def close_text():
            nonlocal index, text_open
            if text_open:
                yield self.event("content_block_stop", index=index)
                index, text_open = index + 1, False

        def blocks(piece: str | None):
            nonlocal index
            if calls is None:
                content, made = piece or "", []
            else:
                content, made = calls.push(piece) if piece is not None else calls.flush()
            if content:
                yield from text(content)
            for call in made:
                yield from close_text()
                block = _tool_use(call)
                yield self.event("content_block_start", index=index, content_block={**block, "input": {}})
                yield self.event("content_block_delta", index=index,
                                 delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
                yield self.event("content_block_stop", index=index)
                index += 1

        try:
            usage = {"input_tokens": 0, "output_tokens": 0}  # known at the end: message_delta carries them
            yield self.event("message_start", message={**self.head(), "usage": usage})
            yield self.event("ping")
            while True:
                item = await pipe.queue.get()
                if isinstance(item, Reply):
                    break
                for event in blocks(item):
                    yield event
            if item.error:
                error = error_for(item)
                yield self.event("error", error={"type": "api_error" if error.status >= 500 else
                                                 "invalid_request_error", "message": error.message})
                return
            for event in [*blocks(None), *close_text()]:
                yield event
            called = calls is not None and calls.called > 0
            yield self.event("message_delta", delta={"stop_reason": self.stop_reason(item, called),
                                                     "stop_sequence": item.stop_string}, usage=_usage(item))
            yield self.event("message_stop")
        finally:  # the client went away (the server cancels this generator), or the reply is done
            if not handle.done:
                handle.cancel()
