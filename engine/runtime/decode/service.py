"""The chat service: several conversations at once over one chain, as micro-batched streams.

A ``ChatService`` owns a chain (in-process ``LocalChain`` or the distributed ``RemoteChain``), the
coordinator's tokenizer and optionally one drafter per stream.  ``submit`` queues a conversation
and returns a ``Handle`` at once; a single scheduler thread admits queued requests onto free stream
ids (each stream has its own KV state on every stage and is reset before use), and advances the
active ``Decoding`` whose round came back first, so that one stream's round is in flight while another
is collected and resubmitted, exactly as ``generate_streams`` interleaves them.  New requests join
between rounds; a cancelled one stops at its next round.

Prefix cache: after a reply a stream keeps its KV on every stage, and the service remembers the
tokens it holds (``engine.runtime.decode.prefix``).  A request goes to the free stream whose cache
serves it best, whose cache is rewound to the prefix they share; only the rest is prefilled.  A
request submitted ``after`` another (the API's ``n`` choices of one prompt) waits for it and runs on
its stream, so the prompt they share is prefilled once (unless another request took that stream in
between).

Fitting the context: ``submit`` tokenizes the conversation on the caller's thread (never under the
scheduler's lock, so a huge conversation stalls neither the scheduler nor whoever asks ``busy``).
``fit="refuse"`` (the API) raises ``ContextExceeded`` with the counts when the conversation and the
reply do not fit; ``fit="drop"`` (the app) leaves out the oldest messages, found by a binary search
over how many to drop (a logarithmic number of renders, not one per message).

Text arrives through ``on_text(piece, tokens_so_far)`` as it is generated
(``engine.runtime.decode.reply.ReplyText``) and the finished reply through ``on_done(Reply)``;
both are called on the scheduler thread.  When a stage fails, ``engine.runtime.decode.recovery``
asks failover for a new chain, and the replies in flight carry on over it.  The engine knows
nothing of any UI: an app wraps these callbacks in its own cross-thread signals.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
from typing import Callable

import numpy as np

from engine.config import Scheduling
from engine.errors import ContextError, FleetError
from engine.runtime.decode.generate import Decoding
from engine.runtime.decode.kvsequence import KVSequence
from engine.runtime.decode.prefix import PrefixCache, common_prefix
from engine.runtime.decode.recovery import Recovery
from engine.runtime.decode.reply import OnText, Reply, ReplyText, call
from engine.runtime.decode.sampling import GREEDY, SamplingParams
from engine.runtime.decode.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)

__all__ = ["ChatService", "ContextExceeded", "Handle", "Reply"]

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
    text: ReplyText
    on_done: Callable[[Reply], None] | None
    chat: bool
    ignore_eos: bool
    k: int | str | None
    sampling: SamplingParams = GREEDY
    decoding: Decoding | None = None
    dropped: int = 0
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
    def __init__(self, chain, tokenizer: ChatTokenizer | None = None, *, scheduling: Scheduling = Scheduling(),
                 drafters: Callable[[int], list | None] | None = None, rewind: str = "mask",
                 max_length: int | None = None, eos_ids=None, owned=(), recover=None, prefix_cache: bool = True,
                 draft_alone: bool = True):
        """``scheduling``: the streams, the default draft length ``k`` (an int, or ``"auto"``; 0 turns
        speculation off), whether a stream drafting alone speculates ahead (sends its next round while
        one is verified, ``Decoding``) and the prompt tokens a prefill forward takes (other streams'
        rounds run between chunks); its draft kind is what the ``drafters`` are made for;
        ``drafters(n)`` gives one drafter per stream (``speculative.stream_drafters``) or None;
        ``owned`` are further objects to ``close()`` with the service (a local fleet);
        ``recover(StageError)`` gives a new chain when a stage fails (``engine.fleet.failover``),
        on which the replies in flight carry on; without it they end with the error;
        ``prefix_cache=False`` prefills every conversation whole (a benchmark's cold side);
        ``draft_alone``: a stream drafts only while it is the only one generating, its other rounds
        are plain.  With several streams the verify's extra rows cost more than the drafts give,
        whichever the drafter (docs/benchmarks.md, "A second PC that drafts")."""
        if scheduling.streams < 1:
            raise FleetError("the chat service needs at least one stream")
        self.chain = chain
        self.scheduling = scheduling
        self.tokenizer = tokenizer or ChatTokenizer(chain.first_folder)
        self.rewind = rewind
        self.max_length = max_length or chain.spec.max_position
        manifest = getattr(chain, "manifest", None)
        self.eos = frozenset(int(i) for i in (eos_ids if eos_ids is not None else manifest.eos_token_ids))
        self.drafters = drafters(scheduling.streams) if drafters else None
        self.recovery = Recovery(recover, manifest.stage_count if manifest else 1)
        self.prefix = PrefixCache(prefix_cache)
        self.draft_alone = draft_alone
        m = manifest
        self.description = f"{m.model_name}, {m.stage_count} part{'s' if m.stage_count > 1 else ''}" if m else ""
        self._owned = list(owned)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: collections.deque[_Request] = collections.deque()
        self._free = list(range(scheduling.streams))
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
        request = _Request(handle, messages, max_new_tokens, ReplyText(self.tokenizer, stop, on_text), on_done,
                           chat, ignore_eos, k, sampling or GREEDY, grammar=grammar, dropped=dropped,
                           ids=ids.reshape(-1).tolist(), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                           after=after)
        with self._lock:
            if self._closed:
                raise FleetError("the chat service is closed")
            self._queue.append(request)
            self._wake.notify()
        return handle

    @property
    def streams(self) -> int:
        """Requests that can generate at once (``Scheduling.streams``)."""
        return self.scheduling.streams

    @property
    def k(self) -> int | str:
        """The draft length of a request that names none (``Scheduling.k``)."""
        return self.scheduling.k

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
        return self.prefix.longest(ids)

    @property
    def stages_up(self) -> list[bool]:
        """Whether each stage was up when last seen (``Recovery``)."""
        return self.recovery.stages_up

    @property
    def stage_failures(self) -> collections.Counter:
        """Each stage's failed forwards (``Recovery``)."""
        return self.recovery.stage_failures

    @property
    def failovers(self) -> collections.Counter:
        """Failovers by outcome (``Recovery``)."""
        return self.recovery.failovers

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
                        request.handle.stream = (after if after in self._free else
                                                 self.prefix.pick(self._free, request.ids))
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

    def _start(self, request: _Request, prompt: list[int] | None = None, kept: int = 0) -> None:
        """Starts a request's decoding; ``prompt``: carry on a reply whose chain was replaced (its
        conversation and the tokens it emitted before), of which the stream's cache holds ``kept``."""
        stream = request.handle.stream
        try:
            ids = prompt if prompt is not None else request.ids
            cached = kept
            mirrored = getattr(self.chain, "mirrored", None)  # a standby lacking the stream: start it anew
            if (prompt is None and not request.prompt_logprobs
                    and (mirrored is None or mirrored(stream))):
                # one token at least is prefilled: its logits give the reply
                cached = min(common_prefix(self.prefix.held(stream), ids), len(ids) - 1)
            k = self.scheduling.k if request.k is None else request.k
            drafter = self.drafters[stream] if self.drafters and k != 0 else None
            if request.grammar is not None and request.constraint is None:
                request.constraint = self.tokenizer.constraint(request.grammar, self.eos)
            seq = self._sequences.get(stream)
            if seq is None:
                seq = self._sequences[stream] = KVSequence(self.chain, self.max_length, stream, self.rewind)
            if prompt is None:
                request.text.begin()
            request.decoding = Decoding(seq, ids, request.max_new_tokens - len(request.earlier),
                                        frozenset() if request.ignore_eos else self.eos,
                                        scheduling=self.scheduling, drafter=drafter, k=k if drafter else 0,
                                        on_token=lambda t: self._token(request, t),
                                        cancel=request.handle._cancel, sampling=request.sampling,
                                        cached=max(cached, 0), constraint=request.constraint,
                                        logprobs=request.logprobs,
                                        prompt_logprobs=request.prompt_logprobs and prompt is None,
                                        alone=(lambda: len(self._active) == 1) if self.draft_alone else None)
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
        """A forward failed: the chain's state is unknown (a remote chain has dropped its link).  The
        replies in flight carry on over the chain ``Recovery`` gets; otherwise (or if it cannot) every
        stream in flight ends with the error, and the next request resets (and reconnects)."""
        try:
            if self.recovery.carry_on(exc, bool(self._active), self._replace_chain):
                return
        except Exception as failed:
            exc = failed
        self.prefix.clear()
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
        self.prefix.clear()
        resumed, self._active = self._active, []
        for request in resumed:
            request.prompt_entries = request.prompt_entries or request.decoding.prompt_entries
            done = request.decoding.result
            settled = request.decoding.settled() if kept else 0
            seq = self._sequences.get(request.handle.stream)
            holds = getattr(chain, "holds", None)
            if settled and seq is not None and holds is not None and holds(seq.stream, seq.slots_for(settled)):
                seq.settle(settled)
                self.recovery.failovers["kept"] += 1
            else:
                settled = 0
            request.first = request.first or done
            request.earlier += done.tokens
            request.rerouted += 1
            self._start(request, prompt=request.decoding.prompt + done.tokens, kept=settled)

    def _token(self, request: _Request, token: int) -> None:
        request.text.push(token, len(request.earlier) + len(request.decoding.result.tokens))
        if request.text.stopped:
            request.handle._cancel.set()  # no further rounds: the decoding ends at this one

    def _finish(self, request: _Request, stopped_by: str | None = None, error: str | None = None,
                context: bool = False) -> None:
        handle = request.handle
        result = request.decoding.result if request.decoding else None
        request.text.finish(len(result.tokens) if result else 0)
        if request.text.stopped and not error:
            stopped_by = "stop"
        if result is not None:
            first = request.first or result
            reply = Reply(request.text.text, request.earlier + list(result.tokens), first.prompt_tokens,
                          "error" if error else stopped_by or result.stopped_by, first.ttft_s * 1e3,
                          result.decode_tok_s, result.drafted, result.accepted, error, handle.stream,
                          request.dropped, rerouted=request.rerouted,
                          cached_tokens=request.decoding.cached if not request.rerouted else 0,
                          stage_ms=list(result.breakdown.stage_ms), rounds=result.breakdown.rounds,
                          logprobs=list(handle.logprobs) if request.logprobs is not None else None,
                          prompt_logprobs=request.prompt_entries or request.decoding.prompt_entries,
                          stop_string=request.text.stop.hit if not error else None)
        else:
            reply = Reply("", [], 0, "error" if error else stopped_by or "cancelled", error=error, stream=handle.stream,
                          context_error=context)
        if handle.stream is not None:
            decoding = request.decoding
            self.prefix.remember(handle.stream, None if decoding is None or error or not decoding.result.tokens else
                                 decoding.prompt + decoding.result.tokens[:-1])  # the last token was never fed
            with self._lock:
                self._free.append(handle.stream)
                self._free.sort()
        if result is not None and result.tokens and not error:
            self.recovery.went_through()
        handle.reply = reply
        handle._done.set()
        if request.on_done:
            call(request.on_done, reply)


def _describe(exc: BaseException) -> str:
    """A message for a person: engine errors say what happened already; anything else is named."""
    if isinstance(exc, FleetError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
