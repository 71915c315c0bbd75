"""The local fleet: stages 1.. of a model as ``fleet worker`` processes on loopback.

This is what ``fleet generate --local-workers`` (and the app's default) runs: the same processes,
sockets and handshake as a multi-machine fleet, all on this computer.  Each worker's log goes to
a file; a worker that fails to start is reported with the end of its log.  The workers exit with
their parent: each watches its stdin, which only the parent holds open.
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

from engine.config import paths
from engine.errors import FleetError
from engine.launch import await_ready, end_processes, start_fleet
from engine.runtime.stages.turns import machine_turns_file


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalFleet:
    def __init__(self, shard_dirs: list[Path], key_file: Path, *, devices: list[str] | None = None,
                 mode: str = "fast", precision: str | None = None, delay_ms: float = 0.0, tls: bool = False,
                 deadline_s: float = 2.0, log_dir: Path | None = None, link_workers: bool = True,
                 isolate: bool = False, cpu_sets: list[str | None] | None = None, take_turns: bool = True):
        """``link_workers``: pass each worker its successor (``--next``); without it the coordinator's
        route tells them.  ``isolate``: one compiled model per stream; ``cpu_sets``: a CPU list per
        worker to pin it to (``engine.runtime.relay.affinity``).  ``take_turns``: unless the workers are
        pinned, they compute one at a time (``engine.runtime.stages.turns``); the coordinator joins them
        through ``turns``."""
        self.shard_dirs = [Path(d) for d in shard_dirs]
        self.devices = devices or ["CPU"] * len(self.shard_dirs)
        self.addresses = [f"127.0.0.1:{free_port()}" for _ in self.shard_dirs]
        self.log_dir = log_dir or paths().data / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.key_file = key_file
        self.link_workers = link_workers
        self.mode, self.precision, self.delay_ms, self.tls, self.deadline_s = mode, precision, delay_ms, tls, deadline_s
        self.isolate = isolate
        self.cpu_sets = cpu_sets or [None] * len(self.shard_dirs)
        self.turns = machine_turns_file() if take_turns and not any(self.cpu_sets) else None

    def arguments(self, i: int) -> list[str]:
        """The ``fleet`` arguments of worker ``i``."""
        cmd = ["worker", "--shard", str(self.shard_dirs[i]), "--listen", self.addresses[i], "--device", self.devices[i],
               "--fleet-key-file", str(self.key_file), "--lifeline", "--deadline", str(self.deadline_s),
               "--mode", self.mode]
        if self.link_workers and i + 1 < len(self.shard_dirs):
            cmd += ["--next", self.addresses[i + 1]]
        if self.precision:
            cmd += ["--precision", self.precision]
        if self.delay_ms:
            cmd += ["--delay-ms", str(self.delay_ms)]
        cmd += ["--tls" if self.tls else "--no-tls"]  # the caller's setting, never the saved file's
        if self.isolate:
            cmd += ["--isolate-streams"]
        if self.cpu_sets[i]:
            cmd += ["--cpus", self.cpu_sets[i]]
        if self.turns:
            cmd += ["--compute-turns", str(self.turns)]
        return cmd

    def start_worker(self, i: int) -> subprocess.Popen:
        log = self.log_dir / f"worker-{self.addresses[i].replace(':', '-')}.log"
        proc = start_fleet(self.arguments(i), log)
        if i < len(self.procs):
            self.procs[i], self.logs[i] = proc, log
        else:
            self.procs.append(proc)
            self.logs.append(log)
        return proc

    def start(self, timeout_s: float = 120.0) -> "LocalFleet":
        for i in range(len(self.shard_dirs)):
            self.start_worker(i)
        for i in range(len(self.shard_dirs)):
            self.wait_ready(i, timeout_s)
        return self

    def wait_ready(self, i: int, timeout_s: float = 120.0) -> None:
        """Blocks until worker ``i`` printed its ready line; raises with its log if it died instead."""
        try:
            await_ready(self.procs[i], self.logs[i], timeout_s)
        except FleetError as exc:
            self.close()
            raise FleetError(f"local worker for stage {i + 1} did not start ({exc})") from None

    def close(self) -> None:
        end_processes(self.procs)
        self.procs = []

    def __enter__(self) -> "LocalFleet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
