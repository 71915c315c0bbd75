"""Where a tensor-parallel token goes, on loopback (no simulated link): Qwen2.5-Coder-1.5B `gguf`,
each process pinned to one core, 32 greedy tokens after a 40-token prompt, ms a token (median).

  whole   the 1-stage shard alone
  stub    rank 0 of the 2-rank export alone, each exchange a local copy (no peer, no socket)
  pair    rank 0 and rank 1 in two processes (cores 0 and 1) exchanging over loopback, with the
          time rank 0 spends in its exchanges and, within them, waiting for rank 1's part
  loop    two processes swapping a [1, 1, 1536] part 2000 times (the exchange alone)

Run: python ranks-exchange-cost-avx2.py  (the modes interleaved twice; the shards from the cache)
"""
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np

MODEL, PROMPT, N, KEY = "qwen2.5-coder-1.5b", list(range(100, 140)), 32, b"k" * 32


def decode(step, n=N):
    ids = list(PROMPT)
    logits = step(np.array([ids]), np.ones((1, len(ids)), np.int64), np.arange(len(ids))[None])
    times = []
    for _ in range(n):
        ids.append(int(logits[0, -1].argmax()))
        t = time.perf_counter()
        logits = step(np.array([[ids[-1]]]), np.ones((1, len(ids)), np.int64), np.array([[len(ids) - 1]]))
        times.append(time.perf_counter() - t)
    return 1000 * float(np.median(times)), ids[len(PROMPT):]


def child(mode: str, port: int) -> dict:
    rank = 1 if mode == "pair1" or mode == "loop1" else 0
    os.sched_setaffinity(0, {rank})  # before OpenVINO sizes its threads
    from engine.export.exporter import export_model, rank_folder
    from engine.manifest import load_manifest
    from engine.runtime.stages.stage import StageRunner, compile_config
    from engine.transport.mesh import Mesh
    config = compile_config("fast")
    if mode.startswith("loop"):
        mesh = _pair_mesh(rank, port, "fp")
        x, out = np.ones((1, 1, 1536), np.float32), np.empty((1, 1, 1536), np.float32)
        for _ in range(100):
            mesh.all_reduce(x, out)
        t = time.perf_counter()
        for _ in range(2000):
            mesh.all_reduce(x, out)
        return {"us_per_exchange": round((time.perf_counter() - t) / 2000 * 1e6, 1)}
    if mode == "whole":
        ms, tokens = decode(StageRunner(export_model(MODEL, stages=1, weights="gguf").folders[0],
                                        config=config).forward)
        return {"ms_per_token": round(ms, 1), "tokens": tokens[:6]}
    out = export_model(MODEL, weights="gguf", ranks=2).out
    if mode == "stub":
        class Stub(Mesh):
            def _collect(self, x, o, combine):
                combine([x, x])
        ms, _ = decode(StageRunner(rank_folder(out, 0), config=config, mesh=Stub(0, 2)).forward)
        return {"ms_per_token": round(ms, 1)}
    mesh = _pair_mesh(rank, port, load_manifest(rank_folder(out, 0)).fingerprint)
    runner = StageRunner(rank_folder(out, rank), config=config, mesh=mesh)
    spent = {"collect": 0.0, "wait": 0.0}
    for name, method in (("collect", "_collect"), ("wait", "_receive")):
        def timed(self, *a, _f=getattr(Mesh, method), _n=name, **k):
            t = time.perf_counter()
            try:
                return _f(self, *a, **k)
            finally:
                spent[_n] += time.perf_counter() - t
        setattr(Mesh, method, timed)
    decode(runner.forward, 4)
    runner.reset(0)
    spent.update(collect=0.0, wait=0.0)
    before = mesh.exchanges
    ms, tokens = decode(runner.forward)
    steps = N + 1
    return {"ms_per_token": round(ms, 1), "exchange_ms_per_token": round(1000 * spent["collect"] / steps, 1),
            "waiting_ms_per_token": round(1000 * spent["wait"] / steps, 1),
            "exchanges_per_token": (mesh.exchanges - before) / steps, "tokens": tokens[:6]}


def _pair_mesh(rank, port, fingerprint):
    from engine.transport.mesh import Mesh
    if rank == 1:
        mesh = Mesh(1, 2)
        mesh.listen(socket.create_server(("127.0.0.1", port)), KEY, fingerprint)
        while 0 not in mesh.links:
            time.sleep(0.01)
        return mesh
    return Mesh.dial({1: f"127.0.0.1:{port}"}, KEY, fingerprint, 2, timeout_s=300)


def run(mode: str, port: int) -> str:
    return subprocess.run([sys.executable, __file__, mode, str(port)], check=True, capture_output=True,
                          text=True).stdout.strip().splitlines()[-1]


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(json.dumps(child(sys.argv[1], int(sys.argv[2]))), flush=True)
        raise SystemExit
    port = 7600
    for round_ in range(2):
        for mode in ("whole", "stub", "pair", "loop"):
            port += 1
            if mode in ("pair", "loop"):
                peer = subprocess.Popen([sys.executable, __file__, f"{mode}1", str(port)], stdout=subprocess.PIPE,
                                        text=True)
                got = run(f"{mode}0", port)
                print(round_ + 1, mode, "rank 1:", peer.communicate()[0].strip().splitlines()[-1], flush=True)
            else:
                got = run(mode, port)
            print(round_ + 1, mode, got, flush=True)
