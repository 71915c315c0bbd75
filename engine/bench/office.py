"""The office comparison of ``fleet bench sim``: what a second PC adds to one, ours and llama.cpp's.

Two simulated PCs of one core each: this process, pinned to one core, is PC 1; a network namespace
held to the other core is PC 2, its link shaped by tc tbf.  Four servers of the same GGUF are up at
once and take turns, wave by wave:

- ours on one PC: the model whole in this process;
- ours split: stage 0 here, stage 1 on PC 2 (the relay keeps one group of streams per stage in
  flight, so both PCs compute at once), the boundary where both stages take the same time per
  token on this CPU (``balanced_boundary``: an even split by weight bytes, timed);
- ours as two replicas: the model whole here, and whole on PC 2, fed its token ids from here;
  each user is routed to one copy (``Replicas``);
- llama.cpp on one PC: ``llama-server`` on PC 1's core;
- llama.cpp's split: ``llama-server`` here with ``--rpc`` to ``rpc-server`` on PC 2, which holds
  the layers our stage 1 holds (and the output head, as our last stage does);
- llama.cpp as two replicas: ``llama-server`` here and another on PC 2, the users dealt to them in
  turn, as a round-robin proxy in front of them would.

A wave is one request per user at once, a different prompt each, greedy, the end of text ignored, no
prompt cache on either side; its aggregate tok/s is every reply's tokens over the wave's wall time,
its time to first token the median of the users'.  Ours are asked through the chat service, llama.cpp
through its ``/completion`` endpoint with the very token ids our chat template made.
"""

from __future__ import annotations

import os
import socket
import statistics
import threading
import time
from pathlib import Path

from engine.bench.harness import NO_HOOKS, PROMPTS, Hooks
from engine.bench.llamacpp import LlamaServer, binary
from engine.errors import FleetError
from engine.fleet.deploy import LOCAL, StagePlacement, deploy
from engine.fleet.placement import ModelShape, balanced_split
from engine.fleet.profile import profile_shards
from engine.fleet.sim import Office
from engine.fleet.survey import device_profile
from engine.launch import end_processes
from engine.runtime.decode.replicas import Replicas
from engine.runtime.decode.service import ChatService
from engine.runtime.decode.tokenizer import ChatTokenizer
from engine.runtime.stages.chain import LocalChain

OURS_ONE, OURS_SPLIT, OURS_REPLICAS = "ours, one PC", "ours split, 2 PCs", "ours, 2 replicas (2 PCs)"
LLAMA_ONE, LLAMA_SPLIT = "llama.cpp, one PC", "llama.cpp RPC split, 2 PCs"
LLAMA_REPLICAS = "llama.cpp, 2 replicas (2 PCs)"
RPC_PORT = 50052


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


def balanced_boundary(folders: list[Path], shape: ModelShape, core: int) -> int:
    """The layer where a 2-stage split of alike one-core PCs is balanced, from timing the stages of
    a 2-stage export (``folders``) on ``core``: on a CPU that computes in float the head costs less
    than its bytes say, so the split by bytes (``placement.even_split``) leaves stage 0 the busier."""
    before = pin_process({core})
    try:
        measured = profile_shards(folders, "CPU")
    finally:
        pin_process(before)
    return balanced_split(shape, device_profile("pc", measured), 2)[0]


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


def interleave(waves: dict, users: tuple[int, ...], runs: int, log, hooks: Hooks = NO_HOOKS) -> list[dict]:
    """Runs every wave (``name -> f(users) -> (tok/s, first token ms)``) at every user count, taking
    turns, ``runs`` times; one row per configuration and user count with the medians.  Every other
    run takes the waves in reverse order, so that no configuration always follows the same one."""
    samples: dict[tuple[str, int], list[tuple[float, float]]] = {}
    total, done = runs * len(users) * len(waves), 0
    for run in range(runs):
        order = list(waves.items())[::-1 if run % 2 else 1]
        for u in users:
            for name, wave in order:
                tok_s, ttft = wave(u)
                samples.setdefault((name, u), []).append((tok_s, ttft))
                log(f"run {run + 1}/{runs}, {u} user(s), {name}: {tok_s:.2f} tok/s, first token {ttft:.0f} ms")
                done += 1
                hooks.step(done, total, f"run {run + 1}/{runs}: {name}, {u} user(s)")
    return [{"server": name, "users": u, "tok_s": round(statistics.median(t for t, _ in got), 2),
             "ttft_ms": round(statistics.median(f for _, f in got), 1), "runs_tok_s": [round(t, 2) for t, _ in got]}
            for (name, u), got in samples.items()]


def compare(office: Office, model: str, gguf: Path, whole: list[Path], split, *, key: bytes, weights: str,
            tokens: int, users: tuple[int, ...], runs: int, core: int, log, hooks: Hooks = NO_HOOKS
            ) -> tuple[list[dict], dict]:
    """Rows (one per server and user count, medians over ``runs`` waves) and the ratios that say
    whether the second PC adds up.  ``whole``: the model exported whole; ``split``: its 2-stage
    export; ``core``: PC 1's CPU (PC 2's is its node's); ``hooks``: progress, and a cancel between waves."""
    pc2 = office.nodes[next(iter(office.nodes))]
    layers = split.stages[-1].layers[1]
    half = split.stages[1].layers[0]
    prompts = [ChatTokenizer(whole[0]).chat_ids(m).reshape(-1).tolist() for m in messages(max(users))]
    before = pin_process({core})
    opened: list = []

    def service(chain) -> ChatService:
        opened.append(ChatService(chain, streams=max(users), prefix_cache=False))
        return opened[-1]

    def deployed(start: int):
        """Layers from ``start`` on PC 2, those before here (none: the copy on PC 2 is fed from here)."""
        here = [StagePlacement(LOCAL, "CPU", 0, start)] if start else []
        stages = [*here, StagePlacement(pc2.agent, "CPU", start, layers)]
        deployment, chain = deploy(model, stages, key=key, weights=weights)
        opened.append(DeployedWorkers(deployment, key))
        return chain

    try:
        ours_one = service(LocalChain(whole))
        split_chain = deployed(half)
        ours_split = service(split_chain)
        replicas = Replicas([service(LocalChain(whole)), service(deployed(0))])
        llama_one = LlamaServer(gguf, slots=max(users), threads=1, log=log)
        opened.append(llama_one)
        rpc = RpcServer(office, pc2.name, office.root)
        opened.append(rpc)
        # the last (layers - half) layers and the output head on the RPC device, the rest here
        llama_split = LlamaServer(gguf, slots=max(users), threads=1, rpc=rpc.address,
                                  gpu_layers=layers - half + 1, log=log)
        opened.append(llama_split)
        llama_pc2 = LlamaServer(gguf, slots=max(users), threads=1, host=pc2.ip, log=log,
                                launch=lambda cmd: office.spawn(pc2.name, cmd, office.root / "llama-server-pc2.log"))
        opened.append(llama_pc2)
        waves = {OURS_ONE: lambda u: chat_wave(ours_one, u, tokens),
                 OURS_SPLIT: lambda u: chat_wave(ours_split, u, tokens),
                 OURS_REPLICAS: lambda u: chat_wave(replicas, u, tokens),
                 LLAMA_ONE: lambda u: llama_wave(llama_one, prompts, u, tokens),
                 LLAMA_SPLIT: lambda u: llama_wave(llama_split, prompts, u, tokens),
                 LLAMA_REPLICAS: lambda u: llama_wave([llama_one, llama_pc2], prompts, u, tokens)}
        for name, wave in waves.items():  # warm: first compiles, first pages of the weights
            wave(2)
        rows = interleave(waves, users, runs, log, hooks)
    finally:
        close_all(opened, log)
        pin_process(before)
    return rows, _ratios(rows, users) | {"groups in flight on the split (most)": split_chain.most_in_flight}


def _ratios(rows: list[dict], users: tuple[int, ...]) -> dict:
    tok = {(r["server"], r["users"]): r["tok_s"] for r in rows}
    ratios = {}
    for u in users:
        best = max((LLAMA_SPLIT, LLAMA_REPLICAS), key=lambda name: tok[name, u])
        for ours in (OURS_SPLIT, OURS_REPLICAS):
            ratios[f"{u} user(s): {ours} / llama.cpp RPC split"] = round(tok[ours, u] / tok[LLAMA_SPLIT, u], 3)
            ratios[f"{u} user(s): {ours} / llama.cpp's best of 2 PCs ({best})"] = round(tok[ours, u] / tok[best, u], 3)
            ratios[f"{u} user(s): {ours} / ours one PC"] = round(tok[ours, u] / tok[OURS_ONE, u], 3)
            if u % 2 == 0 and (OURS_ONE, u // 2) in tok:  # the bar: 0.85 x 2 PCs at half the users each
                ratios[f"{u} user(s): {ours} / (2 x one PC at {u // 2})"] = round(
                    tok[ours, u] / (2 * tok[OURS_ONE, u // 2]), 3)
        ratios[f"{u} user(s): ours one PC / llama.cpp one PC"] = round(tok[OURS_ONE, u] / tok[LLAMA_ONE, u], 3)
        ratios[f"{u} user(s): llama.cpp RPC split / llama.cpp one PC"] = round(tok[LLAMA_SPLIT, u] /
                                                                               tok[LLAMA_ONE, u], 3)
    return ratios


class DeployedWorkers:
    """A deployment as something to close: its workers stop."""

    def __init__(self, deployment, key: bytes):
        self.deployment, self.key = deployment, key

    def close(self) -> None:
        self.deployment.stop(self.key)

