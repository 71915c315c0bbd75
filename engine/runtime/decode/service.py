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
cache is rewound to the prefix they share; only the rest is prefilled.

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
    ids: list[int] | None = None  # the conversation's token ids, once admitted


class ChatService:
    def __init__(self, chain, tokenizer: ChatTokenizer | None = None, *, streams: int = 2,
                 drafters: Callable[[int], list | None] | None = None, k: int | str = 4, rewind: str = "mask",
                 max_length: int | None = None, eos_ids=None, owned=(), recover=None, prefix_cache: bool = True,
                 prefill_chunk: int = PREFILL_CHUNK):
        """``drafters(n)`` gives one drafter per stream (``speculative.stream_drafters``) or None;
        ``k`` is the default draft length (an int, or ``"auto"``; 0 turns speculation off);
        ``owned`` are further objects to ``close()`` with the service (a local fleet);
        ``recover(StageError)`` gives a new chain when a stage fails (``engine.fleet.failover``),
        on which the replies in flight carry on; without it they end with the error;
        ``prefix_cache=False`` prefills every conversation whole (a benchmark's cold side);
        ``prefill_chunk``: prompt tokens a forward (other streams' rounds run between chunks)."""
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
        self.prefix_cache = prefix_cache
        self.prefill_chunk = prefill_chunk
        self._held: dict[int, list[int]] = {}  # stream -> the token ids its cache holds, in order
        self._last_used: dict[int, int] = {}
        self._uses = itertools.count()
        m = manifest
        self.description = f"{m.model_name}, {m.stage_count} stage{'s' if m.stage_count > 1 else ''}" if m else ""
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

    def submit(self, messages: list[dict], max_new_tokens: int = 128, on_text: OnText | None = None,
               on_done: Callable[[Reply], None] | None = None, *, chat: bool = True, ignore_eos: bool = False,
               k: int | str | None = None, sampling: SamplingParams | None = None,
               stop: list[str] | tuple[str, ...] = ()) -> Handle:
        """Queues a reply to ``messages`` (``{"role", "content"}`` dicts, the last one the user's).
        ``sampling`` None is greedy; the reply ends before the first of the ``stop`` strings."""
        if not messages:
            raise FleetError("nothing to reply to: the conversation is empty")
        handle = Handle(self, next(self._ids))
        request = _Request(handle, [dict(m) for m in messages], max_new_tokens, on_text, on_done, chat,
                           ignore_eos, k, sampling or GREEDY, StopText(stop))
        with self._lock:
            if self._closed:
                raise FleetError("the chat service is closed")
            self._queue.append(request)
            self._wake.notify()
        return handle

    @property
    def busy(self) -> int:
        """Requests queued or generating."""
        with self._lock:
            return len(self._queue) + len(self._active)

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
                while self._queue and (self._free or self._queue[0].handle.cancelled):
                    request = self._queue.popleft()
                    if request.handle.cancelled:
                        dropped.append(request)
                        continue
                    request.handle.stream = self._pick(request)
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
        try:
            request.ids = self._fit(request).reshape(-1).tolist()
        except Exception:  # _start meets it again and says so
            request.ids = None

        def score(stream: int):
            held = self._held.get(stream, []) if self.prefix_cache and request.ids else []
            reused = _common_prefix(held, request.ids or [])
            return reused - (len(held) - reused) / 2, -self._last_used.get(stream, -1)

        return max(self._free, key=score)

    def _start(self, request: _Request, prompt: list[int] | None = None) -> None:
        """Starts a request's decoding; ``prompt``: carry on a reply whose chain was replaced (its
        conversation and the tokens it emitted before)."""
        stream = request.handle.stream
        try:
            ids = prompt if prompt is not None else request.ids or self._fit(request).reshape(-1).tolist()
            cached = 0
            if prompt is None and self.prefix_cache:  # one token at least is prefilled: its logits give the reply
                cached = min(_common_prefix(self._held.get(stream, []), ids), len(ids) - 1)
            k = self.k if request.k is None else request.k
            drafter = self.drafters[stream] if self.drafters and k != 0 else None
            seq = self._sequences.get(stream)
            if seq is None:
                seq = self._sequences[stream] = KVSequence(self.chain, self.max_length, stream, self.rewind)
            if prompt is None:
                request.text = TextStream(self.tokenizer)
            request.decoding = Decoding(seq, ids, request.max_new_tokens - len(request.earlier),
                                        frozenset() if request.ignore_eos else self.eos, drafter=drafter,
                                        k=k if drafter else 0, on_token=lambda t: self._token(request, t),
                                        cancel=request.handle._cancel, sampling=request.sampling,
                                        cached=max(cached, 0), prefill_chunk=self.prefill_chunk)
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

    def _fit(self, request: _Request):
        """The conversation's token ids, leaving out its oldest messages (the system prompt and the
        last message stay) while it would leave less than a reply's room in the context."""
        messages = request.messages
        room = min(request.max_new_tokens, max(self.max_length // 4, 1))
        while True:
            ids = self.tokenizer.chat_ids(messages, request.chat)
            droppable = [i for i, m in enumerate(messages[:-1]) if m.get("role") != "system"]
            if ids.size + room <= self.max_length or not droppable:
                return ids
            messages = messages[: droppable[0]] + messages[droppable[0] + 1 :]
            request.dropped += 1

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
        if self.recover is not None and isinstance(exc, StageError) and self._active and not self._recovering:
            self._recovering = True  # a new chain that fails at once ends the replies instead of looping
            try:
                chain = self.recover(exc)
            except Exception as failed:
                exc = failed
            else:
                self._replace_chain(chain)
                return
            finally:
                self._recovering = False
        self._held.clear()
        message = _describe(exc)
        if not isinstance(exc, FleetError):
            log.error("chain failure", exc_info=exc)
        failed, self._active = self._active, []
        for request in failed:
            self._finish(request, error=message)

    def _replace_chain(self, chain) -> None:
        """Carries every reply in flight on over ``chain``: each one's prompt and the tokens it has
        emitted are prefilled there, and it continues from the next token."""
        old, self.chain = self.chain, chain
        try:
            old.close()
        except Exception:
            log.exception("closing the broken chain failed")
        self._sequences.clear()
        self._held.clear()
        resumed, self._active = self._active, []
        for request in resumed:
            done = request.decoding.result
            request.first = request.first or done
            request.earlier += done.tokens
            request.rerouted += 1
            self._start(request, prompt=request.decoding.prompt + done.tokens)

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
                          cached_tokens=request.decoding.cached if not request.rerouted else 0)
        else:
            reply = Reply("", [], 0, "error" if error else stopped_by or "cancelled", error=error, stream=handle.stream,
                          context_error=context)
        if handle.stream is not None:
            self._remember(handle.stream, request.decoding, error)
            with self._lock:
                self._free.append(handle.stream)
                self._free.sort()
        handle.reply = reply
        handle._done.set()
        if request.on_done:
            _call(request.on_done, reply)


    def _remember(self, stream: int, decoding: Decoding | None, error: str | None) -> None:
        """What a finished stream's cache holds: its prompt and every token it emitted but the last
        (which was never fed); after an error, or before a first token, nothing known."""
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
