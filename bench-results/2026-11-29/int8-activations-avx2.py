"""Can OpenVINO's CPU plugin multiply int8 activations on a CPU without int8 dot products (AVX2 only)?

One [N, K] MatMul (Qwen2.5-1.5B's gate: 8960 x 1536), one thread, at 1 and 4 rows, medians of
interleaved rounds. Variants:
  f32          float weights
  i4-g32       signed 4-bit codes in groups of 32 with f16 scales (the `gguf` format's Q4_K path)
  i8-row       int8 codes per row (a compressed MatMul: the plugin decompresses to float)
  i8-fq        int8 weights behind a FakeQuantize on the activations (static range): the low-precision
               transformations turn it into an int8 FullyConnected
  i8-fq-dyn    the same with each row scaled by its own largest value first (dynamic, per token)
Prints the kernel each FullyConnected ran (exec type), the relative error, and the times.
Usage: python int8-activations-avx2.py [N K]
"""
import sys
import time

import numpy as np
import openvino as ov
import openvino.opset13 as op

N, K = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (8960, 1536)
rng = np.random.default_rng(0)
W = (rng.standard_normal((N, K)) * 0.02).astype(np.float32)
CFG = {"INFERENCE_NUM_THREADS": 1, "PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}


def model(weights, act=lambda a: (a, None)):
    x = op.parameter([-1, K], np.float32)
    a, scale = act(x.output(0))
    y = op.matmul(a, weights, False, True)
    if scale is not None:
        y = op.multiply(y, scale)
    return ov.Model([y], [x])


def f32():
    return model(op.constant(W))


def i4_g32():
    g = W.reshape(N, K // 32, 32)
    s = np.abs(g).max(-1, keepdims=True) / 7
    q = np.clip(np.round(g / s), -8, 7).astype(np.int8)
    w = op.multiply(op.convert(op.constant(q, dtype=ov.Type.i4), np.float32),
                    op.convert(op.constant(s.astype(np.float16)), np.float32))
    return model(op.reshape(w, [N, K], False))


def i8_row():
    s = np.abs(W).max(-1, keepdims=True) / 127
    q = np.clip(np.round(W / s), -127, 127).astype(np.int8)
    return op.multiply(op.convert(op.constant(q), np.float32), op.constant(s.astype(np.float32)))


def fq(a, lo, hi):
    lo, hi = op.constant(np.float32(lo)), op.constant(np.float32(hi))
    return op.fake_quantize(a, lo, hi, lo, hi, 255).output(0)


def per_row(a):
    m = op.maximum(op.reduce_max(op.abs(a), op.constant(np.array([-1])), True), op.constant(np.float32(1e-8)))
    return fq(op.divide(a, m).output(0), -1.0, 1.0), m


VARIANTS = {
    "f32": f32(),
    "i4-g32": i4_g32(),
    "i8-row": model(i8_row()),
    "i8-fq": model(i8_row(), lambda a: (fq(a, -4.0, 4.0), None)),
    "i8-fq-dyn": model(i8_row(), per_row),
}


def per_call_us(compiled, rows, n=100):
    req = compiled.create_infer_request()
    xs = rng.standard_normal((rows, K)).astype(np.float32)
    for _ in range(10):
        req.infer({0: xs})
    t = time.perf_counter()
    for _ in range(n):
        req.infer({0: xs})
    return (time.perf_counter() - t) / n * 1e6


def main():
    core = ov.Core()
    compiled = {k: core.compile_model(m, "CPU", CFG) for k, m in VARIANTS.items()}
    xs = rng.standard_normal((4, K)).astype(np.float32)
    ref = xs @ W.T
    for k, c in compiled.items():
        kernels = [n.get_rt_info()["layerType"].astype(str) + "/" + n.get_rt_info()["runtimePrecision"].astype(str)
                   for n in c.get_runtime_model().get_ops()
                   if n.get_rt_info()["layerType"].astype(str).startswith("FullyConnected")]
        prof = core.compile_model(VARIANTS[k], "CPU", dict(CFG, PERF_COUNT=True)).create_infer_request()
        prof.infer({0: xs[:1]})
        exec_types = [p.exec_type for p in prof.profiling_info if p.node_type.startswith("FullyConnected")]
        y = c.create_infer_request().infer({0: xs})[0]
        print(f"{k:10s} {kernels} exec {exec_types} relative error {np.abs(y - ref).max() / np.abs(ref).max():.4f}")
    times = {k: {1: [], 4: []} for k in compiled}
    for rnd in range(6):
        for k in (list(compiled) if rnd % 2 == 0 else list(compiled)[::-1]):
            for rows in (1, 4):
                times[k][rows].append(per_call_us(compiled[k], rows))
    for k in compiled:
        print(f"{k:10s} 1 row {np.median(times[k][1]):7.0f} us   4 rows {np.median(times[k][4]):7.0f} us")


if __name__ == "__main__":
    main()
