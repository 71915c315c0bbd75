"""``fleet bench kernels``: our tile kernels (``GGMLMatMul``, engine/kernels) alone, on one thread, for
1, 2, 4 and 8 rows of x (the users of a decode round), on the matrix shapes of a 1.5B model's layer,
beside ggml's own ``vec_dot`` on the same matrices.  Each configuration multiplies enough distinct
random matrices that they do not fit in the CPU's caches, as a decode round's matrices do not; the
configurations take turns round by round."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from engine import kernels
from engine.bench.harness import NO_HOOKS, Hooks, interleave
from engine.bench.report import format_table, median, write_report
from engine.kernels.tiles import tiles
from engine.models.quantized import BLOCKS, NAMES, Q4_1, Q4_K, Q5_1, Q5_K, Q6_K, decompose
from engine.runtime.stages.stage import core

SHAPES = ((8960, 1536), (1536, 8960), (1536, 1536))  # (rows, columns): Qwen2.5-1.5B's MLP and attention
BYTES_A_CONFIG = 64 * 2**20  # the matrices' bytes a configuration multiplies by: twice a large L3
KERNELS = {"ours": kernels.OWN, "ggml": kernels.GGML_KERNEL}
# where each type's blocks keep their f16 scales (d, and dmin where there is one): bytes from, to
SCALES = {Q6_K: [(208, 210)], **{qtype: [(0, 2), (2, 4)] for qtype in (Q4_K, Q5_K, Q4_1, Q5_1)}}


def random_blocks(qtype: int, rng, rows: int, columns: int) -> np.ndarray:
    """Random blocks of a GGML type with small finite f16 scales (any decoder must read them alike)."""
    size, nbytes = BLOCKS[qtype]
    raw = rng.integers(0, 256, (rows, columns // size, nbytes), dtype=np.uint8)
    for start, end in SCALES.get(qtype, [(0, 2)]):
        scales = rng.uniform(1e-3, 1e-2, (rows, columns // size, 1)).astype(np.float16)
        raw[..., start:end] = scales.view(np.uint8)
    return raw.reshape(rows, -1)


def compiled(nodes, qtype: int, shape: tuple[int, int], kernel: int, rng) -> tuple[ov.CompiledModel, int]:
    """A model multiplying x by as many distinct random matrices as fill BYTES_A_CONFIG, on one
    thread, with the operation ``nodes`` builds, and how many matrices that is."""
    rows, columns = shape
    copies = max(1, BYTES_A_CONFIG // random_blocks(qtype, rng, rows, columns).nbytes)
    x = ops.parameter([-1, columns], np.float32)
    outputs = []
    for _ in range(copies):
        raw = random_blocks(qtype, rng, rows, columns)
        matrix = raw if kernel == kernels.GGML_KERNEL else tiles(decompose(qtype, raw, rows, columns))
        outputs.append(nodes.create(kernels.OP, [x.output(0), ops.constant(matrix).output(0)],
                                    {"ggml_type": qtype, "rows": rows, "columns": columns, "kernel": kernel,
                                     "float_x": 0}))
    config = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 1}
    return core().compile_model(ov.Model(outputs, [x]), "CPU", config), copies


def run_kernels(*, runs: int = 5, users: tuple[int, ...] = (1, 2, 4, 8), out: Path | None = None, log=print,
                hooks: Hooks = NO_HOOKS) -> dict:
    """``users``: the rows of x of each configuration.  The report's rows: µs of CPU time a matrix (the
    median of the runs) and the multiply-adds a second that makes (GMAC/s)."""
    before = kernels.use(True)
    nodes = kernels.factory(core())
    kernels.use(*before)
    if nodes is None or not kernels.tile_width():
        raise SystemExit(f"our kernels do not run here: {kernels.unavailable() or 'this CPU has no AVX2'}")
    rng = np.random.default_rng(0)
    models = {(qtype, shape, name): compiled(nodes, qtype, shape, kernel, rng)
              for qtype in (Q4_K, Q6_K) for shape in SHAPES for name, kernel in KERNELS.items()}
    xs = {(m, columns): rng.standard_normal((m, columns)).astype(np.float32) for m in users for _, columns in SHAPES}
    repeats = 3  # calls a measurement times, the median kept

    def measure(key, _round) -> float:
        config, m = key
        model, copies = models[config]
        request = model.create_infer_request()
        times = []
        for _ in range(repeats + 1):
            start = time.process_time()  # CPU time: other work on the machine counts less
            request.infer([xs[(m, config[1][1])]])
            times.append(time.process_time() - start)
        return median(times[1:]) / copies * 1e6

    def label(key) -> str:
        (qtype, (rows, columns), name), m = key
        return f"{NAMES[qtype]} {rows}x{columns} {name}, {m} rows of x"

    keys = [(config, m) for config in models for m in users]
    kept = interleave(measure, keys, runs, warmup=1, alternate=True, hooks=hooks, log=log, label=label)
    us = {key: median(times) for key, times in kept.items()}
    rows = [{"type": NAMES[qtype], "shape": f"{shape[0]}x{shape[1]}", "kernel": name, "rows_of_x": m,
             "us_a_matrix": round(us[key], 1), "gmac_s": round(m * shape[0] * shape[1] / us[key] / 1e3, 2)}
            for key in keys for (qtype, shape, name), m in [key]]
    log(format_table(rows, ["type", "shape", "kernel", "rows_of_x", "us_a_matrix", "gmac_s"]))
    ratios = {}
    for (qtype, shape, name), m in keys:
        if name == "ours":
            what, ours = f"{NAMES[qtype]} {shape[0]}x{shape[1]}, {m} rows of x", us[(qtype, shape, name), m]
            ratios[f"{what}: time, ours over ggml's"] = round(ours / us[(qtype, shape, "ggml"), m], 3)
            ratios[f"{what}: time over {users[0]} rows"] = round(ours / us[(qtype, shape, name), users[0]], 3)
    return write_report("kernels", rows, ratios, out,
                        settings={"runs": runs, "threads": 1, "bytes_a_config": BYTES_A_CONFIG,
                                  "tile_width": kernels.tile_width()})
