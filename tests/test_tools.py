"""Tool calling and structured output on the real SmolLM2 through `fleet serve`'s API, with the
official client and with client libraries (langchain-openai, instructor): forced calls
(``tool_choice`` ``required`` or a named function) always carry arguments valid for the function's
schema, streamed calls arrive as ``tool_calls`` deltas, a conversation with earlier calls and tool
results renders and is answered; and the tool grammars and parsing on their own."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from engine.config import Scheduling
from engine.export.exporter import export_model
from engine.runtime.decode.service import ChatService
from engine.runtime.decode.speculative import stream_drafters
from engine.runtime.stages.chain import LocalChain
from engine.serve.server import ApiServer
from engine.serve.tools import CallStream, parse, plan_tools, render, tools_fit_template

MODEL = "smollm2-135m"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Adds two numbers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def served():
    chain = LocalChain(export_model(MODEL, stages=1, weights="int4").folders)
    service = ChatService(chain, scheduling=Scheduling(streams=2, k=3), drafters=lambda n: stream_drafters("lookup", n))
    server = ApiServer(service, port=0, model_id=MODEL).start()
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    yield service, server, client
    server.stop()
    service.close()


def _check_calls(calls, names=("get_weather", "add")):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.real_model
def test_required_tool_call_is_valid_streamed_or_not(served):
    _, _, client = served
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=120)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls)
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                                 temperature=0, max_tokens=120, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == \
        [(i, c.function.name, c.function.arguments) for i, c in enumerate(choice.message.tool_calls)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.real_model
def test_named_function_sampled_and_one_call_only(served):
    _, _, client = served
    for seed in (1, 2):
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is 2 plus 40?"}], tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "add"}}, parallel_tool_calls=False,
            temperature=1.0, seed=seed, max_tokens=200)
        calls = reply.choices[0].message.tool_calls
        assert len(calls) == 1 and reply.choices[0].finish_reason == "tool_calls"
        _check_calls(calls, names=("add",))


@pytest.mark.real_model
def test_a_conversation_with_calls_and_tool_results_is_answered(served):
    service, _, client = served
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'}]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=40)
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None
    # SmolLM2's template knows no tools: the generic rendering carries the call and its result
    messages, template_tools = render(history, plan_tools(TOOLS, "auto"),
                                      tools_fit_template(service.tokenizer.template))
    prompt = service.tokenizer.decode(service.tokenizer.chat_ids(messages, tools=template_tools).reshape(-1))
    assert template_tools is None and '"name": "get_weather"' in prompt and "<tools>" in prompt
    assert '<tool_response>\n{"temperature": 21' in prompt and '"arguments": {"city": "Paris"' in prompt


@pytest.mark.real_model
def test_auto_gives_text_or_valid_calls(served):
    _, _, client = served
    for content in ("What is the weather like in Paris today?", "Say hello."):
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                               tools=TOOLS, temperature=0, max_tokens=80)
        choice = reply.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            _check_calls(choice.message.tool_calls)
        else:
            assert choice.message.content and "<tool_call>" not in choice.message.content


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=40)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=150)


@pytest.mark.real_model
def test_langchain_bind_tools_and_structured_output(served):
    from langchain_openai import ChatOpenAI

    _, server, _ = served
    llm = ChatOpenAI(base_url=server.url, api_key="unused", model=MODEL, temperature=0, max_tokens=120,
                     max_retries=0)
    called = llm.bind_tools([Weather], tool_choice="Weather").invoke("What is the weather like in Paris?")
    assert called.tool_calls[0]["name"] == "Weather"
    assert Weather(**called.tool_calls[0]["args"])
    ask = "Alice is 31 years old. Give her name and age."
    for method in ("function_calling", "json_schema"):
        person = llm.with_structured_output(Person, method=method).invoke(ask)
        assert isinstance(person, Person), method
    # json_mode constrains to a JSON object only: the schema is the prompt's business
    # (a 135M model asked for "a JSON object" lists keys until max_tokens: it is shown one)
    as_dict = llm.with_structured_output(None, method="json_mode").invoke(
        [("system", "You reply with one short JSON object."),
         ("human", 'Example: {"name": "Bob", "age": 40}. Now Alice, 31 years old:')])
    assert isinstance(as_dict, dict) and "name" in as_dict  # which name a 135M model copies is its business


@pytest.mark.real_model
def test_instructor_tools_and_json_schema_modes(served):
    import instructor

    _, _, client = served
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        patched = instructor.from_openai(client, mode=mode)
        person = patched.chat.completions.create(
            model=MODEL, response_model=Person, max_retries=0, temperature=0, max_tokens=120,
            messages=[{"role": "user", "content": "Alice is 31 years old. Give her name and age."}])
        assert isinstance(person, Person) and 0 <= person.age <= 150


@pytest.mark.real_model
def test_litellm_tools_required_and_named(served):
    import litellm

    _, server, _ = served
    for choice, names in (("required", ("get_weather", "add")),
                          ({"type": "function", "function": {"name": "add"}}, ("add",))):
        reply = litellm.completion(model=f"openai/{MODEL}", api_base=server.url, api_key="unused", messages=ASK,
                                   tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=120, num_retries=0)
        assert reply.choices[0].finish_reason == "tool_calls"
        _check_calls(reply.choices[0].message.tool_calls, names=names)


def test_tool_grammars_accept_calls_and_refuse_what_breaks_them(tiny_exports):
    """On a tokenizer alone: ``required`` takes only calls to the tools with valid arguments, a named
    choice only that function, ``auto`` free text or text then a valid call."""
    from engine.runtime.decode.tokenizer import ChatTokenizer

    tok = ChatTokenizer(tiny_exports["qwen2", "1"].folders[0])
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    bad_args = '<tool_call>\n{"name": "add", "arguments": {"a": "one"'
    cases = {"required": [(call, True), (call + "\n" + call, True), ("Sure: " + call, False), (bad_args, False)],
             "get_weather": [(call, False)],
             "auto": [("Sure, I can add.", True), ("Sure: " + call, True), ("Sure: " + bad_args, False)]}
    for choice, texts in cases.items():
        plan = plan_tools(TOOLS, choice)
        for text, ok in texts:
            constraint = tok.constraint(plan.grammar, [2])
            ids = tok.encode(text)
            assert (constraint.matcher.validate_tokens(ids) == len(ids)) == ok, (choice, text)
    single = plan_tools(TOOLS, "required", parallel=False)
    ids = tok.encode(call + "\n" + call)
    assert tok.constraint(single.grammar, [2]).matcher.validate_tokens(ids) < len(ids)
    bare = plan_tools([{"type": "function", "function": {"name": "now"}}], "required")  # no parameters: no arguments
    for arguments, ok in (("{}", True), ('{"a": 1}', False)):
        ids = tok.encode(f'<tool_call>\n{{"name": "now", "arguments": {arguments}}}\n</tool_call>')
        assert (tok.constraint(bare.grammar, [2]).matcher.validate_tokens(ids) == len(ids)) == ok


def test_calls_are_parsed_whole_and_streamed():
    text = 'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    content, calls = parse(text, ["add"])
    assert [c["function"] for c in calls] == [{"name": "add", "arguments": '{"a": 1, "b": 2}'}]
    assert content.startswith("Let me check.") and '"nope"' in content  # an unknown tool stays text
    stream, pieces, made = CallStream(["add"]), [], []
    for i in range(0, len(text), 3):
        got, new = stream.push(text[i:i + 3])
        pieces.append(got)
        made += new
    rest, _ = stream.flush()
    assert "".join(pieces) + rest == "Let me check.\n" + text[text.index("<tool_call>\n{\"name\": \"nope\""):]
    assert [c["function"] for c in made] == [c["function"] for c in calls]
    assert parse("no calls here", ["add"]) == ("no calls here", [])


def test_templates_with_hermes_tools_get_calls_as_objects():
    assert not tools_fit_template("{{ messages }}") and tools_fit_template("{% if tools %}<tool_call>{% endif %}")
    history = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}]
    messages, tools = render(history, plan_tools(TOOLS, "required"), native=True)
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2} and tools == TOOLS
