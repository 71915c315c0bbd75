"""``fleet bench batch``: many users on one stage at once.  Aggregate tok/s of N streams decoded
(a) as today, one forward per stream on stateful stages (``generate_streams``), (b) packed, every
stream's new tokens in one paged-attention forward per stage (``engine.runtime.stages.paged``), and
(c) ``openvino_genai.ContinuousBatchingPipeline`` on the 1-stage export, OpenVINO's own multi-user
path; with 2+ stages also (d) packed over the relay: stage 0 here, the rest as worker processes on
loopback, one PACKED frame per round through the chain loop (``RemoteChain``).  Same prompts (the
chat prompts, N of them), same compile settings, EOS ignored.  Aggregate decode tok/s: every batch
runs twice, for ``SHORT`` and for ``SHORT + tokens`` new tokens, and the extra tokens of all streams
are divided by the extra time, so the prefill (and any start-up) cancels out the same way for all
three.  Stream counts and the three ways are interleaved, ``runs`` times; medians count.  Also the
KV memory each stream holds at the end: the stateful states' bytes against the paged blocks it uses.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from statistics import median

import numpy as np
import openvino as ov
import openvino_genai

from engine.bench.harness import NO_HOOKS, PROMPTS, Hooks, interleave, loopback, prompt_ids
from engine.bench.report import write_report
from engine.config import DEFAULT_WEIGHTS
from engine.export.exporter import export_model
from engine.runtime.decode.generate import generate_streams
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.packing import Part
from engine.runtime.stages.paged import PagedStage
from engine.runtime.stages.stage import device_config

STREAMS = (1, 2, 4, 8)
SHORT = 4  # new tokens of the short run each long run is measured against


def _prompts(folder: Path, n: int) -> list[np.ndarray]:
    names = list(PROMPTS)
    return [ids.reshape(-1) for ids in prompt_ids(folder, [names[i % len(names)] for i in range(n)])]


def packed_greedy(stages: list[PagedStage], prompts: list[np.ndarray], tokens: int) -> list[list[int]]:
    """Every prompt prefilled in one packed forward, then ``tokens - 1`` packed decode rounds."""
    held = [0] * len(prompts)
    x = list(prompts)
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(tokens):
        parts = [Part(i, ids, held[i]) for i, ids in enumerate(x)]
        for stage in stages:
            results = stage.forward_parts(parts)
            parts = [Part(p.stream, r, p.start, p.keep) for p, r in zip(parts, results)]
        for i, logits in enumerate(results):
            held[i] += len(x[i])
            out[i].append(int(logits[-1].argmax()))
            x[i] = np.array([out[i][-1]])
    for stage in stages:
        for i in range(len(prompts)):
            stage.reset(i)
    return out


def _stateful_kv_bytes(chain: LocalChain, streams: int) -> float:
    total = 0
    for stage in chain.stages:
        for stream in range(streams):
            total += sum(state.state.byte_size for state in stage.request(stream)[0].query_state())
    return total / streams


def _cb_runner(folder: Path, device: str, props: dict):
    scheduler = openvino_genai.SchedulerConfig()
    scheduler.cache_size = 1  # GB
    scheduler.max_num_seqs = max(STREAMS)
    pipe = openvino_genai.ContinuousBatchingPipeline(str(folder), scheduler, device, props)

    def run(prompts: list[np.ndarray], tokens: int) -> float:
        config = openvino_genai.GenerationConfig()
        config.max_new_tokens = config.min_new_tokens = tokens
        config.ignore_eos = True
        config.do_sample = False
        config.apply_chat_template = False
        began = time.perf_counter()
        results = pipe.generate([ov.Tensor(ids.reshape(1, -1)) for ids in prompts], [config] * len(prompts))
        seconds = time.perf_counter() - began
        assert all(len(r.m_generation_ids[0]) == tokens for r in results)
        return seconds

    return run


def run_batch(model: str, *, stage_counts: tuple[int, ...] = (1, 2), streams: tuple[int, ...] = STREAMS,
              tokens: int = 32, runs: int = 2, weights: str = DEFAULT_WEIGHTS, device: str = "CPU",
              out: Path | None = None, log=print, hooks: Hooks = NO_HOOKS) -> dict:
    props = device_config(device)
    exports = {n: export_model(model, stages=n, weights=weights, cancel=hooks.cancel).folders for n in stage_counts}
    one = export_model(model, stages=1, weights=weights, cancel=hooks.cancel).folders[0]
    prompts = _prompts(one, max(streams))
    kv_positions = max(streams) * (max(len(p) for p in prompts) + SHORT + tokens + 64)
    chains = {n: (LocalChain(folders, device=device, paged=False), [PagedStage(f, device, kv_positions=kv_positions)
                                                         for f in folders]) for n, folders in exports.items()}
    ways = {}  # name -> run(prompts, new tokens) -> seconds
    for n, (chain, paged) in chains.items():
        ways[f"per-stream {n}-stage"] = lambda ps, t, chain=chain: generate_streams(
            chain, ps, t, max_length=kv_positions, ignore_eos=True)[1]
        ways[f"packed {n}-stage"] = lambda ps, t, paged=paged: _timed(lambda: packed_greedy(paged, ps, t))
    ways["ContinuousBatchingPipeline 1-stage"] = _cb_runner(one, device, props)
    with contextlib.ExitStack() as closing:
        for n, folders in exports.items():
            if n > 1:
                relay, _ = closing.enter_context(loopback(folders, device=device))
                ways[f"packed {n}-stage, relay"] = lambda ps, t, relay=relay: generate_streams(
                    relay, ps, t, max_length=kv_positions, ignore_eos=True)[1]
        samples = _measure(ways, prompts, streams, tokens, runs, hooks, log)
    rows, ratios = [], {}
    for s in streams:
        for way in ways:
            row = {"way": way, "streams": s, "tok_s": round(median(samples[way, s]), 2),
                   "vs_one_stream": round(median(samples[way, s]) / median(samples[way, streams[0]]), 2)}
            rows.append(row)
            hooks.row(row)
    for n, (chain, paged) in chains.items():
        per_position = sum(stage.kv_bytes for stage in paged) / paged[0].pool.capacity / paged[0].pool.block_size
        length = max(len(p) for p in prompts) + SHORT + tokens
        rows.append({"way": f"KV per stream, {n}-stage", "streams": max(streams),
                     "stateful_mb": round(_stateful_kv_bytes(chain, max(streams)) / 2**20, 2),
                     "paged_mb": round(per_position * -(-length // paged[0].pool.block_size)
                                       * paged[0].pool.block_size / 2**20, 2)})
        rows.append({"way": f"KV pool, {n}-stage", **_pool_costs(paged)})
    tok = {(r["way"], r["streams"]): r["tok_s"] for r in rows if "tok_s" in r}
    for n in exports:
        for s in streams:
            ratios[f"packed / per-stream, {n}-stage, {s} streams"] = round(
                tok[f"packed {n}-stage", s] / tok[f"per-stream {n}-stage", s], 2)
        if 4 in streams:
            ratios[f"packed {n}-stage: 4 streams / 1 stream"] = round(
                tok[f"packed {n}-stage", 4] / tok[f"packed {n}-stage", 1], 2)
        if n > 1:
            for s in streams:
                ratios[f"packed {n}-stage over the relay / in process, {s} streams"] = round(
                    tok[f"packed {n}-stage, relay", s] / tok[f"packed {n}-stage", s], 2)
    if 1 in exports:
        for s in streams:
            ratios[f"packed 1-stage / ContinuousBatchingPipeline, {s} streams"] = round(
                tok["packed 1-stage", s] / tok["ContinuousBatchingPipeline 1-stage", s], 3)
    settings = {"model": model, "weights": weights, "device": device, "tokens": tokens, "runs": runs,
                "prompt_tokens": [len(p) for p in prompts]}
    return write_report("batch", rows, ratios, out, settings=settings)


def _measure(ways: dict, prompts, streams, tokens: int, runs: int, hooks, log) -> dict:
    """Aggregate decode tok/s samples per (way, streams), the ways and stream counts interleaved after
    a round that warms up."""

    def rate(key, _round: int) -> float:
        way, s = key
        extra = ways[way](prompts[:s], SHORT + tokens) - ways[way](prompts[:s], SHORT)
        return s * tokens / extra

    return interleave(rate, [(way, s) for s in streams for way in ways], runs, warmup=1, hooks=hooks, log=log,
                      label=lambda key: f"{key[0]}, {key[1]} streams")


def _pool_costs(stages: list[PagedStage]) -> dict:
    """What the paged stages' KV reuse costs: half the pool's blocks back to it and taken again (a
    stream leaving and another joining), and doubling the pool (every block copied)."""
    pool = stages[0].pool
    positions = pool.capacity * pool.block_size
    length = positions // 2
    began = time.perf_counter()
    for _ in range(100):
        for stage in stages:
            stage.reset(-1)
            stage.pool.resize(-1, length)
    reuse_us = (time.perf_counter() - began) / 100 * 1e6
    for stage in stages:
        stage.reset(-1)
    began = time.perf_counter()
    for stage in stages:
        stage._grow(2 * stage.pool.capacity)
    grow_ms = (time.perf_counter() - began) * 1e3
    return {"reuse_positions": length, "reuse_us": round(reuse_us, 1), "grow_from_positions": positions,
            "grow_ms": round(grow_ms, 1), "grow_mb": round(sum(s.kv_bytes for s in stages) / 2 / 2**20, 1)}


def _timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began
