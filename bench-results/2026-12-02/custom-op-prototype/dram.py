import os
import numpy as np, openvino as ov, openvino.opset13 as ops, time
from openvino.utils.node_factory import NodeFactory
LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "build", "libfsproto.so")
core = ov.Core(); core.add_extension(LIBRARY)
nf = NodeFactory(); nf.add_extension(LIBRARY)
N, K = 65536, 1536
rng = np.random.default_rng(0)
cfg = {"INFERENCE_PRECISION_HINT": "f32"}
xp = ops.parameter([-1, K], ov.Type.f32)
outs_c, outs_s = [], []
for i in range(4):  # 4 x 100 MB: more than the L3 holds
    w = rng.integers(-127, 128, size=(N, K), dtype=np.int8); s = np.full((N, K // 32), 0.01, np.float32)
    outs_c.append(nf.create("Q8MatMul", [xp.output(0), ops.constant(w).output(0), ops.constant(s).output(0),
                                          ops.constant(np.zeros((N, K // 32), np.int32)).output(0)]).output(0))
    conv = ops.convert(ops.constant(w.reshape(N, K // 32, 32)), ov.Type.f32)
    rs = ops.reshape(ops.multiply(conv, ops.constant(s[..., None])), ops.constant(np.array([N, K], np.int64)), False)
    outs_s.append(ops.matmul(xp, rs, False, True).output(0))
x = rng.standard_normal((1, K), dtype=np.float32)
for name, outs in (("custom", outs_c), ("stock", outs_s), ("custom", outs_c), ("stock", outs_s)):
    c = core.compile_model(ov.Model(outs, [xp]), "CPU", cfg); r = c.create_infer_request(); r.infer({0: x})
    t = time.perf_counter()
    for _ in range(10): r.infer({0: x})
    dt = (time.perf_counter() - t) / 10
    print(f"{name}: {dt*1e3:.1f} ms for {4*N*K/1e6:.0f} MB: {4*N*K/dt/1e9:.1f} GB/s")
    del c, r
