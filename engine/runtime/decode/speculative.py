"""Draft sources for speculative decoding, and the online choice of K.

A drafter proposes up to K next tokens from the sequence so far; the target pipeline verifies them
all in one traversal.  Three sources: prompt lookup (the longest recent n-gram match in the
sequence: free, no model), a small draft model with the target's tokenizer (run in this process on
the fast settings, its own KV cache rewound by mask in either mode), and the hybrid of the two (each
round, the lookup where it matches and is expected to give more tokens per millisecond, the model
otherwise).

K auto: every source fits what a round costs (``RoundCost``: drafting plus verify, a fixed part
holding the traversal and a draft model's catch-up, and a part per drafted token).  ``AutoK`` takes
the K that maximises expected tokens per second from that fit and the running acceptance rate (prompt
lookup).  A draft model sees how sure it is of each token it drafts, so it decides round by round:
it drafts one more token while that token's chance of being accepted is worth another draft step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from engine.config import AUTO_WEIGHTS, DRAFTS, int4_layers
from engine.errors import FleetError, ShardError
from engine.manifest import Manifest
from engine.runtime.decode.kvsequence import KVSequence
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.stage import compile_config
from engine.transport.wire import Flag
from engine.tuning import DRAFT_MAX_TRUST, DRAFT_POSITION_SHARE, LOOKUP_PRIOR

TOKENIZER_FILES = ("openvino_tokenizer.bin", "openvino_detokenizer.bin")



def draft_weights(weights: str) -> str:
    """The weight format a draft model is exported in: ``auto`` gives the fast one, INT4, since a
    draft is there for speed and the target checks every token it proposes."""
    return "int4" if weights == AUTO_WEIGHTS else weights


def draft_head(weights: str) -> str:
    """The LM head a draft model is exported with (``export_model(head=...)``): INT4 beside INT4
    weights, since the head is a large share of a draft step and verification corrects what the
    coarser head changes; INT8 otherwise."""
    return "int4" if int4_layers(weights) else "int8"


def draft_format(weights: str) -> dict:
    """How a draft model beside a target in ``weights`` is exported: ``export_model``'s ``weights``
    and ``head`` (``draft_weights``, ``draft_head``), the same for the app, a deployment and the
    benchmarks."""
    weights = draft_weights(weights)
    return {"weights": weights, "head": draft_head(weights)}


def smooth(average: float, sample: float) -> float:
    """A running cost estimate: the first sample, then an exponential average."""
    return sample if not average else 0.8 * average + 0.2 * sample


class Drafter(ABC):
    """What ``Decoding`` asks of a draft source: ``propose`` up to K tokens each round, and hear how
    the round went.  A source with ``fits_k`` chooses how many tokens to draft itself under K auto
    (``Decoding`` sets its ``pick_k``) instead of following ``AutoK``."""

    name = "drafter"
    fits_k = False
    pick_k = False

    def reset(self) -> None:
        """Forgets the sequence (a new generation starts)."""

    def prime(self, prompt: list[int]) -> None:
        """Takes in the prompt while the target's prefill is in flight."""

    @abstractmethod
    def propose(self, history: list[int], k: int) -> list[int]:
        """Up to ``k`` next tokens after ``history`` (none: a plain step)."""

    def feedback(self, proposed: int, accepted: int, verify_ms: float, draft_ms: float) -> None:
        """The outcome of the round this source drafted: drafts accepted, and what it cost."""


class PromptLookup(Drafter):
    """Proposes the continuation of the most recent earlier occurrence of the sequence's last n-gram."""

    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.matched = 0  # the length of the n-gram the last proposal continued (0: none)

    def reset(self) -> None:
        self.matched = 0

    def propose(self, history: list[int], k: int) -> list[int]:
        self.matched = 0
        n_hist = len(history)
        arr = None
        for n in range(min(self.max_ngram, n_hist - 1), self.min_ngram - 1, -1):
            if arr is None:
                arr = np.asarray(history, dtype=np.int64)
            tail = arr[-n:]
            # candidate starts of an earlier copy of the tail, most recent first
            starts = np.flatnonzero(arr[: n_hist - n] == tail[0])[::-1]
            for s in starts:
                if np.array_equal(arr[s : s + n], tail):
                    follow = arr[s + n : s + n + k]
                    if len(follow):
                        self.matched = n
                        return follow.tolist()
        return []


class DraftModel(Drafter):
    """A small model with the target's tokenizer, proposing greedily from its own KV cache.

    With ``pick_k`` (K auto) it drafts up to K tokens but stops where another draft step no longer
    pays: the next token would be accepted only if every draft before it is, and that chance (the
    product of the draft's top-1 probabilities, scaled by how often its confidence has held in
    verification) must be worth a draft step at the measured round cost: deciding token by token
    beats one K per round chosen from the acceptance rate (docs/speculative-history.md).

    The scale on its confidence (accepted drafts per unit of it) goes up to ``DRAFT_MAX_TRUST``, above
    1: a draft model can be under-confident (the 0.5B draft is, in ``fast`` mode), and capped at 1 it
    stops drafting where its drafts are still being accepted."""

    name = "model"
    fits_k = True
    DECAY = 0.95
    MAX_CATCH_UP = 16  # tokens a catch-up feeds at most (see ``_catch_up``)

    def __init__(self, chain, rewind: str = "mask", stream: int = 0):
        self.chain = chain
        self.seq = KVSequence(chain, chain.spec.max_position, stream, rewind)
        self.fed: list[int] = []  # the tokens taken in (a long catch-up leaves some out of the cache)
        self.pick_k = False
        self._guesser = PromptLookup()
        self._bonus: tuple[int, float] | None = None  # the token after a right guess, and its probability
        self._forget()

    def _forget(self) -> None:
        self.costs = RoundCost()
        # decayed sums: accepted drafts and the confidence they were drafted with; top-1 probabilities
        self._accepted, self._predicted = 1.0, 1.0
        self._prob_sum, self._prob_weight = 0.8, 1.0
        self._chance = 0.0  # the round in flight's drafts, by the draft's confidence

    def reset(self) -> None:
        self.seq.reset()
        self.fed = []
        self._bonus = None
        self._forget()

    def warm(self, tokens: int = 256) -> None:
        """One forward of ``tokens`` positions, then a reset.  The first forward longer than any
        before grows the request's buffers, and a fresh compiled model's first costs far more; after
        this one a catch-up of up to ``tokens`` costs only its compute, not a first round's share of
        the reply's time."""
        self.seq.reset()
        self.seq.forward(np.zeros(min(tokens, self.seq.max_length), np.int64))
        self.reset()

    def prime(self, prompt: list[int]) -> None:
        """Feeds the prompt while the target's prefill runs (its time is prompt processing, not decoding)."""
        self._catch_up(prompt)
        self._drop_bonus()

    def _catch_up(self, history: list[int], limit: int | None = None) -> tuple[int, float]:
        """Brings the draft cache up to ``history``: the draft's next token and its probability.

        With ``limit``, a catch-up feeds only the last ``limit`` tokens it lacks; the tokens before
        them are counted in ``fed`` but left out of the cache, and later positions follow as if
        they were there (only drafts are ever rewound, so no rewind reaches them).  The hybrid
        leaves the model idle for dozens of rounds where lookup or plain steps pay better, and a
        try of the model after that caught up on every token it missed, many draft steps' worth: a
        try's cost grew with the time away, so trying less often saved nothing.  A draft that lacks part of its own
        answer's middle still drafts from the prompt and the recent text."""
        common = 0
        known = min(len(self.fed), len(history))
        while common < known and self.fed[common] == history[common]:
            common += 1
        common = min(common, len(history) - 1)  # re-feed at least one token: its logits give the next
        if common < len(self.fed):  # the draft cache holds tokens the sequence no longer has
            self.seq.reject(len(self.fed) - common)
            del self.fed[common:]
        new = history[common:]
        self.fed.extend(new)
        if limit and len(new) > limit:
            self.seq.skip(len(new) - limit)
            new = new[-limit:]
        return self._step(new)

    def _step(self, ids: list[int]) -> tuple[int, float]:
        """Feeds ``ids`` (already the end of ``fed``): the draft's next token and its probability
        (1.0 unless ``pick_k``).

        With the mask rewind a single token goes in beside a guess at the draft's next token (prompt
        lookup's, else the token again): steps alternate between one token and the two of a catch-up,
        and a step of another width than the last costs more than a second position does (the plugin
        re-prepares every node).  A right guess gives the token
        after it in the same forward (``_bonus``); a wrong one is masked out.  With the trim rewind
        a wrong guess would cost a trim, so a single token goes in alone."""
        flags = Flag.PROBS if self.pick_k else Flag.NONE
        row = -1
        if len(ids) == 1 and self.seq.rewind == "mask":
            guess = (self._guesser.propose(self.fed, 1) or ids)[0]
            out = self.seq.forward([ids[0], guess], flags | Flag.ALL_POSITIONS)
            row = 0
            if int(out.tokens[0]) == guess:
                self._bonus = int(out.tokens[1]), float(out.probs[1]) if self.pick_k else 1.0
            else:
                self.seq.reject(1)
        else:
            out = self.seq.forward(ids, flags)
        if not self.pick_k:
            return int(out.tokens[row]), 1.0
        prob = float(out.probs[row])
        self._prob_sum = self._prob_sum * self.DECAY + prob
        self._prob_weight = self._prob_weight * self.DECAY + 1
        return int(out.tokens[row]), prob

    def propose(self, history: list[int], k: int) -> list[int]:
        if k <= 0 or not history:
            return []
        token, prob = self._catch_up(history, self.MAX_CATCH_UP)
        drafts = [token]
        # accepted per unit of the draft's confidence: above 1 where the draft is under-confident
        trust = min(DRAFT_MAX_TRUST, self._accepted / self._predicted)

        def accepted(confidence: float) -> float:  # the chance a draft drafted with it is accepted
            return min(1.0, trust * confidence)

        chance = prob  # the draft's confidence that every draft so far is right
        # tokens the round gives (the verify adds one); unclipped, unlike ``accepted``: clipped, the
        # draft drafted further than pays
        expected = 1 + trust * chance
        self._chance = chance
        fixed, per_draft = self.costs.fit() if self.costs else (3.0, 1.0)  # before any round: a guess
        while len(drafts) < k:
            if self._bonus is not None:  # the last step's guess was right: the token after it is free
                # it costs a verify position: worth it while its chance raises tokens per ms
                if self.pick_k and accepted(chance * self._bonus[1]) < DRAFT_POSITION_SHARE * expected:
                    break
                self.fed.append(token)
                token, prob = self._bonus
                self._bonus = None
            else:
                if self.pick_k:
                    # one more step adds a token accepted with trust * chance * (its probability,
                    # taken as the mean so far), for per_draft ms: worth it while it raises tokens per ms
                    gain = accepted(chance * self._prob_sum / self._prob_weight)
                    if gain * (fixed + per_draft * len(drafts)) < expected * per_draft:
                        break
                self.fed.append(token)
                token, prob = self._step([token])
            drafts.append(token)
            chance *= prob
            expected += accepted(chance)
            self._chance += chance
        self._drop_bonus()
        return drafts  # the next propose() rewinds whatever the target did not keep

    def _drop_bonus(self) -> None:
        """A right guess not proposed holds a cache slot the sequence does not have: masks it out."""
        if self._bonus is not None:
            self._bonus = None
            self.seq.reject(1)

    def feedback(self, proposed: int, accepted: int, verify_ms: float, draft_ms: float) -> None:
        self.costs.add(proposed, verify_ms, draft_ms)
        self.learn(accepted)

    def learn(self, accepted: int) -> None:
        """How many of the last round's drafts were accepted, against the confidence they were
        drafted with (without the round's cost: see ``Hybrid.feedback``)."""
        self._accepted = self._accepted * self.DECAY + accepted
        self._predicted = self._predicted * self.DECAY + self._chance


class Hybrid(Drafter):
    """Prompt lookup where it matches and is expected to give more tokens per millisecond, the draft
    model otherwise.

    A lookup proposal costs nothing to make but is often wrong; the model's is right more often but
    costs its draft steps.  Each source's acceptance (decayed) and round cost come from the rounds'
    outcomes.  The lookup's acceptance is kept per matched n-gram length (in code a one-token match
    is common and usually wrong, a three-token match usually right) and per draft position.  A
    lookup proposal the hybrid does not take is scored against the tokens the round gives instead,
    so a lookup that failed early is not judged by that alone while the model drafts; a lookup
    passed over for a while is still tried now and then.  A matched length no round has scored yet
    is not tried on its prior alone: its first proposal is scored against the model's round (in
    `exact` a failed 3-token lookup round costs a 4-position verify for one token).  No round is a
    plain step: under K auto the model drafts as far as its confidence pays, and a plain step
    between drafted rounds changes the verify's width twice, each change costing the plugin a
    re-preparation.

    A switch has a cost: after lookup rounds the model's next round pays a longer catch-up (capped,
    ``DraftModel.MAX_CATCH_UP``) and new shapes.  So the model's rounds are fitted apart by what came
    before them, and a lookup round chosen right after a model round is charged the difference,
    once: the model itself is priced at its steady cost.  The model's own cost fit, which sets how
    far it drafts, holds only those steady rounds: fed its returns too, it drafted too little.

    The model's record decays as slowly as a passed-over lookup's (``MODEL_DECAY``).  Text that is
    hard for the model is hard for the lookup too: when the model's record reacted within a few
    rounds and the lookup's over dozens, a short hard stretch for the model handed its rounds to a
    lookup judged on the easier text before, which was then right far less often where taken than
    where it had been scored.

    Each of these rules won side by side against the hybrid without it (docs/speculative-history.md).

    With ``pick_k`` (K auto, which ``Decoding`` sets) the lookup proposes ``LOOKUP_K`` tokens: a
    steady verify width, where a K of its own chosen online changed it; the model fits its own round
    cost and drafts as far as its confidence pays."""

    name = "hybrid"
    fits_k = True
    DECAY = 0.9  # a lookup round's outcome
    MIN_WAIT, MAX_WAIT = 8, 64  # rounds a passed-over lookup waits before it is tried again
    # A lookup proposal not taken is scored against the tokens its round gave instead (nearly every
    # round): its acceptance decays per scored round more slowly than per round drafted.
    UNUSED_DECAY = 0.97
    MODEL_DECAY = UNUSED_DECAY  # the model's record: as slow (see the class docstring)
    LOOKUP_K = 3  # the lookup's K under K auto

    def __init__(self, lookup: PromptLookup, model: DraftModel):
        self.lookup = lookup
        self.model = model
        self._forget()

    @property
    def pick_k(self) -> bool:
        return self.model.pick_k

    @pick_k.setter
    def pick_k(self, on: bool) -> None:
        self.model.pick_k = on

    def reset(self) -> None:
        self.lookup.reset()
        self.model.reset()
        self._forget()

    def _forget(self) -> None:
        self.model_stats = [1.0, 2.0, 1.0]  # decayed accepted, drafted, rounds: a prior of 1 of 2
        # per matched n-gram length ("lookup<n>"), per draft position: decayed [right, tried], tried
        # only where every draft before it was right
        self.positions: dict[str, list[list[float]]] = {
            f"lookup{n}": [] for n in range(1, self.lookup.max_ngram + 1)}
        self.verify_ms = 0.0  # a round's verify (smoothed): the cost of a source without data yet
        self.lookup_costs = RoundCost()  # every lookup round's, shape changes included
        self.return_costs = RoundCost()  # the model's rounds right after a lookup round
        self.last = self._previous = None
        self._skipped, self._wait = 0, self.MIN_WAIT  # the lookup's rounds passed over, and its wait
        self._unused = None  # (history length, source, drafts) of a lookup proposal not taken
        self._scored: set[str] = set()

    def prime(self, prompt: list[int]) -> None:
        self.model.prime(prompt)

    def _rate(self, source: str, proposed: int = 0) -> float:
        """Expected tokens per ms of a round: the source's acceptance and round-cost fit (the mean
        verify until that fit has data).  A lookup round proposes ``proposed`` drafts and pays
        ``_leave_ms``; a model round drafts as many as the model's rounds have lately, at their
        steady cost."""
        if source == "model":
            accepted, _, rounds = self.model_stats
            k = self._model_k()
            tokens, cost = 1 + accepted / rounds, self.model.costs.cost(k)
            return tokens / ((cost or self.verify_ms) + 1e-3)
        tokens, chance = 1.0, 1.0
        for right, tried in self._positions(source, proposed):
            chance *= right / tried
            tokens += chance
        return tokens / ((self.lookup_costs.cost(proposed) or self.verify_ms) + self._leave_ms() + 1e-3)

    def _positions(self, source: str, count: int) -> list[list[float]]:
        """The first ``count`` positions' [right, tried] of a lookup source, from a prior."""
        rows = self.positions[source]
        rows.extend(list(LOOKUP_PRIOR[min(len(rows), 1)]) for _ in range(count - len(rows)))
        return rows[:count]

    def _leave_ms(self) -> float:
        """What a lookup round costs later when the model drafted the last round: the model's next
        round pays a longer catch-up and new shapes."""
        if self.last != "model" or not (self.return_costs and self.model.costs):
            return 0.0
        k = self._model_k()
        return max(0.0, self.return_costs.cost(k) - self.model.costs.cost(k))

    def _model_k(self) -> float:
        """How many tokens the model's rounds have drafted lately."""
        _, drafted, rounds = self.model_stats
        return drafted / rounds

    def propose(self, history: list[int], k: int) -> list[int]:
        """Up to ``k`` drafts (fewer when ``pick_k`` and the lookup's K or the model's confidence is lower)."""
        self._score_unused(history)
        drafts = self.lookup.propose(history, min(k, self.LOOKUP_K) if self.pick_k else k)
        choice = "model"
        if drafts:
            lookup = f"lookup{self.lookup.matched}"
            # a lookup passed over for a while is tried once, so its estimate keeps up with the
            # text; each try that does not win it back doubles the wait (8, 16, 32, 64 rounds)
            if lookup not in self._scored:  # no round has scored it yet: the model's round will
                self._unused = (len(history), lookup, drafts)
            elif self._rate(lookup, len(drafts)) >= self._rate("model"):
                choice, self._skipped, self._wait = lookup, 0, self.MIN_WAIT
            elif self._skipped >= self._wait:
                choice, self._skipped, self._wait = lookup, 0, min(2 * self._wait, self.MAX_WAIT)
            else:
                self._skipped += 1
                self._unused = (len(history), lookup, drafts)
        self._previous, self.last = self.last, choice
        if choice == "model":
            return self.model.propose(history, k)
        return drafts

    def _score_unused(self, history: list[int]) -> None:
        """Scores the lookup proposal the last round did not take against the tokens that round
        gave: the lookup's acceptance keeps up with the text while the model drafts.  Only the
        positions those tokens cover are scored."""
        if self._unused is None:
            return
        start, source, drafts = self._unused
        self._unused = None
        given = history[start:]
        covered = min(len(drafts), len(given))
        matched = 0
        while matched < covered and drafts[matched] == given[matched]:
            matched += 1
        self._record_lookup(source, matched, covered, self.UNUSED_DECAY)

    def _record_lookup(self, source: str, matched: int, covered: int, decay: float) -> None:
        """The first ``matched`` of ``covered`` positions were right: each position is judged only
        where every one before it was right.  A draft past the first wrong one never counts, so a
        proposal scored only as far as a model round's few tokens is not taken as all right.
        Scored as one pool of drafts, such proposals overrated the lookup in reasoning text, where its
        later positions are right far less often than its first."""
        if covered:
            self._scored.add(source)
        for i, row in enumerate(self._positions(source, min(matched + 1, covered))):
            row[0] = row[0] * decay + (i < matched)
            row[1] = row[1] * decay + 1

    def feedback(self, proposed: int, accepted: int, verify_ms: float, draft_ms: float) -> None:
        self.verify_ms = smooth(self.verify_ms, verify_ms)
        if self.last == "model":
            outcome = (accepted, proposed, 1)
            self.model_stats = [v * self.MODEL_DECAY + new for v, new in zip(self.model_stats, outcome)]
            if self._previous == "model" or not self.model.costs:
                self.model.feedback(proposed, accepted, verify_ms, draft_ms)
            else:  # its own fit keeps its steady cost: fed a return's, it drafted shorter rounds
                self.return_costs.add(proposed, verify_ms, draft_ms)
                self.model.learn(accepted)
        else:
            self._record_lookup(self.last, accepted, proposed, self.DECAY)
            self.lookup_costs.add(proposed, verify_ms, draft_ms)


def open_draft_chain(folders: list[Path], device: str = "CPU", turns=None):
    """A draft model's chain, in either mode compiled with the device's ``fast`` settings (its cache
    rewinds by mask: ``stream_drafters``).  A draft's numbers never reach the output, the target's
    verify decides every token, so ``exact`` mode and a user's precision hint are the target's alone
    (on CPU the device's default, the f32 hint, drafts faster than bf16: docs/benchmarks.md, "CPU
    precision").  In ``exact`` mode a draft compiled and trimmed like the target made speculation
    slower than the target alone; on the fast settings it pays, with the same output."""
    return LocalChain(folders, device=device, config=compile_config("fast"), turns=turns)


def stream_drafters(kind: str, streams: int, target: Manifest | None = None, draft_chain=None) -> list | None:
    """One drafter per stream of a kind: ``none``, ``lookup``, or ``model``/``hybrid`` over
    ``draft_chain`` (``open_draft_chain``; one draft KV stream each, rewound by mask whatever the
    target's rewind), which must share the target's tokenizer."""
    if kind not in DRAFTS:
        raise FleetError(f"draft must be {', '.join(DRAFTS[:-1])} or {DRAFTS[-1]}, not {kind!r}")
    if kind == "none":
        return None
    if kind == "lookup":
        return [PromptLookup() for _ in range(streams)]
    check_draft_tokenizer(target, draft_chain.manifest, draft_chain.first_folder)
    models = [DraftModel(draft_chain, stream=i) for i in range(streams)]
    for model in models:
        model.warm()
    return [Hybrid(PromptLookup(), m) for m in models] if kind == "hybrid" else models


def check_draft_tokenizer(target: Manifest, draft: Manifest, draft_folder: Path) -> None:
    """Refuses a draft model whose tokenizer is not the target's (same token ids, same text)."""
    for name in TOKENIZER_FILES:
        a, b = target.files.get(name), draft.files.get(name)
        if a is None or b is None or a != b:
            raise ShardError(f"draft model {draft.model_name} ({draft_folder}) does not share the target "
                             f"{target.model_name}'s tokenizer ({name} differs): its token ids would mean "
                             "other text")


class RoundCost:
    """What a speculative round costs, fitted online: round time (drafting + verify) = fixed +
    per_draft * K, by least squares over the recent rounds."""

    WINDOW = 64

    def __init__(self):
        self._rounds: list[tuple[int, float, float]] = []
        self._fit: tuple[float, float] | None = None

    def __bool__(self) -> bool:
        return bool(self._rounds)

    def add(self, k: int, verify_ms: float, draft_ms: float) -> None:
        """One round: ``k`` drafts, the verify's and the whole drafting's time (a draft model's
        catch-up is a fixed cost per round, so the time per drafted token is not a constant)."""
        self._rounds.append((k, verify_ms, draft_ms))
        del self._rounds[:-self.WINDOW]
        self._fit = None

    def fit(self) -> tuple[float, float]:
        """``(fixed, per_draft)`` in ms; call only once a round was added."""
        if self._fit is None:
            ks, verify, draft = np.array(self._rounds, np.float64).T
            if len(set(ks.tolist())) < 2:
                # until two K values were seen: a verify position costs ~3% of a verify, and the
                # drafting is taken as proportional to K
                k = float(np.median(ks))
                per_draft = 0.03 * float(np.median(verify)) + float(np.median(draft)) / k
                self._fit = float(np.median(verify + draft)) - per_draft * k, per_draft
            else:
                slope, intercept = np.polyfit(ks, verify + draft, 1)
                self._fit = float(intercept), max(float(slope), 0.0)
        fixed, per_draft = self._fit
        return max(fixed, 1e-3), per_draft

    def cost(self, k: float) -> float:
        """The expected time of a round with ``k`` drafts, in ms; 0.0 before any round was seen."""
        if not self._rounds:
            return 0.0
        fixed, per_draft = self.fit()
        return fixed + per_draft * k


class AutoK:
    """Chooses K online from the measured acceptance rate and round costs."""

    K_MAX = 12
    KEEP_MARGIN = 0.01

    def __init__(self, k_max: int = K_MAX, k_start: int = 4):
        self.k_max = k_max
        self.k = k_start
        self.successes = 1.0  # a weak prior: acceptance 0.5
        self.failures = 1.0
        self.costs = RoundCost()
        self._seen = 0  # rounds so far
        self._last_k = 0

    @property
    def acceptance(self) -> float:
        return self.successes / (self.successes + self.failures)

    def update(self, k: int, accepted: int, verify_ms: float, draft_ms: float) -> int:
        """One round's outcome (see ``RoundCost.add``); returns the K for the next round."""
        decay = 0.95
        self.successes = self.successes * decay + accepted
        self.failures = self.failures * decay + (1 if accepted < k else 0)
        if k == self._last_k:  # a round after a change of K pays the re-preparation, not K's own cost
            self.costs.add(k, verify_ms, draft_ms)
        self._last_k = k
        self._seen += 1
        self.k = self.choose()
        return self.k

    def cost(self, k: int) -> float:
        return self.costs.cost(k)

    def choose(self) -> int:
        if not self.cost(1):  # no round measured yet
            return self.k
        a = min(self.acceptance, 0.995)
        rates = {k: (1 - a ** (k + 1)) / (1 - a) / self.cost(k) for k in range(1, self.k_max + 1)}
        best_k = max(rates, key=rates.get)
        # A new K changes the verify's shape, and the CPU plugin re-prepares every node for a new
        # input shape: keep the current K unless another is clearly better.
        if self.k in rates and rates[best_k] < rates[self.k] * (1 + self.KEEP_MARGIN):
            best_k = self.k
        # keep the cost model honest: now and then try a neighbour, for two rounds (the second is
        # the one the fit counts)
        if self._seen % 8 in (6, 7):
            best_k = max(1, min(self.k_max, best_k + (1 if self._seen % 16 in (6, 7) else -1)))
        return best_k


class AheadGate:
    """Whether a round goes ahead of the one in flight (``Scheduling(speculate_ahead=True)``): the chance
    it is kept against what keeping it saves and discarding it costs, from the last round's stage times.

    This process drafts the round and runs its stage 0 while the round before is away (the later
    stages' compute and the network).  Kept, that time was hidden: it saves stage 0's compute, less
    what drafting and stage 0 took beyond the time away.  Discarded, the round that replaces it waits
    for that overrun here and for the later stages to compute the discarded one: on equal stages it
    costs only the drafting.  The chance is kept
    apart after a round that accepted every draft and after one that did not (a copied stretch of
    text runs on), decayed.  After ``EXPLORE`` rounds held back one goes anyway, so the chance keeps
    up with the text."""

    DECAY = 0.9
    EXPLORE = 8

    def __init__(self):
        self.odds = {True: [1.0, 2.0], False: [1.0, 2.0]}  # after a full acceptance or not: decayed kept, sent
        self._held = 0  # rounds held back since one went

    def chance(self, full: bool) -> float:
        kept, sent = self.odds[full]
        return kept / sent

    def opens(self, full: bool, stage_ms: list[float], network_ms: float = 0.0, draft_ms: float = 0.0) -> bool:
        """Whether a round goes ahead now; ``full``: the last round accepted every draft; ``draft_ms``:
        what drafting a round ahead takes."""
        first, later = (stage_ms[0], sum(stage_ms[1:])) if stage_ms else (0.0, 0.0)
        away = later + network_ms
        saved = min(first, away - draft_ms)
        lost = max(0.0, draft_ms + first - away) + max(0.0, later - first)
        chance = self.chance(full)
        if saved <= 0:  # nothing computes beside stage 0, or drafting takes the time away
            return False
        if chance * saved >= (1 - chance) * lost or self._held >= self.EXPLORE:
            self._held = 0
            return True
        self._held += 1
        return False

    def learn(self, full: bool, kept: bool) -> None:
        """A round sent ahead after a round that accepted every draft (``full``) or not was kept or not."""
        row = self.odds[full]
        row[0] = row[0] * self.DECAY + kept
        row[1] = row[1] * self.DECAY + 1
