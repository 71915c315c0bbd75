"""Decode tok/s of 1-stage shards in one process and llama-server on the GGUF, interleaved round by
round (one user, greedy, after a 21-token prompt): python dec2.py TOKENS ROUNDS OUT.json DIR..."""
import sys, time, json, platform, numpy as np
from statistics import median
from pathlib import Path
from engine.runtime.stages.stage import StageRunner
from engine.bench.llamacpp import LlamaServer
from engine.models.catalog import resolve_source
import openvino as ov

def main():
    tokens, rounds, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    runners = {d: StageRunner(Path(d), "CPU") for d in sys.argv[4:]}
    ids = [9707, 11, 1246, 525, 498, 30, 358, 1079, 4460, 311, 3270, 264, 13027, 729, 429, 70028, 264, 1140, 315, 5109, 13]
    n = len(ids)
    res = {d: [] for d in [*runners, "llama.cpp"]}
    gguf = resolve_source("qwen2.5-coder-1.5b").path
    with LlamaServer(gguf, threads=2) as server:
        for r in range(rounds):
            for d, st in runners.items():
                st.reset(0)
                st.forward(np.array([ids]), np.ones((1, n), np.int64), np.arange(n)[None], last_only=True)
                tok = 300
                t = time.perf_counter()
                for i in range(tokens):
                    pos = n + i
                    o = st.forward(np.array([[tok]], np.int64), np.ones((1, pos + 1), np.int64), np.array([[pos]]), last_only=True)
                    tok = int(np.argmax(o[0, -1]))
                res[d].append(tokens / (time.perf_counter() - t))
            res["llama.cpp"].append(server.complete(ids, tokens)["predicted_per_second"])
            print(r, {k: round(v[-1], 2) for k, v in res.items()}, flush=True)
    rows = [{"server": k, "median_tok_s": round(median(v), 2), "rounds": [round(x, 2) for x in v]} for k, v in res.items()]
    for row in rows: print(row)
    lc = median(res["llama.cpp"])
    json.dump({"bench": "faithful-six-bit-decode-avx2", "machine": {"cpu": platform.processor() or "AMD EPYC (family 23, AVX2, no AVX-512/VNNI)", "logical_cores": 2, "openvino": ov.get_version()},
               "settings": {"model": "qwen2.5-coder-1.5b", "tokens": tokens, "rounds": rounds, "method": "1-stage shards in one process (StageRunner, greedy) and llama-server on the same GGUF (2 threads), interleaved round by round; medians"},
               "rows": rows, "ratios": {f"{r['server']} / llama.cpp": round(r["median_tok_s"] / lc, 3) for r in rows}}, open(out, "w"), indent=1)

if __name__ == "__main__":
    main()
