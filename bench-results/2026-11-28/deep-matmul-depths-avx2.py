"""Decode/prefill time of one compressed MatMul ([N, K] INT4 in groups of 32, f32 scales) at several depths K and row counts M, on one core: python deep-matmul-depths-avx2.py N K1,K2,... M1,M2,...  (printed: ms and ns per weight)."""
import sys, time, os
os.sched_setaffinity(0, {0})
import numpy as np
import openvino as ov, openvino.opset13 as ops
from engine.runtime.stages.stage import compile_config
core = ov.Core(); cfg = compile_config("fast")
N = int(sys.argv[1]) if len(sys.argv) > 1 else 1536
def build(K, g=32):
    G = K // g
    c = ops.constant(ov.Tensor(ov.Type.i4, ov.Shape([N, G, g])))
    f = ops.convert(c, ov.Type.f32)
    s = ops.convert(ops.constant(np.random.rand(N, G, 1).astype(np.float16)), ov.Type.f32)
    w = ops.reshape(ops.multiply(f, s), ops.constant(np.array([N, K])), False)
    x = ops.parameter(ov.PartialShape([1, -1, K]), ov.Type.f32)
    return core.compile_model(ov.Model([ops.matmul(x, w, False, True)], [x]), "CPU", cfg)
Ks = [int(k) for k in sys.argv[2].split(",")] if len(sys.argv) > 2 else list(range(1024, 9217, 512))
Ms = [int(m) for m in sys.argv[3].split(",")] if len(sys.argv) > 3 else [45]
for K in Ks:
    m = build(K); row = []
    for M in Ms:
        req = m.create_infer_request(); x = np.random.rand(1, M, K).astype(np.float32)
        req.infer({0: x}); t = time.perf_counter()
        n = 10
        for _ in range(n): req.infer({0: x})
        ms = (time.perf_counter() - t) / n * 1e3
        row.append("M=%d %.2f ms %.2f ns/w" % (M, ms, ms * 1e6 / (N * K)))
    print(K, " | ".join(row), flush=True)
