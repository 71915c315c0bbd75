"""Drafts from a draft server on another PC (``engine.runtime.decode.draftserver``), for speculative
rounds.

The draft server drafts ahead on its own PC while the target verifies here, so a round's drafts are
usually there when the round starts: the target's PC spends no time drafting, and the draft model
takes none of its memory or bandwidth.  A ``DraftLink`` is one connection to the server, shared by
the streams; its reader thread keeps, per stream, a mirror of the server's text (the text it was
told, then the drafts it sent).  Each round ``RemoteDraft.propose`` tells the server the text the
target settled on (SYNC, no wait for an answer) and proposes the mirror's tokens beyond it.

Where the target left the draft's path, the mirror holds nothing beyond the text until the server
has drafted from the target's token (one draft step, plus the link).  A round then waits for the
first draft up to ``WAIT_S``: a round without drafts gives one token for a whole verify, while the
first draft costs one draft step.
"""

from __future__ import annotations

import threading
import time

from engine.config import FleetAccess
from engine.errors import FleetError, ShardError
from engine.manifest import Manifest
from engine.runtime.decode.speculative import TOKENIZER_FILES, Drafter, PromptLookup, smooth
from engine.runtime.decode.draftserver import MAX_LEAD, MAX_STREAMS, common_prefix
from engine.transport import wire
from engine.transport.link import Link, handshake
from engine.transport.wire import AuthError, Msg, ProtocolError

AHEAD = MAX_LEAD + 1  # the most a draft server holds beyond the text: its lead, and a step's second draft


class _Mirror:
    """One stream's text as the draft server holds it, from what it was told and sent back."""

    def __init__(self, valid: int):
        self.told: list[int] = []
        self.tokens: list[int] = []  # ``told`` as of the last SYNC that parted, then drafts received
        self.valid = valid  # DRAFTS drafted before this SYNC are on a path the server left


class DraftLink:
    """One authenticated connection to a draft server (``DraftServer``), for ``RemoteDraft``s.  The
    server holds the fleet key but is trusted no further: DRAFTS beyond the lead it may draft (the
    mirror's memory), or with token ids outside the ``target``'s vocabulary, break the link (the
    rounds go plain)."""

    def __init__(self, address: str, access: FleetAccess, target: Manifest | None = None):
        """``access``: the fleet key and TLS the connection goes with."""
        self.address = address
        self.vocab = target.spec.vocab_size if target is not None else None
        try:
            sock, welcome, seal = handshake(address, access.key, {"role": "draft"}, access.tls)
        except OSError as exc:
            raise FleetError(f"cannot reach the draft server at {address}: {exc.strerror or exc}") from None
        except (AuthError, ProtocolError) as exc:
            raise FleetError(f"the draft server at {address} refused us: {exc}") from None
        self.model = str(welcome.get("model", "?"))
        self.context = welcome.get("context")  # the draft model's: a longer text is never told
        if not isinstance(self.context, int):
            sock.close()
            raise FleetError(f"the draft server at {address} did not say its context")
        if target is not None:
            theirs = welcome.get("tokenizer") or {}
            for name in TOKENIZER_FILES:
                if theirs.get(name) is None or theirs.get(name) != target.files.get(name):
                    sock.close()
                    raise ShardError(f"the draft model {self.model} at {address} does not share the target "
                                     f"{target.model_name}'s tokenizer ({name} differs): its token ids would "
                                     "mean other text")
        self.link = Link(sock, address, seal)
        self._cond = threading.Condition()
        self._mirrors: dict[int, _Mirror] = {}
        # SYNCs are numbered across the link's life, so a stream's new drafter (a new mirror) never
        # takes DRAFTS still on their way to the one before
        self._epoch = 0
        self.error: str | None = None  # why the link broke, once it has
        threading.Thread(target=self._reader, daemon=True, name=f"drafts {address}").start()

    def drafter(self, stream: int) -> "RemoteDraft":
        if not 0 <= stream < MAX_STREAMS:
            raise FleetError(f"the draft server at {self.address} drafts for {MAX_STREAMS} streams at most, and "
                             f"this service has more (all its copies' --streams): fewer streams, or a draft model "
                             "on this PC (--draft MODEL)")
        with self._cond:
            # DRAFTS for the stream's drafter before may still be on their way: only later SYNCs count
            self._mirrors[stream] = _Mirror(valid=self._epoch + 1)
        return RemoteDraft(self, stream)

    def _reader(self) -> None:
        try:
            while True:
                frame = self.link.recv()
                if frame.type != Msg.DRAFTS:
                    raise ProtocolError(f"a draft server sent {frame.type.name}")
                (position,), tokens = wire.unpack_tokens(frame, 1, AHEAD)
                if self.vocab is not None and any(not 0 <= t < self.vocab for t in tokens):
                    raise ProtocolError(f"DRAFTS carry a token outside the vocabulary of {self.vocab}")
                with self._cond:
                    mirror = self._mirrors.get(frame.stream)
                    if mirror is None or frame.seq < mirror.valid:
                        continue
                    if position > len(mirror.tokens):
                        raise ProtocolError(f"DRAFTS at {position} leave a gap after {len(mirror.tokens)} tokens")
                    if position + len(tokens) > len(mirror.told) + AHEAD:
                        raise ProtocolError(f"DRAFTS reach {position + len(tokens) - len(mirror.told)} tokens beyond "
                                            f"the text; a draft server drafts at most {AHEAD} ahead")
                    mirror.tokens[position:] = tokens
                    self._cond.notify_all()
        except (OSError, ProtocolError) as exc:  # OSError: ConnectionError, or our own close under the read
            self._broken(str(exc))

    def _broken(self, reason: str) -> None:
        """The link is gone (the first reason stays): every round from now on goes plain."""
        with self._cond:
            self.error = self.error or reason
            self._cond.notify_all()

    def fits(self, history: list[int]) -> bool:
        """Whether the draft model's context leaves room to draft beyond ``history`` (the server
        refuses a longer text, which would end the connection for every stream)."""
        return len(history) + 2 < self.context

    def sync(self, stream: int, history: list[int], lead: int, fresh: bool = False) -> None:
        """Tells the server the stream's text is ``history`` (only what changed goes over the link);
        ``fresh``: a new generation, so the drafts the server made beyond it before are dropped."""
        with self._cond:
            mirror = self._mirrors[stream]
            told = mirror.told
            start = len(told) if history[:len(told)] == told else common_prefix(told, history)
            self._epoch = epoch = self._epoch + 1
            if fresh or mirror.tokens[:len(history)] != history:  # the server parts from its drafts too
                mirror.tokens = list(history)
                mirror.valid = epoch
            mirror.told = list(history)
        if self.error is None:
            try:
                self.link.send(wire.sync_frame(stream, epoch, start, lead, fresh, history[start:]))
            except OSError as exc:  # the server went before the reader heard
                self._broken(f"connection lost ({exc})")

    def ahead(self, stream: int, history: list[int], want: int, wait_s: float) -> list[int]:
        """The stream's drafts beyond ``history``, after waiting up to ``wait_s`` for ``want`` of them."""
        deadline = time.monotonic() + wait_s
        n = len(history)
        with self._cond:
            mirror = self._mirrors[stream]
            while len(mirror.tokens) - n < want and self.error is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return mirror.tokens[n:] if mirror.tokens[:n] == history else []

    def close(self) -> None:
        if self.error is None:
            try:
                self.link.send(wire.Frame(Msg.BYE))
            except OSError:
                pass
        self.link.close()


class RemoteDraft(Drafter):
    """A stream's drafts from a draft server, at a steady verify width under K auto.

    A verify's cost depends on its width, and a width other than the last costs more again (the CPU
    plugin prepares every node again for a new shape).  So each
    round verifies ``WIDTH`` drafts: the server's, after waiting up to ``WAIT_S`` for the first,
    then prompt lookup's continuation of them, then the last token again (a draft that costs only
    its position).

    On a CPU without int8 dot products every position costs (a 4-position verify about twice a plain
    one), and a padded round pays only where its guesses are often right.  So a round goes plain where
    padded rounds with as many guesses (the server's drafts and lookup's) gave fewer extra tokens
    than the padded verify costs over a plain one; every ``RETRY``-th such round is padded anyway,
    to hear whether that still holds.  The first round without any guess goes plain to time a plain
    verify.  With int8 dot products a plain verify costs about a padded one, so rounds stay padded."""

    name = "remote"
    fits_k = True
    WIDTH = 3  # drafts a round verifies under K auto
    LEAD = 2 * WIDTH + 1  # how far beyond the text the server drafts: past the round in flight's drafts
    WAIT_S = 0.03  # how long a round waits for its first draft (see the module docstring)
    RETRY = 4  # of rounds a class's record sends plain, one in this many is padded anyway

    def __init__(self, link: DraftLink, stream: int):
        self.link = link
        self.stream = stream
        self.pick_k = False
        self._lookup = PromptLookup()
        self.plain_s = self.padded_s = 0.0  # a plain verify's time and a padded one's (running averages)
        # drafts accepted in a padded round, by how many of its drafts were guesses (the rest repeat
        # the last token): running averages from a hopeful start, and plain rounds each class sent
        self.gain = [1.0] * (self.WIDTH + 1)
        self._plain = [0] * (self.WIDTH + 1)
        self._class: int | None = None  # the round in flight's guesses (None: not a padded round)

    def prime(self, prompt: list[int]) -> None:
        if self.link.fits(prompt):
            self.link.sync(self.stream, list(prompt), self.LEAD, fresh=True)

    def propose(self, history: list[int], k: int) -> list[int]:
        take = min(k, self.WIDTH) if self.pick_k else k
        if self.link.error is None and self.link.fits(history):  # else plain rounds: the target decides anyway
            self.link.sync(self.stream, history, self.LEAD)
            drafts = self.link.ahead(self.stream, history, 1, self.WAIT_S)[:take]
        else:
            drafts = []
        if not self.pick_k:
            return drafts
        if len(drafts) < take:
            drafts += self._lookup.propose(history + drafts, take - len(drafts))
        guesses = len(drafts)
        full = take == self.WIDTH  # a shorter round: the reply's last tokens, on no record
        if full and self._goes_plain(guesses):
            self._class = None
            return []
        self._class = guesses if full else None
        drafts += drafts[-1:] * (take - len(drafts)) if drafts else history[-1:] * take
        return drafts

    def _goes_plain(self, guesses: int) -> bool:
        """Whether a round with ``guesses`` guesses goes plain (see the class docstring)."""
        if not self.plain_s:
            return guesses == 0
        if (1 + self.gain[guesses]) * self.plain_s >= self.padded_s:
            return False
        self._plain[guesses] += 1
        return self._plain[guesses] % self.RETRY != 0

    def feedback(self, proposed: int, accepted: int, verify_ms: float, draft_ms: float) -> None:
        if proposed == 0:
            self.plain_s = smooth(self.plain_s, verify_ms / 1e3)
        elif self._class is not None:  # a padded round of WIDTH drafts (never without K auto)
            self.padded_s = smooth(self.padded_s, verify_ms / 1e3)
            self.gain[self._class] = smooth(self.gain[self._class], accepted)
