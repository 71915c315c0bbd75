"""``fleet bench wan``: naive distributed decode against the full stack as hop latency grows.

Naive: one stream, no speculation.  Full stack: two streams, each speculating with its own draft
(K auto).  Both on the same N-stage loopback pipeline (default 2) at each injected one-way hop delay,
interleaved; throughput is aggregate tokens over wall time.  ``shards`` runs an existing split
(an export folder or its stage folders) instead of exporting ``model``.
"""

from __future__ import annotations

from pathlib import Path

from engine.bench.harness import (NO_HOOKS, Hooks, decode_streams, draft_export, drafters, interleave, loopback,
                                  prompt_ids, split_export, warm_up)
from engine.bench.report import write_report
from engine.config import DEFAULT_WEIGHTS

WAN_PROMPTS = ("code", "chat")
FULL = "full stack"


def run_wan(model: str, draft: str, *, stages: int = 2, delays=(0.0, 10.0, 50.0, 100.0), tokens: int = 64,
            runs: int = 1, draft_kind: str = "model", k="auto", weights: str = DEFAULT_WEIGHTS, cpu_sets: str = "",
            out: Path | None = None, log=print, shards=None, hooks: Hooks = NO_HOOKS) -> dict:
    folders = split_export(model, stages, weights, shards, hooks)
    stages = len(folders)
    draft_folders = draft_export(draft, draft_kind, weights)
    prompts = prompt_ids(folders[0], WAN_PROMPTS)
    rows, ratios = [], {}
    for d, delay in enumerate(delays):
        within = hooks.part(d, len(delays))
        within.step(0, 1, f"{delay:g} ms: starting the pipeline")
        with loopback(folders, delay_ms=delay, cpu_sets=cpu_sets) as (chain, _):
            spec = drafters(draft_kind, chain, draft_folders, len(prompts))
            warm_up(chain, prompts, tokens, spec, k, hooks)
            # naive: one stream at a time, each prompt; the full stack: every prompt at once
            configs = {f"naive, prompt {i + 1}": lambda ids=ids: decode_streams(chain, [ids], tokens, hooks=hooks)
                       for i, ids in enumerate(prompts)}
            configs[FULL] = lambda: decode_streams(chain, prompts, tokens, drafters_=spec, k=k, hooks=hooks)
            got = interleave(lambda name, _: configs[name](), configs, runs, hooks=within,
                             label=lambda name: f"{delay:g} ms: {name}")
        singles = [got[name][r] for r in range(runs) for name in configs if name != FULL]
        naive = sum(b.tokens for b in singles) / sum(b.wall_s for b in singles)
        full = got[FULL]
        full_tok_s = sum(b.tokens for b in full) / sum(b.wall_s for b in full)
        acceptance = sum(b.acceptance for b in full) / len(full)
        mean_k = sum(b.mean_k for b in full) / len(full)
        rows.append({"delay_ms": delay, "naive_tok_s": round(naive, 2), "full_tok_s": round(full_tok_s, 2),
                     "full_per_stream": round(full_tok_s / len(prompts), 2),
                     "full_vs_naive": round(full_tok_s / naive, 3),
                     "acceptance": round(acceptance, 3), "mean_k": round(mean_k, 2)})
        hooks.row(rows[-1])
        ratios[f"{delay:g}ms full vs naive"] = round(full_tok_s / naive, 3)
        log(f"{delay:g} ms: naive {naive:.2f} tok/s, full stack {full_tok_s:.2f} tok/s")
    hooks.step(1, 1, "done")
    meta = {"model": model, "draft": draft if draft_folders else draft_kind, "stages": stages, "streams": len(prompts),
            "k": k, "tokens_per_stream": tokens, "runs": runs, "weights": weights, "cpu_sets": cpu_sets}
    return write_report("wan", rows, ratios, out, settings=meta)
