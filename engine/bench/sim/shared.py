"""What the parts of ``fleet bench sim`` share: the run they are part of (``Sim``), waves of users
against a chat service or llama-server, the servers a part starts on the simulated PCs and closes,
and PC 1 itself (this process, pinned to its core)."""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.config import FleetAccess
from engine.bench.harness import NO_HOOKS, PROMPTS, Hooks, interleave
from engine.bench.llamacpp import LlamaServer, binary
from engine.errors import FleetError
from engine.fleet.placement import ModelShape
from engine.fleet.sim.office import Office
from engine.launch import end_processes
from engine.runtime.decode.replicas import Replicas
from engine.runtime.decode.service import ChatService

RPC_PORT = 50052
# the offices' agents and the workers a part starts speak plaintext, as the parts' own clients (given no
# TLS contexts) do; ``fleet bench tls`` measures what TLS costs
TLS = False


@dataclass
class Sim:
    """One run of ``fleet bench sim``: what was asked (``users`` None: each part's own counts), and
    what every part starts from: the model exported whole, its 2-stage split where a part asked for
    it, the model's GGUF where it has one, this machine's cores (PC 1 takes the first) and the fleet
    key the simulated PCs share."""

    model: str
    weights: str
    tokens: int
    runs: int
    users: tuple[int, ...] | None
    draft: str
    memory_mb: int
    rates: tuple[float, ...]
    cores: list[int]
    log: Callable[[str], None]
    gguf: Path | None = None
    gguf_missing: str = ""  # why there is no GGUF
    whole: object = None  # the export whole (``ExportResult``)
    shape: ModelShape | None = None
    split: object = None  # the 2-stage export (``ExportResult``), for the parts that run it
    access: FleetAccess | None = None  # the shared key's, read from its file; TLS as the offices speak it
    key: bytes = b""
    root: Path | None = None  # a temporary folder: each office's logs and homes, in a folder of its own


def pin_process(cpus: set[int]) -> set[int]:
    """Pins every thread of this process (OpenVINO's, zeroconf's) to ``cpus``; returns the CPUs it had.
    Processes started afterwards inherit the pinning."""
    before = os.sched_getaffinity(0)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that ended meanwhile
            pass
    return before


@contextlib.contextmanager
def on_pc1(core: int, log):
    """This process pinned to PC 1's ``core`` for a comparison; yields the list of what it opens, all
    closed last first (``close_all``) and the pinning undone when it ends."""
    before = pin_process({core})
    opened: list = []
    try:
        yield opened
    finally:
        close_all(opened, log)
        pin_process(before)


def close_all(opened: list, log) -> None:
    """Closes what a comparison opened, last first; a failure is logged, not raised (closing is best
    effort: the office ends what is left)."""
    for thing in reversed(opened):
        try:
            thing.close()
        except Exception as exc:  # see the docstring
            log(f"closing {thing!r} failed: {exc}")


def messages(users: int) -> list[list[dict]]:
    prompts = list(PROMPTS.values())
    return [[{"role": "user", "content": prompts[u % len(prompts)]}] for u in range(users)]


def chat_wave(service: ChatService | Replicas, users: int, tokens: int) -> tuple[float, float]:
    """One request per user at once, a different prompt each: (aggregate tok/s, median first token ms)."""
    started = time.perf_counter()
    handles = [service.submit(m, tokens, ignore_eos=True) for m in messages(users)]
    replies = [h.wait(1200) for h in handles]
    wall = time.perf_counter() - started
    failed = [r.error or "no reply in time" for r in replies if r is None or r.error]
    if failed:
        raise FleetError(f"a reply failed: {failed[0]}")
    return sum(len(r.tokens) for r in replies) / wall, statistics.median(r.ttft_ms for r in replies)


def llama_wave(servers: LlamaServer | list[LlamaServer], prompts: list[list[int]], users: int,
               tokens: int) -> tuple[float, float]:
    """As ``chat_wave``, of llama-server; several ``servers`` take the users in turn (round robin)."""
    servers = servers if isinstance(servers, list) else [servers]
    timings: list[dict | BaseException] = [{}] * users

    def user(u: int) -> None:
        try:
            timings[u] = servers[u % len(servers)].complete(prompts[u % len(prompts)], tokens)
        except BaseException as exc:  # reported below, on the caller's thread
            timings[u] = exc

    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    failed = [t for t in timings if isinstance(t, BaseException)]
    if failed:
        raise FleetError(f"llama-server failed a request: {failed[0]}")
    return sum(t["predicted_n"] for t in timings) / wall, statistics.median(t["prompt_ms"] for t in timings)


def take_turns(keys, wave: Callable[[tuple[str, int]], tuple[float, float]], runs: int, log,
               hooks: Hooks = NO_HOOKS, alternate: bool = False) -> dict[tuple[str, int], list[tuple[float, float]]]:
    """Runs the wave of every key (``(server, users)``; ``wave(key) -> (tok/s, first token ms)``) once a
    round, ``runs`` rounds (``harness.interleave``); each key's results, each logged as it comes."""

    def logged(key: tuple[str, int], run: int) -> tuple[float, float]:
        tok_s, ttft = wave(key)
        log(f"run {run + 1}/{runs}, {key[1]} user(s), {key[0]}: {tok_s:.2f} tok/s, first token {ttft:.0f} ms")
        return tok_s, ttft

    return interleave(logged, keys, runs, alternate=alternate, hooks=hooks,
                      label=lambda key: f"{key[0]}, {key[1]} user(s)")


def medians(got: list[tuple[float, float]]) -> dict:
    """A row's figures from a wave's results over the runs: the median tok/s and first token, and each run's tok/s."""
    return {"tok_s": round(statistics.median(t for t, _ in got), 2),
            "ttft_ms": round(statistics.median(f for _, f in got), 1), "runs_tok_s": [round(t, 2) for t, _ in got]}


def wave_rows(waves: dict, users: tuple[int, ...], runs: int, log, hooks: Hooks = NO_HOOKS) -> list[dict]:
    """Every wave (``name -> f(users) -> (tok/s, first token ms)``) at every user count, taking turns,
    every other round in the reverse order (``take_turns``); one row per server and user count."""
    keys = [(name, u) for u in users for name in waves]
    samples = take_turns(keys, lambda key: waves[key[0]](key[1]), runs, log, hooks, alternate=True)
    return [{"server": name, "users": u, **medians(got)} for (name, u), got in samples.items()]


class RpcServer:
    """llama.cpp's ``rpc-server`` on a simulated PC: in its namespace and cgroups, on one thread."""

    def __init__(self, office: Office, pc: str, log_dir: Path, threads: int = 1, port: int = RPC_PORT):
        node = office.nodes[pc]
        self.address = f"{node.ip}:{port}"
        self.log = log_dir / f"rpc-server-{pc}.log"
        self.proc = office.spawn(pc, [str(binary("ggml-rpc-server")), "-H", "0.0.0.0", "-p", str(port),
                                      "-t", str(threads)], self.log)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise FleetError(f"rpc-server on {pc} exited (code {self.proc.returncode}): "
                                 f"{self.log.read_text()[-500:]}")
            try:
                socket.create_connection((node.ip, port), timeout=2).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise FleetError(f"rpc-server on {pc} did not listen on {self.address} in 60 s") from None
                time.sleep(0.2)

    def close(self) -> None:
        end_processes([self.proc], timeout_s=15)


class DeployedWorkers:
    """A deployment as something to close: its workers stop."""

    def __init__(self, deployment, key: bytes):
        self.deployment, self.key = deployment, key

    def close(self) -> None:
        self.deployment.stop(FleetAccess(self.key))


def need_gguf(sim: Sim) -> None:
    """The check of a part that runs llama.cpp: the model must have a GGUF."""
    if sim.gguf is None:
        raise FleetError(f"the office comparisons run llama.cpp on the model's GGUF: {sim.gguf_missing}")
