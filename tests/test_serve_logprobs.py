"""``logprobs`` / ``top_logprobs`` (chat and completions, streamed too) against the model's own
full logits, ``logit_bias`` reaching tokens outside the stage's top candidates, the presence and
frequency penalties, and their bad values as 400s naming the field; through the official client."""

from __future__ import annotations

import math

import numpy as np
import openai
import pytest

from engine.runtime.decode.kvsequence import KVSequence
from engine.runtime.decode.sampling import Sampler, SamplingParams
from engine.transport.wire import Flag

from api_support import MODEL, served_tiny

ASK = [{"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def served(tiny_exports):
    with served_tiny(tiny_exports, streams=2) as pair:
        yield pair


def _log_softmax(service, ids: list[int]) -> np.ndarray:
    """The model's log-probabilities of the next token after ``ids``, from a forward of its own."""
    seq = KVSequence(service.chain, service.max_length, stream=service.streams + 1)
    seq.reset()
    row = seq.forward(ids, Flag.LOGITS).logits[0, -1].astype(np.float64)
    return row - row.max() - math.log(np.exp(row - row.max()).sum())


def test_chat_logprobs_are_the_models_own(served):
    service, client = served
    got = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0, logprobs=True,
                                         top_logprobs=3, extra_body={"ignore_eos": True})
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens == 8
    prompt = service.tokenizer.chat_ids(ASK).reshape(-1).tolist()
    want = _log_softmax(service, prompt)
    best = np.argsort(-want)[:3]
    first = content[0]
    assert [t.token for t in first.top_logprobs] == [service.tokenizer.decode([int(i)]) for i in best]
    assert np.allclose([t.logprob for t in first.top_logprobs], want[best], atol=1e-4)
    for entry in content:  # greedy: each token is its row's likeliest
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == entry.top_logprobs[0].logprob <= 0
        assert entry.logprob >= entry.top_logprobs[-1].logprob
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    # streamed: the same entries, spread over the chunks
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True,
                                                 extra_body={"ignore_eos": True}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    # (this one reused the prompt's cache: its prefill differs from the cold one's by an ulp or so)
    assert np.allclose([e.logprob for e in streamed], [e.logprob for e in content], atol=1e-6)
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None  # not asked for, not computed


def test_completions_logprobs_and_sampled_tokens(served):
    service, client = served
    got = client.completions.create(model=MODEL, prompt="Paris is the capital of", max_tokens=6, temperature=0.8,
                                    seed=3, logprobs=2, extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(len(top) <= 2 and all(v <= 0 for v in top.values()) for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    ids = service.tokenizer.chat_ids([{"role": "user", "content": "Paris is the capital of"}], chat=False)
    ids = ids.reshape(-1).tolist()
    want = _log_softmax(service, ids)  # the sampled first token's log-probability, before temperature
    first = [t for t in range(len(want)) if service.tokenizer.decode([t]) == lp.tokens[0]]
    assert any(abs(want[t] - lp.token_logprobs[0]) < 1e-4 for t in first)
    streamed = list(client.completions.create(model=MODEL, prompt="Paris is the capital of", max_tokens=6,
                                              temperature=0.8, seed=3, logprobs=2, stream=True,
                                              extra_body={"ignore_eos": True}))
    again = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert np.allclose(again, lp.token_logprobs, atol=1e-6) and len(again) == 6


def test_logit_bias_reaches_any_token(served):
    service, client = served
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0, logprobs=True,
                                           top_logprobs=20, extra_body={"ignore_eos": True})
    first = plain.choices[0].logprobs.content[0]
    ids = service.tokenizer.chat_ids(ASK).reshape(-1).tolist()
    row = _log_softmax(service, ids)
    unlikely = int(np.argsort(row)[3])  # far outside the 256 top candidates of a 384-token vocabulary
    for temperature in (0, 0.7):
        forced = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=temperature,
                                                logit_bias={str(unlikely): 100}, logprobs=True,
                                                extra_body={"ignore_eos": True})
        tokens = [e.token for e in forced.choices[0].logprobs.content]
        assert tokens == [service.tokenizer.decode([unlikely])] * 4
    banned = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0, logprobs=True,
                                            logit_bias={str(int(np.argmax(row))): -100},
                                            extra_body={"ignore_eos": True})
    assert banned.choices[0].logprobs.content[0].token == first.top_logprobs[1].token  # the runner-up


def test_presence_and_frequency_penalties():
    ids, logits = np.array([10, 11, 12]), np.array([3.0, 2.5, 0.0])
    sampler = Sampler(SamplingParams(temperature=0, frequency_penalty=0.3, presence_penalty=0.1))
    assert sampler.distribution(ids, logits, (), {10: 2})[0].tolist() == [11]  # 3 - 2 * 0.3 - 0.1 < 2.5
    assert sampler.distribution(ids, logits, (), {10: 1})[0].tolist() == [10]  # 3 - 0.3 - 0.1 > 2.5
    sampler = Sampler(SamplingParams(temperature=0, presence_penalty=-2.0))
    assert sampler.distribution(ids, logits, (), {11: 1})[0].tolist() == [11]  # a negative one favours them
    assert not SamplingParams(temperature=0, frequency_penalty=0.5).greedy  # greedy, but not the top-1 path


def test_penalties_through_the_api(served):
    service, client = served

    def reply(**kw):
        got = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0,
                                             extra_body={"ignore_eos": True}, logprobs=True, **kw)
        return [e.token for e in got.choices[0].logprobs.content]

    plain, penalised = reply(), reply(frequency_penalty=2.0, presence_penalty=2.0)
    assert max(plain.count(t) for t in plain) > 2  # a random tiny model repeats itself greedily
    assert max(penalised.count(t) for t in penalised) < max(plain.count(t) for t in plain)


@pytest.mark.parametrize("body, param", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": 3}, "logprobs"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"logit_bias": {"-1": 5}}, "logit_bias"),
    ({"logit_bias": {"384": 5}}, "logit_bias"),  # the tiny vocabulary has 384 tokens
    ({"logit_bias": {"99999999999999999999999": 5}}, "logit_bias"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
])
def test_bad_logprobs_and_penalties_are_400s_naming_the_field(served, body, param):
    service, client = served
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, extra_body=body)
    assert caught.value.body["param"] == param


def test_completions_logprobs_out_of_range(served):
    service, client = served
    for bad in (21, -1, True):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, prompt="Paris", max_tokens=2, extra_body={"logprobs": bad})
        assert caught.value.body["param"] == "logprobs"
