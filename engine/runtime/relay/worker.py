"""The stage worker: serves one shard on a TCP port as a link of the daisy chain.

A worker accepts one upstream peer (the coordinator or the previous stage) after the fleet-key
handshake, dials its successor and keeps retrying until it is up, and per request runs its shard
and passes the activations on.  The final stage turns logits into top-1 tokens and sends the RESULT
back; results travel hop by hop over the same connections.

Deadlines: while a worker owes its upstream a reply it sends ALIVE heartbeats, and while its
successor owes it one it watches for them.  A successor that dies or goes silent turns, within
the deadline, into an ERROR naming that stage and its address; the worker then redials it, so the
chain serves the next request once the stage is back.  Anything malformed a peer sends costs that
peer its connection (before the handshake) or an ERROR reply (after it), never the process.

A hot standby is a worker whose upstream is a mirror (``engine.runtime.relay.mirror``): a session
opened with MIRROR, whose frames it applies to its caches without answering or passing anything on.
When the stage's sender connects to it for real (a failover's switch), it first applies what the
mirror still has queued; a mirror that ends without its BYE leaves no stream behind.  A worker that
serves an upstream ignores copies.  Each stage's PONG says how many positions each stream's cache
holds, so that a coordinator knows which streams a switch kept.  A worker mirrors what it sends on
to the standby of the stage after it when the coordinator's route names one.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from engine.config import FleetAccess, RelayOptions, ShardOptions
from engine.errors import FleetError, ShardError
from engine.manifest import load_manifest
from engine.runtime.relay.mirror import Mirror
from engine.runtime.stages.factory import open_stage
from engine.runtime.stages.output import select
from engine.runtime.stages.packing import Part
from engine.runtime.stages.stage import compile_config
from engine.runtime.stages.turns import turns_identity
from engine.transport import wire
from engine.transport.link import Link, Listening, accept_loop, authenticate_peer, connect_successor, parse_address
from engine.transport.mesh import Mesh, MeshError
from engine.transport.wire import AuthError, Flag, Frame, Msg, ProtocolError, Seal

MAX_STREAMS = 64
MIRROR_DRAIN_S = 10.0  # how long a standby taking over applies the copies it still has before serving
TOKEN_COUNT_S = 5.0  # how often a serving worker counts the tokens it served (the tray's live tally)
TOKENS = "tokens"  # the name its count is reported under (``engine.launch.report``)


class RequestError(FleetError):
    """An authenticated peer sent a well-formed frame this stage (or ``stage`` at ``address``)
    cannot serve; ``transient`` when it will pass (a successor being redialed)."""

    def __init__(self, reason: str, stage: int | None = None, address: str | None = None,
                 transient: bool = False):
        super().__init__(reason)
        self.stage = stage
        self.address = address
        self.transient = transient


def answer(logits: np.ndarray, stream: int, seq: int, flags: Flag, stage_ms: np.ndarray) -> Frame:
    """The RESULT a last stage sends back for one stream: what ``flags`` ask of its ``logits``
    ``[1, q, vocab]``, and no more."""
    out = select(logits, flags)
    return wire.result_frame(stream, seq, flags, out.tokens, stage_ms, out.probs, out.logits, out.candidates)


class Worker(Listening):
    """One stage of a chain served on a TCP port (the module's docstring)."""

    def __init__(self, folder: Path | str, listen: str, next_address: str | None = None, *,
                 access: FleetAccess, shard: ShardOptions = ShardOptions(), delay_ms: float = 0.0,
                 log: Callable[[str], None] | None = None,
                 max_frame: int = wire.DEFAULT_MAX_FRAME, isolate: bool = False, turns=None,
                 counted: Callable[[int], None] | None = None, relay: RelayOptions = RelayOptions()):
        """``folder``: the shard it serves.  ``access``: the fleet key, TLS and deadline every link of the
        worker goes with; ``shard``: how the shard is compiled (this stage's device, the correctness mode
        every stage must run, the precision hint; its weights go unused here).  ``relay``: how often it
        sends ALIVE while it owes a reply and checks its successor's silence.  ``counted``:
        told the tokens served so far, whenever they are counted (``_count_tokens``).
        A tensor-parallel rank (``engine.transport.mesh``) other than 0 also listens, on a port of
        its own beside ``listen``'s host, for rank 0's connection."""
        manifest = load_manifest(Path(folder))  # its files hashed once, for the mesh and the stage
        if manifest.rank == 0 and manifest.ranks > 1:
            raise ShardError(f"{folder} is tensor-parallel rank 0 of {manifest.ranks}: it runs in the coordinator "
                             f"(`fleet generate --shards` it, with --remote naming the other ranks' workers)")
        self.mesh = Mesh(manifest.rank, manifest.ranks) if manifest.ranks > 1 else None
        self.runner = open_stage(Path(folder), shard.device, compile_config(shard.mode, shard.precision), manifest,
                                 isolate=isolate, turns=turns, mesh=self.mesh)
        m = self.manifest = self.runner.manifest
        self.access = access
        self.relay = relay
        self.delay_s = delay_ms / 1e3
        self.max_frame = max_frame
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.identity = {"role": "stage", "fingerprint": m.fingerprint, "stage": m.stage_index,
                         "first_layer": m.layers[0], "mode": shard.mode, "delay_ms": delay_ms}
        self.max_length = m.spec.max_position
        self.hidden = m.spec.hidden_size

        try:
            self._listener = socket.create_server(parse_address(listen, "0.0.0.0"))
        except OSError as exc:
            raise FleetError(f"cannot listen on {listen}: {exc.strerror or exc}") from None
        host, port = self._listener.getsockname()[:2]
        self._mesh_listener = None
        if self.mesh is not None:
            self._mesh_listener = socket.create_server((host, 0))
            self.mesh.listen(self._mesh_listener, access.key, m.fingerprint, tls=access.tls, log=self.log)
        # what peers and error messages call this worker: a wildcard bind is shown as the host name
        self.address = f"{socket.gethostname() if host in ('0.0.0.0', '::') else host}:{port}"
        self._fixed_next = next_address is not None
        self._next = next_address
        self._stop = threading.Event()
        self._lock = threading.Lock()
        # One frame at a time, and only from the current upstream: a replaced session may still hold
        # frames its peer sent before giving up on it, and they must not touch the new session's KV.
        self._serving = threading.Lock()
        self._upstream: Link | None = None
        self._downstream: Link | None = None
        self._down_ready = threading.Event()
        self._down_silence = 0.0
        self._down_last_rx = 0.0
        self._down_reason = "not connected yet"
        self._owed: set[tuple[int, int]] = set()  # requests we still owe upstream a reply for
        self._outstanding: set[tuple[int, int]] = set()  # requests the successor owes us
        self._mirror_link: Link | None = None  # the copies this standby is sent, while it stands by
        self._mirror_done = threading.Event()  # no mirror session is being applied
        self._mirror_done.set()
        self._mirror: Mirror | None = None  # the copies this worker sends the next stage's standby
        self._masks: dict[int, np.ndarray] = {}
        self._kv_length: dict[int, int] = {}
        self.tokens = 0  # positions (tokens) this stage has run for its upstream
        self._counted = (0, time.monotonic())  # tokens already logged ("served N tokens"), and when
        self.counted = counted or (lambda tokens: None)

    # --- life cycle --------------------------------------------------------------------------------

    def describe(self) -> dict:
        m = self.manifest
        mesh = self._mesh_listener.getsockname()[1] if self._mesh_listener is not None else None
        return {"stage": m.stage_index, "layers": list(m.layers), "rank": m.rank, "mesh": mesh,
                "address": self.address, "device": self.runner.device, "delay_ms": self.delay_s * 1e3,
                "host": socket.gethostname(), "packs": self.runner.packs, "turns": turns_identity(self.runner.turns),
                "streams": {str(stream): n for stream, n in dict(self._kv_length).items()}}

    def start(self) -> "Worker":
        for target, name in ((self._accept_loop, "accept"), (self._heartbeat_loop, "heartbeat"),
                             (self._downstream_loop, "downstream")):
            threading.Thread(target=target, daemon=True, name=f"worker {name}").start()
        return self

    def stop(self) -> None:
        super().stop()
        if self.mesh is not None:
            self.mesh.close()
            self._mesh_listener.close()
        if self._mirror is not None:
            self._mirror.close()
        for link in (self._upstream, self._downstream, self._mirror_link):
            if link is not None:
                link.close()

    # --- upstream: accept, authenticate, serve -----------------------------------------------------

    def _accept_loop(self) -> None:
        accept_loop(self._listener, self._stop, self._authenticate, self._session, "upstream", self.log)

    def _authenticate(self, conn: socket.socket) -> tuple[socket.socket, Seal]:
        return authenticate_peer(conn, self.access.key, self.identity, self.access.tls)

    def _session(self, conn: socket.socket, seal: Seal, peer: str) -> None:
        link = Link(conn, peer, seal, self.delay_s, self.max_frame)
        try:
            frame = link.recv()
        except (ConnectionError, ProtocolError) as exc:
            self.log(f"closing upstream {peer}: {exc}")
            link.close()
            return
        if frame.type == Msg.MIRROR:
            self._mirror_session(link, peer)
            return
        if not self._mirror_done.wait(MIRROR_DRAIN_S):
            self.log(f"the copies from {self._mirror_link.peer if self._mirror_link else '?'} are not all "
                     f"applied after {MIRROR_DRAIN_S:.0f} s: their streams are not taken over")
            self._end_mirror(None)
        with self._lock:
            previous, self._upstream = self._upstream, link
            self._owed.clear()
        if previous is not None:
            self.log(f"upstream {peer} replaces {previous.peer}")
            previous.close()
        self.log(f"serving upstream {peer}")
        try:
            while not self._stop.is_set():
                if frame.type == Msg.BYE:
                    break
                with self._serving:
                    if self._upstream is not link:
                        break
                    self._dispatch(link, frame)
                frame = link.recv()
        except ConnectionError as exc:
            self.log(f"upstream {peer} gone: {exc}")
        except ProtocolError as exc:
            self.log(f"closing upstream {peer}: {exc}")
        finally:
            link.close()
            with self._lock:
                if self._upstream is link:
                    self._upstream = None
            self.log(f"upstream {peer} left")
            self._count_tokens(force=True)

    def _mirror_session(self, link: Link, peer: str) -> None:
        """A sender's copies of this stage's input, applied to the caches and never answered.  A
        standby holds only what its current copies gave it: the streams it held before are forgotten."""
        self._end_mirror(None)
        with self._serving:
            self._drop_copies()
            with self._lock:
                self._mirror_link = link
                self._mirror_done.clear()
        self.log(f"standing by: {peer} sends copies of this stage's input")
        handed = False
        try:
            while not self._stop.is_set():
                frame = link.recv()
                if frame.type == Msg.BYE:
                    handed = True
                    break
                with self._serving:
                    if self._mirror_link is not link:
                        break
                    self._apply_copy(frame)
        except (ConnectionError, ProtocolError) as exc:
            self.log(f"copies from {peer} ended: {exc}")
        finally:
            self._end_mirror(link, kept=handed)

    def _end_mirror(self, link: Link | None, kept: bool = False) -> None:
        """Ends mirror session ``link`` (None: whichever runs); unless ``kept`` (its sender handed
        over), the streams it filled are forgotten: one may lack a copy."""
        with self._serving:
            with self._lock:
                current = self._mirror_link
                if current is None or (link is not None and current is not link):
                    return
                self._mirror_link = None
            current.close()
            if not kept:
                self._drop_copies()
            self._mirror_done.set()

    def _drop_copies(self) -> None:
        """Forgets every stream, unless an upstream is being served: a standby's streams are its copies'."""
        if self._upstream is None:
            for stream in list(self._kv_length):
                self._forget(stream)

    def _forget(self, stream: int) -> None:
        self.runner.reset(stream)
        self._kv_length.pop(stream, None)
        self._masks.pop(stream, None)

    def _apply_copy(self, frame: Frame) -> None:
        """Applies a mirrored frame to the caches (a worker serving an upstream ignores it); a stream
        whose copy cannot be applied is forgotten, never taken over half-filled."""
        if self._upstream is not None:
            return
        streams = [frame.stream]
        try:
            if frame.type == Msg.FORWARD:
                self._forward(None, frame, copy=True)
            elif frame.type == Msg.PACKED:
                packed = wire.unpack_packed(frame)
                streams = [h.stream for h in packed[1]]
                self._forward_packed(None, *packed, copy=True)
            elif frame.type == Msg.RESET:
                self._reset(frame.stream, copy=True)
            elif frame.type == Msg.KEEP:
                self._keep(frame, copy=True)
        except (RequestError, ProtocolError, ShardError, RuntimeError, MeshError):
            for stream in streams:
                self._forget(stream)

    def _count_tokens(self, force: bool = False) -> None:
        """Logs the tokens served since the last count, at most every ``TOKEN_COUNT_S``, and tells
        ``counted`` the total (a ``fleet worker`` process reports it to its agent, whose status the
        tray worker adds up into its live tally)."""
        counted, when = self._counted
        now = time.monotonic()
        if self.tokens > counted and (force or now - when >= TOKEN_COUNT_S):
            self._counted = (self.tokens, now)
            self.log(f"served {self.tokens - counted} tokens")
            self.counted(self.tokens)

    def _reply(self, link: Link, frame: Frame) -> None:
        with self._lock:
            self._owed.discard((frame.stream, frame.seq))
        try:
            link.send(frame)
        except OSError:
            link.close()

    def _error(self, link: Link, frame: Frame, reason: str, stage: int | None = None,
               address: str | None = None, transient: bool = False) -> None:
        doc = {"stage": self.manifest.stage_index if stage is None else stage,
               "address": address or self.address, "reason": reason, "transient": transient}
        self._reply(link, wire.control(Msg.ERROR, doc, frame.stream, frame.seq))

    def _dispatch(self, link: Link, frame: Frame) -> None:
        """Serves one frame from upstream; what it cannot serve is answered with an ERROR per request."""
        keys = [(frame.stream, frame.seq)]
        if frame.type == Msg.PACKED:
            try:
                packed = wire.unpack_packed(frame)
            except ProtocolError as exc:
                self._error(link, frame, str(exc))
                return
            keys = [(p.stream, p.seq) for p in packed[1]]
        if frame.type in (Msg.FORWARD, Msg.PACKED, Msg.PING):
            with self._lock:
                self._owed.update(keys)
        try:
            if frame.type == Msg.FORWARD:
                self._forward(link, frame)
            elif frame.type == Msg.PACKED:
                self._forward_packed(link, *packed)
            elif frame.type == Msg.RESET:
                self._reset(frame.stream)
            elif frame.type == Msg.KEEP:
                self._keep(frame)
            elif frame.type == Msg.PING:
                self._ping(link, frame)
            else:
                raise RequestError(f"unexpected {frame.type.name} frame")
        except RequestError as exc:
            failure = exc
        except (ProtocolError, ShardError) as exc:  # ShardError: a paged stage given a mask with holes...
            failure = RequestError(str(exc))
        except (RuntimeError, MeshError) as exc:  # OpenVINO refused the request, or a rank's exchange failed
            failure = RequestError(f"inference failed: {exc}")
        else:
            return
        for stream, seq in keys:
            self._error(link, Frame(frame.type, stream, seq), str(failure), failure.stage, failure.address,
                        failure.transient)

    def _reset(self, stream: int, copy: bool = False) -> None:
        if stream in self._kv_length:
            self.runner.reset(stream)
            self._kv_length[stream] = 0
        if not copy:
            self._send_down(Frame(Msg.RESET, stream), track=False)

    def _keep(self, frame: Frame, copy: bool = False) -> None:
        slots = wire.unpack_keep(frame, self._kv_length.get(frame.stream, 0))
        self.runner.keep(frame.stream, slots)
        self._kv_length[frame.stream] = len(slots)
        if not copy:
            self._send_down(wire.keep_frame(frame.stream, slots), track=False)

    def _check_forward(self, frame: Frame) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """A FORWARD's tensors (``wire.unpack_forward``), checked to fit this stage and the stream's cache."""
        x, mask, pos, stage_ms = wire.unpack_forward(frame)
        self._check_rows(x, 1, "activations")
        q = x.shape[1]
        past = self._kv_length.get(frame.stream, 0)
        if mask.shape != (1, past + q):
            raise RequestError(f"attention mask {mask.shape} {mask.dtype} does not cover the {past} cached "
                               f"and {q} new positions of stream {frame.stream}")
        if past + q > self.max_length or pos.min() < 0 or pos.max() >= self.max_length:
            raise RequestError(f"positions beyond the context of {self.max_length}")
        self._check_streams([frame.stream])
        return x, mask, pos, stage_ms

    def _check_rows(self, x: np.ndarray, batch: int, what: str) -> None:
        """Raises unless ``x`` is what this stage takes: token ids at the first stage, else hidden
        states, after ``batch`` leading axes (1 in a FORWARD, none in a PACKED frame)."""
        if self.runner.first:
            ok = x.dtype == np.int64 and x.ndim == batch + 1
        else:
            ok = x.dtype == np.float32 and x.ndim == batch + 2 and x.shape[-1] == self.hidden
        if not ok:
            raise RequestError(f"{what} of shape {x.shape} {x.dtype} do not fit stage "
                               f"{self.manifest.stage_index} (hidden size {self.hidden})")

    def _check_streams(self, streams: list[int]) -> None:
        if len(set(self._kv_length) | set(streams)) > MAX_STREAMS:
            raise RequestError(f"more than {MAX_STREAMS} streams")

    def _forward(self, link: Link | None, frame: Frame, copy: bool = False) -> None:
        """``copy``: a mirrored frame (a standby's): the caches take it in, nothing is answered or sent on."""
        x, mask, pos, stage_ms = self._check_forward(frame)
        stream = frame.stream
        buf = self._masks.get(stream)
        if buf is None:
            buf = self._masks[stream] = np.zeros((1, self.max_length), np.int64)
        length = mask.shape[1]
        buf[0, :length] = mask[0]
        if not copy and not self.runner.last and not self._down_ready.is_set():
            raise self._down_missing()
        start = time.perf_counter()
        y = self.runner.forward(x, buf[:, :length], pos, stream, last_only=not frame.flags & Flag.ALL_POSITIONS)
        self._kv_length[stream] = length
        if copy:
            return
        self.tokens += pos.size
        self._count_tokens()
        timings = np.append(stage_ms, np.float32((time.perf_counter() - start) * 1e3))
        if self.runner.last:
            self._reply(link, answer(y, stream, frame.seq, frame.flags, timings))
        elif not self._send_down(wire.forward_frame(stream, frame.seq, y, mask, pos, timings, frame.flags)):
            self._error(link, frame, "connection lost", self.manifest.stage_index + 1, self._next, True)

    def _forward_packed(self, link: Link | None, x: np.ndarray, heads: list[wire.PartHeader], pos: np.ndarray,
                        stage_ms: np.ndarray, copy: bool = False) -> None:
        """Every stream's rows in one forward of a paged stage; one PACKED frame on, or one RESULT
        per stream back (``copy``: neither, as ``_forward``)."""
        if not self.runner.packs:
            raise RequestError(f"stage {self.manifest.stage_index} is stateful: it takes one stream per FORWARD")
        self._check_rows(x, 0, "packed rows")
        if pos.min() < 0 or pos.max() >= self.max_length or any(h.start + h.q > self.max_length for h in heads):
            raise RequestError(f"positions beyond the context of {self.max_length}")
        self._check_streams([h.stream for h in heads])
        if not copy and not self.runner.last and not self._down_ready.is_set():
            raise self._down_missing()
        begins = np.cumsum([0] + [h.q for h in heads])
        parts = [Part(h.stream, x[a:b], h.start, h.q if h.flags & Flag.ALL_POSITIONS else 1, pos[a:b])
                 for h, a, b in zip(heads, begins, begins[1:])]
        start = time.perf_counter()
        outs = self.runner.forward_parts(parts)
        for h in heads:
            self._kv_length[h.stream] = h.start + h.q
        if copy:
            return
        self.tokens += len(pos)
        self._count_tokens()
        timings = np.append(stage_ms, np.float32((time.perf_counter() - start) * 1e3))
        if self.runner.last:
            for h, logits in zip(heads, outs):
                self._reply(link, answer(logits[None], h.stream, h.seq, h.flags, timings))
            return
        frame = wire.packed_frame(np.concatenate(outs), heads, pos, timings)
        if not self._send_down(frame, keys=[(h.stream, h.seq) for h in heads]):
            raise RequestError("connection lost", self.manifest.stage_index + 1, self._next, True)

    def _ping(self, link: Link, frame: Frame) -> None:
        """Readiness check from the coordinator; its ``route`` names the stages after this one, and
        its ``standbys`` their hot standbys (an address or null each)."""
        doc = frame.json()
        route, standbys = doc.get("route", []), doc.get("standbys", [])
        if not isinstance(route, list) or not all(isinstance(a, str) for a in route):
            raise RequestError("malformed route")
        if (not isinstance(standbys, list) or len(standbys) > len(route)
                or not all(a is None or isinstance(a, str) for a in standbys)):
            raise RequestError("malformed standbys")
        if not self.runner.last:
            self._mirror_to(standbys[0] if standbys else None, route[0] if route else None)
        if self.runner.last:
            if route:
                raise RequestError(f"this is the last stage, but the route continues to {route}")
            self._reply(link, wire.control(Msg.PONG, {"stages": [self.describe()]}, frame.stream, frame.seq))
            return
        if route and route[0] != self._next:
            if self._fixed_next:
                raise RequestError(f"this stage forwards to {self._next} (--next), not {route[0]}")
            self.log(f"next stage set to {route[0]} by the coordinator")
            with self._lock:
                self._next = route[0]
                down = self._downstream
            if down is not None:
                down.close()
        if self._next is None:
            raise RequestError("no next stage configured (start the worker with --next, or give the "
                               "coordinator the whole route)")
        if not self._down_ready.wait(min(1.0, self.access.deadline_s)):
            raise self._down_missing()
        if not self._send_down(wire.control(Msg.PING, {"route": route[1:], "standbys": standbys[1:]}, frame.stream,
                                            frame.seq)):
            raise self._down_missing()

    def _mirror_to(self, standby: str | None, next_address: str | None) -> None:
        """Sends copies of what goes to the next stage to its standby at ``standby`` (None: to no
        one).  A standby that becomes the next stage is handed its copies first."""
        mirror = self._mirror
        if mirror is not None and mirror.address != standby:
            self._mirror = None
            if mirror.address == next_address:
                mirror.handover()
            else:
                mirror.close()
        if standby is not None and self._mirror is None:
            self._mirror = Mirror(standby, access=self.access, manifest=self.manifest, mode=self.identity["mode"],
                                  max_frame=self.max_frame, log=self.log)

    def _down_missing(self) -> RequestError:
        return RequestError(f"{self._down_reason} (redialing)", self.manifest.stage_index + 1, self._next, True)

    # --- downstream: dial, relay results, watch the deadline ---------------------------------------

    def _send_down(self, frame: Frame, track: bool = True, keys: list[tuple[int, int]] | None = None) -> bool:
        """``keys``: the replies the frame asks for, when not the one its header names.  The next
        stage's standby is sent a copy (``_mirror_to``)."""
        parts = wire.encode_parts(frame)
        mirror = self._mirror
        if mirror is not None:
            mirror.send(frame, parts)
        link = self._downstream
        if link is None or not self._down_ready.is_set():
            return False
        with self._lock:
            if track:
                if not self._outstanding:
                    self._down_last_rx = time.monotonic()  # the silence clock starts now
                self._outstanding.update(keys or [(frame.stream, frame.seq)])
        try:
            link.send_parts(parts)
        except OSError:
            link.close()
            return False
        return True

    def _downstream_loop(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            target = self._next
            if target is None or self.runner.last:
                self._stop.wait(0.2)
                continue
            link = self._connect_down(target)
            if link is None:
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            backoff = 0.1
            reason = self._relay_from(link)
            link.close()
            with self._lock:
                self._downstream = None
                self._down_ready.clear()
                lost, self._outstanding = self._outstanding, set()
            self._down_reason = reason
            up = self._upstream
            if not self._stop.is_set():
                self.log(f"next stage {target}: {reason}")
            for stream, seq in sorted(lost):
                if up is not None:
                    self._error(up, Frame(Msg.ERROR, stream, seq), reason, self.manifest.stage_index + 1, target, True)

    def _connect_down(self, target: str) -> Link | None:
        try:
            link, peer_delay = connect_successor(target, self.access.key, self.manifest, self.identity["mode"],
                                                 self.access.tls, self.max_frame)
        except (AuthError, ProtocolError) as exc:
            self.log(f"next stage {target} refused: {exc}")
            self._stop.wait(2.0)  # a misconfiguration: do not hammer the peer
            return None
        except OSError:
            return None
        self._down_silence = self.access.deadline_s / 2 + 2 * peer_delay
        with self._lock:
            if target != self._next:  # re-routed while we dialed
                link.close()
                return None
            self._downstream = link
            self._down_ready.set()
        self.log(f"connected to next stage {target}")
        return link

    def _relay_from(self, link: Link) -> str:
        """Relays everything the successor sends back upstream; returns why the link ended."""
        tick = self.relay.heartbeat(self.access.deadline_s)
        self._down_last_rx = time.monotonic()
        while not self._stop.is_set():
            try:
                frame = link.recv(tick)
            except ConnectionError:
                return "connection lost"
            except ProtocolError as exc:
                return f"sent a malformed frame ({exc})"
            now = time.monotonic()
            if frame is None:
                if link.closed.is_set():
                    return "connection closed (re-routed)"
                if self._outstanding and now - self._down_last_rx > self._down_silence:
                    return f"no reply for {now - self._down_last_rx:.1f} s (stalled)"
                continue
            self._down_last_rx = now
            if frame.type == Msg.ALIVE:
                continue
            if frame.type == Msg.PONG:
                try:
                    frame = self._pong(frame)
                except ProtocolError as exc:  # as a lost link: what it owes us fails, and it is redialed
                    return f"sent a malformed frame ({exc})"
            with self._lock:
                self._outstanding.discard((frame.stream, frame.seq))
            if frame.type in (Msg.RESULT, Msg.ERROR, Msg.PONG):
                up = self._upstream
                if up is not None:
                    self._reply(up, frame)
        return "stopped"

    def _pong(self, frame: Frame) -> Frame:
        """The successor's PONG with this stage's description put first (raises ProtocolError for a malformed one)."""
        stages = frame.json().get("stages", [])
        if not isinstance(stages, list):
            raise ProtocolError("a PONG whose stages are not a list")
        return wire.control(Msg.PONG, {"stages": [self.describe(), *stages]}, frame.stream, frame.seq)

    def _heartbeat_loop(self) -> None:
        tick = self.relay.heartbeat(self.access.deadline_s)
        while not self._stop.wait(tick):
            up = self._upstream
            if up is not None and self._owed:
                try:
                    up.send(Frame(Msg.ALIVE))
                except OSError:
                    pass
