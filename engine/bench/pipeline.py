"""``fleet bench pipeline``: what the TCP relay costs.

Single-stream greedy decode of one prompt through the 1-stage in-process chain, the N-stage chain
in-process, and the N-stage chain over loopback TCP with each stage beyond the first in its own
worker process.  Runs are interleaved round-robin (this machine is noisy).

Two per-hop figures: ``relay_round_trip_ms_per_hop`` is what the relay itself costs (a frame down
the chain and back through every worker, no compute in between); ``loopback_extra_ms_per_hop`` is
the loopback chain's extra time per token over the same shards in-process, divided by stages - 1.
On one machine the second includes the stages fighting over the same cores (the OpenVINO threads of
a stage that just finished keep spinning for a while), which separate machines do not have.
"""

from __future__ import annotations

import time
from pathlib import Path
from statistics import median

from engine.bench.harness import NO_HOOKS, STORY_PROMPT, Hooks, interleave, loopback, split_export
from engine.bench.report import half_range, write_report
from engine.config import DEFAULT_WEIGHTS
from engine.export.exporter import export_model
from engine.runtime.stages.chain import LocalChain
from engine.runtime.decode.generate import Generator
from engine.runtime.decode.tokenizer import ChatTokenizer

def run_pipeline(model: str, *, stages: int = 2, tokens: int = 128, warmup: int = 1, runs: int = 5,
                 weights: str = DEFAULT_WEIGHTS, delay_ms: float = 0.0, out: Path | None = None, log=print, shards=None,
                 hooks: Hooks = NO_HOOKS) -> dict:
    """``shards`` runs an existing split (an export folder or its stage folders) instead of
    exporting ``model`` into ``stages``."""
    whole = export_model(model, stages=1, weights=weights, cancel=hooks.cancel)
    split = split_export(model, stages, weights, shards, hooks)
    stages = len(split)
    ids = ChatTokenizer(whole.folders[0]).prompt_ids(STORY_PROMPT)
    length = ids.shape[1] + tokens + 1
    on_token = (lambda t: hooks.on_token(0, t)) if hooks.on_token else None
    hooks.step(0, 1, "starting the pipeline")
    with loopback(split, delay_ms=delay_ms) as (remote, _):
        chains = {
            "1-stage in-process": LocalChain(whole.folders),
            f"{stages}-stage in-process": LocalChain(split),
            f"{stages}-stage loopback TCP": remote,
        }

        def decode(name: str, _round: int):
            result = Generator(chains[name], length).generate(ids, tokens, ignore_eos=True, on_token=on_token,
                                                              cancel=hooks.cancel)
            hooks.check()
            return result

        samples = interleave(decode, chains, runs, warmup=warmup, hooks=hooks, log=log)
        pings = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(100):
                remote.ping()
            pings.append((time.perf_counter() - start) * 10)  # ms per ping
    rows = []
    for name, results in samples.items():
        token_ms = median(r.breakdown.to_json()["token_ms"] for r in results)
        mid = sorted(results, key=lambda r: r.decode_tok_s)[len(results) // 2]
        bd = mid.breakdown.to_json()
        rows.append({
            "config": name,
            "tok_s": round(median(r.decode_tok_s for r in results), 2),
            "token_ms": round(token_ms, 3),
            "ttft_ms": round(median(r.ttft_s * 1e3 for r in results), 1),
            "stage_ms": "/".join(f"{s:.2f}" for s in bd["stage_compute_ms"]),
            "network_ms": bd["network_ms"],
            "host_ms": bd["host_ms"],
            "same_tokens": all(r.tokens == samples[name][0].tokens for r in results),
        })
        hooks.row(rows[-1])
    hooks.step(1, 1, "done")
    by = {r["config"]: r for r in rows}
    inproc, tcp = by[f"{stages}-stage in-process"], by[f"{stages}-stage loopback TCP"]
    hops = stages - 1
    ratios = {
        "tcp_vs_inprocess": round(tcp["tok_s"] / inproc["tok_s"], 3),
        "split_vs_whole": round(inproc["tok_s"] / by["1-stage in-process"]["tok_s"], 3),
        "loopback_extra_ms_per_hop": round((tcp["token_ms"] - inproc["token_ms"]) / hops, 3),
        "network_ms_per_hop": round(tcp["network_ms"] / hops, 3),
        "relay_round_trip_ms_per_hop": round(median(pings) / hops, 3),
    }
    # each ratio per round (the configurations took turns): how far it moved between the repeats
    whole_runs, split_runs, tcp_runs = (samples[n] for n in (
        "1-stage in-process", f"{stages}-stage in-process", f"{stages}-stage loopback TCP"))

    def ms_per_token(result) -> float:
        return result.breakdown.to_json()["token_ms"]

    spread = {key: round(value, 3) for key, value in {
        "tcp_vs_inprocess": half_range([t.decode_tok_s / i.decode_tok_s for t, i in zip(tcp_runs, split_runs)]),
        "split_vs_whole": half_range([i.decode_tok_s / w.decode_tok_s for i, w in zip(split_runs, whole_runs)]),
        "loopback_extra_ms_per_hop": half_range([(ms_per_token(t) - ms_per_token(i)) / hops
                                                 for t, i in zip(tcp_runs, split_runs)]),
    }.items() if value is not None}
    meta = {"model": model, "stages": stages, "weights": weights, "prompt_tokens": int(ids.shape[1]),
            "new_tokens": tokens, "warmup": warmup, "runs": runs, "delay_ms": delay_ms,
            "return_path": "hop by hop"}
    return write_report("pipeline", rows, ratios, out, settings=meta, spread=spread)
