"""``fleet bench parity``: our stage chains against openvino_genai.LLMPipeline on the same export.

Every configuration decodes the same chat-templated input ids for ``tokens`` new tokens with EOS
ignored.  Configurations run round-robin (one run of each per round) so that the machine's drift
hits them alike; the table reports medians and ratios to LLMPipeline compiled with the same
settings as our stages (and, for reference, LLMPipeline at OpenVINO's own defaults).  Our chains
run the stateful stages whose parity the paper claims (the beam_idx Gather is theirs), and one row
the paged stages that serve by default.  With ``llamacpp`` (a GGUF source), llama.cpp's
``llama-server`` decodes the same ids from the very GGUF the shards came from, timed by its own
``timings`` (``engine.bench.llamacpp``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable

import numpy as np

from engine.bench.harness import NO_HOOKS, STORY_PROMPT, Hooks, genai_runner, interleave
from engine.bench.llamacpp import VERSION as LLAMACPP_VERSION
from engine.bench.llamacpp import LlamaCppUnavailable, LlamaServer
from engine.bench.report import median, write_report
from engine.config import DEFAULT_WEIGHTS
from engine.export.exporter import export_model
from engine.runtime.stages.chain import LocalChain
from engine.runtime.decode.generate import Generator
from engine.runtime.stages.stage import device_config
from engine.runtime.decode.tokenizer import ChatTokenizer
from engine.models.catalog import resolve_source

LLAMACPP = "llama.cpp 1-stage (same GGUF)"


def _genai(folder: Path, ids: np.ndarray, tokens: int, device: str, props: dict) -> Callable[[], tuple[float, float]]:
    run = genai_runner(folder, tokens, device=device, props=props)
    return lambda: run(ids)[:2]


def _chain_runner(folders: list[Path], ids: np.ndarray, tokens: int, device: str,
                  hooks: Hooks = NO_HOOKS, paged: bool = False) -> Callable[[], tuple[float, float]]:
    chain = LocalChain(folders, device=device, paged=paged, static=False)
    gen = Generator(chain, max_length=ids.shape[1] + tokens + 1)
    on_token = (lambda t: hooks.on_token(0, t)) if hooks.on_token else None

    def run():
        result = gen.generate(ids, tokens, ignore_eos=True, on_token=on_token, cancel=hooks.cancel)
        hooks.check()
        return result.decode_tok_s, result.ttft_s * 1e3

    return run


def _llamacpp_runner(server: LlamaServer, ids: np.ndarray, tokens: int) -> Callable[[], tuple[float, float]]:
    prompt = [int(t) for t in ids.reshape(-1)]

    def run():
        timings = server.complete(prompt, tokens)
        return timings["predicted_per_second"], timings["prompt_ms"]

    return run


def llamacpp_gguf(model: str) -> Path:
    """The GGUF llama.cpp runs for ``model``: the source itself (llama.cpp reads no HF folder)."""
    source = resolve_source(model)
    if source.kind != "gguf":
        raise LlamaCppUnavailable(f"llama.cpp runs GGUF files; {model} is a {source.kind} source")
    return source.path


def run_parity(model: str, *, tokens: int = 128, warmup: int = 2, runs: int = 5, weights: str = DEFAULT_WEIGHTS,
               device: str = "CPU", llamacpp: bool = False, head: str = "int8", out: Path | None = None, log=print,
               hooks: Hooks = NO_HOOKS) -> dict:
    """``head="int4"`` adds a row with the LM head in INT4 (``fleet export --head int4``)."""
    exports = {n: export_model(model, stages=n, weights=weights, cancel=hooks.cancel) for n in (1, 2, 3)}
    nobeam = export_model(model, stages=1, weights=weights, beam_idx=False, cancel=hooks.cancel)
    first = exports[1].folders[0]
    ids = ChatTokenizer(first).prompt_ids(STORY_PROMPT)
    configs = {
        "LLMPipeline 1-stage": _genai(first, ids, tokens, device, device_config(device)),
        "LLMPipeline 1-stage, OpenVINO defaults": _genai(first, ids, tokens, device, {}),
        "ours 1-stage": _chain_runner(exports[1].folders, ids, tokens, device, hooks),
        "ours 2-stage": _chain_runner(exports[2].folders, ids, tokens, device, hooks),
        "ours 3-stage": _chain_runner(exports[3].folders, ids, tokens, device, hooks),
        "ours 1-stage, no beam_idx": _chain_runner(nobeam.folders, ids, tokens, device, hooks),
        "ours 1-stage, paged": _chain_runner(exports[1].folders, ids, tokens, device, hooks, paged=True),
    }
    if head != "int8":
        small = export_model(model, stages=1, weights=weights, head=head, cancel=hooks.cancel)
        configs[f"ours 1-stage, {head.upper()} head"] = _chain_runner(small.folders, ids, tokens, device, hooks)
    peers = contextlib.ExitStack()
    peer_note = "not asked for"
    if llamacpp:
        try:
            server = peers.enter_context(LlamaServer(llamacpp_gguf(model), log=log))
            configs[LLAMACPP] = _llamacpp_runner(server, ids, tokens)
            peer_note = f"llama-server {LLAMACPP_VERSION}"
        except LlamaCppUnavailable as exc:
            peer_note = f"skipped: {exc}"
            log(f"llama.cpp column {peer_note}")
    with peers:
        samples = interleave(lambda name, _: configs[name](), configs, runs, warmup=warmup, hooks=hooks, log=log)
    base = median([s[0] for s in samples["LLMPipeline 1-stage"]])
    rows = []
    for name, values in samples.items():
        tps = [v[0] for v in values]
        rows.append({
            "config": name,
            "tok_s": round(median(tps), 2),
            "min": round(min(tps), 2),
            "max": round(max(tps), 2),
            "ttft_ms": round(median([v[1] for v in values]), 1),
            "vs_llmpipeline": round(median(tps) / base, 3) if base else 0.0,
        })
        hooks.row(rows[-1])
    hooks.step(1, 1, "done")
    ratios = {row["config"]: row["vs_llmpipeline"] for row in rows}
    if LLAMACPP in samples:
        peer = [s[0] for s in samples[LLAMACPP]]
        for name in [n for n in samples if n.startswith("ours") and "no beam_idx" not in n]:
            ours = [s[0] for s in samples[name]]
            ratios[f"{name} / llama.cpp"] = round(median(ours) / median(peer), 3)
            # each round's own ratio: the machine's drift over the run cancels out
            ratios[f"{name} / llama.cpp, paired by round"] = round(median([a / b for a, b in zip(ours, peer)]), 3)
    meta = {"model": model, "weights": weights, "head": head, "device": device, "prompt_tokens": int(ids.shape[1]),
            "new_tokens": tokens, "warmup": warmup, "runs": runs, "llamacpp": peer_note}
    return write_report("parity", rows, ratios, out, settings=meta)
