"""`fleet serve` answering from a document collection (``api_documents``): a chat request's prompt is
grounded in the passages that match its question, as the app's chat is (``engine.conversation.sources``),
and the reply lists them; a request can go without them.  Real requests through the ``openai`` client
to the tiny Qwen2 export, compared with the service's own greedy replies."""

from __future__ import annotations

import json

import openai
import pytest

from engine.config import Scheduling
from engine.conversation.sources import INSTRUCTION, find_sources, with_sources
from engine.documents.collection import Library
from engine.runtime.decode.service import ChatService
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.stage import compile_config
from engine.serve.server import ApiServer

MODEL = "tiny"
QUESTION = [{"role": "user", "content": "How much are meals covered on a trip?"}]


@pytest.fixture(scope="module")
def handbook(tmp_path_factory):
    folder = tmp_path_factory.mktemp("docs")
    (folder / "travel.md").write_text("# Travel\n\nMeals on a trip are covered up to 45 euros a day.\n\n"
                                      "Taxis are covered after 22:00.\n", encoding="utf-8")
    (folder / "kitchen.txt").write_text("The kettle is descaled on Fridays.\n", encoding="utf-8")
    collection = Library(tmp_path_factory.mktemp("library")).create("handbook")
    collection.add(folder)
    collection.update()
    return collection


@pytest.fixture(scope="module")
def service(tiny_exports):
    service = ChatService(LocalChain(tiny_exports["qwen2", "2"].folders, config=compile_config("exact")),
                          scheduling=Scheduling(streams=2))
    yield service
    service.close()


@pytest.fixture(scope="module")
def served(service, handbook):
    server = ApiServer(service, port=0, model_id=MODEL, documents=handbook).start()
    yield openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    server.stop()


def test_a_chat_request_is_answered_from_the_servers_documents(served, service, handbook):
    sources = find_sources(handbook, QUESTION[0]["content"])
    assert sources and sources[0]["file"].endswith("travel.md") and "45 euros" in sources[0]["text"]
    grounded = with_sources(QUESTION, sources)
    assert grounded[0]["role"] == "system" and grounded[0]["content"].startswith(INSTRUCTION)
    want = service.submit(grounded, 12).wait(60)

    got = served.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == want.prompt_tokens
    assert [s["file"] for s in got.model_extra["sources"]] == [s["file"] for s in sources]
    assert got.model_extra["sources"][0]["text"] == sources[0]["text"]

    chunks = list(served.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0,
                                                 stream=True))
    assert chunks[0].model_extra["sources"] == got.model_extra["sources"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text


def test_a_request_can_go_without_the_documents(served, service):
    plain = service.submit(QUESTION, 12).wait(60)
    got = served.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0,
                                         extra_body={"documents": False})
    assert got.choices[0].message.content == plain.text and got.usage.prompt_tokens == plain.prompt_tokens
    assert "sources" not in (got.model_extra or {})


def test_a_server_without_documents_refuses_a_request_for_them(service):
    server = ApiServer(service, port=0, model_id=MODEL).start()
    try:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4,
                                           extra_body={"documents": True})
        error = json.loads(raised.value.response.text)["error"]
        assert error["param"] == "documents" and "api_documents" in error["message"]
    finally:
        server.stop()
