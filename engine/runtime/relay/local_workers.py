"""Local workers: stages 1.. of a model as ``fleet worker`` processes this process starts on loopback.

Not to be confused with ``engine.fleet.local_agent`` (a node agent on this PC that starts the
workers it is asked for).  This is what ``fleet generate --local-workers`` runs: the same processes,
sockets and handshake as a multi-machine fleet, all on this computer.  Each worker's log goes to
a file; a worker that fails to start is reported with the end of its log.  The workers exit with
their parent: each watches its stdin, which only the parent holds open.

``hosting="threads"`` serves the same workers from threads of this process instead: the same
sockets, handshake and frames, without a process start and an OpenVINO start per worker (the
test suite's fast tier runs its relay tests so; a worker's death is a process's, so those
tests keep to processes).
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

from engine.config import FleetAccess, RelayOptions, ShardOptions, parse_devices, paths
from engine.errors import FleetError
from engine.launch import FleetProcess, stop_all
from engine.manifest import part_name
from engine.runtime.relay.worker import Worker
from engine.runtime.stages.turns import compute_turns, machine_turns_file

HOSTINGS = ("processes", "threads")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keep(entries: list, i: int, value) -> None:
    """Worker ``i``'s entry: replaced when it was started before, else added."""
    if i < len(entries):
        entries[i] = value
    else:
        entries.append(value)


class LocalWorkers:
    """Stages 1.. of a model served on this computer by workers this process starts, for a coordinator
    here (the module's docstring)."""

    def __init__(self, shard_dirs: list[Path], access: FleetAccess, *, shard: ShardOptions = ShardOptions(),
                 relay: RelayOptions = RelayOptions(), delay_ms: float = 0.0,
                 log_dir: Path | None = None, link_workers: bool = True,
                 isolate: bool = False, cpu_sets: list[str | None] | None = None, take_turns: bool = True,
                 hosting: str = "processes"):
        """``access``: the fleet key, TLS and deadline the workers go with; a worker process is told
        its key file (``access.key_file``), whether it speaks TLS and the deadline.  ``shard``: how the
        workers compile their shards (the correctness mode every stage must run, the precision hint, and
        one device for every worker or one per worker, ``parse_devices``; its weights go unused here);
        ``relay``: what the workers' relay runs with (a worker process is told its heartbeat).  ``link_workers``:
        pass each worker its successor (``--next``); without it the coordinator's route tells them.
        ``isolate``: one compiled model per stream; ``cpu_sets``: a CPU list per worker to pin it to
        (``engine.runtime.relay.affinity``).  ``take_turns``: unless the workers are pinned, they compute
        one at a time (``engine.runtime.stages.turns``); the coordinator joins them through ``turns``.
        ``hosting``: "processes" or "threads" (the module's docstring)."""
        if hosting not in HOSTINGS:
            raise FleetError(f"unknown hosting {hosting!r}; choose one of {', '.join(HOSTINGS)}")
        if hosting == "threads" and any(cpu_sets or []):
            raise FleetError("workers hosted in threads cannot be pinned to CPUs of their own")
        if hosting == "processes" and access.key_file is None:
            raise FleetError("worker processes need the fleet key's file: a fleet access read from one "
                             "(engine.fleetkey.access_of)")
        self.shard_dirs = [Path(d) for d in shard_dirs]
        self.shard, self.relay = shard, relay
        self.devices = parse_devices(shard.device, len(self.shard_dirs))
        self.addresses = [f"127.0.0.1:{free_port()}" for _ in self.shard_dirs]
        self.log_dir = log_dir or paths().data / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.hosting = hosting
        self.processes: list[FleetProcess] = []  # hosting "processes"
        self.workers: list = []  # hosting "threads": engine.runtime.relay.worker.Worker
        self._log_files: list = []  # their logs, open
        self.logs: list[Path] = []
        self.access = access
        self.link_workers = link_workers
        self.delay_ms = delay_ms
        self.isolate = isolate
        self.cpu_sets = cpu_sets or [None] * len(self.shard_dirs)
        self.turns = machine_turns_file() if take_turns and not any(self.cpu_sets) else None

    def stage_shard(self, i: int) -> ShardOptions:
        """How worker ``i`` compiles its shard: the shard options, on its own device."""
        return self.shard.on(self.devices[i])

    def arguments(self, i: int) -> list[str]:
        """The ``fleet`` arguments of worker ``i``."""
        cmd = ["worker", "--shard", str(self.shard_dirs[i]), "--listen", self.addresses[i],
               "--fleet-key-file", str(self.access.key_file), "--deadline", str(self.access.deadline_s),
               *self.stage_shard(i).worker_arguments(), *self.relay.worker_arguments()]
        if self.link_workers and i + 1 < len(self.shard_dirs):
            cmd += ["--next", self.addresses[i + 1]]
        if self.delay_ms:
            cmd += ["--delay-ms", str(self.delay_ms)]
        cmd += ["--tls" if self.access.uses_tls else "--no-tls"]  # the caller's access, never the saved settings
        if self.isolate:
            cmd += ["--isolate-streams"]
        if self.cpu_sets[i]:
            cmd += ["--cpus", self.cpu_sets[i]]
        if self.turns:
            cmd += ["--compute-turns", str(self.turns)]
        return cmd

    def start_worker(self, i: int) -> subprocess.Popen | None:
        """Starts worker ``i`` (again, if it ran before); its process, or None when hosted in a thread."""
        log = self.log_dir / f"worker-{self.addresses[i].replace(':', '-')}.log"
        _keep(self.logs, i, log)
        if self.hosting == "threads":
            self._start_thread(i, log)
            return None
        process = FleetProcess(self.arguments(i), log).start()
        _keep(self.processes, i, process)
        return process.proc

    def _start_thread(self, i: int, log: Path) -> None:
        log.parent.mkdir(parents=True, exist_ok=True)
        out = open(log, "a", buffering=1)

        def write(message: str) -> None:
            try:
                out.write(message + "\n")
            except ValueError:  # closed with the fleet while a worker's thread still had a word to log
                pass

        nxt = self.addresses[i + 1] if self.link_workers and i + 1 < len(self.shard_dirs) else None
        try:
            worker = Worker(self.shard_dirs[i], self.addresses[i], nxt, access=self.access, shard=self.stage_shard(i),
                            delay_ms=self.delay_ms, log=write, isolate=self.isolate, turns=compute_turns(self.turns),
                            relay=self.relay)
        except Exception as exc:
            out.close()
            self.close()
            raise self._not_started(i, exc) from exc
        worker.start()
        _keep(self.workers, i, worker)
        _keep(self._log_files, i, out)

    @property
    def procs(self) -> list[subprocess.Popen]:
        """The worker processes (hosting "processes")."""
        return [p.proc for p in self.processes]

    def start(self, timeout_s: float = 120.0) -> "LocalWorkers":
        for i in range(len(self.shard_dirs)):
            self.start_worker(i)
        for i in range(len(self.shard_dirs)):
            self.wait_ready(i, timeout_s)
        return self

    def wait_ready(self, i: int, timeout_s: float = 120.0) -> None:
        """Blocks until worker ``i`` printed its ready line; raises with its log if it died instead.
        A worker hosted in a thread is ready once started."""
        if self.hosting == "threads":
            return
        try:
            self.processes[i].wait_ready(timeout_s)
        except FleetError as exc:
            self.close()
            raise self._not_started(i, exc) from None

    def _not_started(self, i: int, why: Exception) -> FleetError:
        """Worker ``i`` (the model's part i + 2: part 1 runs in this process) did not start."""
        return FleetError(f"the local worker for {part_name(i + 1, len(self.shard_dirs) + 1)} did not start ({why})")

    def close(self) -> None:
        stop_all(self.processes)
        self.processes = []
        for worker, out in zip(self.workers, self._log_files):
            worker.stop()
            out.close()
        self.workers, self._log_files = [], []

    def __enter__(self) -> "LocalWorkers":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
