"""A reply as the chat service makes it: its text as it comes (``ReplyText``), and the finished
``Reply`` with how it went.

``ReplyText`` turns a reply's tokens into the text its caller sees: incrementally decoded
(multi-byte characters held back until complete), and cut at the first stop string (text that may
begin one is held back until it is known not to).  Each piece goes to the caller's ``on_text`` as it
comes; the service calls it on its scheduler thread."""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

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


class ReplyText:
    """One reply's text: its tokens decoded as they come, cut at the first of ``stops``, each piece
    told to ``on_text(piece, tokens so far)``; ``text`` is what was told so far."""

    def __init__(self, tokenizer: ChatTokenizer, stops: list[str] | tuple[str, ...] = (),
                 on_text: OnText | None = None):
        self.stop = StopText(stops)
        self.on_text = on_text
        self._stream: TextStream | None = None
        self._tokenizer = tokenizer
        self._pieces: list[str] = []

    def begin(self) -> None:
        """The reply's first token is next (a reply carried on over a new chain keeps its text)."""
        self._stream = TextStream(self._tokenizer)

    @property
    def stopped(self) -> bool:
        """A stop string was found: nothing after it is told."""
        return self.stop.hit is not None

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def push(self, token: int, tokens: int) -> None:
        """The reply's next token (``tokens`` so far); after a stop string, nothing."""
        if self.stopped:
            return
        self._tell(self.stop.push(self._stream.push(token)), tokens)

    def finish(self, tokens: int) -> None:
        """The reply ended: what was held back (an incomplete character, a possible stop's start)."""
        if self._stream is not None:
            self._tell(self.stop.push(self._stream.flush()) + self.stop.flush(), tokens)

    def _tell(self, piece: str, tokens: int) -> None:
        if piece:
            self._pieces.append(piece)
            if self.on_text:
                call(self.on_text, piece, tokens)


def call(callback, *args) -> None:
    """A caller's callback failing must not take the scheduler (and every other stream) down."""
    try:
        callback(*args)
    except Exception:
        log.exception("chat service callback failed")
