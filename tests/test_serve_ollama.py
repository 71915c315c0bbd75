"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/tags``, ``/api/show``) with the official ``ollama``
client as the real client, over the tiny model behind an API key: replies streamed as NDJSON and not,
the same text as the service's own, options, ``format`` held to a JSON schema, a forced tool call
(arguments an object) and its result sent back, and errors in Ollama's shape."""

from __future__ import annotations

import http.client
import json

import jsonschema
import ollama
import pytest

from engine.config import Scheduling
from engine.runtime.decode.service import ChatService
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.stage import compile_config
from engine.serve.server import ApiServer

MODEL = "tiny"
KEY = "fs-test-key-ollama-0123456789"
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Adds two numbers", "parameters": ADD}}]
ASK = [{"role": "user", "content": "What is 1 plus 2?"}]
GREEDY = {"temperature": 0, "num_predict": 8}


@pytest.fixture(scope="module")
def served(tiny_exports):
    # the tools prompt alone is 641 of the tiny tokenizer's tokens
    service = ChatService(LocalChain(tiny_exports["qwen2", "2"].folders, config=compile_config("exact")),
                          scheduling=Scheduling(streams=2), max_length=1024)
    server = ApiServer(service, port=0, api_key=KEY, model_id=MODEL).start()
    client = ollama.Client(host=f"http://127.0.0.1:{server.port}", headers={"Authorization": f"Bearer {KEY}"},
                           timeout=60)
    yield service, server, client
    server.stop()
    service.close()


def _raw(server, method, path, body=None, key=KEY):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    conn.request(method, path, json.dumps(body) if body is not None else None, headers)
    response = conn.getresponse()
    payload = response.read().decode()
    conn.close()
    return response.status, response.getheader("Content-Type"), payload


def test_chat_streamed_and_not_is_the_service_reply(served):
    service, server, client = served
    expected = service.submit(ASK, 8, chat=True).wait(60)
    whole = client.chat(model=MODEL, messages=ASK, options=GREEDY)
    assert whole.done and whole.done_reason == "length" and whole.message.role == "assistant"
    assert whole.message.content == expected.text
    assert whole.eval_count == 8 and whole.prompt_eval_count == expected.prompt_tokens
    assert whole.total_duration > 0 and whole.prompt_eval_duration > 0
    chunks = list(client.chat(model=MODEL, messages=ASK, options=GREEDY, stream=True))
    assert len(chunks) > 2 and not any(c.done for c in chunks[:-1]) and chunks[-1].done
    assert "".join(c.message.content for c in chunks) == expected.text
    assert chunks[-1].done_reason == "length" and chunks[-1].eval_count == 8
    # streamed by default, one JSON object per line
    status, kind, payload = _raw(server, "POST", "/api/chat", {"model": MODEL, "messages": ASK, "options": GREEDY})
    lines = [json.loads(line) for line in payload.splitlines()]
    assert status == 200 and kind == "application/x-ndjson" and len(lines) == len(chunks)
    assert lines[-1]["done"] and "".join(line["message"]["content"] for line in lines) == expected.text


def test_generate_templated_and_raw(served):
    service, _, client = served
    prompt = "Once upon a time"
    chat = service.submit([{"role": "user", "content": prompt}], 6, chat=True).wait(60).text
    raw = service.submit([{"role": "user", "content": prompt}], 6, chat=False).wait(60).text
    options = {"temperature": 0, "num_predict": 6}
    assert client.generate(model=MODEL, prompt=prompt, options=options).response == chat
    streamed = list(client.generate(model=MODEL, prompt=prompt, options=options, stream=True))
    assert "".join(c.response for c in streamed) == chat and streamed[-1].done and streamed[-1].eval_count == 6
    assert client.generate(model=MODEL, prompt=prompt, raw=True, options=options).response == raw
    loaded = client.generate(model=MODEL)  # no prompt: Ollama's "load the model"
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_stop_and_bad_options(served):
    service, _, client = served
    text = service.submit(ASK, 8, chat=True).wait(60).text
    stop = text[3:5]
    cut = client.chat(model=MODEL, messages=ASK, options={**GREEDY, "stop": [stop]})
    assert cut.message.content == text[: text.find(stop)] and cut.done_reason == "stop"
    for options, field in (({"mirostat_eta": 0.1}, "options.mirostat_eta"), ({"num_predict": 0}, "options.num_predict"),
                           ({"temperature": 5}, "options.temperature")):
        with pytest.raises(ollama.ResponseError) as caught:
            client.chat(model=MODEL, messages=ASK, options=options)
        assert caught.value.status_code == 400 and caught.value.error.startswith(field), caught.value.error
    # options of Ollama's own runtime are accepted, to no effect
    assert client.chat(model=MODEL, messages=ASK, options={**GREEDY, "num_ctx": 4096}).message.content == text


def test_list_show_and_version(served):
    service, server, client = served
    [card] = client.list().models
    assert card.model == f"{MODEL}:latest" and card.size > 0 and len(card.digest) == 64
    assert card.details.format == "openvino" and card.details.family == "qwen2" and card.details.parameter_size
    shown = client.show(MODEL)
    assert shown.details.family == "qwen2" and shown.template == service.tokenizer.template
    assert shown.modelinfo["qwen2.context_length"] == service.max_length and "tools" in shown.capabilities
    assert client.show(f"{MODEL}:latest").details.quantization_level == card.details.quantization_level
    status, _, payload = _raw(server, "GET", "/api/version")
    assert status == 200 and json.loads(payload)["version"]


def test_unknown_model_missing_key_and_images_in_ollama_shape(served):
    _, server, client = served
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="llama3.2", messages=ASK)
    assert caught.value.status_code == 404 and "llama3.2" in caught.value.error
    status, _, payload = _raw(server, "POST", "/api/show", {"model": "llama3.2"})
    assert status == 404 and list(json.loads(payload)) == ["error"]
    keyless = ollama.Client(host=f"http://127.0.0.1:{server.port}", timeout=30)
    with pytest.raises(ollama.ResponseError) as caught:
        keyless.list()
    assert caught.value.status_code == 401 and "API key" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model=MODEL, messages=[{"role": "user", "content": "hi", "images": [b"\x89PNG"]}])
    assert caught.value.status_code == 400 and caught.value.error.startswith("messages[0].images")


def test_format_holds_the_reply_to_a_schema(served):
    _, _, client = served
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    reply = client.chat(model=MODEL, messages=ASK, format=schema, options={"temperature": 0, "num_predict": 60})
    assert reply.done_reason == "stop"
    jsonschema.validate(json.loads(reply.message.content), schema)
    streamed = list(client.chat(model=MODEL, messages=ASK, format=schema, stream=True,
                                options={"temperature": 0, "num_predict": 60}))
    assert "".join(c.message.content for c in streamed) == reply.message.content
    # "json": an object, whatever its keys (a random model never closes its first key: cut by length)
    free = client.generate(model=MODEL, prompt="Hello", format="json", options={"temperature": 0, "num_predict": 10})
    assert free.response.startswith('{"') and free.done_reason == "length"


def _forced(client, stream: bool):
    """A chat whose reply must call a tool (the extension ``tool_choice``; Ollama has none), through
    the official client's own request and parsing."""
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "stream": stream,
            "options": {"temperature": 0, "num_predict": 80}}
    return client._request(ollama.ChatResponse, "POST", "/api/chat", json=body, stream=stream)


def test_a_forced_tool_call_and_its_result(served):
    _, _, client = served
    reply = _forced(client, stream=False)
    [call] = reply.message.tool_calls
    assert call.function.name == "add" and reply.done
    jsonschema.validate(dict(call.function.arguments), ADD)
    chunks = list(_forced(client, stream=True))
    streamed = [c for chunk in chunks for c in (chunk.message.tool_calls or [])]
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == \
        [("add", dict(call.function.arguments))] and chunks[-1].done
    # the call (arguments as an object) and its result go back, as Ollama's clients send them
    history = ASK + [reply.message, {"role": "tool", "content": "3", "tool_name": "add"}]
    answer = client.chat(model=MODEL, messages=history, tools=TOOLS, options=GREEDY)
    assert answer.done and answer.eval_count == 8 and not answer.message.tool_calls


def test_a_tool_schema_that_is_not_an_object_is_a_400(served):
    """A call's arguments are an object (Ollama's messages carry them as one): a schema of another
    type (a string here) gave a 500 once its call was made; it is refused, naming the field."""
    _, _, client = served
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {"type": "string", "enum": ["go"]}}}]
    body = {"model": MODEL, "messages": ASK, "tools": tools, "tool_choice": "required", "stream": False,
            "options": {"temperature": 0, "num_predict": 120}}
    with pytest.raises(ollama.ResponseError) as caught:
        client._request(ollama.ChatResponse, "POST", "/api/chat", json=body, stream=False)
    assert caught.value.status_code == 400
    assert caught.value.error.startswith('tools[0].function.parameters: a tool\'s arguments are a JSON object')
