"""Anthropic's Messages API (``POST /v1/messages``) with the official ``anthropic`` client as the real
client, over the tiny model behind an API key: a message created and streamed (``messages.stream``)
with the service's own text, stop reasons (``max_tokens``, ``stop_sequence``, ``tool_use``), a forced
tool call (``tool_choice`` ``any``) whose input holds to its schema and whose result goes back, and
errors the client raises as its own (401, 400, 404)."""

from __future__ import annotations

import http.client
import json

import anthropic
import jsonschema
import pytest

from engine.config import Scheduling
from engine.runtime.decode.service import ChatService
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.stage import compile_config
from engine.serve.server import ApiServer

MODEL = "tiny"
KEY = "fs-test-key-anthropic-0123456789"
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"name": "add", "description": "Adds two numbers", "input_schema": ADD}]
ASK = [{"role": "user", "content": "What is 1 plus 2?"}]
GREEDY = {"temperature": 0}  # sampling fields the client (2.x) no longer takes as arguments


@pytest.fixture(scope="module")
def served(tiny_exports):
    # the tools prompt alone is 641 of the tiny tokenizer's tokens
    service = ChatService(LocalChain(tiny_exports["qwen2", "2"].folders, config=compile_config("exact")),
                          scheduling=Scheduling(streams=2), max_length=1024)
    server = ApiServer(service, port=0, api_key=KEY, model_id=MODEL).start()
    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key=KEY, max_retries=0, timeout=60)
    yield service, server, client
    server.stop()
    service.close()


def test_create_and_stream_are_the_service_reply(served):
    service, _, client = served
    system = "You are terse."
    expected = service.submit([{"role": "system", "content": system}, *ASK], 8, chat=True).wait(60)
    message = client.messages.create(model=MODEL, max_tokens=8, messages=ASK, system=system, extra_body=GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == expected.text
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 8
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == expected.prompt_tokens
    with client.messages.stream(model=MODEL, max_tokens=8, messages=ASK, extra_body=GREEDY,
                                system=[{"type": "text", "text": system}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == expected.text and final.content[0].text == expected.text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8


def test_stop_sequences(served):
    service, _, client = served
    text = service.submit(ASK, 8, chat=True).wait(60).text
    stop = text[3:5]
    message = client.messages.create(model=MODEL, max_tokens=8, messages=ASK, extra_body=GREEDY,
                                     stop_sequences=["never in this text", stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == text[: text.find(stop)]


def test_any_tool_choice_gives_a_valid_tool_use_and_its_result_is_answered(served):
    _, _, client = served
    message = client.messages.create(model=MODEL, max_tokens=80, messages=ASK, tools=TOOLS, extra_body=GREEDY,
                                     tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert message.stop_reason == "tool_use"
    [use] = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "add" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, ADD)
    with client.messages.stream(model=MODEL, max_tokens=80, messages=ASK, tools=TOOLS, extra_body=GREEDY,
                                tool_choice={"type": "tool", "name": "add",
                                             "disable_parallel_tool_use": True}) as stream:
        final = stream.get_final_message()
    [streamed] = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and (streamed.name, streamed.input) == ("add", use.input)
    history = ASK + [{"role": "assistant", "content": message.content},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "3"},
                                                  {"type": "text", "text": "Thanks."}]}]
    answer = client.messages.create(model=MODEL, max_tokens=8, messages=history, tools=TOOLS, extra_body=GREEDY,
                                    tool_choice={"type": "none"})
    assert answer.stop_reason == "max_tokens" and [b.type for b in answer.content] == ["text"]


def test_a_tool_schema_that_is_not_an_object_is_a_400(served):
    """A tool's input is an object: a schema of another type (a string here) gave a 500 once its
    call was made (its input parsed as JSON); it is refused, naming the field as this API does."""
    _, _, client = served
    tools = [{"name": "pick", "input_schema": {"type": "string", "enum": ["go"]}}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=120, messages=ASK, tools=tools, extra_body=GREEDY,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True})
    error = caught.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith('tools[0].input_schema: a tool\'s arguments are a JSON object'), error


def test_output_config_holds_the_reply_to_a_schema(served):
    _, _, client = served
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    message = client.messages.create(model=MODEL, max_tokens=40, messages=ASK, extra_body=GREEDY,
                                     output_config={"format": {"type": "json_schema", "schema": schema}})
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_errors_are_the_clients_own(served):
    _, server, client = served
    wrong = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model=MODEL, max_tokens=4, messages=ASK)
    assert caught.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as caught:  # the client's create() insists on max_tokens
        client.post("/v1/messages", cast_to=anthropic.types.Message, body={"model": MODEL, "messages": ASK})
    error = caught.value.body["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith("max_tokens")
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=ASK)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=4, messages=ASK, stop_sequences=list("abcde"))
    assert caught.value.body["error"]["message"].startswith("stop_sequences")


def test_the_key_as_x_api_key(served):
    _, server, _ = served
    for headers, status in (({"x-api-key": KEY}, 200), ({"x-api-key": "wrong"}, 401), ({}, 401)):
        conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
        conn.request("POST", "/v1/messages", json.dumps({"model": MODEL, "max_tokens": 2, "messages": ASK}),
                     {"Content-Type": "application/json", **headers})
        response = conn.getresponse()
        doc = json.loads(response.read())
        conn.close()
        assert response.status == status
        assert doc["type"] == ("message" if status == 200 else "error")
