"""What the fleet tests share: real ``fleet agent`` processes on loopback, each with its own home,
a simulated office of such agents in network namespaces (``engine.fleet.sim.office``),
another process holding a computer's compute turn, a listener that trickles its answers, and greedy
decoding through a deployment compared with its stages in one process."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from engine.config import FleetAccess, ShardOptions
from engine.fleet.deploy import deploy
from engine.fleet.sim.office import Office
from engine.fleetkey import access_of
from engine.launch import FleetProcess
from engine.runtime.decode.generate import Generator
from engine.runtime.stages.chain import LocalChain
from engine.transport import wire

IDS = np.array([[5, 17, 42, 101, 7, 250, 33, 64, 9]], dtype=np.int64)


@contextlib.contextmanager
def agent_process(key_file: Path, home: Path, *, mdns: bool = False, name: str = "node", env: dict | None = None,
                  listen: str = "127.0.0.1:0", tls: bool = False):
    """A ``fleet agent`` process with its own home (its own node id and shard store) and ``env`` on
    top of this one's; yields (process, HOST:PORT of its control API).  ``tls``: it and its workers
    speak TLS (the fleet's default; off by default here, as the engine's clients are when given no
    TLS contexts)."""
    home.mkdir(parents=True, exist_ok=True)
    args = ["agent", "--listen", listen, "--fleet-key-file", str(key_file), "--name", name,
            "--tls" if tls else "--no-tls"] + ([] if mdns else ["--no-mdns"])
    agent = FleetProcess(args, home / "agent.log", env={**os.environ, **(env or {}), "FLEETSHARD_HOME": str(home)})
    try:
        yield agent.start().proc, agent.wait_ready(60)
    finally:
        agent.stop(timeout_s=15)


def fleet_profile(model: str, agents: dict, key: bytes, *, weights: str = "int4", memory: int = 8 << 30,
                  access: FleetAccess | None = None) -> dict:
    """The fleet profile failover re-plans from and standbys are placed with, for ``agents`` (name ->
    (process, address)): their real node ids and addresses, every device alike with ``memory`` bytes
    (the survey, which measures them, has its own tests; here what matters is where the layers go).
    ``access``: how the agents are asked (default: ``key`` in plain text)."""
    from engine.export.exporter import export_model
    from engine.fleet.control import ControlClient
    from engine.fleet.deploy import LOCAL
    from engine.fleet.placement import DeviceProfile, Fleet, ModelShape
    from engine.fleet.profile import model_shape
    from engine.manifest import load_manifest

    nodes = {"coordinator": {"name": "this PC", "address": LOCAL}}
    for name, (_, address) in agents.items():
        with ControlClient(address, access or FleetAccess(key)) as client:
            nodes[client.status()["node"]["node_id"]] = {"name": name, "address": address}
    folder = export_model(model, stages=1, weights=weights).folders[0]
    shape = ModelShape(**model_shape(load_manifest(folder)))
    devices = [DeviceProfile(node, "CPU", memory, layer_ms=0.2, head_ms=1.0) for node in nodes]
    rtt = {(a, b): 0.3 for a in nodes for b in nodes if a < b}
    return {"model": shape.to_json(), "nodes": nodes,
            "fleet": Fleet(devices=devices, rtt_ms=rtt, coordinator="coordinator").to_json()}


@contextlib.contextmanager
def fleet_up(args: list[str], log: Path, env: dict | None = None):
    """``fleet up ARGS --lifeline`` as a process, its stderr in ``log``; yields (process, the lines it
    printed up to its "ready DEPLOYMENT" line, that Deployment).  Killed on the way out if still up."""
    from engine.fleet.deploy import Deployment

    with open(log, "w") as err:
        up = subprocess.Popen([sys.executable, "-m", "engine.cli", "up", *args, "--lifeline"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=err, text=True, env=env or os.environ.copy())
    try:
        lines = []
        while not (lines and lines[-1].startswith("ready ")):
            line = up.stdout.readline()
            assert line, f"fleet up ended early: {log.read_text()[-3000:]}"
            lines.append(line)
        yield up, lines, Deployment.load(Path(lines[-1].split(" ", 1)[1].strip()))
    finally:
        if up.poll() is None:
            up.kill()
        up.stdout.close()


@contextlib.contextmanager
def simulated_office(specs, key_file: Path, root: Path, *, tls: bool = False):
    """An ``engine.fleet.sim.office.Office`` of ``specs`` whose agents answer inside the block; every namespace,
    link and cgroup it made is gone after it, also after a failure.  Needs root.  ``tls``: as
    ``agent_process``'s."""
    with Office(specs, access=access_of(key_file, tls=tls), root=root) as office:
        yield office


HOLDER = """
import sys
from engine.runtime.stages.turns import ComputeTurns
turns = ComputeTurns(sys.argv[1])
with turns:
    print("held", flush=True)
    sys.stdin.read()  # until the test closes our stdin
"""


def eventually(predicate, timeout_s: float = 60.0) -> bool:
    """Whether ``predicate()`` comes true within ``timeout_s`` (a guard against a hang, not a measure)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def waits_for_turn(path: Path, timeout_s: float = 60.0) -> bool:
    """Whether a process (or a thread, through a descriptor of its own) comes to wait for the
    compute turn of ``path``: a blocked ``flock`` on the file in /proc/locks (Linux)."""
    import pytest

    if not Path("/proc/locks").exists():
        pytest.skip("reads the kernel's table of file locks (/proc/locks: Linux only)")
    info = path.stat()
    inode = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    return eventually(lambda: any("->" in line and inode in line.split()
                                  for line in Path("/proc/locks").read_text().splitlines()), timeout_s)


@contextlib.contextmanager
def turn_held(path: Path):
    """Another process holding the compute turn of ``path`` until the test closes its stdin (or
    the block ends); yields that process."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.kill()
        holder.wait()
        holder.stdin.close()
        holder.stdout.close()


def greedy(chain, tokens=12):
    return Generator(chain, max_length=128).generate(IDS, tokens, ignore_eos=True).tokens


def greedy_in_process(deployment):
    """What the deployment's exported stages give in one process."""
    return greedy(LocalChain(sorted(Path(deployment.stage0).parent.glob("stage*[0-9]"))))


def deployed_equals_in_process(source: str, stages, key: bytes, tls=None) -> None:
    """Deploys ``stages`` (f32), decodes through the chain, stops it, and compares with the same
    exported stages in one process; ``tls``: the fleet's TLS contexts, when its agents speak it."""
    deployment, chain = deploy(source, stages, access=FleetAccess(key, tls), shard=ShardOptions(weights="f32"))
    try:
        got = greedy(chain)
    finally:
        chain.close()
        deployment.stop(FleetAccess(key, tls))
    assert got == greedy_in_process(deployment)


class Trickler:
    """A listener on loopback (a keyless host) that answers each connection with the start of a
    CHALLENGE, a byte every ``gap`` seconds (well inside any per-read timeout), ``count`` bytes, then
    closes it.  ``accepted`` is set once a connection came."""

    def __init__(self, gap: float = 0.1, count: int = 60):
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.accepted = threading.Event()
        self._stop = threading.Event()
        self._reply = wire.encode(wire.control(wire.Msg.CHALLENGE, {"nonce": "00" * 32, "proof": "00" * 32}))[:count]
        self._gap = gap
        threading.Thread(target=self._accept, daemon=True, name="trickler").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.accepted.set()
            threading.Thread(target=self._trickle, args=(conn,), daemon=True, name="trickle").start()

    def _trickle(self, conn: socket.socket) -> None:
        with conn:
            for byte in self._reply:
                if self._stop.wait(self._gap):
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    return

    def close(self) -> None:
        self._stop.set()
        self._listener.close()

    def __enter__(self) -> "Trickler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
