"""How the next token is chosen: greedy, or sampled with temperature, top-p, top-k, a repetition
penalty and a seed.

``SamplingParams`` is what a request carries (the API server, the chat service and the CLI share
it); ``temperature == 0`` is greedy decoding, token-identical to the top-1 path.  A sampled request
has the last stage return its top ``CANDIDATE_COUNT`` token ids and logits per position (``Flag.CANDIDATES``,
a few KB instead of the vocabulary), and the coordinator's ``Sampler`` draws from them, verifying
speculative drafts by rejection sampling.

A seeded request's text does not depend on how it was computed: the uniform number that picks the
token at position i is drawn from (seed, i) alone, not from a stream whose state would depend on how
many drafts earlier rounds tried, and it picks in token-id order, so that logits which differ by an
ulp between a cold prefill and the prefix cache (near-ties swapping places) pick the same token.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np

from engine.errors import FleetError
from engine.runtime.stages.output import top_candidates

MAX_LOGPROBS = 20  # alternatives a request may ask for per token (OpenAI's top_logprobs limit)


class SamplingError(FleetError):
    """A sampling parameter is out of range; ``field`` names it (the API answers 400 with it)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens (0: no limit beyond the candidates the stage returns)
    repetition_penalty: float = 1.0  # > 1 makes tokens already in the sequence less likely (CTRL's rule)
    seed: int | None = None  # the same seed and request give the same text; None or -1: a random seed
    presence_penalty: float = 0.0  # OpenAI's: subtracted from the logit of every token the reply holds
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time the reply holds the token
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), -100..100

    def __post_init__(self):
        _check("temperature", self.temperature, 0.0, 2.0)
        _check("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError("top_k", f"must be a whole number of 0 or more, not {self.top_k!r}")
        _check("repetition_penalty", self.repetition_penalty, 0.0, 10.0, low_open=True)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise SamplingError("seed", f"must be a whole number, not {self.seed!r}")
        _check("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise SamplingError("logit_bias", f"keys must be token ids (whole numbers of 0 or more), not {token!r}")
            _check("logit_bias", bias, -100.0, 100.0)

    @property
    def adjusts(self) -> bool:
        """Whether logits are changed before the choice (penalties, biases): greedy then needs a sampler."""
        return bool(self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty
                    or self.logit_bias)

    @property
    def greedy(self) -> bool:
        """The plain top-1 path: temperature 0 and nothing that changes the logits."""
        return self.temperature == 0.0 and not self.adjusts


def _check(field: str, value, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SamplingError(field, f"must be a number, not {value!r}")
    if value > high or value < low or (low_open and value == low):
        bound = f"more than {low:g}" if low_open else f"at least {low:g}"
        raise SamplingError(field, f"must be {bound} and at most {high:g}, not {value!r}")


GREEDY = SamplingParams()


class Sampler:
    """Chooses tokens from the candidates a forward returned, by one request's ``SamplingParams``.

    ``choose`` also verifies speculative drafts by rejection sampling: our drafters propose tokens
    deterministically (q puts all its mass on the draft x), so x is accepted with probability
    min(1, p(x)/q(x)) = p(x), and a rejection draws from the residual max(0, p - q) renormalised, which
    is p without x.  The tokens emitted are then distributed exactly as the target's own samples."""

    def __init__(self, params: SamplingParams):
        if params.greedy:
            raise ValueError("greedy decoding takes the top-1 path, not a sampler")
        self.params = params
        random_seed = params.seed is None or params.seed == -1
        self.seed = int(np.random.SeedSequence().entropy) if random_seed else params.seed % 2**64
        self.rng = np.random.default_rng(self.seed)
        self.prompt_len: int | None = None  # the history before the first choice: the penalties count after it
        bias = dict(params.logit_bias)
        self._bias = (np.fromiter(bias, np.int64, len(bias)), np.fromiter(bias.values(), np.float32, len(bias)))

    def candidates(self, out) -> tuple[np.ndarray, np.ndarray]:
        """The candidates to choose from in a forward's ``Output``: with a ``logit_bias``, the top of
        its full logits (``Flag.LOGITS``) after the biases, so that a token outside the stage's top
        candidates can be pushed in; else the stage's own."""
        if not self.params.logit_bias or out.logits is None:
            return out.candidates
        rows = np.array(out.logits[0], dtype=np.float32)
        ids, bias = self._bias
        known = ids < rows.shape[-1]
        rows[:, ids[known]] += bias[known]
        return top_candidates(rows)

    def uniform(self, position: int) -> float:
        """The uniform number that picks the token at ``position`` of the sequence (prompt included)."""
        return float(np.random.default_rng((self.seed, position)).random())

    def distribution(self, ids: np.ndarray, logits: np.ndarray, seen,
                     counts: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and their probabilities after the penalties, temperature, top-k and top-p
        (temperature 0: the one likeliest token after the penalties).  ``seen``: the tokens of the
        sequence (the repetition penalty); ``counts``: the reply's tokens and their counts (the
        presence and frequency penalties)."""
        p = self.params
        logits = logits.astype(np.float64)
        if p.repetition_penalty != 1.0 and len(seen):
            hit = np.isin(ids, np.fromiter(seen, np.int64, len(seen)) if not isinstance(seen, np.ndarray) else seen)
            logits[hit] = np.where(logits[hit] > 0, logits[hit] / p.repetition_penalty,
                                   logits[hit] * p.repetition_penalty)
        if counts:
            times = np.array([counts.get(int(t), 0) for t in ids], dtype=np.float64)
            logits -= p.frequency_penalty * times + p.presence_penalty * (times > 0)
        order = np.argsort(-logits, kind="stable")
        if p.temperature == 0.0:
            return ids[order[:1]], np.ones(1)
        ids, logits = ids[order], logits[order] / p.temperature
        if p.top_k:
            ids, logits = ids[: p.top_k], logits[: p.top_k]
        probs = np.exp(logits - logits[0])
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            ids, probs = ids[:keep], probs[:keep] / probs[:keep].sum()
        return ids, probs

    def draw(self, ids: np.ndarray, probs: np.ndarray, u: float | None = None) -> int:
        """The token whose share of the mass, laid out in token-id order, holds ``u`` (default: the
        sampler's own stream)."""
        order = np.argsort(ids, kind="stable")
        cum = np.cumsum(probs[order])
        u = self.rng.random() if u is None else u
        return int(ids[order][min(np.searchsorted(cum, u * cum[-1], side="right"), len(ids) - 1)])

    def choose(self, cand_ids: np.ndarray, cand_logits: np.ndarray, history: list[int],
               drafts: list[int]) -> tuple[list[int], int]:
        """The tokens to emit after ``history`` given the candidates of each verified position (the
        last ``len(drafts) + 1`` rows), and how many drafts were accepted.

        Each position's token is drawn from p with that position's own uniform; a draft is accepted
        when the draw is the draft (probability p(x) = min(1, p/q) for our q(x) = 1), and otherwise
        the draw, which then is distributed as p without x (the residual max(0, p - q)), is emitted.
        That is rejection sampling, coupled so that a seeded text is the very text of the same
        request without speculation."""
        rows = len(drafts) + 1
        cand_ids, cand_logits = cand_ids[-rows:], cand_logits[-rows:]
        seen = set(history) if self.params.repetition_penalty != 1.0 else ()
        if self.prompt_len is None:
            self.prompt_len = len(history)
        penalised = self.params.presence_penalty or self.params.frequency_penalty
        counts = collections.Counter(history[self.prompt_len:]) if penalised else None
        for i in range(rows):
            ids, probs = self.distribution(cand_ids[i], cand_logits[i], seen, counts)
            token = self.draw(ids, probs, self.uniform(len(history) + i))
            if i < len(drafts) and token == drafts[i]:
                if seen != ():
                    seen.add(token)
                if counts is not None:
                    counts[token] += 1
                continue
            return [*drafts[:i], token], i
        raise AssertionError("unreachable: the last row has no draft to accept")


def token_logprobs(rows: np.ndarray, tokens: list[int], top: int) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """Each of ``tokens``' log-probability under the model (the log-softmax of its row of raw
    logits: before temperature, penalties and biases, as OpenAI reports them), with the ``top``
    likeliest tokens of that row and theirs."""
    entries = []
    for row, token in zip(rows, tokens):
        row = np.asarray(row, dtype=np.float64)
        peak = row.max()
        norm = peak + math.log(np.exp(row - peak).sum())
        alternatives = []
        if top:
            best = np.argpartition(-row, top - 1)[:top]
            best = best[np.argsort(-row[best], kind="stable")]
            alternatives = [(int(i), float(row[i] - norm)) for i in best]
        entries.append((int(token), float(row[int(token)] - norm), alternatives))
    return entries
