"""`fleet bench profile` in miniature: a decode round split into the graph's nodes by kind and the
Python around the call, for each user count and each path of the matrices side by side, in the common
report format."""

from __future__ import annotations

import json

from engine.bench.profile import KERNEL, NODES, run_profile


def test_a_decode_round_is_split_into_node_kinds_and_the_python_around_them(tiny_models, tmp_path):
    report = run_profile(str(tiny_models["llama"]), tokens=8, users=(1, 2), runs=1, weights="f32", memory_mb=8,
                         paths=("stock", "ggml"), out=tmp_path / "profile.json", log=lambda _: None)
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert saved["bench"] == "profile" and saved["rows"] == report["rows"] and "cpu" in saved["machine"]
    for users, path in ((1, "stock"), (2, "stock"), (1, "ggml"), (2, "ggml")):
        parts = {r["part"]: r for r in report["rows"] if r["users"] == users and r.get("path") == path}
        assert set(NODES) <= set(parts), parts
        assert parts["layer matmuls"]["ms per round"] > 0 and parts["head matmul"]["ms per round"] > 0
        assert abs(sum(parts[k]["share of the graph"] for k in NODES) - 1) < 0.01
        kernels = [k for k in parts if k.startswith(KERNEL)]  # the matmuls again, by the plugin's kernel
        assert kernels and all(parts[k]["ms per round"] > 0 for k in kernels), kernels
        round_ms = parts["whole round"]["ms per round"]
        inside = sum(parts[k]["ms per round"] for k in ("inference call", "stage's Python around the call",
                                                         "decoding loop's Python"))
        assert parts["inference call"]["ms per round"] > 0 and abs(inside - round_ms) < 0.01 * round_ms + 0.01
        assert parts["whole round"]["tok/s"] > 0
        assert 0 < report["ratios"][f"{users} users, {path} path: the matmuls' share of the graph"] <= 1
        assert report["ratios"][f"{users} users: tok/s, ggml kernels over stock"] > 0
    memory = [r for r in report["rows"] if r["part"].startswith("stock int8 matmul reading 8 MB")]
    assert len(memory) == 1 and memory[0]["GB/s"] > 0
