"""How the next token is chosen: greedy, or sampled with temperature, top-p, top-k, a repetition
penalty and a seed.

``SamplingParams`` is what a request carries (the API server, the chat service and the CLI share
it); ``temperature == 0`` is greedy decoding, token-identical to the top-1 path.  A sampled request
has the last stage return its top ``CANDIDATES`` token ids and logits per position (``Flag.CANDIDATES``,
a few KB instead of the vocabulary), and the coordinator's ``Sampler`` draws from them, verifying
speculative drafts by rejection sampling.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from engine.errors import FleetError


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
    seed: int | None = None  # the same seed, request and configuration give the same text

    def __post_init__(self):
        _check("temperature", self.temperature, 0.0, 2.0)
        _check("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError("top_k", f"must be a whole number of 0 or more, not {self.top_k!r}")
        _check("repetition_penalty", self.repetition_penalty, 0.0, 10.0, low_open=True)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise SamplingError("seed", f"must be a whole number, not {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
        self.rng = np.random.default_rng(params.seed)

    def distribution(self, ids: np.ndarray, logits: np.ndarray, seen) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and their probabilities after the penalty, temperature, top-k and top-p."""
        p = self.params
        logits = logits.astype(np.float64)
        if p.repetition_penalty != 1.0 and len(seen):
            hit = np.isin(ids, np.fromiter(seen, np.int64, len(seen)) if not isinstance(seen, np.ndarray) else seen)
            logits[hit] = np.where(logits[hit] > 0, logits[hit] / p.repetition_penalty,
                                   logits[hit] * p.repetition_penalty)
        order = np.argsort(-logits, kind="stable")
        ids, logits = ids[order], logits[order] / p.temperature
        if p.top_k:
            ids, logits = ids[: p.top_k], logits[: p.top_k]
        probs = np.exp(logits - logits[0])
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            ids, probs = ids[:keep], probs[:keep] / probs[:keep].sum()
        return ids, probs

    def draw(self, ids: np.ndarray, probs: np.ndarray) -> int:
        return int(ids[min(np.searchsorted(np.cumsum(probs), self.rng.random() * probs.sum(), side="right"),
                           len(ids) - 1)])

    def choose(self, cand_ids: np.ndarray, cand_logits: np.ndarray, history: list[int],
               drafts: list[int]) -> tuple[list[int], int]:
        """The tokens to emit after ``history`` given the candidates of each verified position (the
        last ``len(drafts) + 1`` rows), and how many drafts were accepted."""
        rows = len(drafts) + 1
        cand_ids, cand_logits = cand_ids[-rows:], cand_logits[-rows:]
        seen = set(history) if self.params.repetition_penalty != 1.0 else ()
        for i, draft in enumerate(drafts):
            ids, probs = self.distribution(cand_ids[i], cand_logits[i], seen)
            p_draft = float(probs[ids == draft].sum())
            if self.rng.random() < p_draft:  # accepted with probability min(1, p/q), q(draft) = 1
                if seen != ():
                    seen.add(draft)
                continue
            residual = np.where(ids == draft, 0.0, probs)  # max(0, p - q): p without the draft
            return [*drafts[:i], self.draw(ids, residual)], i
        ids, probs = self.distribution(cand_ids[rows - 1], cand_logits[rows - 1], seen)
        return [*drafts, self.draw(ids, probs)], len(drafts)
