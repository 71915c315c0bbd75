"""Rank 0 of the 2-rank Qwen2.5-Coder-1.5B gguf export alone (each exchange a local copy), with and without split_deep_matmuls, interleaved in one process on one core: a 45-token prefill and the median of 8 decode steps; then the largest logit difference.  python rank-split-prefill-avx2.py fast|exact"""
import os, sys, time
import numpy as np
os.sched_setaffinity(0, {0})
from engine.export.exporter import export_model, rank_folder
from engine.runtime.stages import stage as st
from engine.runtime.stages.stage import StageRunner, compile_config
from engine.transport.mesh import Mesh
out = export_model("qwen2.5-coder-1.5b", weights="gguf", ranks=2).out
class Stub(Mesh):
    def _collect(self, x, o, combine):
        combine([x, x])
mode = sys.argv[1]
config = compile_config("exact" if mode == "exact" else "fast")
real = st.split_deep_matmuls
runners = {}
for name in ("split", "plain"):
    st.split_deep_matmuls = real if name == "split" else (lambda m, d=None: (0, None))
    runners[name] = StageRunner(rank_folder(out, 0), config=config, mesh=Stub(0, 2))
P = 45
ids = np.arange(100, 100 + P)[None]
logits = {}
for r in range(3):
    for name, run in runners.items():
        run.reset(0)
        t = time.perf_counter()
        y = run.forward(ids, np.ones((1, P), np.int64), np.arange(P)[None], last_only=True).copy()
        t1 = time.perf_counter()
        times = []
        for i in range(8):
            a = time.perf_counter()
            run.forward(np.array([[7 + i]]), np.ones((1, P + 1 + i), np.int64), np.array([[P + i]]), last_only=True)
            times.append(time.perf_counter() - a)
        logits[name] = y
        print(r, name, "prefill ms", round((t1 - t) * 1000), "decode ms", round(np.median(times) * 1000, 1), flush=True)
print("max |diff|", float(np.abs(logits["split"] - logits["plain"]).max()), "max logit", float(np.abs(logits["plain"]).max()),
      "argmax same", bool((logits["split"].argmax(-1) == logits["plain"].argmax(-1)).all()))
