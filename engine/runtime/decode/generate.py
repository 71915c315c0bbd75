"""The generation loop: prefill, then decode through a stage chain (greedy, or sampled by a request's
``SamplingParams``), optionally speculative.

The loop needs a ``Chain`` (``engine.runtime.interfaces``): ``reset``, ``submit``/``collect`` (a
forward in two halves, so several streams can be in flight) returning an ``Output`` (top-1 tokens),
and ``keep`` for the trim rewind; the in-process chain and the distributed pipeline both have them.

Speculative rounds feed the pending token plus K drafted ones and verify all K+1 positions in one
traversal; the accepted prefix plus the target's own next token are emitted (sampled: drafts are
accepted by rejection sampling, ``engine.runtime.decode.sampling``, so the text is distributed as the
target's own samples).  Rejected positions
are masked out (``rewind="mask"``, the paper's mask-based rewind: nothing is copied, position ids
follow the logical length) or cut from every stage's cache (``"trim"``).

Speculating ahead (``Scheduling.speculate_ahead``, PipeInfer's early speculation for one stream): while a round
is verified, the next is already on its way, drafted as if the round in flight accepts every draft
and its own next token is the drafter's guess.  Over a pipeline, stage 0 computes it while the later
stages verify the first, so the computers of a split work at once for one user.  It is kept when the
round gives exactly those tokens; otherwise it is discarded and every stage's cache rewound past it,
as a rejected draft is, so greedy output is the same either way.  A round goes ahead where the chance
it is kept pays for what a discarded one costs the later stages (``speculative.AheadGate``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from engine.config import Scheduling
from engine.errors import ContextError
from engine.runtime.decode.grammar import Constraint
from engine.runtime.decode.kvsequence import KVSequence
from engine.runtime.decode.sampling import Sampler, SamplingParams, token_logprobs
from engine.runtime.decode.speculative import AheadGate, AutoK, Drafter, smooth
from engine.runtime.interfaces import Chain
from engine.runtime.stages.output import Output, top_candidates
from engine.transport.wire import Flag


class Breakdown:
    """Where decode time goes, summed over rounds: compute per stage, the network (waiting beyond
    the remote stages' compute), drafting, and the host (everything else: the loop, masks, framing).
    ``to_json`` gives each per generated token."""

    def __init__(self):
        self.rounds = 0
        self.tokens = 0
        self.total_ms = 0.0
        self.stage_ms: list[float] = []
        self.network_ms = 0.0
        self.draft_ms = 0.0

    def add(self, wall_ms: float, out: Output, tokens: int = 1, draft_ms: float = 0.0) -> None:
        if not self.stage_ms:
            self.stage_ms = [0.0] * len(out.stage_ms)
        self.rounds += 1
        self.tokens += tokens
        self.total_ms += wall_ms
        self.stage_ms = [a + b for a, b in zip(self.stage_ms, out.stage_ms)]
        self.network_ms += out.network_ms
        self.draft_ms += draft_ms

    def to_json(self) -> dict:
        n = max(self.tokens, 1)
        stage = [s / n for s in self.stage_ms]
        network, draft, total = self.network_ms / n, self.draft_ms / n, self.total_ms / n
        return {
            "steps": self.rounds,
            "token_ms": round(total, 3),
            "stage_compute_ms": [round(s, 3) for s in stage],
            "network_ms": round(network, 3),
            "draft_ms": round(draft, 3),
            "host_ms": round(max(total - sum(stage) - network - draft, 0.0), 3),
        }


@dataclasses.dataclass
class Generation:
    prompt_tokens: int
    tokens: list[int]
    ttft_s: float  # prompt in -> first new token out
    decode_s: float  # first token -> last token
    stopped_by: str  # "eos" | "max_tokens" | "cancelled"
    breakdown: Breakdown = dataclasses.field(default_factory=Breakdown)  # decode rounds only
    drafted: int = 0
    accepted: int = 0
    k_history: list[int] = dataclasses.field(default_factory=list)
    bloat: float = 1.0  # physical KV slots per logical token at the end
    compactions: int = 0
    trim_ms: float = 0.0
    prefill_compute_ms: float = 0.0  # the prefill's compute, all stages
    ahead: int = 0  # rounds sent ahead of the round in flight (``speculate_ahead``)
    ahead_kept: int = 0  # of them, the rounds whose assumption held

    @property
    def decode_tok_s(self) -> float:
        """Decode throughput: tokens after the first over the time they took."""
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def to_json(self) -> dict:
        doc = {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": len(self.tokens),
            "ttft_ms": round(self.ttft_s * 1e3, 2),
            "decode_tok_s": round(self.decode_tok_s, 2),
            "stopped_by": self.stopped_by,
            "breakdown": self.breakdown.to_json(),
        }
        if self.drafted:
            rounds = max(len(self.k_history), 1)
            doc["speculative"] = {
                "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": round(self.acceptance, 3),
                "tokens_per_round": round(len(self.tokens) / rounds, 2),
                "mean_k": round(sum(self.k_history) / rounds, 2),
                "kv_bloat": round(self.bloat, 3), "compactions": self.compactions,
                "trim_ms": round(self.trim_ms, 2),
            }
            if self.ahead:
                doc["speculative"].update(ahead=self.ahead, ahead_kept=self.ahead_kept)
        return doc


def _verify_greedy(targets: list[int], drafts: list[int]) -> tuple[list[int], int]:
    """Greedy verification: the drafts that equal the model's top-1 targets before them are accepted,
    and the target after the last of them is emitted too."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return targets[: accepted + 1], accepted


@dataclasses.dataclass
class _Ahead:
    """A round sent ahead of the one in flight: its tokens (the guess at the round in flight's own
    next token, then drafts), its ticket, drafting time and when it went."""

    tokens: list[int]
    ticket: object
    draft_ms: float
    sent: float
    full: bool  # the round before the one in flight accepted every draft (``AheadGate``)


class Decoding:
    """One stream's generation as a state machine: ``start`` submits the prefill, each ``advance``
    collects the round in flight, emits its tokens and submits the next.  ``Generator`` drives one;
    ``generate_streams`` interleaves several through the same chain (micro-batching)."""

    def __init__(self, seq: KVSequence, prompt: list[int], max_new_tokens: int, eos: frozenset, *,
                 scheduling: Scheduling = Scheduling(), drafter: Drafter | None = None, k: int | str | None = None,
                 on_token: Callable[[int], None] | None = None, cancel=None, sampling: SamplingParams | None = None,
                 cached: int = 0, constraint: Constraint | None = None,
                 logprobs: int | None = None, prompt_logprobs: bool = False, alone: Callable[[], bool] | None = None):
        """``scheduling``: the draft length (``k``), whether each drafted round is followed at once by
        the next, drafted as if it accepts every draft (``speculate_ahead``, the module's docstring;
        only on the plain greedy path: no sampling, constraint or logprobs) and the prompt tokens a
        prefill forward takes (``prefill_chunk``); its streams and draft kind are its caller's.  ``k``:
        this request's draft length instead of the scheduling's.  ``cached``: the stream's cache
        already holds the prompt's first ``cached`` tokens (the prefix cache): only the rest is
        prefilled.
        ``constraint``: every token (greedy, sampled or a draft) must be one its grammar allows; the
        stream asks for full logits (``Flag.LOGITS``), since the top candidates the last stage
        returns may hold no legal token, and ends once the grammar is complete.  ``alone``: whether
        this stream is the only one generating, asked each round: the drafter is consulted only then,
        the other rounds are plain (``ChatService(draft_alone=True)``)."""
        self.seq = seq
        self.alone = alone
        self.cached = cached
        self.prefill_chunk = scheduling.prefill_chunk
        self._unfed: list[int] = []  # the prompt's tokens still to prefill after the chunk in flight
        self._prefill_ms = 0.0
        self.sampler = Sampler(sampling) if sampling is not None and not sampling.greedy else None
        self._flags = Flag.CANDIDATES if self.sampler else Flag.NONE  # greedy takes the top-1 path, as ever
        self.constraint = constraint
        if constraint is not None:  # only a constrained stream pays for vocabulary-sized rows
            self._flags = Flag.LOGITS
        # ``logprobs``: each emitted token's log-probability and its ``logprobs`` likeliest alternatives
        # (``token_logprobs``), from full logits; a logit_bias needs them too (a biased token may be
        # outside the top candidates)
        self.logprobs = logprobs
        self.token_logprobs: list = []
        # ``prompt_logprobs``: every prompt token's too (its first has none), from all the prefill's
        # positions; the prompt must then be prefilled whole (``cached`` 0)
        self.prompt_entries: list | None = [(int(prompt[0]), None, [])] if prompt_logprobs and prompt else None
        self._fed = cached  # prompt tokens fed before the chunk in flight
        self._chunk: list[int] = []
        if logprobs is not None or (sampling is not None and sampling.logit_bias):
            self._flags |= Flag.LOGITS
        self.prompt = prompt
        if not prompt:
            raise ContextError("the prompt is empty: there is nothing to continue")
        room = seq.max_length - len(prompt)
        if room <= 0:
            raise ContextError(f"the prompt ({len(prompt)} tokens) leaves no room in the context of {seq.max_length}")
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
        self.max_new_tokens = min(max_new_tokens, room)
        self.eos = eos
        self.drafter = drafter
        k = scheduling.k if k is None else k
        auto = k == "auto"
        if drafter is not None and drafter.fits_k:  # it picks its own number of drafts, up to K_MAX
            drafter.pick_k = auto
            self.auto, self.k = None, AutoK.K_MAX if auto else int(k)
        else:
            self.auto = AutoK() if auto else None
            self.k = self.auto.k if auto else int(k)
        self.on_token = on_token
        self.cancel = cancel
        self.result = Generation(len(prompt), [], 0.0, 0.0, "max_tokens")
        self.history = list(prompt)
        self.active = True
        self.ticket = None
        self._drafts: list[int] = []
        self._draft_ms = 0.0
        self._consulted = False  # whether the drafter was asked for the round in flight
        self._times: dict[str, float] = {}
        self.speculate_ahead = scheduling.speculate_ahead and drafter is not None and self._flags == Flag.NONE
        self._ahead: _Ahead | None = None  # the round on its way after the one in flight
        self._gate = AheadGate() if self.speculate_ahead else None
        self._ahead_draft_ms = 0.0  # drafting a round ahead (smoothed)
        self._full = False  # the last round collected accepted every draft it had (and had some)
        self._last: Output | None = None  # the last round collected (its stage times price the gate)
        self._discarded = None  # the ticket of a round sent ahead and discarded, to collect

    def settled(self) -> int:
        """How many tokens of the prompt and the reply so far every stage's cache holds for sure: all
        but the round in flight's (a prompt chunk, or the last token with its drafts)."""
        return self._fed if self._chunk or self._unfed else len(self.history) - 1

    def start(self) -> None:
        if self.cached:
            self.seq.truncate(self.cached)
        else:
            self.seq.reset()
        if self.drafter is not None:
            self.drafter.reset()
        self._times["start"] = self._times["round"] = time.perf_counter()
        self._unfed = self.prompt[self.cached:]
        self._prefill_next()
        if self.drafter is not None:  # a draft model takes in the prompt while the prefill is in flight
            self.drafter.prime(self.prompt)

    def _prefill_next(self) -> None:
        chunk, self._unfed = self._unfed[: self.prefill_chunk], self._unfed[self.prefill_chunk:]
        flags = Flag.NONE if self._unfed else self._flags  # the last chunk's logits count
        if self.prompt_entries is not None:
            flags |= Flag.ALL_POSITIONS | Flag.LOGITS
        self._chunk = chunk
        self.ticket = self.seq.submit(chunk, flags)
        if self.constraint is not None and not self._unfed:
            self.constraint.allowed()  # computed while the forward runs (over a remote chain)

    def _submit_round(self) -> None:
        room = self.max_new_tokens - len(self.result.tokens)
        self._drafts, self._draft_ms = [], 0.0
        self._consulted = (self.drafter is not None and self.k > 0 and room > 1
                           and (self.alone is None or self.alone()))
        if self._consulted:
            t = time.perf_counter()
            self._drafts = self.drafter.propose(self.history, min(self.k, room - 1))
            self._draft_ms = (time.perf_counter() - t) * 1e3
        self._times["verify"] = time.perf_counter()
        flags = (Flag.ALL_POSITIONS if self._drafts else Flag.NONE) | self._flags
        self.ticket = self.seq.submit([self.result.tokens[-1], *self._drafts], flags)
        if self.constraint is not None:
            self.constraint.allowed()  # computed while the round runs (over a remote chain)
        if self.speculate_ahead and self._consulted:
            self._send_ahead(room - len(self._drafts) - 1)

    def _send_ahead(self, room: int) -> None:
        """Sends the round after the one in flight, which assumes that round gives its drafts and
        then the drafter's guess at the token after them; ``room``: the tokens left to emit after
        that round if so."""
        if room < 1 or not self._gate.opens(self._full, self._last.stage_ms, self._last.network_ms,
                                            self._ahead_draft_ms):
            return
        chain = self.seq.chain
        chain.flush()  # the round in flight goes first: the later stages start on it while this one is drafted
        t = time.perf_counter()
        tokens = self.drafter.propose(self.history + self._drafts, min(self.k, room - 1) + 1)
        draft_ms = (time.perf_counter() - t) * 1e3
        self._ahead_draft_ms = smooth(self._ahead_draft_ms, draft_ms)
        if not tokens:
            return
        ticket = self.seq.submit(tokens, Flag.ALL_POSITIONS if len(tokens) > 1 else Flag.NONE)
        chain.flush()
        self._ahead = _Ahead(tokens, ticket, draft_ms, time.perf_counter(), self._full)
        self.result.ahead += 1

    def _take_ahead(self, ahead: _Ahead) -> None:
        """The round sent ahead assumed what the round just collected gave: it becomes the round in
        flight, and the next goes ahead of it."""
        self.ticket, self._drafts, self._draft_ms = ahead.ticket, ahead.tokens[1:], ahead.draft_ms
        self._consulted = True
        self._times["verify"] = ahead.sent
        self.result.ahead_kept += 1
        self._send_ahead(self.max_new_tokens - len(self.result.tokens) - len(self._drafts) - 1)

    def advance(self) -> bool:
        """Collects the round in flight and submits the next; False once the stream has finished."""
        if self._discarded is not None:  # its output comes before the round in flight's
            discarded, self._discarded = self._discarded, None
            self.seq.chain.collect(discarded)
        out = self.seq.chain.collect(self.ticket)
        if self._chunk:  # a prompt chunk came back
            start, self._fed, self._chunk = self._fed, self._fed + len(self._chunk), []
            if self.prompt_entries is not None:
                follow = self.prompt[start + 1 : self._fed + 1]  # the prompt tokens its positions predict
                self.prompt_entries += token_logprobs(out.logits[0, : len(follow)], follow, self.logprobs or 0)
        if self._unfed:  # a prompt chunk: no token yet, the next chunk goes
            self._prefill_ms += sum(out.stage_ms)
            self._prefill_next()
            return True
        now = time.perf_counter()
        result, drafts = self.result, self._drafts
        if self.constraint is not None:
            emitted, accepted = self._constrained(out, drafts)
        elif self.sampler is not None:
            emitted, accepted = self.sampler.choose(*self.sampler.candidates(out), self.history, drafts)
        else:
            emitted, accepted = _verify_greedy(out.tokens[-(len(drafts) + 1):].tolist(), drafts)
        ahead, self._ahead = self._ahead, None
        kept = ahead is not None and emitted == [*drafts, ahead.tokens[0]]
        if ahead is not None:  # only a stream that speculates ahead sends one
            self._gate.learn(ahead.full, kept)
        self._full, self._last = bool(drafts) and accepted == len(drafts), out
        # a round sent ahead holds the slots after this round's: a discarded one goes with its rejected drafts
        self.seq.reject(len(drafts) - accepted + (len(ahead.tokens) if ahead is not None and not kept else 0))
        first = not result.tokens
        if drafts:
            result.drafted += len(drafts)
            result.accepted += accepted
            result.k_history.append(len(drafts))
        if self._consulted:
            verify_ms = (now - self._times["verify"]) * 1e3
            self.drafter.feedback(len(drafts), accepted, verify_ms, self._draft_ms)
            if drafts and self.auto:
                self.k = self.auto.update(len(drafts), accepted, verify_ms, self._draft_ms)
        entries = (token_logprobs(out.logits[0, -(len(drafts) + 1):], emitted, self.logprobs)
                   if self.logprobs is not None else None)
        for j, token in enumerate(emitted):
            result.tokens.append(token)
            if entries:  # before on_token, which may stream it
                self.token_logprobs.append(entries[j])
            self.history.append(token)
            if self.on_token:
                self.on_token(token)
            if token in self.eos:
                result.stopped_by = "eos"
                break
            if self.constraint is not None:
                self.constraint.accept(token)
                if self.constraint.finished:  # nothing but an end of text may follow
                    result.stopped_by = "eos"
                    break
            if len(result.tokens) >= self.max_new_tokens:
                break
        if first:
            result.ttft_s = now - self._times["start"]
            result.prefill_compute_ms = self._prefill_ms + sum(out.stage_ms)
            self._times["first"] = now
        else:
            result.breakdown.add((now - self._times["round"]) * 1e3, out, len(emitted), self._draft_ms)
        self._times["round"] = now
        if result.stopped_by == "max_tokens" and self.cancel is not None and self.cancel.is_set():
            result.stopped_by = "cancelled"
        if result.stopped_by != "max_tokens" or len(result.tokens) >= self.max_new_tokens:
            if ahead is not None:  # nothing follows: the round sent ahead is rewound and its output dropped
                if kept:
                    self.seq.reject(len(ahead.tokens))
                self.seq.chain.collect(ahead.ticket)
            self._finish(now)
            return False
        if kept:
            self._take_ahead(ahead)
            return True
        if ahead is not None:
            self._discarded = ahead.ticket
        self._submit_round()
        return True

    def _constrained(self, out: Output, drafts: list[int]) -> tuple[list[int], int]:
        """The tokens a constrained round emits, and the drafts accepted: each verified position's
        logits masked by the grammar (after the drafts before it), the drafts up to the first the
        grammar refuses verified as usual (greedy: the masked argmax; sampled: rejection sampling
        over the masked row's top candidates)."""
        rows = out.logits[0, -(len(drafts) + 1):]
        masked, legal = self.constraint.mask_rows(rows, drafts)
        if self.sampler is not None:  # the masked rows stand in for the stage's (a logit_bias applies to them)
            bias = self.sampler.params.logit_bias
            rows = Output(out.tokens, logits=masked[None], candidates=None if bias else top_candidates(masked))
            return self.sampler.choose(*self.sampler.candidates(rows), self.history, legal)
        return _verify_greedy(masked.argmax(-1).tolist(), legal)

    def _finish(self, now: float) -> None:
        self.active = False
        result = self.result
        result.decode_s = now - self._times["first"]
        result.bloat, result.compactions, result.trim_ms = self.seq.bloat, self.seq.compactions, self.seq.trim_ms


class Generator:
    """Greedy generation over a chain, one request at a time; with a drafter, speculative, scheduled
    as ``scheduling`` says (its draft length, speculating ahead and prefill chunk: ``Decoding``)."""

    def __init__(self, chain: Chain, max_length: int, eos_ids: list[int] | tuple[int, ...] = (),
                 rewind: str = "mask", stream: int = 0, *, scheduling: Scheduling = Scheduling()):
        self.chain = chain
        self.max_length = max_length
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.seq = KVSequence(chain, max_length, stream, rewind)
        self.scheduling = scheduling

    def generate(self, input_ids: np.ndarray, max_new_tokens: int, *, ignore_eos: bool = False,
                 on_token: Callable[[int], None] | None = None, cancel=None, drafter: Drafter | None = None,
                 k: int | str | None = None, sampling: SamplingParams | None = None) -> Generation:
        """``k``: this request's draft length instead of the scheduling's."""
        prompt = [int(t) for t in np.asarray(input_ids).reshape(-1)]
        decoding = Decoding(self.seq, prompt, max_new_tokens, frozenset() if ignore_eos else self.eos_ids,
                            scheduling=self.scheduling, drafter=drafter, k=k, on_token=on_token, cancel=cancel,
                            sampling=sampling)
        decoding.start()
        while decoding.advance():
            pass
        return decoding.result


def generate_streams(chain: Chain, prompts: list[np.ndarray], max_new_tokens: int, *, max_length: int,
                     eos_ids=(), ignore_eos: bool = False, rewind: str = "mask", drafters=None,
                     scheduling: Scheduling = Scheduling(), on_token: Callable[[int, int], None] | None = None,
                     cancels=None, sampling: SamplingParams | None = None) -> tuple[list[Generation], float]:
    """Micro-batching: one stream per prompt (stream ids 0..N-1, each with its own KV state on every
    stage), interleaved so that one stream's round is in flight while another is collected and
    resubmitted: whichever stream's result comes back first is served first; each decoded as
    ``scheduling`` says (``Decoding``; one stream per prompt, whatever its streams).  Returns the
    generations and the wall time of the whole batch."""
    eos = frozenset() if ignore_eos else frozenset(int(i) for i in eos_ids)
    decodings = []
    for i, ids in enumerate(prompts):
        callback = (lambda t, i=i: on_token(i, t)) if on_token else None
        decodings.append(Decoding(KVSequence(chain, max_length, i, rewind),
                                  [int(t) for t in np.asarray(ids).reshape(-1)], max_new_tokens, eos,
                                  scheduling=scheduling, drafter=drafters[i] if drafters else None, on_token=callback,
                                  cancel=cancels[i] if cancels else None, sampling=sampling))
    start = time.perf_counter()
    for d in decodings:
        d.start()
    active = list(decodings)  # in the order their rounds were submitted
    while active:
        d = active.pop(chain.first_ready([d.ticket for d in active]))
        if d.advance():
            active.append(d)
    return [d.result for d in decodings], time.perf_counter() - start
