"""``fleet bench ksweep``: which K wins at which hop latency, and whether ``--k auto`` finds it.

A single stream on an N-stage loopback pipeline (default 3) at several injected one-way hop delays;
at each delay the target alone, every fixed K and ``auto`` decode the same prompts, interleaved
prompt by prompt.  Throughput is all tokens over all decode time at that delay.  ``shards`` runs
an existing split (an export folder or its stage folders) instead of exporting ``model``.
"""

from __future__ import annotations

from pathlib import Path

from engine.bench.harness import (NO_HOOKS, Hooks, draft_export, drafters, loopback, prompt_ids, run_batch,
                                  split_export, warm_up)
from engine.bench.report import write_report

SWEEP_PROMPTS = ("code", "technical explanation")


def run_ksweep(model: str, draft: str, *, stages: int = 3, delays=(0.0, 50.0, 100.0), ks=(2, 3, 5, 7, 10, "auto"),
               tokens: int = 96, draft_kind: str = "model", weights: str = "int4", cpu_sets: str = "",
               out: Path | None = None, log=print, shards=None, hooks: Hooks = NO_HOOKS) -> dict:
    folders = split_export(model, stages, weights, shards, hooks)
    stages = len(folders)
    draft_folders = draft_export(draft, draft_kind, weights)
    prompts = prompt_ids(folders[0], SWEEP_PROMPTS)
    configs = ["none", *ks]
    widest = max((k for k in ks if k != "auto"), default="auto")  # the warm-up's K
    rows, ratios = [], {}
    total, done = len(delays) * (1 + len(prompts) * len(configs)), 0
    for delay in delays:
        totals = {c: {"tokens": 0, "s": 0.0, "drafted": 0, "accepted": 0, "ks": []} for c in configs}
        hooks.step(done, total, f"{delay:g} ms: starting the pipeline")
        with loopback(folders, delay_ms=delay, cpu_sets=cpu_sets) as (chain, _):
            (drafter,) = drafters(draft_kind, chain, draft_folders, 1)
            warm_up(chain, prompts[:1], tokens, [drafter], widest, hooks)
            done += 1
            for i, ids in enumerate(prompts):
                order = configs if i % 2 == 0 else configs[::-1]
                for k in order:
                    hooks.step(done, total, f"{delay:g} ms: prompt {i + 1}/{len(prompts)}, K={k}")
                    run = run_batch(chain, [ids], tokens, drafters_=None if k == "none" else [drafter],
                                    k=0 if k == "none" else k, hooks=hooks)
                    done += 1
                    (g,) = run.results
                    t = totals[k]
                    t["tokens"] += len(g.tokens) - 1
                    t["s"] += g.decode_s
                    t["drafted"] += g.drafted
                    t["accepted"] += g.accepted
                    t["ks"] += g.k_history
                log(f"{delay:g} ms: prompt {i + 1}/{len(prompts)} done")
        speeds = {}
        for k in configs:
            t = totals[k]
            speeds[k] = t["tokens"] / t["s"]
            rows.append({"delay_ms": delay, "k": "no spec" if k == "none" else k, "tok_s": round(speeds[k], 2),
                         "vs_no_spec": round(speeds[k] / speeds["none"], 3) if k != "none" else 1.0,
                         "acceptance": round(t["accepted"] / t["drafted"], 3) if t["drafted"] else None,
                         "mean_k": round(sum(t["ks"]) / len(t["ks"]), 2) if t["ks"] else None})
            hooks.row(rows[-1])
        fixed = {k: v for k, v in speeds.items() if isinstance(k, int)}
        best = max(fixed, key=fixed.get)
        ratios[f"{delay:g}ms best fixed K"] = best
        ratios[f"{delay:g}ms auto vs best fixed"] = round(speeds["auto"] / fixed[best], 3)
        ratios[f"{delay:g}ms best vs no spec"] = round(max(speeds["auto"], fixed[best]) / speeds["none"], 3)
        log(f"{delay:g} ms: best fixed K={best} {fixed[best]:.2f} tok/s, auto {speeds['auto']:.2f}")
    hooks.step(total, total, "done")
    meta = {"model": model, "draft": draft if draft_folders else draft_kind, "draft_kind": draft_kind,
            "stages": stages, "tokens": tokens, "prompts": list(SWEEP_PROMPTS), "weights": weights,
            "cpu_sets": cpu_sets, "delay": "one-way, on every worker's receive and send (2x per hop per round)"}
    return write_report("ksweep", rows, ratios, out, settings=meta)
