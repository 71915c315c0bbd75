"""Structured output (``response_format``) by grammar-constrained decoding: every constrained reply
is valid JSON for its schema, from random weights, greedy or sampled, with speculation and four
packed streams; drafts the grammar refuses are never accepted; only constrained streams ask for
full logits; the API takes ``json_object`` and ``json_schema`` and refuses a schema it cannot follow."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api_support import reply_text

from engine.config import Scheduling
from engine.runtime.decode.generate import Decoding
from engine.runtime.decode.grammar import GrammarError, compile_grammar
from engine.runtime.decode.sampling import SamplingParams
from engine.runtime.decode.service import ChatService
from engine.runtime.decode.speculative import PromptLookup, stream_drafters
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.stage import compile_config
from engine.serve.server import ApiServer
from engine.transport.wire import Flag

MODEL = "tiny"
ASK = [{"role": "user", "content": "Describe a fox as JSON."}]


@pytest.fixture(scope="module")
def chain(tiny_exports):
    return LocalChain(tiny_exports["qwen2", "2"].folders, config=compile_config("exact"))


@pytest.fixture(scope="module")
def service(chain):
    service = ChatService(chain, scheduling=Scheduling(streams=4, k=3), drafters=lambda n: stream_drafters("lookup", n))
    yield service
    service.close()


@pytest.fixture(scope="module")
def client(service):
    server = ApiServer(service, port=0, model_id=MODEL).start()
    yield openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    server.stop()


# Schemas bounded in size (short strings, few items, ranged integers), so that even a random model's
# reply closes within the token budget.
_leaf = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda values: {"enum": values}, st.lists(st.sampled_from(["red", "green", 3, None, True]),
                                                          min_size=1, max_size=3, unique=True)),
)
_names = st.sampled_from(["a", "name", "size", "tags", "x_1", "ok"])


def _object(children):
    return st.builds(
        lambda props, data: {"type": "object", "properties": props, "additionalProperties": False,
                             "required": data.draw(st.lists(st.sampled_from(sorted(props)), unique=True))
                             if props else []},
        st.dictionaries(_names, children, min_size=1, max_size=3), st.data())


def _longest(schema: dict) -> int:
    """The most bytes a compact JSON value of ``schema`` can take (a string's character escaped as
    ``\\uXXXX`` at worst), so that a token budget of as many tokens surely lets the grammar close it."""
    if "enum" in schema:
        return max(len(json.dumps(v)) for v in schema["enum"])
    kind = schema["type"]
    if kind == "string":
        return 2 + 6 * schema["maxLength"]
    if kind == "object":
        return 2 + sum(len(name) + 6 + _longest(child) for name, child in schema["properties"].items())
    if kind == "array":
        return 2 + schema["maxItems"] * (_longest(schema["items"]) + 2)
    return {"integer": 4, "boolean": 5, "null": 4}[kind]


BUDGET = 400  # new tokens per constrained reply; every token is at least a byte

_schemas = st.recursive(
    _leaf,
    lambda children: st.one_of(
        _object(children),
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(0, 3)),
    ),
    max_leaves=5,
).filter(lambda s: s.get("type") in ("object", "array") and _longest(s) <= BUDGET)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                               HealthCheck.too_slow])
@given(schemas=st.lists(_schemas, min_size=3, max_size=3), seed=st.integers(0, 2**16))
def test_every_constrained_reply_validates_with_speculation_and_packed_streams(service, schemas, seed):
    """Three constrained streams (greedy, sampled, sampled with top-p) beside a free one, all with
    prompt-lookup drafts, at once on four streams: each constrained reply is JSON its schema accepts,
    ended by the grammar, not by the token budget."""
    samplings = [None, SamplingParams(temperature=1.0, seed=seed), SamplingParams(temperature=0.7, top_p=0.9,
                                                                                  seed=seed + 1)]
    handles = [service.submit(ASK, BUDGET, grammar=compile_grammar("json_schema", s), sampling=p)
               for s, p in zip(schemas, samplings)]
    free = service.submit(ASK, 24, ignore_eos=True)
    for schema, handle in zip(schemas, handles):
        reply = handle.wait(120)
        assert reply.error is None and reply.stopped_by == "eos", (schema, reply)
        jsonschema.validate(json.loads(reply.text), schema)
    assert len(free.wait(120).tokens) == 24


def test_json_object_mode_and_the_top_one_token_being_illegal(service, chain):
    """Greedy decoding masks too: the random model's top-1 first token is not ``{``, yet the reply
    opens a JSON object (a random model never closes its first key: any JSON object is unbounded, so
    it ends by length, a prefix of an object)."""
    reply = service.submit(ASK, 40, grammar=compile_grammar("json_object")).wait(60)
    assert reply.text.startswith('{"') and reply.stopped_by == "max_tokens"
    free = service.submit(ASK, 20).wait(60)
    assert not free.text.lstrip().startswith("{")


def test_drafts_the_grammar_refuses_end_the_accepted_run(service):
    tok = service.tokenizer
    constraint = tok.constraint(compile_grammar("json_schema", {"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}), service.eos)
    opening = tok.encode('{"a": ')
    legal, illegal = tok.encode("7")[0], tok.encode("x")[0]
    vocab = constraint.tokenizer.size + 5  # the model's vocabulary may be larger than the tokenizer's
    rows = np.zeros((len(opening) + 2, vocab), np.float32)
    masked, kept = constraint.mask_rows(rows, opening + [illegal, legal])
    assert kept == opening and masked.shape == (len(opening) + 1, vocab)
    assert np.isfinite(masked[-1, legal]) and masked[-1, illegal] == -np.inf and np.isinf(masked[:, -5:]).all()
    assert masked[0, tok.encode("{")[0]] == 0 and np.isinf(masked[0]).sum() == vocab - 1  # only "{" at first
    # the matcher is where it was: "{" is still the only token allowed
    assert constraint.allowed().sum() == 1
    # a draft run that completes the grammar stops before an end of text (rolling a matcher back over
    # its end of text lost a token more: the next round's mask was then one token behind)
    whole = tok.encode('{"a": 7}')
    _, kept = constraint.mask_rows(np.zeros((len(whole) + 2, vocab), np.float32), whole + [min(service.eos)])
    assert kept == whole and constraint.allowed().sum() == 1


def test_speculation_does_not_change_a_greedy_constrained_reply(service, chain):
    """Greedy constrained decoding with prompt-lookup drafts gives the very tokens of the plain one,
    and drafts were accepted (the masked target agreed with them)."""
    from engine.runtime.decode.kvsequence import KVSequence

    schema = {"type": "array", "items": {"type": "object", "properties": {"k": {"enum": ["aa", "bb"]}},
                                         "required": ["k"], "additionalProperties": False}, "maxItems": 6,
              "minItems": 6}
    prompt = service.tokenizer.chat_ids(ASK).reshape(-1).tolist()
    got = []
    for drafter in (None, PromptLookup()):
        constraint = service.tokenizer.constraint(compile_grammar("json_schema", schema), service.eos)
        decoding = Decoding(KVSequence(chain, 512, 0, "mask"), prompt, 200, service.eos, drafter=drafter, k=4,
                            constraint=constraint)
        assert decoding._flags == Flag.LOGITS
        decoding.start()
        while decoding.advance():
            pass
        got.append(decoding.result)
    assert got[1].tokens == got[0].tokens and got[1].accepted > 0
    jsonschema.validate(json.loads(service.tokenizer.decode(got[0].tokens)), schema)


def test_response_format_through_the_api(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "rank"], "additionalProperties": False}
    for stream in (False, True):
        response = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=100, temperature=0, stream=stream,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}})
        text, finish = reply_text(response, stream)
        jsonschema.validate(json.loads(text), schema)
        assert finish == "stop"
    obj = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=10, temperature=0.8, seed=5,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")
    text = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0,
                                          response_format={"type": "text"})
    assert text.choices[0].finish_reason == "length"


@pytest.mark.parametrize("fmt, param", [
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "two"}}},
     "response_format.json_schema.schema"),
    ({"type": "yaml"}, "response_format.type"),
])
def test_a_schema_that_cannot_be_followed_is_a_400_naming_it(client, fmt, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, response_format=fmt)
    assert caught.value.body["param"] == param


def test_compile_grammar_refuses_a_schema_that_is_not_an_object():
    with pytest.raises(GrammarError, match="must be an object"):
        compile_grammar("json_schema", ["not", "a", "schema"])
