"""``fleet bench profile``: where a decode step's time goes on this machine, for one user and for
several at once, on the 1-stage export of a model (paged, as the app serves it).

Each decode round (every stream one new token, packed into one forward) is split into:
- the inference call, and inside it the graph's nodes by kind, from OpenVINO's performance counters
  (``PERF_COUNT``): the matmuls (FullyConnected) with the output head apart, attention, and the rest,
  each as its share of the counters' sum (the counters can add up to more than the call's wall time,
  so the sum's ratio to it is reported too);
- the stage's Python around the call (its inputs), and the decoding loop's around the forward
  (sampling, bookkeeping): the time from one decode round's start to the next, less the forward.
Beside it, the speed at which the stock compressed int8 MatMul reads weights from memory (matrices
of ``memory_mb`` in all, more than a CPU cache holds): the bound a memory-bound decode meets.
Each of ``paths`` is profiled side by side, interleaved: the stock path (the CPU plugin's compressed
MatMuls) and, where this machine has the kernel extension, the carried GGUF matrices in the
``GGMLMatMul`` operation (``engine.kernels``: our kernels for the types they cover, ggml's for the
rest).  With ``--llamacpp``, llama-server's own per-token time on the same GGUF, one user, sits beside
them, measured in each run after them.
A path named with ``-dynamic`` (``ggml-dynamic``) runs without the graphs with a fixed token axis
(``engine.runtime.stages.paged``): its rounds run on the graph with dynamic shapes; the others have
the fixed graph of each user count compiled before they start.
Prefill forwards are left out; the rounds are run ``runs`` times and each figure is the median.
``mode`` is the correctness mode the stage compiles in: ``exact`` keeps the activations in float,
in our kernels as in the stock MatMuls.
"""

from __future__ import annotations

import collections
import contextlib
import time
from pathlib import Path
from statistics import median

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from engine import kernels
from engine.bench.harness import PROMPTS, prompt_ids
from engine.bench.llamacpp import VERSION as LLAMACPP_VERSION
from engine.bench.llamacpp import LlamaServer
from engine.bench.report import write_report
from engine.config import DEFAULT_WEIGHTS
from engine.errors import FleetError
from engine.export.exporter import export_model
from engine.models.catalog import CATALOG, pull
from engine.runtime.decode.generate import generate_streams
from engine.runtime.decode.tokenizer import ChatTokenizer
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.paged import PagedStage
from engine.runtime.stages.stage import compile_config, core

USERS = (1, 4)
ATTENTION = ("PagedAttention", "ScaledDotProductAttention")  # node types, as prefixes
NODES = ("layer matmuls", "head matmul", "attention", "other nodes")
KERNEL = "matmuls on "  # and the plugin's name of the kernel
LLAMACPP_PROMPT = "The capital of France is"
MEMORY_MB = 400
MEMORY_COLUMNS = 1536
DYNAMIC = "-dynamic"  # a path's suffix: its stage without the graphs with a fixed token axis


class _Rounds:
    """Wraps a paged stage's forward: per decode round, its wall time, the inference call's and each
    node's (by kind), in ms.  Also the stage's compute turn, so it sees the call itself."""

    def __init__(self, stage: PagedStage):
        self.stage = stage
        self.rounds: list[dict] = []
        self._forward = stage._forward_parts
        self._infer = 0.0
        stage._forward_parts = self._forward_parts
        stage.turns = self  # the forward takes the turn around the call alone

    def __enter__(self):
        self._infer = time.perf_counter()

    def __exit__(self, *exc):
        self._infer = time.perf_counter() - self._infer

    def _forward_parts(self, parts):
        start = time.perf_counter()
        out = self._forward(parts)
        wall = time.perf_counter() - start
        if all(len(p.x) == 1 for p in parts):  # a decode round
            infos = self.stage.last_request.profiling_info  # in the order the nodes ran
            matmuls = [i for i, info in enumerate(infos) if info.node_type.startswith("FullyConnected")
                       or (info.node_type == "Reference" and "MatMul" in info.node_name)]  # GGMLMatMul
            kinds = collections.Counter()
            for i, info in enumerate(infos):
                kind = ("head matmul" if i == matmuls[-1] else "layer matmuls") if i in matmuls else \
                    "attention" if info.node_type.startswith(ATTENTION) else "other nodes"
                ms = info.real_time.total_seconds() * 1e3
                kinds[kind] += ms
                if i in matmuls:  # which kernel multiplies: the plugin's (int8 or float activations), or ggml's
                    kinds[KERNEL + ("ggml kernels" if info.node_type == "Reference" else info.exec_type)] += ms
            self.rounds.append({"streams": len(parts), "start": start * 1e3, "forward": wall * 1e3,
                                "infer": self._infer * 1e3, "reading": (time.perf_counter() - start - wall) * 1e3,
                                **kinds})
        return out


def run_profile(model: str, tokens: int = 64, device: str = "CPU", weights: str = DEFAULT_WEIGHTS,
                users: tuple[int, ...] = USERS, runs: int = 3, llamacpp: bool = False,
                memory_mb: int = MEMORY_MB, paths: tuple[str, ...] | None = None, mode: str = "fast",
                out: Path | None = None, log=print) -> dict:
    """``paths``: the matrices' paths to profile side by side, of ``kernels.STOCK`` and ``kernels.GGML``,
    each also with ``DYNAMIC`` (default: both where this machine has the kernel extension, else the
    stock one)."""
    export = export_model(model, stages=1, weights=weights)
    folder = export.folders[0]
    config = {**compile_config(mode), "PERF_COUNT": "YES"}
    if not paths:
        before = kernels.use(True)
        paths = (kernels.STOCK, kernels.GGML) if kernels.path(core())[0] == kernels.GGML else (kernels.STOCK,)
        kernels.use(*before)
    chains, recorders = {}, {}
    for path in paths:  # each chain compiled with its path; the process's choice restored after
        matrices = path.removesuffix(DYNAMIC)
        unknown = matrices not in (kernels.STOCK, kernels.GGML)
        before = kernels.use(matrices == kernels.GGML)
        try:
            if unknown or (matrices == kernels.GGML and kernels.path(core())[0] != kernels.GGML):
                raise FleetError(f"unknown path {path!r}: the paths are stock and ggml, each also with "
                                 f"{DYNAMIC}" if unknown else
                                 f"the ggml kernels cannot run here: {kernels.path(core())[1]}")
            chains[path] = LocalChain(export.folders, device=device, config=config, paged=True,
                                      fixed_rows=not path.endswith(DYNAMIC))
            for n in users:  # one round of n users is n rows
                chains[path].stages[0].fix_rows(n)
        finally:
            kernels.use(*before)
        recorders[path] = _Rounds(chains[path].stages[0])
    names = list(PROMPTS)
    measured = {(path, n): [] for path in paths for n in users}
    with contextlib.ExitStack() as stack:
        peer = stack.enter_context(_Peer(model, folder, tokens, log)) if llamacpp else None
        for run in range(runs):
            _run(run, runs, users, paths, chains, recorders, folder, names, tokens, measured, log)
            if peer is not None:
                peer.measure()
                log(f"run {run + 1}/{runs}, 1 user, llama.cpp: {peer.times[-1]:.2f} ms a token")
    rows, ratios = [], {}
    for path in paths:
        for n in users:
            rows += _path_rows(path, n, measured[path, n], ratios)
    if len(paths) > 1:
        for n in users:
            rounds = {path: next(r["ms per round"] for r in rows if r["users"] == n and r.get("path") == path
                                 and r["part"] == "whole round") for path in paths}
            if kernels.STOCK in rounds and kernels.GGML in rounds:
                ratio = rounds[kernels.STOCK] / rounds[kernels.GGML]
                ratios[f"{n} users: tok/s, ggml kernels over stock"] = round(ratio, 3)
            for path in rounds:
                if path + DYNAMIC in rounds:
                    ratio = rounds[path + DYNAMIC] / rounds[path]
                    ratios[f"{n} users, {path} path: tok/s, fixed token axis over dynamic shapes"] = round(ratio, 3)
    speed = _memory_speed(device, memory_mb, runs)
    rows.append({"users": 0, "part": f"stock int8 matmul reading {memory_mb} MB of weights, GB/s",
                 "ms per round": round(memory_mb * 2**20 / (speed * 1e6), 3), "GB/s": round(speed, 2)})
    if llamacpp:
        row, ratio = peer.report(rows, paths)
        rows.append(row)
        ratios.update(ratio)
    stage = chains[paths[0]].stages[0]
    settings = {"model": model, "weights": stage.manifest.weights, "paths": list(paths),
                "tokens": tokens, "runs": runs, "device": device, "mode": mode, "compile": config}
    return write_report("profile", rows, ratios, out, settings)


def _run(run, runs, users, paths, chains, recorders, folder, names, tokens, measured, log) -> None:
    """One run: every user count on every path, interleaved (the machine's load falls on them alike)."""
    for n in users:
        prompts = [ids.reshape(-1) for ids in prompt_ids(folder, [names[i % len(names)] for i in range(n)])]
        for path in paths:
            rounds = recorders[path]
            rounds.rounds.clear()
            generate_streams(chains[path], prompts, tokens, max_length=4096, ignore_eos=True)
            steps = [r for r in rounds.rounds if r["streams"] == n]
            if len(steps) < 3:
                raise FleetError(f"only {len(steps)} decode rounds of {n} streams were seen: ask for more tokens")
            measured[path, n].append(_split(steps))
            log(f"run {run + 1}/{runs}, {n} users, {path} path: {measured[path, n][-1]['whole round']:.2f} ms "
                "a round")


def _path_rows(path: str, n: int, measured: list[dict], ratios: dict) -> list[dict]:
    """The rows of one path and user count (each part's median over the runs), and its ratios."""
    keys = dict.fromkeys(k for m in measured for k in m)  # a kernel may run in some runs only
    parts = {key: median(m.get(key, 0.0) for m in measured) for key in keys}
    graph, step = sum(parts[k] for k in NODES), parts["whole round"]
    rows = []
    for key, value in parts.items():
        row = {"users": n, "path": path, "part": key, "ms per round": round(value, 3)}
        row.update({"share of the graph": round(value / graph, 3)} if key in NODES or key.startswith(KERNEL) else
                   {"share of the round": round(value / step, 3)})
        if key == "whole round":
            row["tok/s"] = round(n * 1e3 / step, 2)
        rows.append(row)
    label = f"{n} users, {path} path"
    ratios[f"{label}: the matmuls' share of the graph"] = round((parts["layer matmuls"] + parts["head matmul"])
                                                              / graph, 3)
    ratios[f"{label}: the inference call's share of the round"] = round(parts["inference call"] / step, 3)
    ratios[f"{label}: the counters' sum over the call's wall time"] = round(graph / parts["inference call"], 3)
    return rows


def _split(steps: list[dict]) -> dict:
    """The median decode round's parts (ms).  A round lasts from its forward's start to the next
    round's, less the time this bench spent reading the counters (the last round has no next and
    counts only in the other parts)."""
    kernels = sorted({k for s in steps for k in s if k.startswith(KERNEL)})
    parts = {k: median(s.get(k, 0.0) for s in steps) for k in (*NODES, *kernels)}
    infer, forward = median(s["infer"] for s in steps), median(s["forward"] for s in steps)
    step = median(b["start"] - a["start"] - a["reading"] for a, b in zip(steps, steps[1:]))
    return {**parts, "inference call": infer, "stage's Python around the call": forward - infer,
            "decoding loop's Python": max(step - forward, 0.0), "whole round": step}


def _memory_speed(device: str, memory_mb: int, runs: int) -> float:
    """GB/s at which one row of activations meets four int8 matrices with f32 scales per 32 columns
    (the stock compressed MatMul), ``memory_mb`` of codes in all: the median of ``runs`` timings."""
    rows = max(1, memory_mb * 2**20 // (4 * MEMORY_COLUMNS))
    x = ops.parameter([-1, MEMORY_COLUMNS], ov.Type.f32)
    rng = np.random.default_rng(0)
    outputs = []
    for _ in range(4):
        codes = ops.constant(rng.integers(-127, 128, (rows, MEMORY_COLUMNS // 32, 32), dtype=np.int8))
        scales = ops.constant(np.full((rows, MEMORY_COLUMNS // 32, 1), 0.01, np.float32))
        weight = ops.reshape(ops.multiply(ops.convert(codes, ov.Type.f32), scales),
                             ops.constant(np.array([rows, MEMORY_COLUMNS], np.int64)), False)
        outputs.append(ops.matmul(x, weight, False, True).output(0))
    request = core().compile_model(ov.Model(outputs, [x]), device, compile_config("fast")).create_infer_request()
    row = np.ones((1, MEMORY_COLUMNS), np.float32)
    request.infer({0: row})  # warm
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        request.infer({0: row})
        times.append(time.perf_counter() - start)
    return 4 * rows * MEMORY_COLUMNS / median(times) / 1e9


class _Peer:
    """llama-server on the model's GGUF, one user: its own time per token, measured once a run (after
    our paths, so the machine's load falls on both alike), and its ratio to each path's."""

    def __init__(self, model: str, folder: Path, tokens: int, log):
        # plain text: llama-server b9993 refuses some chat answers of its own (HTTP 500, "does not match
        # the expected Content-only format")
        self.ids = [int(t) for t in ChatTokenizer(folder).prompt_ids(LLAMACPP_PROMPT, chat=False).reshape(-1)]
        self.server = LlamaServer(pull(CATALOG[model]), log=log)
        self.tokens = tokens
        self.times: list[float] = []

    def __enter__(self) -> "_Peer":
        self.server.__enter__()
        self.server.complete(self.ids, 4)  # warm
        return self

    def __exit__(self, *exc) -> None:
        self.server.__exit__(*exc)

    def measure(self) -> None:
        self.times.append(self.server.complete(self.ids, self.tokens)["predicted_per_token_ms"])

    def report(self, rows: list[dict], paths) -> tuple[dict, dict]:
        per_token = median(self.times)
        ours = {path: next(r["ms per round"] for r in rows if r["users"] == 1 and r.get("path") == path
                           and r["part"] == "whole round") for path in paths}
        return ({"users": 1, "part": f"llama.cpp {LLAMACPP_VERSION}, whole token", "ms per round": round(per_token, 3),
                 "tok/s": round(1e3 / per_token, 2)},
                {f"1 user, {path} path: tok/s, ours over llama.cpp": round(per_token / ms, 3)
                 for path, ms in ours.items()})
