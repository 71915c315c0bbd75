"""Several choices in one request: ``n`` (seeded choices are the single requests seeded seed, seed+1...),
lists of prompts, streamed and not; completions' ``echo`` with the prompt's log-probabilities
(against the model's own logits) and ``max_tokens: 0``; their limits as 400s naming the field."""

from __future__ import annotations

import math

import numpy as np
import openai
import pytest

from engine.runtime.decode.kvsequence import KVSequence
from engine.transport.wire import Flag

from api_support import MODEL, served_tiny

PROMPTS = ["The quick brown fox", "Paris is the capital of", "def add(a, b):"]


@pytest.fixture(scope="module")
def served(tiny_exports):
    with served_tiny(tiny_exports, streams=3) as pair:
        yield pair


def _one(client, prompt, **kw):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, extra_body={"ignore_eos": True},
                                     **kw).choices[0].text


def test_a_list_of_prompts_times_n(served):
    service, client = served
    got = client.completions.create(model=MODEL, prompt=PROMPTS, n=2, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == list(range(6))
    alone = [_one(client, p, temperature=0) for p in PROMPTS]
    assert [c.text for c in got.choices] == [t for t in alone for _ in range(2)]
    prompt_tokens = sum(service.tokenizer.chat_ids([{"role": "user", "content": p}], chat=False).size
                        for p in PROMPTS)
    assert got.usage.prompt_tokens == prompt_tokens and got.usage.completion_tokens == 6 * 8
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS, n=2, max_tokens=8, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    texts = [""] * 6
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in got.choices]


def test_seeded_chat_choices_are_the_single_requests_seeded_one_after_another(served):
    service, client = served
    ask = [{"role": "user", "content": "A fleet of laptops"}]
    got = client.chat.completions.create(model=MODEL, messages=ask, n=3, max_tokens=12, temperature=1.0, seed=40,
                                         extra_body={"ignore_eos": True})
    alone = [client.chat.completions.create(model=MODEL, messages=ask, max_tokens=12, temperature=1.0, seed=40 + j,
                                            extra_body={"ignore_eos": True}).choices[0].message.content
             for j in range(3)]
    assert [c.message.content for c in got.choices] == alone and len(set(alone)) == 3
    chunks = list(client.chat.completions.create(model=MODEL, messages=ask, n=3, max_tokens=12, temperature=1.0,
                                                 seed=40, stream=True, extra_body={"ignore_eos": True}))
    texts = [""] * 3
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == alone


def test_a_prompts_choices_prefill_it_once(served):
    _, client = served
    # a prompt of its own, long beside the chat template's head that other streams' caches may hold
    ask = [{"role": "user", "content": " ".join(f"laptop {i} relays activations;" for i in range(10))}]
    got = client.chat.completions.create(model=MODEL, messages=ask, n=3, max_tokens=6, temperature=1.0, seed=7,
                                         extra_body={"ignore_eos": True})
    prompt = got.usage.prompt_tokens
    assert prompt > 100 and len(got.choices) == 3
    # the 2nd and 3rd choices find the prompt in the 1st's stream (but its last token, whose logits
    # start the reply); the 1st at most the template's head
    assert got.usage.prompt_tokens_details.cached_tokens >= 2 * (prompt - 1)


def _prompt_log_softmax(service, ids: list[int]) -> np.ndarray:
    seq = KVSequence(service.chain, service.max_length, stream=service.streams + 1)
    seq.reset()
    rows = seq.forward(ids, Flag.LOGITS | Flag.ALL_POSITIONS).logits[0].astype(np.float64)
    peak = rows.max(-1, keepdims=True)
    return rows - peak - np.log(np.exp(rows - peak).sum(-1, keepdims=True))


def test_echo_with_the_prompts_logprobs_and_max_tokens_zero(served):
    service, client = served
    prompt = "Paris is the capital of France."
    ids = service.tokenizer.chat_ids([{"role": "user", "content": prompt}], chat=False).reshape(-1).tolist()
    rows = _prompt_log_softmax(service, ids)
    want = [rows[k - 1, ids[k]] for k in range(1, len(ids))]
    for _ in range(2):  # the second time a stream's cache holds the prompt: it is prefilled whole anyway
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                        temperature=0)
        choice = got.choices[0]
        assert choice.text == prompt and got.usage.completion_tokens == 0
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert np.allclose(lp.token_logprobs[1:], want, atol=1e-4)
        assert all(len(top) == 1 for top in lp.top_logprobs[1:])
    more = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=0,
                                     temperature=0, extra_body={"ignore_eos": True})
    alone = _one(client, prompt, temperature=0)
    assert more.choices[0].text == prompt + alone[: len(more.choices[0].text) - len(prompt)]
    assert len(more.choices[0].logprobs.tokens) == len(ids) + 3 and more.usage.completion_tokens == 3
    assert math.isclose(more.choices[0].logprobs.token_logprobs[1], want[0], abs_tol=1e-4)


@pytest.mark.parametrize("path, body, param", [
    ("completions", {"prompt": "hi", "n": 9}, "n"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("completions", {"prompt": ["hi", ""]}, "prompt"),
    ("completions", {"prompt": ["hi"] * 33}, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "echo": True, "logprobs": 1, "stream": True}, "logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 12}, "n"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
])
def test_choice_limits_are_400s_naming_the_field(served, path, body, param):
    service, client = served
    with pytest.raises(openai.BadRequestError) as caught:
        client.post(f"/{path}", body={"model": MODEL, **body}, cast_to=object)
    assert caught.value.body["param"] == param
