"""``fleet bench tls``: what mutual TLS costs a fleet, side by side with the same fleet unencrypted.

Two loopback fleets of the same shards, stage 0 here and each later stage in its own worker
process (``harness.loopback``): one speaking TLS with the fleet certificate (the default), one with
it turned off.  Each round decodes one long prompt on both, taking turns and alternating which goes
first, so that the machine's drift (other work sharing its cores) falls on both alike.  Two figures
per fleet: prefill tok/s (the prompt's tokens over the time to the first new token: the widest
frames) and decode tok/s (one stream, a frame per token each way); and the CPU time the run took in
this process and the fleet's workers together, per new token, which other work sharing the cores
disturbs far less than the wall time.  The ratios are TLS over plain, each the median of the rounds'
own ratios (a round's two runs are minutes apart at most) and, for the speeds, the ratio of the
medians; 1.0 is no cost (for the CPU time, above 1.0 is the cost).

What TLS adds to one trip down the chain and back is measured alone too: sets of ``PINGS`` pings,
the two fleets taking turns set by set.  A decode token makes the same trip, so the extra time of a
ping over the plain fleet's time per token (``tls_share_of_decode_token``) is what TLS costs decode
with no other work's noise in it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from statistics import median

import psutil

from engine.bench.harness import NO_HOOKS, Hooks, interleave, loopback, split_export
from engine.bench.quality import bench_text
from engine.bench.report import write_report
from engine.config import DEFAULT_WEIGHTS
from engine.runtime.decode.generate import Generator
from engine.runtime.decode.tokenizer import ChatTokenizer

CONFIGS = {"TLS": True, "plain": False}
PINGS = 200  # pings a set


def run_tls(model: str, *, stages: int = 2, tokens: int = 128, prompt: int = 512, warmup: int = 1, runs: int = 7,
            weights: str = DEFAULT_WEIGHTS, out: Path | None = None, log=print, shards=None,
            hooks: Hooks = NO_HOOKS) -> dict:
    """``prompt``: the prompt's tokens (the shipped prose, cut); ``tokens``: new tokens per run;
    ``shards`` runs an existing split instead of exporting ``model`` into ``stages``."""
    split = split_export(model, stages, weights, shards, hooks)
    ids = ChatTokenizer(split[0]).prompt_ids(bench_text(), chat=False)[:, :prompt]
    length = ids.shape[1] + tokens + 1
    hooks.step(0, 1, "starting a fleet with TLS and one without")
    with loopback(split, tls=True) as (secure, secure_workers), loopback(split, tls=False) as (plain, plain_workers):
        chains = {"TLS": secure, "plain": plain}
        processes = {name: [psutil.Process(os.getpid())] + [psutil.Process(p.pid) for p in workers.procs]
                     for name, workers in (("TLS", secure_workers), ("plain", plain_workers))}
        cpu_ms: dict[str, list[float]] = {name: [] for name in CONFIGS}

        def run(name: str, round_: int):
            before = _cpu_s(processes[name])
            result = Generator(chains[name], length).generate(ids, tokens, ignore_eos=True, cancel=hooks.cancel)
            if round_ >= warmup:
                cpu_ms[name].append((_cpu_s(processes[name]) - before) * 1e3 / len(result.tokens))
            hooks.check()
            return result

        samples = interleave(run, CONFIGS, runs, warmup=warmup, alternate=True, hooks=hooks, log=log)

        def pings(name: str, _round: int) -> float:
            start = time.perf_counter()
            for _ in range(PINGS):
                chains[name].ping()
            return (time.perf_counter() - start) * 1e3 / PINGS

        ping_ms = interleave(pings, CONFIGS, runs, warmup=1, alternate=True, hooks=hooks)
    prefill = {name: [r.prompt_tokens / r.ttft_s for r in results] for name, results in samples.items()}
    decode = {name: [r.decode_tok_s for r in results] for name, results in samples.items()}
    rows = []
    for name, results in samples.items():
        rows.append({"config": name, "tls": CONFIGS[name],
                     "decode_tok_s": round(median(decode[name]), 2),
                     "prefill_tok_s": round(median(prefill[name]), 1),
                     "cpu_ms_per_token": round(median(cpu_ms[name]), 3),
                     "ping_ms": round(median(ping_ms[name]), 4),
                     "decode_runs": [round(v, 2) for v in decode[name]],
                     "prefill_runs": [round(v, 1) for v in prefill[name]],
                     "cpu_ms_runs": [round(v, 3) for v in cpu_ms[name]],
                     "same_tokens": all(r.tokens == samples["plain"][0].tokens for r in results)})
        hooks.row(rows[-1])
    hooks.step(1, 1, "done")

    def paired(values: dict) -> float:
        return round(median(a / b for a, b in zip(values["TLS"], values["plain"])), 4)

    ratios = {
        "decode_tls_vs_plain": paired(decode),
        "prefill_tls_vs_plain": paired(prefill),
        "cpu_per_token_tls_vs_plain": paired(cpu_ms),
        "ping_extra_ms": round(median(a - b for a, b in zip(ping_ms["TLS"], ping_ms["plain"])), 4),
        "tls_share_of_decode_token": round(median(a - b for a, b in zip(ping_ms["TLS"], ping_ms["plain"]))
                                           * rows[1]["decode_tok_s"] / 1e3, 4),
        "decode_tls_vs_plain_of_medians": round(rows[0]["decode_tok_s"] / rows[1]["decode_tok_s"], 4),
        "prefill_tls_vs_plain_of_medians": round(rows[0]["prefill_tok_s"] / rows[1]["prefill_tok_s"], 4),
    }
    meta = {"model": model, "stages": len(split), "weights": weights, "prompt_tokens": int(ids.shape[1]),
            "new_tokens": tokens, "warmup": warmup, "runs": runs, "pings_a_set": PINGS,
            "order": "interleaved, alternating"}
    return write_report("tls", rows, ratios, out, settings=meta)


def _cpu_s(processes: list[psutil.Process]) -> float:
    """The CPU seconds ``processes`` have taken so far (user and system, every thread)."""
    return sum(sum(p.cpu_times()[:2]) for p in processes)
