"""The chat service: several conversations at once over one chain, as micro-batched streams.

A ``ChatService`` owns a chain (in-process ``LocalChain`` or the distributed ``RemoteChain``), the
coordinator's tokenizer and optionally one drafter per stream.  ``submit`` queues a conversation
and returns a ``Handle`` at once; a single scheduler thread admits queued requests onto free stream
ids (each stream has its own KV state on every stage and is reset before use), and advances the
active ``Decoding`` whose round came back first, so that one stream's round is in flight while another
is collected and resubmitted, exactly as ``generate_streams`` interleaves them.  New requests join
between rounds; a cancelled one stops at its next round.

Prefix cache: after a reply a stream keeps its KV on every stage, and the service remembers the
tokens it holds.  A request goes to the free stream whose cache serves it best (``_pick``), whose
cache is rewound to the prefix they share; only the rest is prefilled.  A request submitted
``after`` another (the API's ``n`` choices of one prompt) waits for it and runs on its stream, so the
prompt they share is prefilled once (unless another request took that stream in between).

Fitting the context: ``submit`` tokenizes the conversation on the caller's thread (never under the
scheduler's lock, so a huge conversation stalls neither the scheduler nor whoever asks ``busy``).
``fit="refuse"`` (the API) raises ``ContextExceeded`` with the counts when the conversation and the
reply do not fit; ``fit="drop"`` (the app) leaves out the oldest messages, found by a binary search
over how many to drop (a logarithmic number of renders, not one per message).

Text arrives through ``on_text(piece, tokens_so_far)`` as it is generated (incrementally decoded,
multi-byte characters held back until complete, and text that may begin a stop string held back
until it is known not to) and the finished reply through ``on_done(Reply)``;
both are called on the scheduler thread.  The engine knows nothing of any UI: an app wraps these
callbacks in its own cross-thread signals.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
from typing import Callable

import numpy as np

from engine.errors import ContextError, FleetError, StageError
from engine.runtime.decode.generate import PREFILL_CHUNK, Decoding
from engine.runtime.decode.kvsequence import KVSequence
from engine.runtime.decode.sampling import GREEDY, SamplingParams
from engine.runtime.decode.stops import StopText
from engine.runtime.decode.tokenizer import ChatTokenizer, TextStream

log = logging.getLogger(__name__)

OnText = Callable[[str, int], None]
FITS = ("drop", "refuse")


class ContextExceeded(ContextError):
    """The conversation (``prompt_tokens``) and the reply asked for (``max_new_tokens``) do not fit
    the context of ``max_length`` tokens; ``prompt_full`` when the conversation alone fills it."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int, max_length: int):
        self.prompt_tokens, self.max_new_tokens, self.max_length = prompt_tokens, max_new_tokens, max_length
        self.prompt_full = prompt_tokens >= max_length
        if self.prompt_full:
            message = (f"this model's maximum context length is {max_length} tokens, and the conversation alone "
                       f"is {prompt_tokens} tokens: shorten it")
        else:
            message = (f"this model's maximum context length is {max_length} tokens; {prompt_tokens + max_new_tokens}"
                       f" were asked for ({prompt_tokens} in the conversation, {max_new_tokens} for the reply): "
                       f"at most {max_length - prompt_tokens} fit for the reply")
        super().__init__(message)


@dataclasses.dataclass
class Reply:
    """One finished reply and how it went."""

    text: str
    tokens: list[int]
    prompt_tokens: int
    stopped_by: str  # "eos" | "stop" (a stop string) | "max_tokens" | "cancelled" | "error"
    ttft_ms: float = 0.0  # prefill submitted -> first new token
    decode_tok_s: float = 0.0  # tokens after the first over the time they took
    drafted: int = 0
    accepted: int = 0
    error: str | None = None
    stream: int | None = None
    dropped: int = 0  # oldest messages left out so the conversation fits the context
    context_error: bool = False  # the error is the conversation not fitting the context
    rerouted: int = 0  # times the chain broke under this reply and it carried on over a new one
    cached_tokens: int = 0  # prompt tokens the stream's cache already held (the prefix cache)
    stage_ms: list[float] = dataclasses.field(default_factory=list)  # decode rounds' compute per stage, summed
    rounds: int = 0  # decode rounds (forwards after the first token)
    logprobs: list | None = None  # per token: (token, logprob, [(alternative, logprob)...]), when asked for
    prompt_logprobs: list | None = None  # the same for the prompt's tokens (the first one's logprob None)
    stop_string: str | None = None  # the stop string that ended it (``stopped_by`` "stop")

    @property
    def finish_reason(self) -> str:
        """OpenAI's name for why the reply ended: ``stop`` (end of text or a stop string), ``length``."""
        return {"eos": "stop", "stop": "stop", "max_tokens": "length"}.get(self.stopped_by, self.stopped_by)

    @property
    def acceptance(self) -> float | None:
        """Accepted per drafted token; None when nothing was drafted (no speculation)."""
        return self.accepted / self.drafted if self.drafted else None

    def to_json(self) -> dict:
        doc = {"new_tokens": len(self.tokens), "prompt_tokens": self.prompt_tokens, "stopped_by": self.stopped_by,
               "ttft_ms": round(self.ttft_ms, 1), "decode_tok_s": round(self.decode_tok_s, 2)}
        if self.drafted:
            doc["acceptance"] = round(self.acceptance, 3)
        if self.cached_tokens:
            doc["cached_tokens"] = self.cached_tokens
        if self.error:
            doc["error"] = self.error
        if self.dropped:
            doc["dropped_messages"] = self.dropped
        return doc


class Handle:
    """A submitted request: cancel it, or wait for its reply."""

    def __init__(self, service: "ChatService", request_id: int):
        self._service = service
        self.id = request_id
        self.stream: int | None = None  # the stream id once admitted
        self.reply: Reply | None = None
        self.logprobs: list = []  # (token, logprob, [(alternative, logprob)...]) per token, when asked for
        self._cancel = threading.Event()
        self._done = threading.Event()

    def cancel(self) -> None:
        """Stops the reply at its next round (a queued request never starts)."""
        self._cancel.set()
        self._service._poke()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Reply | None:
        self._done.wait(timeout)
        return self.reply


@dataclasses.dataclass(eq=False)
class _Request:
    handle: Handle
    messages: list[dict]
    max_new_tokens: int
    on_text: OnText | None
    on_done: Callable[[Reply], None] | None
    chat: bool
    ignore_eos: bool
    k: int | str | None
    sampling: SamplingParams = GREEDY
    stop: StopText = dataclasses.field(default_factory=StopText)
    decoding: Decoding | None = None
    text: TextStream | None = None
    dropped: int = 0
    pieces: list[str] = dataclasses.field(default_factory=list)
    earlier: list[int] = dataclasses.field(default_factory=list)  # tokens emitted before the chain was replaced
    first: object = None  # the first decoding's result (its TTFT), once the chain was replaced
    rerouted: int = 0
    prompt_entries: list | None = None  # the prompt's log-probabilities, once prefilled
    ids: list[int] | None = None  # the conversation's token ids, once admitted
    grammar: str | None = None  # llguidance grammar the reply must follow (``engine.runtime.decode.grammar``)
    constraint: object = None  # its state, made at the start (it carries over a replaced chain)
    logprobs: int | None = None  # alternatives per token to report (None: no log-probabilities)
    prompt_logprobs: bool = False  # the prompt's tokens' log-probabilities too
    after: Handle | None = None  # the request it waits for, to reuse its stream's cache


class ChatService:
    def __init__(self, chain, tokenizer: ChatTokenizer | None = None, *, streams: int = 2,
                 drafters: Callable[[int], list | None] | None = None, k: int | str = 4, rewind: str = "mask",
                 max_length: int | None = None, eos_ids=None, owned=(), recover=None, prefix_cache: bool = True,
                 prefill_chunk: int = PREFILL_CHUNK, draft_alone: bool = True, speculate_ahead: bool = False):
        """``drafters(n)`` gives one drafter per stream (``speculative.stream_drafters``) or None;
        ``k`` is the default draft length (an int, or ``"auto"``; 0 turns speculation off);
        ``owned`` are further objects to ``close()`` with the service (a local fleet);
        ``recover(StageError)`` gives a new chain when a stage fails (``engine.fleet.failover``),
        on which the replies in flight carry on; without it they end with the error;
        ``prefix_cache=False`` prefills every conversation whole (a benchmark's cold side);
        ``prefill_chunk``: prompt tokens a forward (other streams' rounds run between chunks);
        ``draft_alone``: a stream drafts only while it is the only one generating, its other rounds
        are plain.  With several streams the verify's extra rows cost more than the drafts give,
        whichever the drafter (docs/benchmarks.md, "A second PC that drafts").  ``speculate_ahead``: a
        stream drafting alone sends its next round while one is verified (``Decoding``)."""
        if streams < 1:
            raise FleetError("the chat service needs at least one stream")
        self.chain = chain
        self.tokenizer = tokenizer or ChatTokenizer(chain.first_folder)
        self.streams = streams
        self.k = k
        self.rewind = rewind
        self.max_length = max_length or chain.spec.max_position
        manifest = getattr(chain, "manifest", None)
        self.eos = frozenset(int(i) for i in (eos_ids if eos_ids is not None else manifest.eos_token_ids))
        self.drafters = drafters(streams) if drafters else None
        self.recover = recover
        self._recovering = False
        self.stage_failures: collections.Counter = collections.Counter()  # stage -> forwards that failed there
        # "recovered" | "failed" -> times; "kept": replies carried on from the caches they had (a standby's switch)
        self.failovers: collections.Counter = collections.Counter()
        self.stages_up: list[bool] = [True] * (manifest.stage_count if manifest else 1)
        self.prefix_cache = prefix_cache
        self.prefill_chunk = prefill_chunk
        self.draft_alone = draft_alone
        self.speculate_ahead = speculate_ahead
        # stream -> the token ids its cache holds, in order; the scheduler (its only writer) writes it
        # under the lock, for ``cached_prefix`` on other threads
        self._held: dict[int, list[int]] = {}
        self._last_used: dict[int, int] = {}
        self._uses = itertools.count()
        m = manifest
        self.description = f"{m.model_name}, {m.stage_count} part{'s' if m.stage_count > 1 else ''}" if m else ""
        self._owned = list(owned)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: collections.deque[_Request] = collections.deque()
        self._free = list(range(streams))
        self._active: list[_Request] = []
        self._sequences: dict[int, KVSequence] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="chat-scheduler", daemon=True)
        self._thread.start()

    # --- the caller's side -------------------------------------------------------------------------

    def submit(self, messages: list[dict], max_new_tokens: int | None = 128, on_text: OnText | None = None,
               on_done: Callable[[Reply], None] | None = None, *, chat: bool = True, ignore_eos: bool = False,
               k: int | str | None = None, sampling: SamplingParams | None = None,
               stop: list[str] | tuple[str, ...] = (), grammar: str | None = None, fit: str = "drop",
               tools: list[dict] | None = None, logprobs: int | None = None,
               prompt_logprobs: bool = False, after: Handle | None = None) -> Handle:
        """Queues a reply to ``messages`` (``{"role", "content"}`` dicts, the last one the user's).
        ``sampling`` None is greedy; the reply ends before the first of the ``stop`` strings;
        ``grammar`` (``grammar.compile_grammar``) constrains every token of the reply; ``tools`` go to
        the chat template (``ChatTokenizer.chat_ids``).
        ``max_new_tokens`` None: what is left of the context, at most a quarter of it.  ``fit``:
        ``"drop"`` leaves out the oldest messages (but the system prompts and the last message) while
        the conversation would leave less than a reply's room; ``"refuse"`` raises ``ContextExceeded``
        when the conversation and ``max_new_tokens`` do not fit.  Tokenizes on the caller's thread
        (an API server calls this off its event loop).  ``logprobs``: each token's log-probability
        and that many alternatives' go to ``handle.logprobs`` as they are made, and to the reply;
        ``prompt_logprobs``: the prompt's tokens' too (``Reply.prompt_logprobs``; the prompt is then
        prefilled whole, whatever the prefix cache holds).  ``after``: a handle of this service whose
        request this one waits for, then runs on its stream, reusing the prompt it prefilled."""
        if not messages:
            raise FleetError("nothing to reply to: the conversation is empty")
        if fit not in FITS:
            raise ValueError(f"fit must be one of {FITS}, not {fit!r}")
        if max_new_tokens is not None and max_new_tokens < 1:
            raise FleetError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
        messages = [dict(m) for m in messages]
        quarter = max(self.max_length // 4, 1)
        room = quarter if max_new_tokens is None else min(max_new_tokens, quarter)
        try:
            ids, dropped = self.fit(messages, chat, room if fit == "drop" else None, tools=tools)
        except Exception as exc:  # the template or tokenizer refusing the messages: the caller's error
            raise FleetError(f"cannot tokenize the conversation: {_describe(exc)}") from None
        if fit == "refuse" and (ids.size >= self.max_length or
                                max_new_tokens is not None and ids.size + max_new_tokens > self.max_length):
            raise ContextExceeded(int(ids.size), max_new_tokens or 1, self.max_length)
        if max_new_tokens is None:
            max_new_tokens = max(min(quarter, self.max_length - int(ids.size)), 1)
        handle = Handle(self, next(self._ids))
        request = _Request(handle, messages, max_new_tokens, on_text, on_done, chat, ignore_eos, k,
                           sampling or GREEDY, StopText(stop), grammar=grammar, dropped=dropped,
                           ids=ids.reshape(-1).tolist(), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                           after=after)
        with self._lock:
            if self._closed:
                raise FleetError("the chat service is closed")
            self._queue.append(request)
            self._wake.notify()
        return handle

    @property
    def queued(self) -> int:
        """Requests waiting for a free stream."""
        with self._lock:
            return len(self._queue)

    @property
    def busy(self) -> int:
        """Requests queued or holding a stream (being started, generating or finishing): a request
        the scheduler has taken from the queue but not yet started is busy too (a router counts it)."""
        with self._lock:
            return len(self._queue) + self.streams - len(self._free)

    def cached_prefix(self, ids: list[int]) -> int:
        """The most of ``ids`` (from the start) that a stream's cache holds (0 without the prefix cache)."""
        if not self.prefix_cache:
            return 0
        with self._lock:
            held = list(self._held.values())
        return max((_common_prefix(h, ids) for h in held), default=0)

    def close(self, timeout: float = 10.0) -> None:
        """Cancels everything, stops the scheduler and closes the chain (and whatever it owns)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for request in [*self._queue, *self._active]:
                request.handle._cancel.set()
            self._wake.notify()
        self._thread.join(timeout)
        for thing in [self.chain, *self._owned]:
            try:
                thing.close()
            except Exception:  # closing is best effort: a dead worker must not stop the rest
                log.exception("closing %r failed", thing)

    def _poke(self) -> None:
        with self._lock:
            self._wake.notify()

    # --- the scheduler thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._closed or self._queue or self._active):
                    self._wake.wait()
                if self._closed and not self._active and not self._queue:
                    return
                admitted, dropped = [], []
                for request in list(self._queue):  # in order; one waiting for another lets the rest by
                    if request.handle.cancelled:
                        self._queue.remove(request)
                        dropped.append(request)
                    elif self._free and (request.after is None or request.after.done):
                        self._queue.remove(request)
                        after = request.after.stream if request.after is not None else None
                        request.handle.stream = after if after in self._free else self._pick(request)
                        self._free.remove(request.handle.stream)
                        admitted.append(request)
                if self._closed:
                    dropped += admitted
                    admitted = []
            for request in dropped:
                self._finish(request, stopped_by="cancelled")
            for request in admitted:
                self._start(request)
            if self._active:
                self._advance_first()

    def _pick(self, request: _Request) -> int:
        """The free stream worth most to the request: the tokens of it the stream's cache holds,
        less half of what the request would evict there (another conversation's turns, which it
        may still want), so that a shared chat-template prefix does not evict a whole conversation
        while a stream stands empty; among equals, the least recently used."""
        def score(stream: int):
            held = self._held.get(stream, []) if self.prefix_cache and request.ids else []
            reused = _common_prefix(held, request.ids or [])
            return reused - (len(held) - reused) / 2, -self._last_used.get(stream, -1)

        return max(self._free, key=score)

    def _start(self, request: _Request, prompt: list[int] | None = None, kept: int = 0) -> None:
        """Starts a request's decoding; ``prompt``: carry on a reply whose chain was replaced (its
        conversation and the tokens it emitted before), of which the stream's cache holds ``kept``."""
        stream = request.handle.stream
        try:
            ids = prompt if prompt is not None else request.ids
            cached = kept
            mirrored = getattr(self.chain, "mirrored", None)  # a standby lacking the stream: start it anew
            if (prompt is None and self.prefix_cache and not request.prompt_logprobs
                    and (mirrored is None or mirrored(stream))):
                # one token at least is prefilled: its logits give the reply
                cached = min(_common_prefix(self._held.get(stream, []), ids), len(ids) - 1)
            k = self.k if request.k is None else request.k
            drafter = self.drafters[stream] if self.drafters and k != 0 else None
            if request.grammar is not None and request.constraint is None:
                request.constraint = self.tokenizer.constraint(request.grammar, self.eos)
            seq = self._sequences.get(stream)
            if seq is None:
                seq = self._sequences[stream] = KVSequence(self.chain, self.max_length, stream, self.rewind)
            if prompt is None:
                request.text = TextStream(self.tokenizer)
            request.decoding = Decoding(seq, ids, request.max_new_tokens - len(request.earlier),
                                        frozenset() if request.ignore_eos else self.eos, drafter=drafter,
                                        k=k if drafter else 0, on_token=lambda t: self._token(request, t),
                                        cancel=request.handle._cancel, sampling=request.sampling,
                                        cached=max(cached, 0), prefill_chunk=self.prefill_chunk,
                                        constraint=request.constraint, logprobs=request.logprobs,
                                        prompt_logprobs=request.prompt_logprobs and prompt is None,
                                        alone=(lambda: len(self._active) == 1) if self.draft_alone else None,
                                        speculate_ahead=self.speculate_ahead)
            if request.logprobs is not None:  # filled in as tokens come (after those of a replaced chain)
                del request.handle.logprobs[len(request.earlier):]
                request.decoding.token_logprobs = request.handle.logprobs
        except ContextError as exc:
            self._finish(request, error=str(exc), context=True)
            return
        except Exception as exc:
            self._finish(request, error=_describe(exc))
            return
        self._active.append(request)
        try:
            request.decoding.start()  # resets the stream on every stage, then submits the prefill
        except Exception as exc:
            self._chain_failed(exc)

    def fit(self, messages: list[dict], chat: bool = True, room: int | None = None,
            tools: list[dict] | None = None) -> tuple[np.ndarray, int]:
        """The conversation's token ids and how many messages were left out: with ``room``, the
        fewest oldest messages (never a system prompt, nor the last message) whose leaving out
        leaves ``room`` tokens in the context, found by a binary search; all of them if even that
        does not fit.  Without ``room`` nothing is left out."""
        ids = self.tokenizer.chat_ids(messages, chat, tools=tools)
        if room is None or ids.size + room <= self.max_length:
            return ids, 0
        droppable = [i for i, m in enumerate(messages[:-1]) if m.get("role") != "system"]

        def without(n: int) -> np.ndarray:
            gone = set(droppable[:n])
            return self.tokenizer.chat_ids([m for i, m in enumerate(messages) if i not in gone], chat, tools=tools)

        low, high = 0, len(droppable)  # leaving out `low` does not fit; `high` fits, or is all there is
        best = without(high) if high else ids
        if best.size + room > self.max_length:
            return best, high
        while high - low > 1:
            middle = (low + high) // 2
            tried = without(middle)
            if tried.size + room <= self.max_length:
                high, best = middle, tried
            else:
                low = middle
        return best, high

    def _advance_first(self) -> None:
        """Advances the stream whose round came back first (``_active`` is in submission order)."""
        try:
            request = self._active[self.chain.first_ready([r.decoding.ticket for r in self._active])]
            more = request.decoding.advance()
        except Exception as exc:
            self._chain_failed(exc)
            return
        self._active.remove(request)
        if more:
            self._active.append(request)
        else:
            self._finish(request)

    def _chain_failed(self, exc: Exception) -> None:
        """A forward failed: the chain's state is unknown (a remote chain has dropped its link).  With
        ``recover`` the replies in flight carry on over the chain it gives; otherwise (or if it cannot)
        every stream in flight ends with the error, and the next request resets (and reconnects)."""
        if isinstance(exc, StageError):
            self.stage_failures[exc.stage] += 1
            if 0 <= exc.stage < len(self.stages_up):
                self.stages_up[exc.stage] = False
        if self.recover is not None and isinstance(exc, StageError) and self._active and not self._recovering:
            self._recovering = True  # a new chain that fails at once ends the replies instead of looping
            try:
                chain = self.recover(exc)
            except Exception as failed:
                exc = failed
                self.failovers["failed"] += 1
            else:
                self.failovers["recovered"] += 1
                self.stages_up = [True] * len(self.stages_up)
                self._replace_chain(chain)
                return
            finally:
                self._recovering = False
        with self._lock:
            self._held.clear()
        message = _describe(exc)
        if not isinstance(exc, FleetError):
            log.error("chain failure", exc_info=exc)
        failed, self._active = self._active, []
        for request in failed:
            self._finish(request, error=message)

    def _replace_chain(self, chain) -> None:
        """Carries every reply in flight on over ``chain``: each one's prompt and the tokens it has
        emitted are prefilled there, and it continues from the next token.  The same chain re-routed
        (a hot standby took a stage over, ``RemoteChain.reroute``) keeps what every stage's cache
        holds of a stream: only the round that was lost is fed again."""
        kept = chain is self.chain
        old, self.chain = self.chain, chain
        if not kept:
            try:
                old.close()
            except Exception:
                log.exception("closing the broken chain failed")
            self._sequences.clear()
        with self._lock:
            self._held.clear()
        resumed, self._active = self._active, []
        for request in resumed:
            request.prompt_entries = request.prompt_entries or request.decoding.prompt_entries
            done = request.decoding.result
            settled = request.decoding.settled() if kept else 0
            seq = self._sequences.get(request.handle.stream)
            holds = getattr(chain, "holds", None)
            if settled and seq is not None and holds is not None and holds(seq.stream, seq.slots_for(settled)):
                seq.settle(settled)
                self.failovers["kept"] += 1
            else:
                settled = 0
            request.first = request.first or done
            request.earlier += done.tokens
            request.rerouted += 1
            self._start(request, prompt=request.decoding.prompt + done.tokens, kept=settled)

    def _token(self, request: _Request, token: int) -> None:
        if request.stop.hit is not None:  # the rest of a round after a stop string
            return
        piece = request.stop.push(request.text.push(token))
        if request.stop.hit is not None:
            request.handle._cancel.set()  # no further rounds: the decoding ends at this one
        if piece:
            request.pieces.append(piece)
            if request.on_text:
                _call(request.on_text, piece, len(request.earlier) + len(request.decoding.result.tokens))

    def _finish(self, request: _Request, stopped_by: str | None = None, error: str | None = None,
                context: bool = False) -> None:
        handle = request.handle
        result = request.decoding.result if request.decoding else None
        if request.text is not None:
            tail = request.stop.push(request.text.flush()) + request.stop.flush()
            if tail:
                request.pieces.append(tail)
                if request.on_text:
                    _call(request.on_text, tail, len(result.tokens) if result else 0)
        if request.stop.hit is not None and not error:
            stopped_by = "stop"
        if result is not None:
            first = request.first or result
            reply = Reply("".join(request.pieces), request.earlier + list(result.tokens), first.prompt_tokens,
                          "error" if error else stopped_by or result.stopped_by, first.ttft_s * 1e3,
                          result.decode_tok_s, result.drafted, result.accepted, error, handle.stream,
                          request.dropped, rerouted=request.rerouted,
                          cached_tokens=request.decoding.cached if not request.rerouted else 0,
                          stage_ms=list(result.breakdown.stage_ms), rounds=result.breakdown.rounds,
                          logprobs=list(handle.logprobs) if request.logprobs is not None else None,
                          prompt_logprobs=request.prompt_entries or request.decoding.prompt_entries,
                          stop_string=request.stop.hit if not error else None)
        else:
            reply = Reply("", [], 0, "error" if error else stopped_by or "cancelled", error=error, stream=handle.stream,
                          context_error=context)
        if handle.stream is not None:
            with self._lock:
                self._remember(handle.stream, request.decoding, error)
                self._free.append(handle.stream)
                self._free.sort()
        if result is not None and result.tokens and not error and not all(self.stages_up):
            self.stages_up = [True] * len(self.stages_up)  # a reply went through every stage
        handle.reply = reply
        handle._done.set()
        if request.on_done:
            _call(request.on_done, reply)


    def _remember(self, stream: int, decoding: Decoding | None, error: str | None) -> None:
        """What a finished stream's cache holds: its prompt and every token it emitted but the last
        (which was never fed); after an error, or before a first token, nothing known.  Under the lock."""
        self._last_used[stream] = next(self._uses)
        if decoding is None or error or not decoding.result.tokens:
            self._held.pop(stream, None)
        else:
            self._held[stream] = decoding.prompt + decoding.result.tokens[:-1]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    same = np.asarray(a[:n]) == np.asarray(b[:n])
    return n if same.all() else int(np.argmin(same))


def _call(callback, *args) -> None:
    """A caller's callback failing must not take the scheduler (and every other stream) down."""
    try:
        callback(*args)
    except Exception:
        log.exception("chat service callback failed")


def _describe(exc: BaseException) -> str:
    """A message for a person: engine errors say what happened already; anything else is named."""
    if isinstance(exc, FleetError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
