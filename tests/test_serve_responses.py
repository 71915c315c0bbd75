"""``POST /v1/responses``, the Responses API's minimum, with the official client: text (a string, or
messages and instructions) in, text out, streamed as its events; the same text as the chat
completion of the same conversation; a length cut as ``incomplete``; bad fields as 400s."""

from __future__ import annotations

import openai
import pytest

from engine.config import Scheduling
from engine.runtime.decode.service import ChatService
from engine.runtime.stages.chain import LocalChain
from engine.serve.server import ApiServer

MODEL = "tiny"


@pytest.fixture(scope="module")
def client(tiny_exports):
    service = ChatService(LocalChain(tiny_exports["llama", "1"].folders), scheduling=Scheduling(streams=2))
    server = ApiServer(service, port=0, model_id=MODEL).start()
    yield openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    server.stop()
    service.close()


def _chat(client, messages, tokens):
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=tokens, temperature=0)
    return got.choices[0]


def test_a_response_is_the_chat_completion_of_its_input(client):
    got = client.responses.create(model=MODEL, input="The quick brown fox", max_output_tokens=12, temperature=0)
    want = _chat(client, [{"role": "user", "content": "The quick brown fox"}], 12)
    assert got.output_text == want.message.content and got.object == "response" and got.id.startswith("resp_")
    assert got.status == ("incomplete" if want.finish_reason == "length" else "completed")
    assert got.usage.output_tokens <= 12 and got.usage.input_tokens > 3
    messages = [{"role": "user", "content": "Paris is"}, {"role": "assistant", "content": "the capital"},
                {"role": "user", "content": [{"type": "input_text", "text": "of France"}]}]
    got = client.responses.create(model=MODEL, input=messages, instructions="Be brief.", max_output_tokens=10,
                                  temperature=0)
    want = _chat(client, [{"role": "system", "content": "Be brief."}, *messages[:2],
                          {"role": "user", "content": "of France"}], 10)
    assert got.output_text == want.message.content


def test_a_streamed_response_adds_up(client):
    whole = client.responses.create(model=MODEL, input="def add(a, b):", max_output_tokens=16, temperature=0)
    events = list(client.responses.create(model=MODEL, input="def add(a, b):", max_output_tokens=16,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert kinds.count("response.output_text.delta") > 1
    assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": 5}, "temperature"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": []}, "input"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "input"),
])
def test_bad_responses_requests_are_400s_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/responses", body={"model": MODEL, **body}, cast_to=object)
    assert caught.value.body["param"] == param
