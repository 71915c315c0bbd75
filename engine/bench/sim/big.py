"""The ``big`` part of ``fleet bench sim``: a model that no simulated PC can hold alone, served
across two of them.

Two PCs of one core and ``memory_mb`` each (cgroup caps; this machine has no swap) at 1 Gbit/s: the
whole model does not fit on one, by the placement solver's memory model (every stage's weights, its
KV cache at the planned context, a runtime overhead: the headroom), and llama.cpp whole on one
pages its weights from disk.  The solver places the model from what each PC's agent reports free
under its cap.  The servers run one at a time (under a cap they cannot share a PC):

- ours split: ``fleet serve`` on PC 1 (the coordinator: the API and stage 0), a worker on PC 2;
- llama.cpp whole on PC 1, as it comes (most weights repacked into its own memory) and with
  ``--no-repack`` (every weight read from the mapped file), the two ways a user can run it;
- llama.cpp's split: ``llama-server`` on PC 1 with ``--rpc`` to ``rpc-server`` on PC 2, the layers
  divided as ours are.

Before each server starts, the files it reads leave the page cache, so the pages it reads are
charged to its PC as on a PC that just started (a page cached earlier by another cgroup would be
free for it).  Each wave is one streamed request per user at once, a prompt no server saw before,
greedy, the end of text ignored; tok/s is every reply's tokens over the wave's wall time.  Each
PC's peak memory (what its processes use: the page cache they do not map left out) is sampled
while the server loads and serves, with the processes the cap killed.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import statistics
import threading
import time
from pathlib import Path

from engine.bench.harness import NO_HOOKS, PROMPTS, Hooks
from engine.bench.llamacpp import LlamaServer
from engine.bench.serve import user_wave
from engine.bench.sim.shared import TLS, RpcServer, Sim, medians
from engine.config import FleetAccess
from engine.errors import FleetError
from engine.export.exporter import export_model
from engine.fleet.sim import netns
from engine.fleet.control import ControlClient, worker_address
from engine.fleet.placement import DeviceProfile, Fleet, Infeasible, ModelShape, Plan, solve
from engine.fleet.sim.office import NodeSpec, Office
from engine.launch import end_processes, fleet_command

USERS = (1, 4)
TOKENS = 32  # few: llama.cpp paging its weights makes every token slow
CONTEXT = 1024  # llama.cpp's context per slot: it allocates the KV cache of every slot whole, under the cap
SERVE_PORT = 8100
OURS = "ours split, 2 capped PCs"
LLAMA_ONE, LLAMA_ONE_MAPPED = "llama.cpp, one capped PC", "llama.cpp --no-repack, one capped PC"
LLAMA_SPLIT = "llama.cpp RPC split, 2 capped PCs"


def run(sim: Sim, hooks: Hooks) -> tuple[list[dict], dict, dict]:
    """Two PCs of one core and ``sim.memory_mb`` each, at 1 Gbit/s."""
    specs = [NodeSpec(f"pc{i + 1}", memory_mb=sim.memory_mb, cpus=str(sim.cores[i]), rate_mbit=1000.0)
             for i in range(2)]
    with Office(specs, access=sim.access, root=sim.root / "big", log=sim.log) as office:
        rows, ratios, plan = compare_big(office, sim.model, sim.gguf, sim.shape, key=sim.key, weights=sim.weights,
                                            runs=sim.runs, log=sim.log, hooks=hooks)
    return rows, ratios, {"big": {"memory_mb": sim.memory_mb, "users": list(USERS), "tokens": TOKENS,
                                  "pcs": "2, one core and the memory cap each, 1 Gbit/s; no swap",
                                  "placement": plan.explain().splitlines()}}


def place(office: Office, shape: ModelShape, users: int, key: bytes) -> Plan:
    """The solver's placement over the office's PCs (the first one the coordinator), each with the
    memory its agent reports free under its cap and alike in speed (a stage's time is the weights
    it reads per token, as ``placement.even_split`` counts them).  Raises FleetError when one PC
    holds the whole model: then the comparison would not be about a model too big for one."""
    devices = []
    for node in office.nodes.values():
        with ControlClient(node.agent, FleetAccess(key)) as agent:
            free = agent.status()["node"]["available_mb"] << 20
        devices.append(DeviceProfile(node.name, "CPU", free, layer_ms=1.0,
                                     head_ms=shape.head_bytes / shape.layer_bytes))
    names = [d.node for d in devices]
    fleet = Fleet(devices, {(a, b): 0.3 for a in names for b in names if a < b}, coordinator=names[0])
    try:
        alone = solve(shape, fleet, max_stages=1)
    except Infeasible:
        return solve(shape, fleet, objective="throughput", users=users)
    raise FleetError(f"{alone.stages[0].node} holds the whole model under its cap: give each PC less memory")


def _uncache(paths: list[Path]) -> None:
    """Drops the files' pages from the page cache (those no process maps)."""
    for path in paths:
        for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class _Peaks:
    """Samples each PC's memory every 50 ms until closed: the peaks of what its processes use (mapped
    files too) and of their anonymous memory, and the cap's kills."""

    def __init__(self, office: Office):
        self.office = office
        self.peak = {(name, what): 0 for name in office.nodes for what in ("used", "anon")}
        self.kills = {name: netns.oom_kills(n.cgroup) for name, n in office.nodes.items()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            for name, node in self.office.nodes.items():
                self.peak[name, "used"] = max(self.peak[name, "used"], netns.memory_used(node.cgroup))
                self.peak[name, "anon"] = max(self.peak[name, "anon"], netns.memory_anonymous(node.cgroup))

    def close(self) -> dict:
        self._stop.set()
        self._thread.join()
        out = {}
        for name, node in self.office.nodes.items():
            out[f"peak_mb_{name}"] = self.peak[name, "used"] >> 20
            out[f"peak_anon_mb_{name}"] = self.peak[name, "anon"] >> 20
            out[f"oom_kills_{name}"] = netns.oom_kills(node.cgroup) - self.kills[name]
        return out


class _OursServer:
    """``fleet serve`` on PC 1 with stage 0, its later stage a worker that PC 2's agent runs."""

    def __init__(self, office: Office, folders: list[Path], model: str, key: bytes, streams: int):
        pc1, pc2 = office.nodes.values()
        self.key, self.agent = key, pc2.agent
        with ControlClient(pc2.agent, FleetAccess(key)) as agent:
            digest, _ = agent.send_shard(folders[1])
            self.worker = agent.start_worker(digest)
        _uncache([folders[0]])
        self.log = office.root / "fleet-serve.log"
        self.proc = office.spawn(pc1.name, fleet_command(
            "serve", "--shards", str(folders[0]), "--remote", worker_address(pc2.agent, self.worker["port"]),
            "--host", "0.0.0.0", "--port", str(SERVE_PORT), "--streams", str(streams), "--model-id", model,
            "--fleet-key-file", str(office.key_file), "--tls" if TLS else "--no-tls"), self.log, home=True)
        self.url = f"http://{pc1.ip}:{SERVE_PORT}/v1"
        deadline = time.monotonic() + 300
        while "ready " not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise FleetError(f"fleet serve on {pc1.name} did not come up: {self.log.read_text()[-800:]}")
            time.sleep(0.5)
        self.api_key = (pc1.home / "config" / "api.key").read_text().strip()

    def close(self) -> None:
        end_processes([self.proc], timeout_s=15)
        with contextlib.suppress(Exception), ControlClient(self.agent, FleetAccess(self.key)) as agent:
            agent.stop_worker(self.worker["id"])


class _Both:
    """llama.cpp's split as one server: ``llama-server`` and the ``rpc-server`` it uses."""

    def __init__(self, server: LlamaServer, rpc: RpcServer):
        self.server, self.rpc, self.url = server, rpc, server.url

    def close(self) -> None:
        self.server.close()
        self.rpc.close()


def compare_big(office: Office, model: str, gguf: Path, shape: ModelShape, *, key: bytes, weights: str,
                   runs: int, log, hooks: Hooks = NO_HOOKS) -> tuple[list[dict], dict, Plan]:
    """Rows per server and user count (medians over ``runs`` waves, with each PC's peak memory), the
    ratios of ours to llama.cpp's, and the solver's placement."""
    plan = place(office, shape, max(USERS), key)
    log(plan.explain())
    boundary = plan.stages[0].end
    split = export_model(model, split=[boundary], weights=weights)
    pc1, pc2 = office.nodes.values()
    prompts = list(PROMPTS.values())
    waves = itertools.count()  # a number in each prompt: no server has seen it before

    def llama(*extra: str, rpc: str | None = None):
        _uncache([gguf])
        return LlamaServer(gguf, slots=max(USERS), context=CONTEXT, threads=1, extra=extra, rpc=rpc,
                           gpu_layers=None if rpc is None else shape.num_layers - boundary + 1, host=pc1.ip,
                           launch=lambda cmd: office.spawn(pc1.name, cmd, office.root / "llama-server.log"), log=log)

    def llama_split():
        rpc = RpcServer(office, pc2.name, office.root)
        try:
            return _Both(llama(rpc=rpc.address), rpc)
        except BaseException:
            rpc.close()
            raise

    servers = {OURS: lambda: _OursServer(office, split.folders, model, key, max(USERS)),
               LLAMA_ONE: lambda: llama(), LLAMA_ONE_MAPPED: lambda: llama("--no-repack"),
               LLAMA_SPLIT: llama_split}
    rows, total, done = [], len(servers) * len(USERS) * runs, 0
    for name, start in servers.items():
        peaks, server, samples = _Peaks(office), None, {}
        try:
            server = start()
            key_of = getattr(server, "api_key", "bench")
            extra = None if name == OURS else {"cache_prompt": False}
            for run in range(runs + 1):  # the first: warm-up
                for users in USERS:
                    asked = [f"({next(waves)}) {prompts[u % len(prompts)]}" for u in range(users)]
                    results, wall = user_wave(server.url, model, asked, TOKENS, api_key=key_of, extra=extra)
                    if run:
                        ttft = statistics.median(r["ttft_ms"] for r in results)
                        samples.setdefault(users, []).append((sum(r["tokens"] for r in results) / wall, ttft))
                        log(f"{name}, {users} user(s), run {run}/{runs}: {samples[users][-1][0]:.2f} tok/s")
                        done += 1
                        hooks.step(done, total, f"{name}: {users} user(s), run {run}/{runs}")
        except Exception as exc:  # a server the cap kills, or one that cannot start: its row says so
            log(f"{name} failed: {exc}")
            samples["error"] = str(exc)[-300:]
        finally:
            if server is not None:
                server.close()
            memory = peaks.close() | {"cap_mb": pc1.spec.memory_mb}
        if "error" in samples:
            rows.append({"part": "big", "server": name, "error": samples["error"], **memory})
        for users, got in sorted((u, g) for u, g in samples.items() if u != "error"):
            rows.append({"part": "big", "server": name, "users": users, **medians(got), **memory})
    return rows, _ratios(rows), plan


def _ratios(rows: list[dict]) -> dict:
    tok = {(r["server"], r["users"]): r["tok_s"] for r in rows if "tok_s" in r}
    ratios = {}
    for u in USERS:
        if (OURS, u) not in tok:
            continue
        alone = [tok[s, u] for s in (LLAMA_ONE, LLAMA_ONE_MAPPED) if (s, u) in tok]
        if alone:
            ratios[f"too big, {u} user(s): ours split / llama.cpp one capped PC (its better way)"] = round(
                tok[OURS, u] / max(alone), 3)
        if (LLAMA_SPLIT, u) in tok:
            ratios[f"too big, {u} user(s): ours split / llama.cpp RPC split"] = round(
                tok[OURS, u] / tok[LLAMA_SPLIT, u], 3)
    return ratios
