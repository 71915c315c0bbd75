"""Tensor parallelism: the ranks of one shard exchange partial results inside its graph.

A tensor-parallel export (``fleet export --ranks 2``) gives each rank every layer but only its share
of each layer's heads and MLP columns, and of the head's vocabulary.  Where a layer's output
projections (attention's ``o``, the MLP's ``down``) leave a partial sum, the graph holds an
``AllReduce`` node, and after the head's vocabulary slice an ``AllGather``; both are OpenVINO custom
operations whose ``evaluate`` swaps tensors with the other ranks over an authenticated connection
(``Mesh``).  Every rank then runs the same forwards in the same order: one user's token costs each
PC half the weights it would read alone.  Rank 0 ends with the whole model's logits; the others,
whose results the coordinator does not use, send rank 0 their vocabulary slices and keep only their
own.  They send a slice whole only where rank 0's forward needs the logits or the probabilities;
otherwise each row's largest logits, one for a greedy token or ``wire.CANDIDATE_COUNT`` for sampling
(a few bytes a row, where a vocabulary slice would cost the link its time on every token).  Rank 0
says which on every part it sends (the frame's flags: ``Mesh.needs``).

Every rank but 0 listens on a port of its own (its worker names it in its PONG); rank 0, in the
coordinator, dials them when it opens the chain (the fleet-key handshake, then sealed SHARE
frames), and a rank takes the next coordinator's connection in place of the last.  With two ranks
they swap their parts over one connection; with more, rank 0 gathers, combines in rank order and
sends the result back.  Sums are always taken in rank order, so every rank holds the
very same activations.

A collective node finds its mesh by its friendly name (``bind``): the plugin compiles a copy of each
node, which keeps the name but not the Python object.
"""

from __future__ import annotations

import itertools
import queue
import socket
import threading
import time

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from engine.errors import FleetError
from engine.transport import wire
from engine.transport.link import HANDSHAKE_TIMEOUT_S, Link, accept_loop, authenticate_peer, connect_peer
from engine.transport.wire import Frame, Msg

EXCHANGE_TIMEOUT_S = 30.0  # the longest one rank waits at an exchange for the others to get there
INLINE_BYTES = 64 << 10  # a frame this small always fits the peer's socket buffer: sent from the caller
_MESHES: dict[str, "Mesh"] = {}
_ids = itertools.count(1)


class MeshError(FleetError):
    """A tensor-parallel peer is missing, refused us, went away or sent something else than its part."""


class Mesh:
    """This rank's connections to the other ranks of one tensor-parallel group."""

    def __init__(self, rank: int, ranks: int, links: dict[int, Link] | None = None,
                 timeout_s: float = EXCHANGE_TIMEOUT_S):
        """``links``: rank 0's connection to each other rank; a rank > 0 starts without and
        ``listen``s for rank 0."""
        self.rank, self.ranks, self.links = rank, ranks, dict(links or {})
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.id = f"mesh{next(_ids)}"
        self.exchanges = 0
        # What rank 0's current forward needs of the gathered logits (Flag.LOGITS, PROBS, CANDIDATES,
        # or none: the top-1): set by its chain before each forward, learnt by the others from its parts.
        self.needs = wire.Flag.LOGITS
        self.failure: MeshError | None = None  # the exchange that failed: every later one fails with it
        self._outbox: queue.Queue = queue.Queue()  # large parts, in order; a later part must not overtake them
        threading.Thread(target=self._sender, daemon=True, name=f"{self.id} send").start()
        _MESHES[self.id] = self

    @classmethod
    def dial(cls, addresses: dict[int, str], key: bytes, fingerprint: str, ranks: int, *,
             timeout_s: float = 30.0, tls=None) -> "Mesh":
        """Rank 0: dials every other rank's mesh port (``addresses``: rank -> HOST:PORT), each within
        ``timeout_s``; the handshake proves the fleet key and the model both ways, the peer's
        welcome its rank."""
        return cls(0, ranks, _dial_links(addresses, key, fingerprint, ranks, timeout_s, tls))

    def redial(self, addresses: dict[int, str], key: bytes, fingerprint: str, *, timeout_s: float = 30.0,
               tls=None) -> None:
        """Rank 0: connects to the other ranks again (after a failed exchange, or a rank's worker
        restarted), exchanges counted from 0 on both sides.  The links change in place: the
        compiled graph finds this mesh by its id."""
        links = _dial_links(addresses, key, fingerprint, self.ranks, timeout_s, tls)
        with self._lock:
            old, self.links = self.links, links
            self.exchanges, self.failure = 0, None
        for link in old.values():
            link.close()

    def listen(self, listener: socket.socket, key: bytes, fingerprint: str, *, tls=None, log=None) -> None:
        """Rank > 0: takes rank 0's connection on ``listener`` for as long as the process runs.  A
        new one (the next coordinator session) replaces the last, its exchanges counted from 0."""
        identity = {"role": "mesh", "fingerprint": fingerprint, "rank": self.rank}
        log = log or (lambda msg: None)

        def session(conn: socket.socket, seal: wire.Seal, peer: str) -> None:
            link = Link(conn, f"rank 0 at {peer}", seal)
            try:
                hello = link.recv(HANDSHAKE_TIMEOUT_S)
                doc = hello.json() if hello is not None and hello.type == Msg.CALL else {}
                if doc.get("rank") != 0 or doc.get("ranks") != self.ranks:
                    raise wire.ProtocolError(f"expected rank 0 of {self.ranks}, got {str(doc)[:80]}")
                with self._lock:
                    previous, self.links[0] = self.links.get(0), link
                    self.exchanges, self.failure = 0, None
                link.send(wire.control(Msg.REPLY, {"rank": self.rank}, hello.stream, hello.seq))
            except (ConnectionError, wire.ProtocolError, OSError, ValueError) as exc:
                log(f"tensor-parallel connection from {peer} dropped: {exc}")
                link.close()
                return
            if previous is not None:
                previous.close()
            log(f"tensor-parallel rank 0 at {peer} joined")

        threading.Thread(target=accept_loop, daemon=True, name=f"{self.id} accept",
                         args=(listener, self._closed, lambda conn: authenticate_peer(conn, key, identity, tls),
                               session, "tensor-parallel", log)).start()

    # --- the collectives ---------------------------------------------------------------------------

    def all_reduce(self, x: np.ndarray, out: np.ndarray) -> None:
        """``out`` = the sum of every rank's ``x``, added in rank order."""
        self._guarded(self._reduce, x, out)

    def all_gather(self, x: np.ndarray, out: np.ndarray) -> None:
        """Rank 0: ``out`` = every rank's ``x`` side by side along the last axis, in rank order, the
        others' slices whole or only their rows' largest values (the rest -inf) as ``needs`` says:
        either way ``out``'s top-1 and candidates are the whole vocabulary's.  A rank > 0 sends its
        slice and keeps only its own in ``out``, the rest -inf."""
        self._guarded(self._gather, x, out)

    def check(self) -> None:
        """Raises the failure of an exchange since this connection began.  OpenVINO does not always
        pass an exception raised inside a custom operation on to ``infer``: seen with the ranks in
        two processes, the infer returned with stale outputs (and later ones ran only part of the
        graph), so a forward must ask here after its infer."""
        if self.failure is not None:
            raise self.failure

    def _guarded(self, exchange, x: np.ndarray, out: np.ndarray) -> None:
        self.check()
        try:
            exchange(x, out)
        except Exception as exc:
            self.failure = exc if isinstance(exc, MeshError) else MeshError(f"tensor-parallel exchange failed: {exc}")
            raise self.failure from None

    def _next_seq(self) -> int:
        """The next exchange's number: a frame's 32-bit ``seq``, which wraps around (two exchanges a
        layer, so a rank serving all day long wraps it within months)."""
        with self._lock:
            self.exchanges += 1
            return (self.exchanges - 1) & 0xFFFFFFFF

    def _reduce(self, x: np.ndarray, out: np.ndarray) -> None:
        seq = self._next_seq()
        if self.ranks == 2:  # swap parts: one crossing each way, at once
            other = 1 - self.rank
            self._send(other, self._share(seq, x))
            theirs = self._receive(other, seq, x.shape)
            _sum([x, theirs] if self.rank == 0 else [theirs, x], out)
        elif self.rank == 0:
            _sum([x] + [self._receive(r, seq, x.shape) for r in range(1, self.ranks)], out)
            for r in range(1, self.ranks):
                self._send(r, self._share(seq, out))
        else:
            self._send(0, self._share(seq, x))
            out[...] = self._receive(0, seq, out.shape)

    def _gather(self, x: np.ndarray, out: np.ndarray) -> None:
        seq, width = self._next_seq(), x.shape[-1]
        top = None if self.needs & (wire.Flag.LOGITS | wire.Flag.PROBS) else \
            min(wire.CANDIDATE_COUNT if self.needs & wire.Flag.CANDIDATES else 1, width)
        if self.rank:
            self._send(0, self._share(seq, x if top is None else _largest(x, top)))
            start, end = self.rank * width, (self.rank + 1) * width
            out[..., :start], out[..., start:end], out[..., end:] = -np.inf, x, -np.inf
            return
        out[..., :width] = x
        for r in range(1, self.ranks):
            slice_ = out[..., r * width:(r + 1) * width]
            if top is None:
                slice_[...] = self._receive(r, seq, x.shape)
            else:
                part = self._receive(r, seq, (*x.shape[:-1], 2 * top))
                where = part[..., top:]
                if not np.all((where >= 0) & (where < width) & (where == np.floor(where))):
                    raise MeshError(f"tensor-parallel rank {r} sent vocabulary indices outside its slice")
                slice_.fill(-np.inf)
                np.put_along_axis(slice_, where.astype(np.int64), part[..., :top], axis=-1)

    def _share(self, seq: int, x: np.ndarray) -> Frame:
        """A part for another rank; rank 0's say what its forward needs (``needs``)."""
        return wire.share_frame(seq, x, self.needs if self.rank == 0 else wire.Flag.NONE)

    def _send(self, rank: int, frame: Frame) -> None:
        link = self._link(rank)
        if not self._outbox.unfinished_tasks and sum(t.nbytes for t in frame.tensors) <= INLINE_BYTES:
            try:
                link.send(frame)
            except OSError as exc:
                raise MeshError(f"tensor-parallel {link.peer} is gone: {exc}") from None
        else:  # both ranks send at once: a large part must not wait for the peer to read
            frame.tensors = [np.array(t) for t in frame.tensors]
            self._outbox.put((link, frame))

    def _sender(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            link, frame = item
            try:
                link.send(frame)
            except Exception:  # noqa: BLE001 - the peer's next receive fails; this thread serves on
                link.close()
            finally:
                self._outbox.task_done()

    def _link(self, rank: int) -> Link:
        link = self.links.get(rank)
        if link is None:
            raise MeshError(f"tensor-parallel rank {rank} has not connected to rank {self.rank} (rank 0, the "
                            f"coordinator, dials the others when it opens the chain)")
        return link

    def _receive(self, rank: int, seq: int, shape) -> np.ndarray:
        link = self._link(rank)
        try:
            frame = link.recv(self.timeout_s)
        except (ConnectionError, wire.ProtocolError) as exc:
            raise MeshError(f"tensor-parallel {link.peer} is gone: {exc}") from None
        if frame is None:
            raise MeshError(f"tensor-parallel {link.peer} sent nothing within {self.timeout_s:g} s")
        try:
            part = wire.unpack_share(frame, seq, shape)
        except wire.ProtocolError as exc:
            raise MeshError(f"tensor-parallel {link.peer} is out of step: {exc}") from None
        if self.rank:
            self.needs = frame.flags
        return part

    def close(self) -> None:
        self._closed.set()
        _MESHES.pop(self.id, None)
        self._outbox.put(None)
        for link in self.links.values():
            link.close()


def _dial_links(addresses: dict[int, str], key: bytes, fingerprint: str, ranks: int, timeout_s: float,
                tls) -> dict[int, Link]:
    links: dict[int, Link] = {}
    try:
        for rank, address in sorted(addresses.items()):
            links[rank] = _dial_rank(address, key, fingerprint, rank, ranks, timeout_s, tls)
    except BaseException:
        for link in links.values():
            link.close()
        raise
    return links


def _dial_rank(address: str, key: bytes, fingerprint: str, rank: int, ranks: int, timeout_s: float,
               tls) -> Link:
    """Rank 0's connection to rank ``rank`` at ``address``, acknowledged by that rank."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            link, welcome = connect_peer(address, key, {"role": "mesh", "fingerprint": fingerprint}, tls)
            break
        except OSError:
            if time.monotonic() >= deadline:
                raise MeshError(f"tensor-parallel rank {rank} at {address} did not answer within "
                                f"{timeout_s:g} s") from None
            time.sleep(0.2)
        except (wire.AuthError, wire.ProtocolError) as exc:
            raise MeshError(f"tensor-parallel rank {rank} at {address} refused the connection: {exc}") from None
    link.peer = link.seal.peer = f"rank {rank} at {address}"
    try:
        if welcome.get("rank") != rank:
            raise MeshError(f"{address} serves tensor-parallel rank {welcome.get('rank')}, not rank {rank}")
        link.send(wire.control(Msg.CALL, {"rank": 0, "ranks": ranks}))
        ack = link.recv(HANDSHAKE_TIMEOUT_S)
        if ack is None or ack.type != Msg.REPLY:
            raise MeshError(f"tensor-parallel rank {rank} at {address} did not take the connection")
    except (ConnectionError, wire.ProtocolError) as exc:
        link.close()
        raise MeshError(f"tensor-parallel rank {rank} at {address} broke off: {exc}") from None
    except MeshError:
        link.close()
        raise
    return link


def _largest(x: np.ndarray, n: int) -> np.ndarray:
    """Each row's ``n`` largest values of ``x``, then their indices (as float32: exact below 2**24)."""
    where = x.argmax(-1)[..., None] if n == 1 else np.argpartition(x, -n, axis=-1)[..., -n:]
    return np.concatenate([np.take_along_axis(x, where, -1), where.astype(np.float32)], axis=-1)


def _sum(parts: list[np.ndarray], out: np.ndarray) -> None:
    np.add(parts[0], parts[1], out=out)
    for part in parts[2:]:
        np.add(out, part, out=out)


# --- the graph's side -------------------------------------------------------------------------------

class _Collective(ov.Op):
    """A node whose output is its input combined across the ranks (see the subclasses)."""

    def __init__(self, *args):
        super().__init__(self, args)
        self.constructor_validate_and_infer_types()

    def visit_attributes(self, visitor) -> bool:
        return True

    def has_evaluate(self, *args) -> bool:
        return True

    def _mesh(self) -> Mesh:
        name = self.get_friendly_name()
        mesh = _MESHES.get(name.split("/")[0])
        if mesh is None:
            raise MeshError(f"the collective {name} is not bound to a tensor-parallel mesh (open the shard "
                            f"with one)")
        return mesh


class AllReduce(_Collective):
    class_type_info = ov.DiscreteTypeInfo("AllReduce", "extension")

    def validate_and_infer_types(self) -> None:
        if self.get_input_size():
            self.set_output_type(0, self.get_input_element_type(0), self.get_input_partial_shape(0))

    def evaluate(self, outputs, inputs) -> bool:
        self._mesh().all_reduce(inputs[0].data, outputs[0].data)
        return True


class AllGather(_Collective):
    """Concatenates the ranks' parts along the last axis; its one attribute-free input says how
    many ranks there are by the constant second input ``ranks``."""

    class_type_info = ov.DiscreteTypeInfo("AllGather", "extension")

    def validate_and_infer_types(self) -> None:
        if self.get_input_size() < 2:
            return
        shape = self.get_input_partial_shape(0)
        ranks = int(self.input_value(1).get_node().get_data().item())
        dims = list(shape)
        last = dims[-1]
        dims[-1] = ov.Dimension(last.get_length() * ranks) if last.is_static else ov.Dimension()
        self.set_output_type(0, self.get_input_element_type(0), ov.PartialShape(dims))

    def evaluate(self, outputs, inputs) -> bool:
        x = inputs[0].data
        mesh = self._mesh()
        shape = (*x.shape[:-1], x.shape[-1] * mesh.ranks)
        outputs[0].shape = shape
        mesh.all_gather(x, outputs[0].data)
        return True


COLLECTIVES = (AllReduce, AllGather)


def all_gather(x: ov.Output, ranks: int) -> ov.Node:
    return AllGather(x, ops.constant(np.int64(ranks)).output(0))


def register(core: ov.Core) -> None:
    """Lets ``core`` read graphs that hold collectives (once per core)."""
    for op in COLLECTIVES:
        core.add_extension(op)


def bind(model: ov.Model, mesh: Mesh) -> int:
    """Names every collective of ``model`` after ``mesh`` (how ``evaluate`` finds it); returns how many."""
    count = 0
    for node in model.get_ordered_ops():
        if node.get_type_name() in {op.class_type_info.name for op in COLLECTIVES}:
            node.set_friendly_name(f"{mesh.id}/{count}")
            count += 1
    return count
