"""``fleet bench microbatch``: aggregate throughput of 1, 2 and 3 concurrent streams on 2- and
3-stage loopback pipelines at several injected hop delays.

All stages share this machine's cores, so N streams can gain at most
``min(N, (compute + waiting) / compute)``: whatever the single stream spends waiting on the wire can
be filled with another stream's compute, nothing more.  The ideal comes from the same run's
single stream over its whole run, prefill included as in the measured throughput (compute = every
stage plus the coordinator's own work; waiting = the rest).  Stream counts are interleaved, ``runs``
times each; the median counts.

Near the knee (N close to that bound) the bound is out of reach whatever the overheads: a
stream's hop that outlasts the other streams' computes leaves the cores idle while every stream
travels, and a stream that lands during another's compute waits its turn.  ``schedule`` is the gain
the same breakdown allows once that is counted: the streams run through the measured stage
computes and hops, taking turns first come first served (``schedule_bound``), with no overhead.

``isolation``: at one point (first stage count, 10 ms, 2 and 3 streams) shared compiled models
against one compiled model per stream, with the workers' resident memory.  ``turns``: at the same
point, stages taking compute turns (``engine.runtime.stages.turns``, the default) against all computing at
once.

``shards`` runs an existing split (an export folder or its stage folders) instead of exporting
``model`` once per stage count.
"""

from __future__ import annotations

from pathlib import Path
from statistics import median

from engine.bench.harness import (NO_HOOKS, PROMPTS, Hooks, decode_streams, interleave, loopback, prompt_ids, rss_mb,
                                  split_export, warm_up)
from engine.bench.report import write_report
from engine.config import DEFAULT_WEIGHTS


# Each side-by-side comparison's two sides, (label, loopback options); its ratio is the second over the first.
COMPARISONS = {
    "isolation": (("shared compiled", {"isolate": False}), ("per-stream compiled", {"isolate": True})),
    "turns": (("all at once", {"turns": False}), ("compute turns", {"turns": True})),
}


def schedule_bound(stage_ms: list[float], hop_ms: float, streams: int, tokens: int = 200) -> float:
    """The gain over one stream of ``streams`` streams through stages that take turns on one
    computer's cores: a token is each stage's compute (``stage_ms``) in order, ``hop_ms`` on the
    wire after each but the last, and the result's way back through every hop; a compute starts when
    its stream has arrived and the cores are free, the earliest arrival first."""
    hops = [hop_ms] * (len(stage_ms) - 1) + [hop_ms * (len(stage_ms) - 1)]
    ready = [0.0] * streams
    stage = [0] * streams
    done = [0] * streams
    free = end = 0.0
    while min(done) < tokens:
        i = min((i for i in range(streams) if done[i] < tokens), key=lambda i: ready[i])
        free = max(ready[i], free) + stage_ms[stage[i]]
        ready[i] = free + hops[stage[i]]
        stage[i] = (stage[i] + 1) % len(stage_ms)
        if stage[i] == 0:
            done[i] += 1
            end = max(end, ready[i])
    return streams * tokens / end * (sum(stage_ms) + sum(hops))


def _sweep(chain, prompts, counts, tokens: int, runs: int, hooks: Hooks, label: str) -> dict[int, list]:
    """Each stream count's decodes, ``runs`` rounds of them taking turns, after a warm-up."""
    warm_up(chain, prompts[: max(counts)], tokens, hooks=hooks)
    return interleave(lambda n, _: decode_streams(chain, prompts[:n], tokens, hooks=hooks), counts, runs,
                      alternate=True, hooks=hooks, label=lambda n: f"{label}, {n} stream(s)")


def _stage_shares(result, compute_ms: float) -> list[float]:
    """``compute_ms`` split between the stages as their decode compute was, the coordinator's own
    work counted with stage 0 (it runs there)."""
    decode = result.breakdown.to_json()
    stage = decode["stage_compute_ms"]
    stage[0] += decode["host_ms"]
    return [compute_ms * s / sum(stage) for s in stage]


def run_microbatch(model: str, *, stage_counts=(2, 3), delays=(0.0, 10.0, 50.0), counts=(1, 2, 3),
                   tokens: int = 64, runs: int = 2, isolation: bool = True, turns: bool = True,
                   weights: str = DEFAULT_WEIGHTS, cpu_sets: str = "", out: Path | None = None, log=print, shards=None,
                   hooks: Hooks = NO_HOOKS) -> dict:
    names = list(PROMPTS)[: max(counts)]
    rows, ratios = [], {}
    splits = {}
    if shards:
        given = split_export(model, 0, weights, shards)
        splits = {len(given): given}
        stage_counts = (len(given),)
    points = len(stage_counts) * len(delays) + 2 * (isolation + turns)
    point = 0  # of the points measured, each a share of the progress
    for stages in stage_counts:
        folders = splits.get(stages) or split_export(model, stages, weights, hooks=hooks)
        splits[stages] = folders
        prompts = prompt_ids(folders[0], names)
        sets = cpu_sets if len(cpu_sets.split(";")) == stages else ""
        if cpu_sets and not sets:
            log(f"--cpus names {len(cpu_sets.split(';'))} CPU sets: the {stages}-stage points run unpinned")
        for delay in delays:
            with loopback(folders, delay_ms=delay, cpu_sets=sets) as (chain, _):
                samples = _sweep(chain, prompts, counts, tokens, runs, hooks.part(point, points),
                                 f"{stages} stages, {delay:g} ms")
            point += 1
            single = sorted(samples[1], key=lambda b: b.tok_s)[len(samples[1]) // 2]
            bd = single.breakdown()
            bound = bd["token_ms"] / bd["compute_ms"]
            waiting = bd["token_ms"] - bd["compute_ms"]
            stage_ms = _stage_shares(single.results[0], bd["compute_ms"])
            hop_ms = waiting / (2 * (stages - 1))
            base = median(b.tok_s for b in samples[1])
            for n in counts:
                tok_s = median(b.tok_s for b in samples[n])
                ideal = min(n, bound)
                schedule = schedule_bound(stage_ms, hop_ms, n)
                gain = tok_s / base
                rows.append({"stages": stages, "delay_ms": delay, "streams": n, "tok_s": round(tok_s, 2),
                             "per_stream": round(tok_s / n, 2), "gain": round(gain, 3), "ideal": round(ideal, 3),
                             "of_ideal": round(gain / ideal, 3), "schedule": round(schedule, 3),
                             "of_schedule": round(gain / schedule, 3), "compute_ms": round(bd["compute_ms"], 2),
                             "waiting_ms": round(waiting, 2)})
                if n > 1:
                    ratios[f"{stages}st {delay:g}ms {n} streams gain"] = round(gain, 3)
                    ratios[f"{stages}st {delay:g}ms {n} streams of ideal"] = round(gain / ideal, 3)
                hooks.row(rows[-1])
            log(f"{stages} stages, {delay:g} ms: " + ", ".join(f"{r['streams']}x {r['tok_s']}"
                                                              for r in rows[-len(counts):]))
    comparisons = [c for c, on in (("isolation", isolation), ("turns", turns)) if on]
    for what in comparisons:
        stages = stage_counts[0]
        folders = splits[stages]
        prompts = prompt_ids(folders[0], names)
        (base_label, base_opts), (alt_label, alt_opts) = COMPARISONS[what]
        speeds = {}
        for label, opts in ((base_label, base_opts), (alt_label, alt_opts)):
            with loopback(folders, delay_ms=10.0, **opts) as (chain, fleet):
                samples = _sweep(chain, prompts, counts, tokens, runs, hooks.part(point, points), f"{what}: {label}")
                memory = sum(rss_mb(p.pid) for p in fleet.procs)
            point += 1
            for n in counts:
                speeds[label, n] = median(b.tok_s for b in samples[n])
                rows.append({"stages": stages, "delay_ms": 10.0, "streams": n, "tok_s": round(speeds[label, n], 2),
                             "per_stream": round(speeds[label, n] / n, 2), what: label,
                             "workers_rss_mb": round(memory, 1)})
                hooks.row(rows[-1])
        for n in counts[1:]:
            ratios[f"{alt_label} vs {base_label} {n} streams"] = round(speeds[alt_label, n] / speeds[base_label, n], 3)
    hooks.step(1, 1, "done")
    meta = {"model": model, "tokens_per_stream": tokens, "runs": runs, "weights": weights, "cpu_sets": cpu_sets,
            "ideal": "min(N, token_ms / compute_ms) from the single-stream run (prefill included) of the same point",
            "schedule": "the gain that breakdown allows with stages taking turns (schedule_bound)"}
    return write_report("microbatch", rows, ratios, out, settings=meta)
