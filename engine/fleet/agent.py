"""The node agent (``fleet agent``): the process every PC of the fleet runs.

It advertises the node over mDNS (``engine.fleet.discovery``) and answers the authenticated control
API (``engine.fleet.control`` is the client): status, receiving shards into its store
(``engine.fleet.shardstore``), starting and stopping ``fleet worker`` processes for them, profiling,
and measuring round trips to peers.  Workers run as child processes tied to the agent (they exit
with it), so stopping the agent closes every connection the node holds and the coordinator sees a
clean departure.

Every agent is its own node (``engine.fleet.node.agent_node_id``), several on one PC too.  An
agent given a ``SimulatedDevice`` (a demo node, ``engine.fleet.demo``) reports that device, profiles
it on the device it really runs on with the costs scaled by its speed, and runs its workers there.
An agent given a link delay (a simulated PC's slow cable, ``engine.fleet.sim.office``) has every worker it
starts hold each frame it takes and sends by that much (the relay's own delay, on top of any a
deployment asks for).

A laptop that sleeps stops its agent and workers with it; on waking the agent notices the gap in its
clock (``WAKE_GAP_S``), says so in its log and announces the node over mDNS again, so that browsers
whose records of it lapsed list it again.  The coordinator's failover, which left the node out,
stops the workers it no longer uses and counts the node back in (``engine.fleet.failover``).
"""

from __future__ import annotations

import dataclasses
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

import numpy as np

from engine.config import DEVICE, MODE, FleetAccess, ShardOptions, paths
from engine.errors import FleetError
from engine.fleet.control import CONTROL_MAX_FRAME, ROLE, AgentError, ControlClient
from engine.fleet.discovery import Advertiser
from engine.fleet.node import SimulatedDevice, agent_node_id, local_node_info
from engine.fleet.profile import profile_shards
from engine.fleet.shardstore import ShardStore, check_hash, pruned_text
from engine.fleetkey import fleet_id
from engine.launch import FleetProcess, stop_all
from engine.manifest import part_name, read_manifest
from engine.runtime.relay.worker import TOKENS
from engine.runtime.stages.stage import core
from engine.runtime.stages.turns import machine_turns_file
from engine.transport import wire
from engine.transport.link import Link, accept_loop, authenticate_peer, parse_address
from engine.transport.wire import Frame, Msg, ProtocolError

MAX_WORKERS = 8
UNFINISHED_S = 600.0  # a transfer no chunk reached for this long is dropped by a prune
WAKE_TICK_S = 1.0  # how often the agent reads its clocks
WAKE_GAP_S = 10.0  # a tick this much late means the PC slept (or the agent was stopped): it announces itself again


class _Worker:
    def __init__(self, wid: str, digest: str, process: FleetProcess, info: dict):
        self.id, self.hash, self.process, self.info = wid, digest, process, info
        self.address, self.log = process.address, process.log
        self.port = int(self.address.rpartition(":")[2])

    @property
    def running(self) -> bool:
        return self.process.running

    def to_json(self) -> dict:
        """``tokens``: the positions it ran for its upstream, as it last reported them (every few
        seconds while it serves, and as its upstream leaves)."""
        proc = self.process.proc
        return {"id": self.id, "hash": self.hash, "address": self.address, "port": self.port,
                "pid": proc.pid, "state": "running" if self.running else f"exited ({proc.returncode})",
                "tokens": self.process.reported.get(TOKENS, 0), **self.info}


class Agent:
    def __init__(self, listen: str = "0.0.0.0:0", *, access: FleetAccess, name: str | None = None,
                 store: Path | None = None, advertise: bool = True, log: Callable[[str], None] | None = None,
                 simulate: SimulatedDevice | None = None, link_delay_ms: float = 0.0):
        """``access``: the fleet key it checks and proves, the TLS it speaks (its workers speak it too)
        and the key file its workers are told (``--fleet-key-file``), which it must have; its own calls
        to peers go with it too."""
        if not 0 <= link_delay_ms < 60_000:
            raise FleetError(f"a link delay is 0 to 60000 ms, not {link_delay_ms:g}")
        if access.key_file is None:
            raise FleetError("a node agent needs the fleet key's file: the workers it starts read it")
        self.link_delay_ms = float(link_delay_ms)
        core()  # before any thread starts: OpenVINO forks a short-lived child when a Core is created
        self.access = access
        self.fleet_id = fleet_id(access.key)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.store = ShardStore(store or paths().data / "agent")
        host, port = parse_address(listen, "0.0.0.0")
        try:
            self._listener = socket.create_server((host, port))
        except OSError as exc:
            raise FleetError(f"cannot listen on {listen}: {exc.strerror or exc}") from None
        self.host, self.port = self._listener.getsockname()[:2]
        self.name = name or socket.gethostname()
        self.node_id = agent_node_id(name)
        self.simulated = simulate
        self.workers: dict[str, _Worker] = {}
        self.activity = "idle"  # receiving, profiling: what the node does besides serving
        self.paused = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._advertiser = None
        self._advert_thread: threading.Thread | None = None
        self._want_advert = advertise
        self._links: set[Link] = set()

    @property
    def address(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"{host}:{self.port}"

    def info(self):
        info = local_node_info(self.port, self.fleet_id, self.name, node=self.node_id, simulated=self.simulated)
        info.status = self.state()
        return info

    def state(self) -> str:
        if self.paused:
            return "paused"
        serving = [w for w in self.workers.values() if w.running]
        if serving:
            return "serving " + ", ".join(part_name(w.info.get("stage", 0), w.info.get("stages"))
                                          for w in serving)
        return self.activity

    # --- life cycle ----------------------------------------------------------------------------------

    def start(self) -> "Agent":
        threading.Thread(target=self._accept_loop, daemon=True, name="agent accept").start()
        threading.Thread(target=self._wake_watch, daemon=True, name="agent wake").start()
        if self._want_advert:  # registering takes seconds (name probing): the control API is up meanwhile
            self._advert_thread = threading.Thread(target=self._advertise, daemon=True, name="agent mdns")
            self._advert_thread.start()
        return self

    def _advertise(self) -> None:
        addresses = None if self.host in ("0.0.0.0", "::") else [self.host]
        advertiser = Advertiser(self.info(), addresses)
        try:
            advertiser.start()
        except FleetError as exc:
            self.log(f"not advertised over mDNS: {exc}")
            return
        with self._lock:
            self._advertiser = advertiser
        if advertiser.info.status != self.state():  # it changed while the name was being registered
            self._changed()

    def _wake_watch(self) -> None:
        """Notices the agent coming back from a sleep: a tick late by ``WAKE_GAP_S`` on either clock
        (a suspended PC stops the monotonic clock on some systems, a stopped process stops neither)."""
        last = (time.monotonic(), time.time())
        while not self._stop.wait(WAKE_TICK_S):
            now = (time.monotonic(), time.time())
            slept = max(now[0] - last[0], now[1] - last[1]) - WAKE_TICK_S
            last = now
            if slept >= WAKE_GAP_S:
                self.log(f"awake again after about {slept:.0f} s asleep: announcing node {self.name} again")
                self._changed()

    def stop(self) -> None:
        """Stops workers, says goodbye over mDNS and closes every control connection."""
        self._stop.set()
        self.stop_workers()
        if self._advert_thread is not None:  # a registration under way ends first, so its goodbye goes out
            self._advert_thread.join(timeout=10)
        with self._lock:
            advertiser, self._advertiser = self._advertiser, None
        if advertiser is not None:
            advertiser.close()
        try:  # shutdown first: a close alone does not wake a thread blocked in accept (the agent may run in-process)
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._listener.close()
        except OSError:
            pass
        for link in list(self._links):
            link.close()

    def set_paused(self, paused: bool) -> None:
        """A paused node stops its workers and takes no new ones; browsers see it as paused."""
        self.paused = paused
        if paused:
            self.stop_workers()
        self._changed()

    def _changed(self) -> None:
        if self._advertiser is not None:
            try:
                self._advertiser.update(self.info())
            except FleetError as exc:
                self.log(f"mDNS update failed: {exc}")

    # --- connections ---------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        accept_loop(self._listener, self._stop, self._authenticate, self._session, "control", self.log)

    def _authenticate(self, conn: socket.socket) -> tuple[socket.socket, wire.Seal]:
        # the node's id in WELCOME lets a browser check that an mDNS record naming this node leads here
        identity = {**ROLE, "node": {"name": self.name, "fleet": self.fleet_id, "id": self.node_id}}
        return authenticate_peer(conn, self.access.key, identity, self.access.tls)

    def _session(self, conn: socket.socket, seal: wire.Seal, peer: str) -> None:
        link = Link(conn, peer, seal, max_frame=CONTROL_MAX_FRAME)
        self._links.add(link)
        try:
            while not self._stop.is_set():
                frame = link.recv()
                if frame.type == Msg.BYE:
                    break
                link.send(self._answer(frame))
        except (ConnectionError, ProtocolError, OSError) as exc:
            self.log(f"control connection from {peer} ended: {exc}")
        finally:
            self._links.discard(link)
            link.close()

    def _answer(self, frame: Frame) -> Frame:
        try:
            if frame.type != Msg.CALL:
                raise FleetError(f"this is a node agent's control port; it does not take {frame.type.name} frames")
            doc = frame.json()
            data = frame.tensors[1].tobytes() if len(frame.tensors) > 1 else None
            handler = getattr(self, f"op_{doc.get('op')}", None) if isinstance(doc.get("op"), str) else None
            if handler is None:
                raise FleetError(f"unknown operation {doc.get('op')!r}")
            result = handler(doc, data)
            reply_data = result.pop("_data", None) if isinstance(result, dict) else None
            out = wire.control(Msg.REPLY, result, frame.stream, frame.seq)
            if reply_data is not None:
                out.tensors.append(np.frombuffer(reply_data, dtype=np.uint8))
            return out
        except (FleetError, ProtocolError) as exc:
            return wire.control(Msg.ERROR, {"reason": str(exc)}, frame.stream, frame.seq)
        except (KeyError, TypeError, ValueError) as exc:
            return wire.control(Msg.ERROR, {"reason": f"malformed request ({exc!r})"}, frame.stream, frame.seq)
        except OSError as exc:  # a full disk, say: the caller hears why, and the connection stays
            return wire.control(Msg.ERROR, {"reason": exc.strerror or str(exc)}, frame.stream, frame.seq)

    # --- operations ----------------------------------------------------------------------------------

    def op_ping(self, doc, data) -> dict:
        return {}

    def op_status(self, doc, data) -> dict:
        return {"node": dataclasses.asdict(self.info()), "state": self.state(), "paused": self.paused,
                "link_delay_ms": self.link_delay_ms, "shards": self.store.listing(), "workers": self.worker_status()}

    def worker_status(self) -> list[dict]:
        """The status of each worker it runs (``_Worker.to_json``: its stage, state and tokens served)."""
        with self._lock:
            workers = list(self.workers.values())
        return [w.to_json() for w in workers]

    def op_has_shard(self, doc, data) -> dict:
        return {"present": self.store.has(doc["hash"])}

    def op_put_begin(self, doc, data) -> dict:
        if data is None:
            raise FleetError("put_begin carries the shard's manifest")
        self.activity = "receiving"
        self._changed()
        return {"have": self.store.begin(doc["hash"], data, doc["sizes"])}

    def op_put_chunk(self, doc, data) -> dict:
        return {"offset": self.store.write(doc["hash"], doc["file"], int(doc["offset"]), data or b"")}

    def op_put_end(self, doc, data) -> dict:
        try:
            path = self.store.finish(doc["hash"])
        finally:
            self.activity = "idle"
            self._changed()
        self.log(f"received shard {doc['hash'][:12]} into {path}")
        return {"ok": True}

    def _served(self) -> set[str]:
        with self._lock:
            return {w.hash for w in self.workers.values() if w.running}

    def op_drop_shard(self, doc, data) -> dict:
        digest = check_hash(doc["hash"])
        if digest in self._served():
            raise FleetError(f"shard {digest[:12]} is being served; stop its worker first")
        self.store.drop(digest)
        return {"ok": True}

    def op_prune(self, doc, data) -> dict:
        return self.prune()

    def prune(self) -> dict:
        """Drops every shard no running worker serves (profiling shards, earlier deployments) and the
        transfers left unfinished for ``UNFINISHED_S``: the disk space a laptop gets back."""
        served, shards = self._served(), self.store.listing()
        unused = [s for s in shards if s["hash"] not in served]
        for shard in unused:
            self.store.drop(shard["hash"])
        unfinished, partial_bytes = self.store.drop_unfinished(UNFINISHED_S)
        freed = sum(s["bytes"] for s in unused) + partial_bytes
        if unused or unfinished:
            self.log(f"removed {pruned_text(len(unused), unfinished)} not in use, {freed / 2**20:.1f} MB")
        return {"dropped": [s["hash"] for s in unused], "unfinished": unfinished, "bytes": freed,
                "kept": len(shards) - len(unused)}

    def op_start_worker(self, doc, data) -> dict:
        if self.paused:
            raise FleetError(f"node {self.name} is paused and does not take work")
        digest = check_hash(doc["hash"])
        if not self.store.has(digest):
            raise FleetError(f"this node does not hold shard {digest[:12]}; send it first")
        with self._lock:
            live = [w for w in self.workers.values() if w.running]
            if len(live) >= MAX_WORKERS:
                raise FleetError(f"node {self.name} already runs {len(live)} workers")
        folder = self.store.path(digest)
        manifest = read_manifest(folder)
        role = doc.get("role") or "stage"
        if role not in ("stage", "draft"):
            raise FleetError(f"a worker is a stage or a draft server, not {role!r}")
        host = self.host if self.host not in ("::",) else "0.0.0.0"
        precision = str(doc["precision"]) if doc.get("precision") else None
        shard = ShardOptions(mode=str(doc.get("mode") or MODE), precision=precision,
                             device=self._real_device(str(doc.get("device") or DEVICE)))
        cmd = ["worker", "--role", role, "--shard", str(folder), "--listen", f"{host}:0",
               "--fleet-key-file", str(self.access.key_file), *shard.worker_arguments()]
        delay_ms = float(doc.get("delay_ms") or 0) + self.link_delay_ms  # the deployment's, over this PC's link
        if delay_ms:
            cmd += ["--delay-ms", str(delay_ms)]
        cmd += ["--tls" if self.access.uses_tls else "--no-tls"]  # as this agent, whatever the saved settings say
        # workers of this computer's cores take turns with each other and with a coordinator here
        cmd += ["--compute-turns", str(machine_turns_file())]
        wid = uuid.uuid4().hex[:8]
        log = paths().data / "logs" / f"agent-worker-{wid}.log"
        process = FleetProcess(cmd, log).start()
        try:
            process.wait_ready(float(doc.get("wait_s") or 180))
        except FleetError as exc:
            raise FleetError(f"the worker for {part_name(manifest.stage_index, manifest.stage_count)} did not start "
                             f"({exc})") from None
        info = {"stage": manifest.stage_index, "stages": manifest.stage_count, "layers": list(manifest.layers),
                "model": manifest.model_name,
                "device": doc.get("device") or DEVICE, "delay_ms": delay_ms, "role": role}
        worker = _Worker(wid, digest, process, info)
        with self._lock:
            self.workers[wid] = worker
        what = part_name(manifest.stage_index, manifest.stage_count) if role == "stage" else \
            f"draft server for {manifest.model_name}"
        self.log(f"started worker {wid}: {what} on port {worker.port}")
        self._changed()
        return worker.to_json()

    def op_stop_worker(self, doc, data) -> dict:
        stopped = self.stop_workers(doc.get("worker"))
        return {"stopped": stopped}

    def stop_workers(self, wid: str | None = None) -> list[str]:
        with self._lock:
            chosen = [w for w in self.workers.values() if wid is None or w.id == wid]
            if wid is not None and not chosen:
                raise FleetError(f"no worker {wid} on node {self.name}")
            for w in chosen:
                del self.workers[w.id]
        stop_all([w.process for w in chosen])
        if chosen:
            self._changed()
        return [w.id for w in chosen]

    def op_pause(self, doc, data) -> dict:
        self.set_paused(bool(doc.get("paused", True)))
        return {"paused": self.paused}

    def op_profile(self, doc, data) -> dict:
        digests = [check_hash(d) for d in doc["hashes"]]
        missing = [d[:12] for d in digests if not self.store.has(d)]
        if missing:
            raise FleetError(f"this node does not hold shards {', '.join(missing)}; send them first")
        device = str(doc.get("device") or "CPU")
        self.activity = "profiling"
        self._changed()
        try:
            result = profile_shards([self.store.path(d) for d in digests], device=self._real_device(device),
                                    tokens=int(doc.get("tokens", 16)), prompt=int(doc.get("prompt", 32)))
        finally:
            self.activity = "idle"
            self._changed()
        return result if self.simulated is None else simulated_profile(result, self.simulated)

    def _real_device(self, device: str) -> str:
        """Where work asked of ``device`` runs: a simulated device's work runs on the device it stands for."""
        if self.simulated is None:
            return device
        if device != self.simulated.name:
            raise FleetError(f"node {self.name} is a demo node with a simulated {self.simulated.name} only, "
                             f"not {device}")
        return self.simulated.runs_on

    def op_rtt(self, doc, data) -> dict:
        """Round trip from this node to each peer agent (its control API's median ping)."""
        out = {}
        for address in doc["peers"][:64]:
            try:
                with ControlClient(str(address), self.access, timeout_s=5) as peer:
                    out[address] = peer.round_trip_ms(int(doc.get("count", 5)))
            except AgentError as exc:
                out[address] = None
                self.log(f"rtt to {address}: {exc}")
        return {"rtt_ms": out}


def simulated_profile(measured: dict, device: SimulatedDevice) -> dict:
    """A profile measured on the device a simulated one runs on, as that device's: its name, its
    memory, and every cost divided by its speed."""
    out = dict(measured, device=device.name, memory_bytes=device.memory_mb << 20, simulated=True)
    for key in ("call_ms", "layer_ms", "head_ms", "embed_ms", "prefill_layer_ms"):
        out[key] = measured[key] / device.speed
    return out
