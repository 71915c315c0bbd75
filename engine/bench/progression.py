"""``fleet bench progression``: the paper's "Progressive Optimization" table on this machine.

Monolithic (the whole model in one process, one stream), then the N-stage loopback pipeline with
one stream, + micro-batching (two streams), + speculation (two streams, each with its own draft,
K auto).  Configurations are interleaved ``runs`` times; throughput is aggregate tokens over wall
time, with each step's ratio to monolithic.  ``shards`` runs an existing split (an export folder
or its stage folders) instead of exporting ``model`` into ``stages``.
"""

from __future__ import annotations

from pathlib import Path
from statistics import median

from engine.bench.harness import (NO_HOOKS, Hooks, decode_streams, draft_export, drafters, interleave, loopback,
                                  prompt_ids, split_export, warm_up)
from engine.bench.report import write_report
from engine.config import DEFAULT_WEIGHTS
from engine.export.exporter import export_model
from engine.runtime.stages.chain import LocalChain

STREAM_PROMPTS = ("code", "chat")


def run_progression(model: str, draft: str, *, stages: int = 2, tokens: int = 96, runs: int = 2,
                    delay_ms: float = 0.0, draft_kind: str = "model", weights: str = DEFAULT_WEIGHTS,
                    cpu_sets: str = "", out: Path | None = None, log=print, shards=None,
                    hooks: Hooks = NO_HOOKS) -> dict:
    whole = export_model(model, stages=1, weights=weights, cancel=hooks.cancel)
    split = split_export(model, stages, weights, shards, hooks)
    stages = len(split)
    draft_folders = draft_export(draft, draft_kind, weights)
    prompts = prompt_ids(whole.folders[0], STREAM_PROMPTS)
    mono = LocalChain(whole.folders)
    names = ["monolithic, 1 stream", f"{stages}-stage, 1 stream", f"{stages}-stage, 2 streams",
             f"{stages}-stage, 2 streams + speculation"]
    hooks.step(0, 1, "starting the pipeline")
    with loopback(split, delay_ms=delay_ms, cpu_sets=cpu_sets) as (chain, _):
        spec = drafters(draft_kind, chain, draft_folders, len(prompts))
        warm_up(mono, prompts[:1], tokens, hooks=hooks)
        warm_up(chain, prompts, tokens, spec, hooks=hooks)
        steps = {
            names[0]: lambda: [decode_streams(mono, [p], tokens, hooks=hooks) for p in prompts],
            names[1]: lambda: [decode_streams(chain, [p], tokens, hooks=hooks) for p in prompts],
            names[2]: lambda: [decode_streams(chain, prompts, tokens, hooks=hooks)],
            names[3]: lambda: [decode_streams(chain, prompts, tokens, drafters_=spec, k="auto", hooks=hooks)],
        }

        def measure(name: str, _round: int) -> tuple[float, float]:
            """Aggregate tok/s, and the last batch's acceptance."""
            batches = steps[name]()
            return sum(b.tokens for b in batches) / sum(b.wall_s for b in batches), batches[-1].acceptance

        samples = interleave(measure, names, runs, alternate=True, hooks=hooks, log=log)
    base = median(s[0] for s in samples[names[0]])
    rows, ratios = [], {}
    for name in names:
        tok_s = median(s[0] for s in samples[name])
        rows.append({"config": name, "tok_s": round(tok_s, 2), "vs_monolithic": round(tok_s / base, 3),
                     "acceptance": round(samples[name][-1][1], 3) if "speculation" in name else None})
        ratios[f"{name} vs monolithic"] = round(tok_s / base, 3)
        hooks.row(rows[-1])
    hooks.step(1, 1, "done")
    meta = {"model": model, "draft": draft if draft_folders else draft_kind, "stages": stages, "tokens": tokens,
            "runs": runs, "delay_ms": delay_ms, "weights": weights, "cpu_sets": cpu_sets}
    return write_report("progression", rows, ratios, out, settings=meta)
