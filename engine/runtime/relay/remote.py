"""The coordinator's side of the distributed pipeline: stage 0 in this process, the rest over TCP.

``RemoteChain`` has the same ``reset()/forward()`` as the in-process chain, so the generation
loop runs unchanged over it.  It dials the first remote stage (retrying until it is up), proves
the fleet key, and pings the chain until every stage answers; the ping carries the route, so
workers started without ``--next`` learn their successor from the coordinator.  Each forward runs
stage 0 locally, sends the activations on and waits for the RESULT under a deadline refreshed by
the workers' heartbeats: a dead or silent stage becomes a ``StageError`` naming it.

When every stage is paged the chain packs, as the in-process chain does: submitted rounds wait
until one is collected, then stage 0 runs them in one forward and one PACKED frame carries those
streams' rows down the chain, so a hop costs one trip for all of them.  The streams are packed into
up to ``depth`` groups that are in flight at once: while stage 1 computes one group, stage 0
computes the next, so the PCs of a split work at the same time instead of taking turns.  A group
goes as soon as fewer than ``depth`` are in flight; its size is the active streams' fair share,
which rebalances the groups as users come and go.  A prompt's chunk (``prompt_rows`` rows or more)
fills a forward by itself: in a pipeline it goes at once as a group of its own, not counted against
``depth``, so that stage 1 starts on the first prompt while stage 0 computes the next ones instead
of waiting for half of them.  Unless fixed, ``depth`` follows the rounds: a
round's trip (every stage's compute and the network's share) over the busiest computer's compute
is how many groups keep that computer busy.  Balanced stages on their own PCs want one group each;
stages that share one computer's compute turns (a local fleet), or a short stage 0 that only feeds
a PC holding the rest, want one group, whose rows share every read of the weights; a slow link
wants more groups, to hide its time.

A copy of the model whole on a node (``fed``) has no stage here: a ``Feeder`` stands in for stage 0,
holding no layers, and the token ids themselves travel to the node.  This process then computes
nothing for that copy, so it never waits for this computer's compute turns (a whole copy beside it
in this process would hold them for a whole forward each time).

A stage with a hot standby (``standbys``) has its input copied there (``engine.runtime.relay.mirror``):
by this chain for the first remote stage, by the stage before it for the others (the PING's route
names them).  ``reroute`` puts a standby in its stage's place and keeps every stream's state: each
stage's PONG says what its caches hold (``holds``), so a reply carries on from its next token.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import random
import time
from pathlib import Path

import numpy as np

from engine.config import FleetAccess, RelayOptions, ShardOptions
from engine.errors import FleetError, ShardError, StageError
from engine.manifest import layer_span, load_manifest
from engine.runtime.interfaces import Chain
from engine.runtime.relay.mirror import Mirror
from engine.runtime.stages.factory import open_stage
from engine.runtime.stages.output import Output
from engine.runtime.stages.packing import Part, as_part, check_parts, packs_of
from engine.runtime.stages.stage import compile_config
from engine.runtime.stages.turns import turns_identity
from engine.transport import wire
from engine.transport.link import Link, connect_successor
from engine.transport.wire import AuthError, Flag, Frame, Msg, PartHeader, ProtocolError


@dataclasses.dataclass
class _Round:
    """A submitted round: ``part`` while it waits to be packed, ``seq`` once it is on its way."""

    stream: int
    flags: Flag
    part: Part | None = None
    seq: int | None = None
    sent: float = 0.0
    error: BaseException | None = None

    @property
    def key(self) -> tuple[int, int | None]:
        return self.stream, self.seq


class Feeder:
    """Stage 0 of a chain whose every stage runs on workers: holds no layers, passes the token ids on
    and counts each stream's positions as a stage does.  Its manifest is the model's, as a stage
    -1 that ends at layer 0, so the worker holding layer 0 is its successor."""

    packs = True
    turns = None

    def __init__(self, folder: Path | str):
        self.folder = Path(folder)
        self.manifest = dataclasses.replace(load_manifest(self.folder), stage_index=-1, layers=(0, 0))
        self._length: dict[int, int] = {}

    def length(self, stream: int) -> int:
        return self._length.get(stream, 0)

    def reset(self, stream: int = 0) -> None:
        self._length[stream] = 0

    def keep(self, stream: int, slots: np.ndarray) -> None:
        self._length[stream] = len(slots)

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                stream: int = 0) -> np.ndarray:
        self._length[stream] = attention_mask.shape[1]
        return input_ids

    def forward_parts(self, parts: list[Part]) -> list[np.ndarray]:
        check_parts(parts, self.length)
        for p in parts:
            self._length[p.stream] = p.start + len(p.x)
        return [p.x for p in parts]


class _Trip:
    """What a round's trip costs, from the rounds collected: each stage's compute (smoothed), and the
    network's share, the least of the recent rounds' (a round that queued behind another group
    waited longer than the network made it).  Stages that take one computer's compute turns never
    compute at once: together they are one stage of the pipeline.  ``max_groups``: the most it ever
    says (``RelayOptions.max_groups``)."""

    WINDOW = 64

    def __init__(self, max_groups: int = RelayOptions.max_groups):
        self.max_groups = max_groups
        self.stage_ms: list[float] = []
        self.network_ms: collections.deque[float] = collections.deque(maxlen=self.WINDOW)

    def observe(self, stage_ms: list[float], network_ms: float) -> None:
        if len(stage_ms) != len(self.stage_ms):
            self.stage_ms = list(stage_ms)
        else:
            for i, ms in enumerate(stage_ms):
                self.stage_ms[i] += 0.1 * (ms - self.stage_ms[i])
        self.network_ms.append(network_ms)

    def groups(self, turns: list[str | None] | None = None) -> int | None:
        """The groups that keep the busiest computer busy (None before any round was measured);
        ``turns``: each stage's compute turns (``turns_identity``), None for a stage with its own cores."""
        if not self.stage_ms or max(self.stage_ms) <= 0:
            return None
        turns = list(turns or [])[:len(self.stage_ms)]
        computers = [shared if shared is not None else i for i, shared in enumerate(turns)]
        computers += range(len(computers), len(self.stage_ms))
        busy: dict[object, float] = {}
        for computer, ms in zip(computers, self.stage_ms):
            busy[computer] = busy.get(computer, 0.0) + ms
        trip = sum(self.stage_ms) + min(self.network_ms)
        return int(min(max(round(trip / max(busy.values())), 1), self.max_groups))


class RemoteChain(Chain):
    """A chain whose stage 0 runs here and whose other stages run on workers (the module's docstring)."""

    def __init__(self, stage0: Path | str, remotes: list[str], *, access: FleetAccess,
                 shard: ShardOptions = ShardOptions(), connect_timeout_s: float = 60.0, isolate: bool = False,
                 turns=None, local=None, depth: int | None = None, fed: bool = False,
                 standbys: list[str | None] | None = None, relay: RelayOptions = RelayOptions()):
        """``access``: the fleet key, TLS and deadline every link of the chain goes with; ``relay``: the
        groups it keeps in flight at most and the rows from which a prompt's chunk goes alone.
        ``shard``: how stage 0 is compiled (its device, the correctness mode every stage must run, the
        precision hint; its weights go unused here).
        ``local``: stage 0 already compiled (a broken chain's, which failover carries over): every
        stream it holds is forgotten, and it is not compiled again.  ``depth``: groups of packed
        streams in flight at once (default: as many as the measured rounds say keep the busiest
        computer busy, one per stage until rounds are measured).  ``fed``: every stage runs on the
        workers, from layer 0 (``Feeder``); ``stage0`` is then only where the model's manifest and
        tokenizer are read.  ``standbys``: each remote stage's hot standby's address (or None), in
        the order of ``remotes``."""
        if not remotes:
            raise FleetError("a remote chain needs the address of at least one worker")
        self.shard = shard
        if fed:
            self.local = Feeder(stage0)
        elif (local is not None and not isinstance(local, Feeder) and Path(local.folder) == Path(stage0)
              and local.device == shard.device):
            for stream in local.streams:
                local.reset(stream)
            self.local = local
        else:
            self.local = open_stage(Path(stage0), shard.device, compile_config(shard.mode, shard.precision),
                                    isolate=isolate, turns=turns)
        self.turns = self.local.turns
        self.manifest = self.local.manifest
        if not self.manifest.first:
            raise ShardError(f"{stage0} is stage {self.manifest.stage_index}; the coordinator runs stage 0")
        if self.manifest.last:
            raise ShardError(f"{stage0} holds the whole model: there is nothing for remote workers to run")
        self.spec = self.manifest.spec
        self.remotes = list(remotes)
        self.standbys = list(standbys or [None] * len(self.remotes))
        if len(self.standbys) != len(self.remotes):
            raise FleetError(f"{len(self.standbys)} standbys given for {len(self.remotes)} remote stages")
        self._mirror: Mirror | None = None
        self._new_standbys: list[tuple[int, str]] = []  # ``stand_by``'s, for the next reset to take up
        self._mirrored: set[int] = set()  # streams reset since the standbys last started taking copies
        self._drops_seen = 0
        self.access = access
        self.relay = relay
        self.connect_timeout_s = connect_timeout_s
        self.stages: list[dict] = []  # what each remote stage reported when the chain came up
        self._link: Link | None = None
        self.connections = 0  # links made so far: a new one reaches a worker that may have restarted
        self._silence = access.deadline_s
        self._ready = False
        self._in_flight: set[tuple[int, int]] = set()
        self._early: dict[tuple[int, int], Frame] = {}
        self._pending: list[_Round] = []
        # an uncollected reply -> the group it went in: (its id, whether it is a prompt's)
        self._groups: dict[tuple[int, int], tuple[int, bool]] = {}
        self._group_ids = itertools.count()
        if depth is not None and depth < 1:
            raise FleetError(f"a chain keeps at least one group of streams in flight, not {depth}")
        self._depth = depth
        self._trip = _Trip(relay.max_groups)
        self._turns: list[str | None] = []  # each stage's compute turns, once the chain is up
        self.most_in_flight = 0  # the most groups that were in flight at once (a pipeline fills up)
        self._seq = random.getrandbits(31)  # a fresh range, so a previous session's late replies never match
        self.connect()
        self._mirror_first()

    @property
    def first_folder(self) -> Path:
        return self.local.folder

    @property
    def paged(self) -> bool:
        """Whether any stage is paged (or static): then the whole chain rewinds by trimming."""
        return self.local.packs or any(stage.get("packs") for stage in self.stages)

    @property
    def packs(self) -> bool:
        """Whether every stage is paged (or static): then rounds of several streams travel in one frame."""
        return self.local.packs and bool(self.stages) and all(s.get("packs") for s in self.stages)

    @property
    def first_address(self) -> str:
        return self.remotes[0]

    def _fail(self, reason: str) -> StageError:
        if self._link is not None:
            self._link.close()
            self._link = None
        self._ready = False
        error = StageError(self.manifest.stage_index + 1, self.first_address, reason)
        self._abandon(error)
        return error

    def _abandon(self, error: StageError) -> None:
        """Every round in flight or waiting is given up (a caller's collect raises ``error``, or
        that the round was given up): a reply still on its way is dropped when it comes."""
        self._in_flight.clear()
        self._early.clear()
        self._groups.clear()
        for round_ in self._pending:
            round_.error = error
        self._pending = []

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        return self._seq

    # --- bring-up ------------------------------------------------------------------------------------

    def connect(self, timeout_s: float | None = None) -> None:
        """Dials the first worker and waits until the whole chain answers (or the connect timeout,
        or ``timeout_s``)."""
        timeout_s = self.connect_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        stage = self.manifest.stage_index + 1
        while self._link is None:
            try:
                self._link, peer_delay = connect_successor(self.first_address, self.access.key, self.manifest,
                                                           self.shard.mode, self.access.tls)
            except (AuthError, ProtocolError) as exc:
                raise StageError(stage, self.first_address, f"handshake failed: {exc}") from None
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise StageError(stage, self.first_address, f"not reachable ({exc.strerror or exc}) within "
                                     f"{timeout_s:.0f} s") from None
                time.sleep(0.2)
                continue
            self._silence = 0.75 * self.access.deadline_s + 2 * peer_delay
            self.connections += 1
        self._wait_ready(deadline)

    def _mirror_first(self) -> None:
        """Copies what this chain sends to the first remote stage to that stage's standby, if any."""
        if self.standbys[0] is not None and self._mirror is None:
            self._mirror = Mirror(self.standbys[0], access=self.access, manifest=self.manifest,
                                  mode=self.shard.mode)

    def reroute(self, stage: int, address: str, timeout_s: float | None = None) -> None:
        """Puts the worker at ``address`` (the stage's hot standby) in the place of stage ``stage``
        and waits until the chain answers again; every stage keeps its streams' caches (what each
        holds: ``holds``).  Raises StageError when the chain does not come up in ``timeout_s`` (by
        default the connect timeout)."""
        timeout_s = self.connect_timeout_s if timeout_s is None else timeout_s
        index = stage - self.manifest.stage_index - 1
        if not 0 <= index < len(self.remotes):
            raise FleetError(f"stage {stage} is not a remote stage of this chain")
        self.remotes[index], self.standbys[index] = address, None
        if index == 0:
            mirror, self._mirror = self._mirror, None
            if mirror is not None:
                mirror.handover()  # before this chain's own connection: the standby applies every copy first
            if self._link is not None:
                self._link.close()
                self._link = None
        self._abandon(StageError(stage, address, "its round was given up when the chain was re-routed"))
        self._ready = False
        if self._link is None:
            self.connect(timeout_s)
        else:
            self._wait_ready(time.monotonic() + timeout_s)

    def stand_by(self, stage: int, address: str) -> None:
        """Names the worker at ``address`` stage ``stage``'s hot standby (a node that came back):
        the chain takes it up at its next ``reset``, on its own thread, and a stream is mirrored from
        its next reset on.  May be called from any thread."""
        self._new_standbys.append((stage, address))

    def _take_up_standbys(self) -> None:
        while self._new_standbys:
            stage, address = self._new_standbys.pop(0)
            index = stage - self.manifest.stage_index - 1
            if 0 <= index < len(self.remotes) and self.remotes[index] != address:
                self.standbys[index] = address
                self._mirrored.clear()
                if index == 0:
                    self._mirror_first()
                else:
                    self._ready = False  # the next ping tells the stage before it

    def mirrored(self, stream: int) -> bool:
        """Whether every standby of the chain has had copies of ``stream`` since it was last reset:
        only then may a new reply reuse the stream's cache (the prefix cache) and still be one a
        standby can take over; otherwise the reply starts the stream anew."""
        self._take_up_standbys()
        if not any(self.standbys):
            return True
        drops = self._mirror.drops if self._mirror is not None else 0
        if drops != self._drops_seen:  # the copies were cut off since: a stream may lack some
            self._drops_seen = drops
            self._mirrored.clear()
        return stream in self._mirrored

    def holds(self, stream: int, positions: int) -> bool:
        """Whether every remote stage's cache of ``stream`` holds at least its first ``positions``
        KV slots, as their PONGs said when the chain last came up (``reroute``)."""
        return all(int(s.get("streams", {}).get(str(stream), 0)) >= positions for s in self.stages)

    def ping(self) -> list[dict]:
        """One trip down the chain and back; returns what every remote stage reports of itself."""
        doc = {"route": self.remotes[1:]}
        if any(self.standbys[1:]):
            doc["standbys"] = self.standbys[1:]
        frame = wire.control(Msg.PING, doc, 0, self._next_seq())
        self._send(frame)
        reply = self._await((frame.stream, frame.seq), Msg.PONG)
        stages = reply.json().get("stages", [])
        if not isinstance(stages, list) or not all(isinstance(s, dict) for s in stages):
            raise self._fail("sent a malformed description of the chain")
        return stages

    def _wait_ready(self, deadline: float) -> None:
        while True:
            try:
                self.stages = self.ping()
                break
            except StageError as exc:
                if self._link is None or time.monotonic() > deadline or not exc.transient:
                    raise
                time.sleep(0.2)
        self._check_stages()
        self._turns = [turns_identity(self.local.turns), *(stage.get("turns") for stage in self.stages)]
        self._ready = True

    def _check_stages(self) -> None:
        end = self.manifest.layers[1]
        for expected, info in enumerate(self.stages, start=self.manifest.stage_index + 1):
            layers = info.get("layers", [None, None])
            if info.get("stage") != expected or layers[0] != end:
                held = "no layers" if None in layers else layer_span(*layers)
                raise self._fail(f"the chain is not contiguous: stage {info.get('stage')} at {info.get('address')} "
                                 f"holds {held}, expected stage {expected} from layer {end}")
            end = layers[1]
        if end != self.spec.num_layers:
            raise self._fail(f"the chain holds {layer_span(0, end)} of the model's {self.spec.num_layers}: give the "
                             f"rest of the route")

    # --- the chain interface -------------------------------------------------------------------------

    def reset(self, stream: int = 0) -> None:
        """Starts a new sequence on every stage; reconnects first if the chain broke since."""
        self._take_up_standbys()
        if self._link is None:
            self.connect()
        elif not self._ready:
            self._wait_ready(time.monotonic() + self.connect_timeout_s)
        self._flush_stream(stream)
        self.local.reset(stream)
        self._send(Frame(Msg.RESET, stream))
        self._mirrored.add(stream)

    def keep(self, stream: int, slots: np.ndarray) -> None:
        """Every stage keeps only these KV slots; ordered before the next FORWARD, so no reply."""
        self._flush_stream(stream)
        self.local.keep(stream, slots)
        self._send(wire.keep_frame(stream, slots))

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                flags: Flag = Flag.NONE, stream: int = 0) -> Output:
        return self.collect(self.submit(input_ids, attention_mask, position_ids, flags, stream))

    def submit(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
               flags: Flag = Flag.NONE, stream: int = 0) -> _Round:
        """Runs stage 0 and sends the activations on (packing: queues the round to go with the
        others); ``collect`` waits for the result.  Several streams may be in flight at once
        (micro-batching): one computes here while others travel."""
        if self.packs:
            self._flush_stream(stream)
            part = as_part(input_ids, attention_mask, position_ids, stream, self.local.length(stream),
                           bool(flags & Flag.ALL_POSITIONS))
            self._pending.append(_Round(stream, flags, part))
            return self._pending[-1]
        start = time.perf_counter()
        hidden = self.local.forward(input_ids, attention_mask, position_ids, stream)
        local_ms = (time.perf_counter() - start) * 1e3
        round_ = _Round(stream, flags, seq=self._next_seq())
        self._send(wire.forward_frame(stream, round_.seq, hidden, attention_mask.astype(np.uint8), position_ids,
                                      np.array([local_ms], np.float32), flags),
                   group=(next(self._group_ids), False))
        round_.sent = time.perf_counter()
        return round_

    def flush(self) -> None:
        """Stage 0 runs every waiting round now and sends it on, one group, whatever ``depth`` says."""
        if self._pending:
            self._flush()

    def _flush_stream(self, stream: int) -> None:
        """Sends what waits if a round of ``stream`` does: its next step must come after it."""
        if any(r.stream == stream for r in self._pending):
            self._flush()

    @property
    def depth(self) -> int:
        """Groups of streams kept in flight: fixed, or what the measured rounds ask for."""
        if self._depth is not None:
            return self._depth
        return self._trip.groups(self._turns) or self.manifest.stage_count

    @property
    def groups_in_flight(self) -> int:
        """Groups in flight that count against ``depth``: a prompt's does not."""
        return len({group for group in self._groups.values() if not group[1]})

    def _flush(self, count: int | None = None, prompt: bool = False) -> None:
        """Stage 0 runs the first ``count`` waiting rounds (all by default), one group in flight, in
        forwards of at most ``PACK_ROWS`` rows (``packs_of``); one PACKED frame a forward takes them on.
        However many frames a group's rows take (long prompts), it counts once against ``depth``;
        ``prompt``: a prompt's chunk, which does not count."""
        count = len(self._pending) if count is None else count
        pending, self._pending = self._pending[:count], self._pending[count:]
        forwards = packs_of(pending, lambda r: len(r.part.x))
        group = next(self._group_ids), prompt
        for i, rounds in enumerate(forwards):
            try:
                self._forward_packed(rounds, group)
            except BaseException as exc:
                for later in forwards[i + 1:]:
                    for r in later:
                        r.error = exc
                raise

    def _forward_packed(self, pending: list[_Round], group: tuple[int, bool]) -> None:
        start = time.perf_counter()
        try:
            hidden = self.local.forward_parts([r.part for r in pending])
        except BaseException as exc:
            for r in pending:
                r.error = exc
            raise
        local_ms = (time.perf_counter() - start) * 1e3
        heads = []
        for r in pending:
            r.seq = self._next_seq()
            heads.append(PartHeader(r.stream, r.seq, r.part.start, len(r.part.x), r.flags))
        frame = wire.packed_frame(np.concatenate(hidden), heads, np.concatenate([r.part.positions for r in pending]),
                                  np.array([local_ms], np.float32))
        self._send(frame, [r.key for r in pending], group)
        for r in pending:
            r.sent, r.part = time.perf_counter(), None

    def collect(self, round_: _Round) -> Output:
        """Waits for a submitted round's RESULT (sending the round first if it still waits to be packed)."""
        if round_.seq is None and round_.error is None:
            self._flush()
        if round_.error is not None:
            raise round_.error
        reply = self._await(round_.key, Msg.RESULT)
        wait_ms = (time.perf_counter() - round_.sent) * 1e3
        try:
            tokens, probs, logits, candidates, stage_ms = wire.unpack_result(reply, round_.flags)
        except ProtocolError as exc:
            raise self._fail(f"sent a malformed frame ({exc})") from None
        stage_ms = stage_ms.tolist()
        out = Output(tokens, probs, logits, candidates, stage_ms, network_ms=max(wait_ms - sum(stage_ms[1:]), 0.0))
        self._trip.observe(stage_ms, out.network_ms)
        return out

    def first_ready(self, rounds: list[_Round]) -> int:
        """Waits until one of these rounds' results is here; returns its index (the earliest
        submitted when several are).  Rounds waiting to be packed go, a fair share at a time, while
        fewer than ``depth`` groups are in flight (or none of these travels); in a pipeline, a
        prompt's chunk goes at once, alone."""
        while True:
            for i, r in enumerate(rounds):
                if r.error is not None or (r.seq is not None and r.key in self._early):
                    return i
            travelling = any(r.seq is not None and r.key in self._in_flight for r in rounds)
            if (prompt := self._waiting_prompt()) is not None:
                self._pending.insert(0, self._pending.pop(prompt))
                self._flush(1, prompt=True)
                continue
            if self._pending and (not travelling or self.groups_in_flight < self.depth):
                self._flush(self._share())
                continue
            if not travelling:
                raise FleetError("none of these rounds was submitted to this chain")
            self._stash(self._receive())

    def _waiting_prompt(self) -> int | None:
        """Where the first waiting round of ``prompt_rows`` rows or more is, if groups are pipelined."""
        if self._pending and self.depth > 1:
            return next((i for i, r in enumerate(self._pending) if len(r.part.x) >= self.relay.prompt_rows), None)
        return None

    def _share(self) -> int:
        """How many waiting rounds go in the next group: the active streams spread evenly over the
        ``depth`` groups (those in flight and those to come)."""
        active = len(self._pending) + len(self._groups)
        return min(len(self._pending), math.ceil(active / self.depth))

    def _stash(self, reply: Frame | None) -> None:
        """Keeps a reply for its request's ``collect``; drops a heartbeat (None) or a late reply to a
        request we already gave up on."""
        if reply is not None and (reply.stream, reply.seq) in self._in_flight:
            self._early[reply.stream, reply.seq] = reply

    def _send(self, frame: Frame, keys: list[tuple[int, int]] | None = None,
              group: tuple[int, bool] | None = None) -> None:
        """``keys``: the replies the frame asks for, when not the one its header names; ``group``: the
        group in flight a FORWARD or PACKED frame's rounds belong to (its id, and whether a prompt's)."""
        if self._link is None:
            raise self._fail("not connected (call reset() to reconnect)")
        if frame.type in (Msg.FORWARD, Msg.PACKED, Msg.PING):
            sent = keys or [(frame.stream, frame.seq)]
            self._in_flight.update(sent)
            if frame.type != Msg.PING:
                self._groups.update(dict.fromkeys(sent, group))
                self.most_in_flight = max(self.most_in_flight, len(set(self._groups.values())))
        parts = wire.encode_parts(frame)
        if self._mirror is not None:
            self._mirror.send(frame, parts)
        try:
            self._link.send_parts(parts)
        except OSError as exc:
            raise self._fail(f"connection lost ({exc})") from None

    def _await(self, key: tuple[int, int], expected: Msg) -> Frame:
        """Waits for the reply to the request ``key`` names; replies to other requests in flight are
        kept for their own ``collect``.  Heartbeats keep the deadline from expiring."""
        while key not in self._early:
            if key not in self._in_flight:
                raise StageError(self.manifest.stage_index + 1, self.first_address,
                                 "its round was given up after another round failed")
            self._stash(self._receive())
        reply = self._early.pop(key)
        self._in_flight.discard(key)
        self._groups.pop(key, None)
        if reply.type == Msg.ERROR:
            doc = reply.json()
            self._ready = False  # re-check the whole chain before the next request
            error = StageError(int(doc.get("stage", -1)), str(doc.get("address", "?")),
                               str(doc.get("reason", "failed")), bool(doc.get("transient")))
            # every caller gives up its other rounds too (or replays them on a new chain): left in
            # flight, their groups would hold back the pipeline for as long as the link lives
            self._abandon(error)
            raise error
        if reply.type != expected:
            raise self._fail(f"answered with {reply.type.name}, expected {expected.name}")
        return reply

    def _receive(self) -> Frame | None:
        """The next reply from stage 1 (None for a heartbeat); raises StageError on silence or loss."""
        try:
            reply = self._link.recv(self._silence)
        except ConnectionError:
            raise self._fail("connection lost (the worker stopped?)") from None
        except ProtocolError as exc:
            raise self._fail(f"sent a malformed frame ({exc})") from None
        if reply is None:
            raise self._fail(f"no reply for {self._silence:.1f} s (stalled)")
        return None if reply.type == Msg.ALIVE else reply

    def close(self) -> None:
        if self._mirror is not None:
            self._mirror.close()
        if self._link is not None:
            try:
                self._link.send(Frame(Msg.BYE))
            except OSError:
                pass
            self._link.close()
            self._link = None
