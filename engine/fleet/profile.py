"""Device profiles: what a node's device costs per layer for a model, measured by running shards.

A profile is data (JSON) the placement solver consumes (``engine.fleet.placement.DeviceProfile``):
per-layer decode and prefill latency, the LM head's cost, the fixed cost of one stage call, the
memory available, and whether the device supports every operation of the shards.  Each shard's step
time is modelled as ``call + layers * layer (+ head if it is the last)`` and fitted by least squares
over the shards run.  The profiling set (``profile_splits``) is three small shards of the model: its
first k and first 2k layers (the embedding's gather is negligible) and its last k layers with the
head; the first two separate the per-layer cost from the per-call cost, the third gives the head.
Any set of shards works; with fewer distinct shapes the call cost is taken as zero.

``model_shape`` gives the solver the model's memory per layer, vocabulary tables and KV cache.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from engine.config import AUTO_WEIGHTS, DEFAULT_WEIGHTS
from engine.errors import FleetError
from engine.limits import process_memory
from engine.export.rankcut import ranks_problem
from engine.manifest import MODEL_XML, Manifest, load_manifest
from engine.models.catalog import resolve_source
from engine.models.checkpoint import open_checkpoint
from engine.runtime.stages.factory import open_stage
from engine.runtime.stages.stage import core
from engine.tuning import STAGE_OVERHEAD_BYTES

# Bytes per weight of each format, with its quantization scales (INT4: f16 scale per group of 128).
# (the data-aware int4-* formats have INT4's layout; gguf carries 4-8 bit codes with an f16 scale per 16
# or 32 and the K-quants' offsets: Qwen2.5-Coder-1.5B's Q4_K_M layers take 0.71 bytes a weight)
WEIGHT_BYTES = {"int4": 0.5 + 2 / 128, "int8": 1.0 + 2 / 128, "gguf": 0.71, "fp16": 2.0, "f32": 4.0}
VOCAB_BYTES = 1.0 + 4 / 128  # embedding and head rows are INT8 with a scale per block
KV_BYTES = 2  # the CPU plugin keeps the KV cache in bf16/f16 by default
EXCHANGE_DTYPE_BYTES = 4  # tensor-parallel ranks exchange their partial sums in f32 (``engine.transport.mesh``)


def weight_bytes(weights: str) -> float:
    """Bytes per layer weight of a shard in ``weights`` (``auto``: as ``gguf``, what it gives a GGUF,
    the larger of what it may give)."""
    if weights == AUTO_WEIGHTS:
        return WEIGHT_BYTES["gguf"]
    return WEIGHT_BYTES.get("int4" if weights.startswith("int4-") else weights, 4.0)


def profile_splits(num_layers: int) -> list[tuple[list[int], int]]:
    """(split, stage index) of each profiling shard: the first k, the first 2k, the last k layers.
    k is a quarter of the model: shards of a few layers run from cache and underestimate a real
    stage's per-layer and head cost."""
    k = max(1, num_layers // 4)
    return [([k], 0), ([2 * k], 0), ([num_layers - k], 1)]


def export_profile_shards(model: str, weights: str = DEFAULT_WEIGHTS, cancel=None) -> list[Path]:
    """Exports (or reuses) the model's profiling shards."""
    # deferred: only the coordinator exports; node agents import this module to profile shards they hold
    from engine.export.exporter import export_model

    resolved = resolve_source(model)
    layers = open_checkpoint(resolved.kind, resolved.path).spec.num_layers
    if layers < 3:
        raise FleetError(f"{model} has {layers} layers: too few to profile by parts")
    return [export_model(model, split=split, weights=weights, only=[index], cancel=cancel).folders[0]
            for split, index in profile_splits(layers)]


def _run_once(runner, x: np.ndarray, tokens: int, prompt: int) -> tuple[float, list[float]]:
    runner.reset()
    t = time.perf_counter()
    runner.forward(x[:, :prompt], np.ones((1, prompt), dtype=np.int64), np.arange(prompt, dtype=np.int64)[None])
    prefill = (time.perf_counter() - t) * 1e3
    decode = []
    for i in range(prompt, prompt + tokens):
        t = time.perf_counter()
        runner.forward(x[:, i:i + 1], np.ones((1, i + 1), dtype=np.int64), np.array([[i]], dtype=np.int64))
        decode.append((time.perf_counter() - t) * 1e3)
    return prefill, decode


def time_shards(folders: list[Path], device: str, tokens: int, prompt: int, runs: int = 5) -> list[dict]:
    """Mean step and median prefill time of each shard, the shards' runs interleaved so that a burst
    of load on a shared machine does not fall on one shard only.  The mean, not the median, of the
    steps: under a CPU quota (a container's, or a simulated PC's) most steps run at full speed and a
    few wait out the throttled rest of the period, which only the mean counts."""
    rng = np.random.default_rng(0)
    runners, inputs = [], []
    for folder in folders:
        runner = open_stage(Path(folder), device)
        spec = runner.manifest.spec
        runners.append(runner)
        inputs.append(rng.integers(0, spec.vocab_size, (1, prompt + tokens), dtype=np.int64) if runner.first
                      else rng.standard_normal((1, prompt + tokens, spec.hidden_size)).astype(np.float32))
    prefill = [[] for _ in runners]
    decode = [[] for _ in runners]
    for r in range(runs + 1):  # the first round warms up
        for i, runner in enumerate(runners):
            p, d = _run_once(runner, inputs[i], tokens, prompt)
            if r:
                prefill[i].append(p)
                decode[i].extend(d)
    out = []
    for i, (folder, runner) in enumerate(zip(folders, runners)):
        m = runner.manifest
        model = core().read_model(str(Path(folder) / MODEL_XML))
        supported = core().query_model(model, device)
        ops = [op.get_friendly_name() for op in model.get_ops()]
        out.append({"layers": list(m.layers), "first": m.first, "last": m.last,
                    "decode_ms": float(np.mean(decode[i])), "prefill_ms": float(np.median(prefill[i])),
                    "prompt": prompt, "op_support": sum(1 for op in ops if op in supported) / max(1, len(ops))})
    return out


def available_memory(device: str) -> int:
    """Bytes a new stage may use on ``device``: free system memory (within this process's cgroup
    memory limits), or a GPU's own memory."""
    if device.upper().startswith("GPU"):
        try:
            total = int(core().get_property(device, "GPU_DEVICE_TOTAL_MEM_SIZE"))
            if total:
                return total
        except RuntimeError:
            pass
    return process_memory()[1]


def fit_costs(runs: list[dict], key: str = "decode_ms") -> tuple[float, float, float | None]:
    """(call, per layer, head) in ms from shard runs, by least squares on
    ``time = call + layers * layer + last * head``; the call cost is 0 when the runs' shapes cannot
    tell it apart, the head None when no run had it."""
    shapes = {(r["layers"][1] - r["layers"][0], r["last"]) for r in runs}
    has_head = any(last for _, last in shapes)
    fit_call = len(shapes) >= 2 + has_head
    rows = [[1.0] * fit_call + [r["layers"][1] - r["layers"][0]] + [float(r["last"])] * has_head for r in runs]
    coef = np.linalg.lstsq(np.array(rows), np.array([r[key] for r in runs]), rcond=None)[0]
    call = max(0.0, float(coef[0])) if fit_call else 0.0
    layer = max(0.0, float(coef[int(fit_call)]))
    return call, layer, (max(0.0, float(coef[-1])) if has_head else None)


def profile_shards(folders: list[Path], device: str = "CPU", tokens: int = 16, prompt: int = 32) -> dict:
    """Runs each shard briefly on ``device`` and derives the per-call, per-layer and head costs."""
    if not folders:
        raise FleetError("profiling needs at least one shard")
    memory = available_memory(device)  # before the shards load: what a stage's own process would find
    runs = time_shards(folders, device, tokens, prompt)
    manifest = load_manifest(Path(folders[0]))
    shape = model_shape(manifest)
    call_ms, layer_ms, head_ms = fit_costs(runs)
    _, prefill_ms, _ = fit_costs(runs, "prefill_ms")
    estimated = head_ms is None or not any(not r["last"] for r in runs)
    if not any(not r["last"] for r in runs):  # only last shards: split by weight bytes (decode reads each once)
        n = runs[0]["layers"][1] - runs[0]["layers"][0]
        share = n * shape["layer_bytes"] / (n * shape["layer_bytes"] + shape["head_bytes"])
        layer_ms, head_ms = runs[0]["decode_ms"] * share / n, runs[0]["decode_ms"] * (1 - share)
    if head_ms is None:  # never ran the head: scale the layer cost by the head's weight bytes
        head_ms = layer_ms * shape["head_bytes"] / shape["layer_bytes"]
    return {"model": manifest.model_name, "fingerprint": manifest.fingerprint, "weights": manifest.weights,
            "device": device, "call_ms": call_ms, "layer_ms": layer_ms, "head_ms": head_ms, "embed_ms": 0.0,
            "prefill_layer_ms": prefill_ms / prompt, "memory_bytes": memory,
            "supported": all(r["op_support"] == 1.0 for r in runs),
            "op_support": min(r["op_support"] for r in runs), "estimated": estimated, "shards": runs}


def model_shape(manifest: Manifest, context: int = 4096, streams: int = 1) -> dict:
    """Memory facts of a model for the placement solver (``placement.ModelShape`` fields)."""
    s = manifest.spec
    attn = s.hidden_size * s.head_dim * (2 * s.num_heads + 2 * s.num_kv_heads)
    mlp = 3 * s.hidden_size * s.intermediate_size
    vocab = int(s.vocab_size * s.hidden_size * VOCAB_BYTES)
    return {"name": manifest.model_name, "num_layers": s.num_layers,
            "layer_bytes": int((attn + mlp) * weight_bytes(manifest.weights)),
            "embed_bytes": vocab, "head_bytes": vocab,
            "kv_bytes_per_layer": 2 * s.num_kv_heads * s.head_dim * min(context, s.max_position) * streams * KV_BYTES,
            "overhead_bytes": STAGE_OVERHEAD_BYTES,
            "max_ranks": 2 if ranks_problem(s, 2, manifest.weights) is None else 1,
            "exchange_bytes": s.hidden_size * EXCHANGE_DTYPE_BYTES}
