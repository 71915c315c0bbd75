"""``fleet bench ksweep``: which K wins at which hop latency, and whether ``--k auto`` finds it.

A single stream on an N-stage loopback pipeline (default 3) at several injected one-way hop delays;
at each delay the target alone, every fixed K and ``auto`` decode the same prompts, interleaved
prompt by prompt.  Throughput is all tokens over all decode time at that delay.  ``shards`` runs
an existing split (an export folder or its stage folders) instead of exporting ``model``.
"""

from __future__ import annotations

from pathlib import Path

from engine.bench.harness import (NO_HOOKS, Hooks, decode_streams, draft_export, drafters, interleave, loopback,
                                  prompt_ids, split_export, warm_up)
from engine.bench.report import write_report
from engine.config import DEFAULT_WEIGHTS

SWEEP_PROMPTS = ("code", "technical explanation")


def run_ksweep(model: str, draft: str, *, stages: int = 3, delays=(0.0, 50.0, 100.0), ks=(2, 3, 5, 7, 10, "auto"),
               tokens: int = 96, draft_kind: str = "model", weights: str = DEFAULT_WEIGHTS, cpu_sets: str = "",
               out: Path | None = None, log=print, shards=None, hooks: Hooks = NO_HOOKS) -> dict:
    folders = split_export(model, stages, weights, shards, hooks)
    stages = len(folders)
    draft_folders = draft_export(draft, draft_kind, weights)
    prompts = prompt_ids(folders[0], SWEEP_PROMPTS)
    configs = ["none", *ks]
    widest = max((k for k in ks if k != "auto"), default="auto")  # the warm-up's K
    rows, ratios = [], {}
    for d, delay in enumerate(delays):
        within = hooks.part(d, len(delays))
        within.step(0, 1, f"{delay:g} ms: starting the pipeline")
        with loopback(folders, delay_ms=delay, cpu_sets=cpu_sets) as (chain, _):
            (drafter,) = drafters(draft_kind, chain, draft_folders, 1)
            warm_up(chain, prompts[:1], tokens, [drafter], widest, hooks)

            def decode(k, prompt: int):
                (g,) = decode_streams(chain, [prompts[prompt]], tokens, drafters_=None if k == "none" else [drafter],
                                      k=0 if k == "none" else k, hooks=hooks).results
                return g

            # a round is a prompt: every configuration decodes it, in the reverse order every other prompt
            got = interleave(decode, configs, len(prompts), alternate=True, hooks=within,
                             log=lambda line: log(f"{delay:g} ms: {line}"), label=lambda k: f"{delay:g} ms: K={k}")
        totals = {k: {"tokens": sum(len(g.tokens) - 1 for g in gs), "s": sum(g.decode_s for g in gs),
                      "drafted": sum(g.drafted for g in gs), "accepted": sum(g.accepted for g in gs),
                      "ks": [k_ for g in gs for k_ in g.k_history]} for k, gs in got.items()}
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
    hooks.step(1, 1, "done")
    meta = {"model": model, "draft": draft if draft_folders else draft_kind, "draft_kind": draft_kind,
            "stages": stages, "tokens": tokens, "prompts": list(SWEEP_PROMPTS), "weights": weights,
            "cpu_sets": cpu_sets, "delay": "one-way, on every worker's receive and send (2x per hop per round)"}
    return write_report("ksweep", rows, ratios, out, settings=meta)
