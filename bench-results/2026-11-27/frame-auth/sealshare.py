"""The share of a relay's wall time its frame tags take: the coordinator's Seal.tag/check timed in
place (the worker seals and checks the same frames, so the chain's critical path carries about
twice this).  Run from a checkout: python sealshare.py TOKENS"""
import json, sys, time
import numpy as np
from engine.transport import wire
from engine.bench.harness import STORY_PROMPT, loopback, split_export
from engine.runtime.decode.generate import Generator, generate_streams
from engine.runtime.decode.tokenizer import ChatTokenizer

spent = [0.0, 0]
durs = []
def timed(f):
    def g(*a, **k):
        t = time.thread_time()
        try:
            return f(*a, **k)
        finally:
            d = time.thread_time() - t; spent[0] += d; spent[1] += 1; durs.append(d)
    return g
wire.Seal.tag = timed(wire.Seal.tag); wire.Seal.check = timed(wire.Seal.check)
tokens = int(sys.argv[1])
split = split_export("smollm2-135m", 2, "int4")
tok = ChatTokenizer(split[0])
short = tok.prompt_ids(STORY_PROMPT)
long_ids = tok.prompt_ids("Summarise this text.\n\n" + open(__file__.replace("sealshare.py", "long.txt")).read())
prompts4 = [tok.prompt_ids(f"({i}) " + STORY_PROMPT) for i in range(4)]
out = {}
with loopback(split) as (chain, _):
    for r in range(2):
        phases = {
            "decode, 1 user": lambda: Generator(chain, short.shape[1] + tokens + 1).generate(short, tokens, ignore_eos=True),
            "decode, 4 users": lambda: generate_streams(chain, prompts4, tokens, max_length=short.shape[1] + tokens + 8, ignore_eos=True),
            f"prefill, {long_ids.shape[1]} tokens": lambda: Generator(chain, long_ids.shape[1] + 4).generate(long_ids, 1, ignore_eos=True),
        }
        for name, run in phases.items():
            spent[:] = [0.0, 0]; durs.clear()
            t = time.perf_counter(); run(); wall = time.perf_counter() - t
            if r:
                out[name] = {"wall_s": round(wall, 4), "coordinator_mac_cpu_ms": round(spent[0] * 1e3, 3), "frames": spent[1], "median_us": round(float(np.median(durs))*1e6, 1), "p90_us": round(float(np.percentile(durs, 90))*1e6, 1), "max_us": round(max(durs)*1e6, 1),
                             "mac_share_of_wall_pct": round(200 * spent[0] / wall, 3)}
print(json.dumps(out))
