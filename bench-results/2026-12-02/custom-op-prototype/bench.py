import os
import numpy as np, openvino as ov, openvino.opset13 as ops, time, sys
LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "build", "libfsproto.so")
core = ov.Core(); core.add_extension(LIBRARY)
N, K, M = 8960, 1536, int(sys.argv[1]) if len(sys.argv) > 1 else 1
threads = sys.argv[2] if len(sys.argv) > 2 else "2"
rng = np.random.default_rng(0)
w = rng.integers(-127, 128, size=(N, K), dtype=np.int8)
s = (rng.random((N, K // 32), dtype=np.float32) * 0.01 + 0.001)
x = rng.standard_normal((M, K), dtype=np.float32)
ref = (w.reshape(N, K // 32, 32).astype(np.float32) * s[..., None]).reshape(N, K) @ x.T
# custom op
xp = ops.parameter([-1, K], ov.Type.f32)
cfg = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": threads}
from openvino.utils.node_factory import NodeFactory
nf = NodeFactory(); nf.add_extension(LIBRARY)
node = nf.create("Q8MatMul", [xp.output(0), ops.constant(w).output(0), ops.constant(s).output(0), ops.constant(np.zeros((N, K//32), np.int32)).output(0)])
m1 = ov.Model([node.output(0)], [xp])
c1 = core.compile_model(m1, "CPU", cfg)
# stock: compressed i8 weights with per-32 scales
wc = ops.constant(w.reshape(N, K // 32, 32)); conv = ops.convert(wc, ov.Type.f32)
mul = ops.multiply(conv, ops.constant(s[..., None])); rs = ops.reshape(mul, ops.constant(np.array([N, K], np.int64)), False)
mm = ops.matmul(xp, rs, False, True)
m2 = ov.Model([mm.output(0)], [xp])
c2 = core.compile_model(m2, "CPU", cfg)
r1, r2 = c1.create_infer_request(), c2.create_infer_request()
y1 = r1.infer({0: x})[0].copy(); y2 = r2.infer({0: x})[0].copy()
print("err custom", np.abs(y1 - ref.T).max() / np.abs(ref).max(), "stock", np.abs(y2 - ref.T).max() / np.abs(ref).max())
print([ (n.get_type_name(), n.get_rt_info()["layerType"].astype(str)) for n in c2.get_runtime_model().get_ordered_ops() if "FullyConnected" in n.get_rt_info()["layerType"].astype(str)])
for rep in range(3):
    for name, r in (("custom", r1), ("stock", r2)):
        t = time.perf_counter()
        for _ in range(200): r.infer({0: x})
        dt = (time.perf_counter() - t) / 200
        print(f"{name} M={M} {dt*1e6:.0f} us  {N*K/dt/1e9:.1f} GB/s(i8)")
