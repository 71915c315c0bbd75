"""``fleet bench placement``: does the solver's cost model predict what a split really does here?

This machine is profiled the way a node is (``engine.fleet.profile``: the model's profiling shards),
the hop between two stages on this machine is measured as what the 2-stage loopback chain costs per
token beyond the same shards in-process (relay plus the two processes contending for the same
cores, which separate machines do not have), and each candidate split (1 stage in-process, 2 stages
even and uneven, 3 stages over loopback workers) is both priced by ``placement.evaluate`` and run,
interleaved round-robin.  Target: predictions within 15% of the measured tok/s.  Then the solver's
own run time on simulated heterogeneous fleets of 4, 8 and 16 nodes for an 80-layer model.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from statistics import median

from engine.bench.harness import NO_HOOKS, STORY_PROMPT, Hooks, interleave, loopback
from engine.bench.report import write_report
from engine.config import DEFAULT_WEIGHTS
from engine.export.exporter import export_model
from engine.fleet.placement import Fleet, ModelShape, evaluate, simulated_fleet, solve
from engine.fleet.profile import export_profile_shards, model_shape, profile_shards
from engine.fleet.survey import device_profile
from engine.manifest import layer_numbers, load_manifest
from engine.runtime.decode.generate import Generator
from engine.runtime.decode.tokenizer import ChatTokenizer
from engine.runtime.stages.chain import LocalChain

NODE = "this machine"
GB = 2**30
# An 80-layer model for the solver's run time: 16 GB of INT4 layers, as the placement tests use.
BIG_MODEL = ModelShape(name="80-layer model", num_layers=80, layer_bytes=int(0.2 * GB), embed_bytes=GB // 2,
                       head_bytes=GB // 2, kv_bytes_per_layer=int(0.04 * GB), overhead_bytes=int(0.3 * GB))


def candidates(n: int) -> dict[str, list[int]]:
    return {"1 stage": [], "2 stages even": [n // 2], "2 stages 1/3-2/3": [n // 3],
            "3 stages even": [n // 3, 2 * n // 3]}


def run_placement(model: str, *, tokens: int = 64, warmup: int = 1, runs: int = 3, weights: str = DEFAULT_WEIGHTS,
                  sizes=(4, 8, 16), out: Path | None = None, log=print, hooks: Hooks = NO_HOOKS) -> dict:
    hooks.step(0, 1, "profiling this PC")
    measured = profile_shards(export_profile_shards(model, weights, cancel=hooks.cancel), "CPU")
    log(f"profile: call {measured['call_ms']:.3f} ms, layer {measured['layer_ms']:.3f} ms, "
        f"head {measured['head_ms']:.3f} ms")
    first = export_model(model, stages=1, weights=weights, cancel=hooks.cancel).folders[0]
    splits = {name: export_model(model, split=cut, weights=weights, cancel=hooks.cancel).folders if cut else [first]
              for name, cut in candidates(load_manifest(first).spec.num_layers).items()}
    shape = ModelShape(**model_shape(load_manifest(first)))
    ids = ChatTokenizer(first).prompt_ids(STORY_PROMPT)
    length = ids.shape[1] + tokens + 1
    with contextlib.ExitStack() as stack:
        chains = {name: stack.enter_context(loopback(folders))[0]
                  for name, folders in splits.items()}
        chains["2 stages even, in-process"] = LocalChain(splits["2 stages even"])
        samples = interleave(  # ms per token
            lambda name, _: 1e3 / Generator(chains[name], length).generate(ids, tokens, ignore_eos=True,
                                                                           cancel=hooks.cancel).decode_tok_s,
            chains, runs, warmup=warmup, hooks=hooks, log=log)
    in_process = samples.pop("2 stages even, in-process")  # ms per token, like every sample below
    hop_ms = median(samples["2 stages even"]) - median(in_process)
    fleet = Fleet(devices=[device_profile(NODE, measured)], rtt_ms={(NODE, NODE): hop_ms}, coordinator=NODE)
    rows = []
    for name, folders in splits.items():
        stages = [(NODE, "CPU", *load_manifest(f).layers) for f in folders]
        predicted = evaluate(shape, fleet, stages).plan.tok_s
        got = 1e3 / median(samples[name])
        rows.append({"split": name, "layers": "/".join(layer_numbers(a, b) for _, _, a, b in stages),
                     "predicted_tok_s": round(predicted, 2), "measured_tok_s": round(got, 2),
                     "error_pct": round((predicted / got - 1) * 100, 1)})
        hooks.row(rows[-1])
    ratios = {f"predicted/measured {r['split']}": round(r["predicted_tok_s"] / r["measured_tok_s"], 3) for r in rows}
    ratios["max |error| %"] = max(abs(r["error_pct"]) for r in rows)
    ratios["within 15%"] = ratios["max |error| %"] <= 15
    ratios["hop_ms"] = round(hop_ms, 3)
    for n in sizes:
        hooks.check()
        times = []
        for seed in range(3):
            t = time.perf_counter()
            plan = solve(BIG_MODEL, simulated_fleet(n, seed), objective="latency")
            times.append((time.perf_counter() - t) * 1e3)
        rows.append({"split": f"solver: {n} simulated nodes, 80 layers", "layers": f"{len(plan.stages)} stages",
                     "solve_ms": round(median(times), 1)})
        ratios[f"solve_ms {n} nodes"] = round(median(times), 1)
        log(f"solver, {n} nodes: {median(times):.0f} ms")
    hooks.step(1, 1, "done")
    return write_report("placement", rows, ratios, out,
                        {"model": model, "tokens": tokens, "runs": runs,
                         "profile": {k: v for k, v in measured.items() if k != "shards"}})
