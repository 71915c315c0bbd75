"""A/B of two builds of the kernel extension in one process (kernels-ab-*.json): each configuration of
``fleet bench kernels`` (engine.bench.kernels: Q4_K and Q6_K matrices of Qwen2.5-1.5B's shapes, enough
distinct ones to leave the caches, one thread) built with both libraries' operations, the two timed in
turns (A B, then B A) at 1, 2, 4 and 8 rows of x; CPU time a matrix, medians of the rounds; and the
largest difference of their outputs.

    python kernels-ab.py A.so B.so ROUNDS OUT.json
"""

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from openvino.utils.node_factory import NodeFactory

from engine import kernels
from engine.bench import kernels as bench
from engine.models.quantized import NAMES, Q4_K, Q6_K
from engine.runtime.stages.stage import core

USERS = (1, 2, 4, 8)


def main(a: str, b: str, rounds: int, out: str) -> None:
    kernels._dependencies()
    libraries = {"A": a, "B": b}
    factories = {}
    for name, library in libraries.items():
        factories[name] = NodeFactory()
        factories[name].add_extension(library)
        core().add_extension(library)
    configs = [(qtype, shape) for qtype in (Q4_K, Q6_K) for shape in bench.SHAPES]
    models = {(config, name): bench.compiled(factories[name], *config, kernels.OWN,
                                             np.random.default_rng(config[0] * 7 + config[1][0]))
              for config in configs for name in libraries}  # the same matrices for A and B
    rng = np.random.default_rng(1)
    xs = {(m, columns): rng.standard_normal((m, columns)).astype(np.float32) for m in USERS
          for _, columns in bench.SHAPES}
    requests = {key: (model.create_infer_request(), copies) for key, (model, copies) in models.items()}
    differences = {}
    for config in configs:
        got = {name: np.concatenate(list(requests[config, name][0].infer([xs[8, config[1][1]]]).values()))
               for name in libraries}
        differences[config] = float(np.abs(got["A"] - got["B"]).max() / np.abs(got["A"]).max())
    times = {}
    for r in range(rounds):
        for config in configs:
            for m in USERS:
                for name in ("AB" if r % 2 == 0 else "BA"):
                    request, copies = requests[config, name]
                    each = []
                    for _ in range(5):
                        start = time.process_time()
                        request.infer([xs[m, config[1][1]]])
                        each.append(time.process_time() - start)
                    times.setdefault((config, m, name), []).append(statistics.median(each) / copies * 1e6)
    rows = []
    for (qtype, shape) in configs:
        for m in USERS:
            us = {name: statistics.median(times[(qtype, shape), m, name]) for name in libraries}
            rows.append({"type": NAMES[qtype], "shape": f"{shape[0]}x{shape[1]}", "rows_of_x": m,
                         "a_us": round(us["A"], 1), "b_us": round(us["B"], 1), "b_over_a": round(us["B"] / us["A"], 3),
                         "max_difference": differences[qtype, shape]})
            print(f"{NAMES[qtype]} {shape[0]}x{shape[1]} {m} rows: A {us['A']:8.1f} µs  B {us['B']:8.1f} µs  "
                  f"B/A {us['B'] / us['A']:.3f}", flush=True)
    Path(out).write_text(json.dumps({"libraries": libraries, "rounds": rounds, "threads": 1, "rows": rows}, indent=2))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
