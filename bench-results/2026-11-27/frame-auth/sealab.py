"""Frame authentication's cost over a real relay, side by side in one process.

Run from a tree carrying baseline.patch (``Seal`` skips its HMAC when FLEET_BENCH_NOSEAL=1 is set
at the handshake; same frame layout): two 2-stage SmolLM2 chains over loopback TCP, each with its
own worker process, one sealed and one not, used in alternation round by round: one user's decode,
four users' packed decode and the prefill of a 1,114-token prompt.  Prints one JSON document."""
import json, os, sys
from contextlib import ExitStack
from statistics import median
from engine.bench.harness import STORY_PROMPT, loopback, split_export
from engine.runtime.decode.generate import Generator, generate_streams
from engine.runtime.decode.tokenizer import ChatTokenizer

rounds, tokens = int(sys.argv[1]), int(sys.argv[2])
first = sys.argv[3] if len(sys.argv) > 3 else "unsealed"  # the chain started first (its position may favour it)
split = split_export("smollm2-135m", 2, "int4")
tok = ChatTokenizer(split[0])
short = tok.prompt_ids(STORY_PROMPT)
long_ids = tok.prompt_ids("Summarise this text.\n\n" + open(os.path.join(os.path.dirname(__file__), "long.txt")).read())
prompts4 = [tok.prompt_ids(f"({i}) " + STORY_PROMPT) for i in range(4)]
samples = {mode: {"decode_1_user_tok_s": [], "decode_4_users_tok_s": [], "prefill_tok_s": []} for mode in ("sealed", "unsealed")}
with ExitStack() as stack:
    chains = {}
    for mode in sorted(("unsealed", "sealed"), key=lambda m: m != first):
        os.environ["FLEET_BENCH_NOSEAL"] = "1" if mode == "unsealed" else "0"
        chains[mode] = stack.enter_context(loopback(split))[0]
    os.environ.pop("FLEET_BENCH_NOSEAL")
    for r in range(rounds + 1):
        order = ("sealed", "unsealed") if r % 2 else ("unsealed", "sealed")
        for mode in order:
            chain = chains[mode]
            d = Generator(chain, short.shape[1] + tokens + 1).generate(short, tokens, ignore_eos=True)
            res, wall = generate_streams(chain, prompts4, tokens, max_length=short.shape[1] + tokens + 8, ignore_eos=True)
            p = Generator(chain, long_ids.shape[1] + 4).generate(long_ids, 1, ignore_eos=True)
            if r:
                s = samples[mode]
                s["decode_1_user_tok_s"].append(d.decode_tok_s)
                s["decode_4_users_tok_s"].append(sum(len(g.tokens) for g in res) / wall)
                s["prefill_tok_s"].append(long_ids.shape[1] / p.ttft_s)
        print(f"round {r}", {m: {k: round(v[-1], 1) for k, v in s.items() if v} for m, s in samples.items()}, file=sys.stderr, flush=True)
med = {m: {k: round(median(v), 2) for k, v in s.items()} for m, s in samples.items()}
ratios = {f"{k}, sealed / unsealed": round(med["sealed"][k] / med["unsealed"][k], 3) for k in med["sealed"]}
print(json.dumps({"medians": med, "ratios": ratios, "samples": samples, "rounds": rounds, "tokens": tokens, "started_first": first,
                  "prefill_tokens": int(long_ids.shape[1])}))
