"""Sampling: the math on hand-made logits, the same seed giving the same text, and the statistical
test that speculative decoding under sampling keeps the target's distribution: thousands of seeded
two-token samples of a tiny model, with and without drafts, against the exact distribution computed
from the model's own candidates (a chi-square test, which rejects a sampler whose residual step is
broken)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.stats import chisquare

from engine.config import Scheduling
from engine.errors import FleetError
from engine.runtime.decode.generate import Generator
from engine.runtime.decode.kvsequence import KVSequence
from engine.runtime.decode.sampling import Sampler, SamplingError, SamplingParams
from engine.runtime.decode.service import ChatService
from engine.runtime.decode.speculative import Drafter
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.output import top_candidates
from engine.runtime.stages.stage import compile_config
from engine.transport.wire import Flag

PROMPT = np.array([[5, 17, 42, 101, 7, 250, 33]], dtype=np.int64)
PARAMS = dict(temperature=1.3, top_k=4)
SAMPLES = 3000


def test_top_k_top_p_temperature_and_the_repetition_penalty():
    ids, logits = top_candidates(np.array([[1.0, 4.0, 3.0, 2.0, 0.0]], np.float32))
    assert ids[0].tolist() == [1, 2, 3, 0, 4] and logits[0].tolist() == [4.0, 3.0, 2.0, 1.0, 0.0]
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=2, seed=0))
    kept, probs = sampler.distribution(ids[0], logits[0], ())
    assert kept.tolist() == [1, 2] and np.allclose(probs, np.exp([4, 3]) / np.exp([4, 3]).sum())
    kept, probs = Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=0)).distribution(ids[0], logits[0], ())
    assert kept.tolist() == [1, 2]  # 0.64 of the mass is not enough, 0.88 is
    cold, _ = Sampler(SamplingParams(temperature=0.01, seed=0)).distribution(ids[0], logits[0], ())
    assert cold[0] == 1
    penalised, _ = Sampler(SamplingParams(temperature=1.0, repetition_penalty=2.0, seed=0)).distribution(
        ids[0], logits[0], {1})
    assert penalised[0] == 2  # 4.0 / 2 falls below 3.0
    with pytest.raises(SamplingError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=1.5)
    with pytest.raises(ValueError):
        Sampler(SamplingParams())  # greedy takes the top-1 path


@pytest.fixture(scope="module")
def chain(tiny_exports):
    return LocalChain(tiny_exports["qwen2", "1"].folders, config=compile_config("exact"))


def _candidates(chain, ids):
    seq = KVSequence(chain, 64)
    seq.reset()
    out = seq.forward(ids, Flag.CANDIDATES)
    return out.candidates[0][-1], out.candidates[1][-1]


def _exact(chain) -> dict[tuple[int, int], float]:
    """P(first two tokens) by the sampling parameters, from the model's own candidates."""
    sampler = Sampler(SamplingParams(**PARAMS, seed=0))
    first, p_first = sampler.distribution(*_candidates(chain, PROMPT[0].tolist()), ())
    exact = {}
    for a, pa in zip(first.tolist(), p_first):
        second, p_second = sampler.distribution(*_candidates(chain, PROMPT[0].tolist() + [a]), ())
        for b, pb in zip(second.tolist(), p_second):
            exact[a, b] = pa * pb
    return exact


class FixedDraft(Drafter):
    """Always drafts the same token: likely after some first tokens, impossible after others, so
    drafts are accepted and rejected often."""

    def __init__(self, token: int):
        self.token = token

    def propose(self, history, k):
        return [self.token] * k


def _sample_pairs(chain, drafter, seeds) -> dict[tuple[int, int], int]:
    gen = Generator(chain, max_length=64, rewind="trim")
    counts: dict[tuple[int, int], int] = {}
    drafted = accepted = 0
    for seed in seeds:
        result = gen.generate(PROMPT, 3, ignore_eos=True, drafter=drafter, k=1,
                              sampling=SamplingParams(**PARAMS, seed=seed))
        pair = tuple(result.tokens[:2])
        counts[pair] = counts.get(pair, 0) + 1
        drafted, accepted = drafted + result.drafted, accepted + result.accepted
    if drafter is not None:
        assert drafted == len(seeds) and 0.1 * drafted < accepted < 0.9 * drafted  # both outcomes were common
    return counts


def _p_value(exact: dict, counts: dict) -> float:
    outcomes = sorted(exact, key=exact.get, reverse=True)
    assert set(counts) <= set(exact)
    expected = np.array([exact[o] for o in outcomes]) * sum(counts.values())
    observed = np.array([counts.get(o, 0) for o in outcomes], dtype=float)
    big = expected >= 5  # chi-square wants 5 expected per bin: pool the rare outcomes
    if not big.all():
        expected = np.append(expected[big], expected[~big].sum())
        observed = np.append(observed[big], observed[~big].sum())
    return chisquare(observed, expected * observed.sum() / expected.sum()).pvalue


def _draft_token(exact: dict) -> int:
    """A second token that is likely after the likeliest first token."""
    first = max({a for a, _ in exact}, key=lambda a: sum(p for (x, _), p in exact.items() if x == a))
    return max((b for a, b in exact if a == first), key=lambda b: exact[first, b])


def test_speculation_under_sampling_keeps_the_target_distribution(chain):
    exact = _exact(chain)
    assert abs(sum(exact.values()) - 1) < 1e-9 and len(exact) == 16
    plain = _sample_pairs(chain, None, range(SAMPLES))
    speculative = _sample_pairs(chain, FixedDraft(_draft_token(exact)), range(SAMPLES, 2 * SAMPLES))
    assert _p_value(exact, plain) > 1e-3
    assert _p_value(exact, speculative) > 1e-3


def test_a_broken_residual_step_is_caught(chain, monkeypatch):
    """Resampling from p instead of the residual after a rejection counts the draft twice."""
    exact = _exact(chain)

    def broken(self, cand_ids, cand_logits, history, drafts):
        rows = len(drafts) + 1
        for i, draft in enumerate(drafts):
            ids, probs = self.distribution(cand_ids[-rows + i], cand_logits[-rows + i], ())
            if self.rng.random() < float(probs[ids == draft].sum()):
                continue
            return [*drafts[:i], self.draw(ids, probs)], i  # p, not p without the draft
        ids, probs = self.distribution(cand_ids[-1], cand_logits[-1], ())
        return [*drafts, self.draw(ids, probs)], len(drafts)

    monkeypatch.setattr(Sampler, "choose", broken)
    speculative = _sample_pairs(chain, FixedDraft(_draft_token(exact)), range(SAMPLES))
    assert _p_value(exact, speculative) < 1e-6


def test_the_same_seed_gives_the_same_text(chain):
    service = ChatService(chain, scheduling=Scheduling(streams=2))
    try:
        messages = [{"role": "user", "content": "The quick brown fox"}]

        def reply(seed):
            return service.submit(messages, 24, ignore_eos=True,
                                  sampling=SamplingParams(temperature=1.0, seed=seed)).wait(60).tokens

        runs = [reply(7), reply(7), reply(8)]
        assert runs[0] == runs[1] and runs[0] != runs[2]
        greedy = [service.submit(messages, 24, ignore_eos=True).wait(60).tokens for _ in range(2)]
        assert greedy[0] == greedy[1] and greedy[0] != runs[0]
    finally:
        service.chain = LocalChain.__new__(LocalChain)  # the module's chain outlives this service
        service.close()


def test_sampling_parameters_are_checked_with_the_field_named():
    for bad, field in [({"temperature": -0.1}, "temperature"), ({"top_k": -1}, "top_k"),
                       ({"seed": 1.5}, "seed"), ({"repetition_penalty": 0}, "repetition_penalty")]:
        with pytest.raises(SamplingError) as caught:
            SamplingParams(**bad)
        assert caught.value.field == field and isinstance(caught.value, FleetError)
    assert list(itertools.islice(iter([SamplingParams().greedy]), 1)) == [True]
