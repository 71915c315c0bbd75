"""The client side of a node agent's control API: status, shard transfer, workers, profiles.

Every call is one CALL frame (a JSON document naming the ``op``, plus raw bytes for shard chunks)
answered by one REPLY or ERROR frame, over a connection authenticated with the fleet key (the same
handshake as the activation relay, ``engine.transport.wire``).  ``send_shard`` streams a shard folder in
chunks, resumes a transfer the node already holds part of, and skips a shard it already has.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from engine.config import FleetAccess, ShardOptions
from engine.errors import FleetError
from engine.fleet.shardstore import content_hash
from engine.manifest import MANIFEST, read_manifest
from engine.progress import Progress, Report, byte_count, quiet
from engine.transport import wire
from engine.transport.link import Link, handshake, parse_address
from engine.transport.wire import AuthError, Frame, Msg, ProtocolError

CHUNK_BYTES = 4 << 20
CONTROL_MAX_FRAME = CHUNK_BYTES + (1 << 20)
ROLE = {"role": "agent"}


class AgentError(FleetError):
    """A node agent could not be reached, refused us, or could not carry out a request."""


def call_frame(op: str, doc: dict | None = None, data: bytes | None = None) -> Frame:
    frame = wire.control(Msg.CALL, {"op": op, **(doc or {})})
    if data is not None:
        frame.tensors.append(np.frombuffer(data, dtype=np.uint8))
    return frame


def prove_node(address: str, access: FleetAccess, node_id: str, *, timeout_s: float = 3.0) -> None:
    """Checks that the agent at ``address`` proves the fleet key and is node ``node_id`` (its WELCOME
    names it): what an mDNS record must pass before it is believed.  Raises AgentError saying why not."""
    with ControlClient(address, access, timeout_s=timeout_s) as agent:
        said = agent.node.get("id") if isinstance(agent.node, dict) else None
    if said != node_id:
        raise AgentError(f"node agent at {address} is node {said or '(no id given)'}, not {node_id}")


def worker_address(agent: str, port: int) -> str:
    """HOST:PORT of a worker that agent ``agent`` (HOST:PORT) started on ``port``."""
    host, _ = parse_address(agent)
    return f"{host}:{port}"


class ControlClient:
    """A connection to the node agent at ``address`` (HOST:PORT), for its calls (the module's docstring)."""

    def __init__(self, address: str, access: FleetAccess, *, timeout_s: float = 10.0):
        """``access``: the fleet key and TLS the connection goes with; ``timeout_s``: the handshake's
        deadline and each call's unless it names its own."""
        self.address = address
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        try:
            sock, self.welcome, seal = handshake(address, access.key, ROLE, access.tls, deadline_s=timeout_s)
        except OSError as exc:
            raise AgentError(f"node agent at {address} is not reachable ({exc.strerror or exc})") from None
        except (AuthError, ProtocolError) as exc:
            raise AgentError(f"node agent at {address}: {exc}") from None
        self.node = self.welcome.get("node", {})
        self._link = Link(sock, address, seal, max_frame=CONTROL_MAX_FRAME)

    def call(self, op: str, data: bytes | None = None, timeout_s: float | None = None, **doc) -> dict:
        """One request; returns the reply's JSON (raw reply bytes, if any, under ``"_data"``)."""
        with self._lock:
            try:
                self._link.send(call_frame(op, doc, data))
                reply = self._link.recv(timeout=timeout_s or self.timeout_s)
            except (ConnectionError, OSError, ProtocolError) as exc:
                self.close()
                raise AgentError(f"node agent at {self.address} lost during {op!r}: {exc}") from None
        if reply is None:
            self.close()
            raise AgentError(f"node agent at {self.address} did not answer {op!r} within "
                             f"{timeout_s or self.timeout_s:.0f} s")
        doc = reply.json()
        if reply.type == Msg.ERROR:
            raise AgentError(f"node {self.node.get('name', self.address)}: {doc.get('reason', 'request failed')}")
        if reply.type != Msg.REPLY:
            raise AgentError(f"node agent at {self.address} answered {op!r} with {reply.type.name}")
        if len(reply.tensors) > 1:
            doc["_data"] = reply.tensors[1].tobytes()
        return doc

    # --- operations ----------------------------------------------------------------------------------

    def status(self) -> dict:
        return self.call("status")

    def round_trip_ms(self, count: int = 5) -> float:
        """Median time of ``count`` empty calls: what a hop to this node costs."""
        times = []
        for _ in range(count):
            t = time.perf_counter()
            self.call("ping")
            times.append((time.perf_counter() - t) * 1e3)
        return float(np.median(times))

    def send_shard(self, folder: Path, progress: Report = quiet, cancel=None,
                   chunk_bytes: int = CHUNK_BYTES) -> tuple[str, bool]:
        """Ships a shard folder; returns (content hash, whether bytes were sent).  ``progress`` counts
        the bytes sent, including those the node already had; ``cancel.is_set()`` stops between
        chunks (the partial transfer stays on the node and resumes next time)."""
        folder = Path(folder)
        manifest = read_manifest(folder)
        digest = content_hash(folder)
        sizes = {name: (folder / name).stat().st_size for name in manifest.files}
        total = sum(sizes.values())

        def sent(done: int) -> None:
            progress(Progress(f"Sending {folder.name}: {byte_count(done, total)}", done / max(1, total), done, total,
                              step="send"))

        if self.call("has_shard", hash=digest)["present"]:
            sent(total)
            return digest, False
        have = self.call("put_begin", (folder / MANIFEST).read_bytes(), hash=digest, sizes=sizes)["have"]
        done = sum(have.values())
        sent(done)
        for name, size in sizes.items():
            offset = int(have.get(name, 0))
            with open(folder / name, "rb") as f:
                f.seek(offset)
                while offset < size:
                    if cancel is not None and cancel.is_set():
                        raise AgentError(f"transfer to {self.address} cancelled (it resumes next time)")
                    block = f.read(chunk_bytes)
                    offset = self.call("put_chunk", block, hash=digest, file=name, offset=offset)["offset"]
                    done += len(block)
                    sent(done)
        self.call("put_end", hash=digest, timeout_s=max(self.timeout_s, 120.0))
        return digest, True

    def start_worker(self, digest: str, *, shard: ShardOptions = ShardOptions(), delay_ms: float = 0.0,
                     timeout_s: float = 180.0, role: str = "stage") -> dict:
        """Starts a worker serving the shard ``digest`` (sent before), compiled as ``shard`` says (its
        device, the correctness mode, the precision hint; its weights go unused).  ``role``: ``stage``
        (a stage of the chain) or ``draft`` (a draft server, ``fleet worker --role draft``)."""
        return self.call("start_worker", timeout_s=timeout_s + 10, hash=digest, device=shard.device, mode=shard.mode,
                         delay_ms=delay_ms, precision=shard.precision, wait_s=timeout_s, role=role)

    def stop_worker(self, worker: str | None = None) -> dict:
        return self.call("stop_worker", worker=worker)

    def close(self) -> None:
        self._link.close()

    def __enter__(self) -> "ControlClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
