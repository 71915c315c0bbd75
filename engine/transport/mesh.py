"""Tensor parallelism: the ranks of one shard exchange partial results inside its graph.

A tensor-parallel export (``fleet export --ranks 2``) gives each rank every layer but only its share
of each layer's heads and MLP columns, and of the head's vocabulary.  Where a layer's output
projections (attention's ``o``, the MLP's ``down``) leave a partial sum, the graph holds an
``AllReduce`` node, and after the head's vocabulary slice an ``AllGather``; both are OpenVINO custom
operations whose ``evaluate`` swaps tensors with the other ranks over an authenticated connection
(``Mesh``).  Every rank then runs the same forwards in the same order, and each ends with the
whole model's logits: one user's token costs each PC half the weights it would read alone.

A rank 0 listens for the others, which dial it (the fleet-key handshake, then sealed SHARE frames).
With two ranks they swap their parts over one connection; with more, rank 0 gathers, combines in
rank order and sends the result back.  Sums are always taken in rank order, so every rank holds the
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
from engine.transport.link import HANDSHAKE_TIMEOUT_S, Link, authenticate_peer, dial, parse_address
from engine.transport.wire import Frame, Msg

EXCHANGE_WAIT_S = 30.0  # the longest one rank waits at an exchange for the others to get there
INLINE_BYTES = 64 << 10  # a frame this small always fits the peer's socket buffer: sent from the caller
_MESHES: dict[str, "Mesh"] = {}
_ids = itertools.count(1)


class MeshError(FleetError):
    """A tensor-parallel peer is missing, refused us, went away or sent something else than its part."""


class Mesh:
    """This rank's connections to the other ranks of one tensor-parallel group."""

    def __init__(self, rank: int, ranks: int, links: dict[int, Link], timeout_s: float = EXCHANGE_WAIT_S):
        self.rank, self.ranks, self.links = rank, ranks, links
        self.timeout_s = timeout_s
        self.id = f"mesh{next(_ids)}"
        self.exchanges = 0
        self._outbox: queue.Queue = queue.Queue()
        threading.Thread(target=self._sender, daemon=True, name=f"{self.id} send").start()
        _MESHES[self.id] = self

    @classmethod
    def serve(cls, listener: socket.socket, key: bytes, fingerprint: str, ranks: int, *,
              timeout_s: float = 30.0, tls=None) -> "Mesh":
        """Rank 0: accepts ranks 1..ranks-1 on ``listener`` (each proves the fleet key and the model),
        waiting up to ``timeout_s`` for each."""
        links: dict[int, Link] = {}
        listener.settimeout(timeout_s)
        while len(links) < ranks - 1:
            try:
                conn, peer = listener.accept()
            except socket.timeout:
                raise MeshError(f"tensor-parallel ranks {sorted(set(range(1, ranks)) - set(links))} did not "
                                f"connect within {timeout_s:g} s") from None
            try:
                conn, seal = authenticate_peer(conn, key, {"role": "mesh", "fingerprint": fingerprint}, tls)
                link = Link(conn, f"{peer[0]}:{peer[1]}", seal)
                hello = link.recv(HANDSHAKE_TIMEOUT_S)
                rank = int(hello.json()["rank"]) if hello is not None and hello.type == Msg.CALL else -1
            except (wire.AuthError, wire.ProtocolError, OSError, ValueError, KeyError, TypeError):
                continue  # a stranger, a broken dial or a malformed hello: keep waiting for the ranks
            if not 0 < rank < ranks or rank in links:
                link.close()
                continue
            link.peer = seal.peer = f"rank {rank} at {peer[0]}:{peer[1]}"
            links[rank] = link
        return cls(0, ranks, links)

    @classmethod
    def join(cls, address: str, key: bytes, fingerprint: str, rank: int, ranks: int, *,
             timeout_s: float = 30.0, tls=None) -> "Mesh":
        """Rank ``rank`` > 0: dials rank 0 at ``address`` until it answers (within ``timeout_s``)."""
        parse_address(address)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sock = dial(address, tls)
                sock.settimeout(HANDSHAKE_TIMEOUT_S)
                _, seal = wire.client_handshake(sock, key, {"role": "mesh", "fingerprint": fingerprint})
                break
            except OSError:
                if time.monotonic() >= deadline:
                    raise MeshError(f"rank 0 of the tensor-parallel group at {address} did not answer "
                                    f"within {timeout_s:g} s") from None
                time.sleep(0.2)
            except wire.AuthError as exc:
                raise MeshError(f"rank 0 at {address} refused rank {rank}: {exc}") from None
        link = Link(sock, f"rank 0 at {address}", seal)
        link.send(wire.control(Msg.CALL, {"rank": rank}))
        return cls(rank, ranks, {0: link})

    # --- the collectives ---------------------------------------------------------------------------

    def all_reduce(self, x: np.ndarray, out: np.ndarray) -> None:
        """``out`` = the sum of every rank's ``x``, added in rank order."""
        self._collect(x, out, lambda parts: _sum(parts, out))

    def all_gather(self, x: np.ndarray, out: np.ndarray) -> None:
        """``out`` = every rank's ``x`` side by side along the last axis, in rank order."""
        self._collect(x, out, lambda parts: np.concatenate(parts, axis=-1, out=out))

    def _collect(self, x: np.ndarray, out: np.ndarray, combine) -> None:
        seq = self.exchanges
        self.exchanges += 1
        if self.ranks == 2:  # swap parts: one crossing each way, at once
            other = 1 - self.rank
            self._send(other, Frame(Msg.SHARE, 0, seq, [x]))
            theirs = self._receive(other, seq, x.shape)
            combine([x, theirs] if self.rank == 0 else [theirs, x])
        elif self.rank == 0:
            parts = [x] + [self._receive(r, seq, x.shape, any_last=True) for r in range(1, self.ranks)]
            combine(parts)
            for r in range(1, self.ranks):
                self._send(r, Frame(Msg.SHARE, 0, seq, [out]))
        else:
            self._send(0, Frame(Msg.SHARE, 0, seq, [x]))
            out[...] = self._receive(0, seq, out.shape)

    def _send(self, rank: int, frame: Frame) -> None:
        if sum(t.nbytes for t in frame.tensors) <= INLINE_BYTES:
            self.links[rank].send(frame)
        else:  # both ranks send at once: a large part must not wait for the peer to read
            frame.tensors = [np.array(t) for t in frame.tensors]
            self._outbox.put((rank, frame))

    def _sender(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            rank, frame = item
            try:
                self.links[rank].send(frame)
            except OSError:
                self.links[rank].close()

    def _receive(self, rank: int, seq: int, shape, any_last: bool = False) -> np.ndarray:
        link = self.links[rank]
        try:
            frame = link.recv(self.timeout_s)
        except (ConnectionError, wire.ProtocolError) as exc:
            raise MeshError(f"tensor-parallel {link.peer} is gone: {exc}") from None
        if frame is None:
            raise MeshError(f"tensor-parallel {link.peer} sent nothing within {self.timeout_s:g} s")
        part = frame.tensors[0] if frame.type == Msg.SHARE and len(frame.tensors) == 1 else None
        if (part is None or frame.seq != seq or part.dtype != np.float32
                or part.shape[:-1] != tuple(shape[:-1]) or (not any_last and part.shape != tuple(shape))):
            raise MeshError(f"tensor-parallel {link.peer} is out of step: expected its part {seq} "
                            f"{tuple(shape)}, got {frame.type.name} {frame.seq}"
                            f"{'' if part is None else ' ' + str(part.shape)}")
        return part

    def close(self) -> None:
        _MESHES.pop(self.id, None)
        self._outbox.put(None)
        for link in self.links.values():
            link.close()


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
