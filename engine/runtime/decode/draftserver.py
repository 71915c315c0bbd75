"""The draft server: a draft model on a PC of its own, drafting ahead while the target verifies.

On one PC a draft model's steps and the target's verify take turns on the same cores.  Here the
draft runs on another PC and never waits for the target: for each stream it keeps drafting its own
greedy continuation of the text it was told, up to ``lead`` tokens beyond it, and sends each token
as soon as it has it (DRAFTS).  The coordinator tells it the text the target settled on after each
round (SYNC); where that text leaves the draft's path, the draft rewinds its cache by mask to where
they part and drafts on from the target's tokens.  When the target accepted every draft and its
own next token is the draft's next one as well, the drafts for the next round are already there.

The coordinator's side is ``engine.runtime.decode.remotedraft``; the frames are defined in
``engine.transport.wire``.  One coordinator is served at a time (a new one replaces it), its streams
round robin, one draft step each.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from engine.config import FleetAccess
from engine.errors import FleetError
from engine.runtime.decode.kvsequence import KVSequence
from engine.runtime.stages.chain import LocalChain
from engine.runtime.decode.speculative import TOKENIZER_FILES, PromptLookup, open_draft_chain
from engine.transport import wire
from engine.transport.link import Link, Listening, accept_loop, authenticate_peer, parse_address
from engine.transport.wire import Flag, Msg, ProtocolError

MAX_STREAMS = 64
MAX_LEAD = 32  # tokens a stream may be drafted beyond the text it was told
CHUNK = 512  # a long text (a new prompt) goes in this many tokens a forward, between other streams' steps


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two texts share from the start."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def draft_identity(manifest) -> dict:
    """What a draft server answers the handshake with: its model, its context (the coordinator
    stops telling it a text that outgrows it), and its tokenizer files' hashes (the coordinator
    refuses a draft whose token ids mean other text)."""
    return {"role": "draft", "fingerprint": manifest.fingerprint, "model": manifest.model_name,
            "context": manifest.spec.max_position,
            "tokenizer": {name: manifest.files.get(name) for name in TOKENIZER_FILES}}


class DraftText:
    """One stream's text on the draft server: what the coordinator told it, the drafts beyond it,
    and how much of that the draft cache holds."""

    def __init__(self, chain, stream: int):
        self.seq = KVSequence(chain, chain.spec.max_position, stream, "mask")
        self.vocab = chain.spec.vocab_size
        self.told: list[int] = []
        self.tokens: list[int] = []  # ``told``, then the drafts beyond it
        self.fed = 0  # tokens in the draft cache (a prefix of ``tokens``)
        self.lead = 0
        self.epoch = 0
        self._lookup = PromptLookup()

    def sync(self, epoch: int, start: int, lead: int, fresh: bool, tokens: list[int]) -> list[int]:
        """Takes a SYNC; returns the drafts already beyond the new text (sent again under this epoch)."""
        if start > len(self.told):
            raise ProtocolError(f"SYNC keeps {start} tokens of a text of {len(self.told)}")
        if any(not 0 <= t < self.vocab for t in tokens):
            raise ProtocolError(f"SYNC carries a token outside the vocabulary of {self.vocab}")
        told = self.told[:start] + tokens
        if len(told) >= self.seq.max_length:
            raise ProtocolError(f"the text ({len(told)} tokens) outgrows the draft's context of {self.seq.max_length}")
        common = len(told) if self.tokens[:len(told)] == told else common_prefix(told, self.tokens)
        if fresh or common < len(told):  # a new generation, or the target left the draft's path: rewind
            if self.fed > common:
                self.seq.reject(self.fed - common)
                self.fed = common
            self.tokens = list(told)
        self.told, self.lead, self.epoch = told, min(lead, MAX_LEAD), epoch
        return self.tokens[len(told):]

    def wants_step(self) -> bool:
        return (bool(self.told) and len(self.tokens) - len(self.told) < self.lead
                and len(self.tokens) + 2 < self.seq.max_length)

    def step(self) -> list[int]:
        """Feeds what the cache lacks (up to ``CHUNK`` tokens); the next drafts (none while a long
        text is still going in).  A single token goes in beside a guess at the draft's next one
        (prompt lookup's, as ``DraftModel`` does): a right guess gives two drafts for one step."""
        if self.fed >= len(self.tokens):  # everything fed: feed the last token again for its logits
            self.seq.reject(1)
            self.fed -= 1
        new = self.tokens[self.fed:self.fed + CHUNK]
        if len(new) > 1:
            out = self.seq.forward(new)
            self.fed += len(new)
            if self.fed < len(self.tokens):
                return []
            self.tokens.append(int(out.tokens[-1]))
            return self.tokens[-1:]
        guess = (self._lookup.propose(self.tokens, 1) or new)[0]
        out = self.seq.forward([new[0], guess], Flag.ALL_POSITIONS)
        self.fed += 1
        drafts = [int(out.tokens[0])]
        if drafts[0] == guess:
            self.fed += 1
            drafts.append(int(out.tokens[1]))
        else:
            self.seq.reject(1)
        self.tokens += drafts
        return drafts


class DraftServer(Listening):
    """Serves a draft model's 1-stage shard on a TCP port (``fleet worker --draft``)."""

    def __init__(self, folders: list[Path], listen: str, *, access: FleetAccess, device: str = "CPU",
                 log: Callable[[str], None] | None = None, config: dict | None = None, delay_ms: float = 0.0):
        """``access``: the fleet key a coordinator must prove and the TLS it speaks; ``config``: compile
        settings other than a draft's own (``open_draft_chain``); ``delay_ms``: a one-way delay on every
        frame (WAN simulation, as a stage worker's)."""
        self.chain = open_draft_chain(folders, device) if config is None else LocalChain(folders, device, config=config)
        self.manifest = self.chain.manifest
        if self.manifest.stage_count != 1:
            raise FleetError(f"a draft server needs the whole draft model in one shard, not stage "
                             f"{self.manifest.stage_index} of {self.manifest.stage_count}")
        self.access, self.delay_s = access, delay_ms / 1e3
        self.identity = draft_identity(self.manifest)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        try:
            self._listener = socket.create_server(parse_address(listen, "0.0.0.0"))
        except OSError as exc:
            raise FleetError(f"cannot listen on {listen}: {exc.strerror or exc}") from None
        host, port = self._listener.getsockname()[:2]
        self.address = f"{socket.gethostname() if host in ('0.0.0.0', '::') else host}:{port}"
        self._stop = threading.Event()
        self._serving = threading.Lock()  # one coordinator's streams at a time
        self._current: Link | None = None
        self.drafted = 0  # tokens drafted, all streams
        self.step_s = 0.0  # the time those drafts took

    def start(self) -> "DraftServer":
        threading.Thread(target=accept_loop, args=(self._listener, self._stop, self._authenticate, self._session,
                                                     "draft", self.log),
                         daemon=True, name="draft accept").start()
        return self

    def stop(self) -> None:
        super().stop()
        if self._current is not None:
            self._current.close()
        if self._serving.acquire(timeout=5.0):  # the session's loop has let go of the draft model
            self._serving.release()

    def _authenticate(self, conn: socket.socket) -> tuple[socket.socket, wire.Seal]:
        return authenticate_peer(conn, self.access.key, self.identity, self.access.tls)

    def _session(self, conn: socket.socket, seal: wire.Seal, peer: str) -> None:
        link = Link(conn, peer, seal, self.delay_s)
        previous, self._current = self._current, link
        if previous is not None:  # its session ends and lets go of the streams
            self.log(f"coordinator {peer} replaces {previous.peer}")
            previous.close()
        with self._serving:
            self.log(f"drafting for {peer}")
            try:
                self._serve(link)
            except OSError as exc:  # ConnectionError on receiving, a closed socket on sending
                self.log(f"coordinator {peer} gone: {exc}")
            except ProtocolError as exc:
                self.log(f"closing coordinator {peer}: {exc}")
            finally:
                link.close()
                self.log(f"coordinator {peer} left; {self.drafted} tokens drafted, "
                         f"{self.step_s * 1e3 / max(self.drafted, 1):.1f} ms each")

    def _serve(self, link: Link) -> None:
        texts: dict[int, DraftText] = {}
        turn = 0
        while not self._stop.is_set():
            frame = link.recv(0 if any(text.wants_step() for text in texts.values()) else 0.5)
            while frame is not None:  # every SYNC that arrived before the next step
                if frame.type == Msg.BYE:
                    return
                self._take(link, texts, frame)
                frame = link.recv(0)
            busy = sorted(s for s, text in texts.items() if text.wants_step())
            if not busy:
                continue
            stream = busy[turn % len(busy)]
            turn += 1
            text = texts[stream]
            started = time.perf_counter()
            drafts = text.step()
            if drafts:
                self.drafted += len(drafts)
                self.step_s += time.perf_counter() - started
                link.send(wire.drafts_frame(stream, text.epoch, len(text.tokens) - len(drafts), drafts))

    def _take(self, link: Link, texts: dict[int, DraftText], frame) -> None:
        if frame.type == Msg.PING:
            link.send(wire.Frame(Msg.PONG, frame.stream, frame.seq))
            return
        if frame.type != Msg.SYNC:
            raise ProtocolError(f"a draft server takes SYNC, not {frame.type.name}")
        (start, lead, fresh), tokens = wire.unpack_tokens(frame, 3, self.chain.spec.max_position)
        text = texts.get(frame.stream)
        if text is None:
            if len(texts) >= MAX_STREAMS:
                raise ProtocolError(f"more than {MAX_STREAMS} streams")
            text = texts[frame.stream] = DraftText(self.chain, frame.stream)
            text.seq.reset()
        ahead = text.sync(frame.seq, start, lead, bool(fresh), tokens)
        if ahead:
            link.send(wire.drafts_frame(frame.stream, frame.seq, len(text.told), ahead))
