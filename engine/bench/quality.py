"""``fleet bench quality``: how faithful each weight format's shards are to the source model's own weights.

The reference is the source's weights in float as they are (a GGUF dequantized, an HF checkpoint's
floats): its 1-stage ``f32`` export, run at the f32 inference precision.  Every other shard set (a
weight format, split into 1, 2 or 3 stages, at the f32 hint and at the device's default precision)
reads the same token ids, a chunk at a time with every position's logits, and is compared position by
position: perplexity of the text, mean KL divergence from the reference (nats per token) and top-1
agreement with the reference's most likely token.

The text is what the bench ships (``texts/``: prose written for it, and a module of this project's
own code), or the user's file.  The reference's log-probabilities are kept in a temporary file (a
few thousand positions of a 150k vocabulary do not fit in memory twice).

The ``humaneval`` part measures at the task level what the divergence costs: each format's export
answers HumanEval behind our OpenAI-compatible API and, with ``llamacpp``, llama-server answers from
the very GGUF through the same client (``engine.bench.tasks``, the answers run sandboxed).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from engine.bench.harness import NO_HOOKS, Hooks
from engine.bench.llamacpp import VERSION as LLAMACPP_VERSION
from engine.bench.llamacpp import LlamaCppUnavailable, LlamaServer
from engine.bench.parity import llamacpp_gguf
from engine.bench.report import write_report
from engine.bench.sandbox import TIME_LIMIT_S, isolation
from engine.bench.tasks import INSTRUCTION, TOKENS, humaneval
from engine.config import Scheduling
from engine.errors import FleetError
from engine.export.exporter import export_model
from engine.runtime.decode.service import ChatService
from engine.runtime.decode.tokenizer import ChatTokenizer
from engine.runtime.stages.chain import LocalChain
from engine.models.catalog import resolve_source
from engine.runtime.stages.stage import compile_config, has_bf16
from engine.serve.server import ApiServer
from engine.transport.wire import Flag

TEXTS = Path(__file__).with_name("texts")
# the code it reads: modules of this project's own (they ship with it)
CODE = [Path(__file__).resolve().parents[1] / "runtime" / "stages" / "packing.py",
        Path(__file__).resolve().parents[1] / "runtime" / "decode" / "kvsequence.py"]
CHUNK = 256  # positions per forward: vocabulary-sized logits for each
PARTS = ("kl", "humaneval")


def bench_text(path: Path | None = None) -> str:
    """The user's text, or the shipped prose followed by some of this project's code."""
    if path is not None:
        try:
            return Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise FleetError(f"cannot read the text {path}: {exc}") from None
    return "\n\n".join(p.read_text(encoding="utf-8") for p in [*sorted(TEXTS.glob("*.txt")), *CODE])


def precisions(device: str) -> dict[str, dict]:
    """The compile settings each format is measured at: f32 throughout (``exact``), the stages' own
    default (``fast``) and, where the CPU has it, bf16 (OpenVINO's own default there)."""
    configs = {"f32": compile_config("exact"), "fast": {}}
    if has_bf16(device):
        configs["bf16"] = {"INFERENCE_PRECISION_HINT": "bf16"}
    return configs


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def log_probs(chain, ids: np.ndarray, hooks: Hooks = NO_HOOKS):
    """Yields (start, log-probabilities [positions, vocab]) for the next token after every position
    of ``ids``, a chunk of ``CHUNK`` positions at a time in one sequence."""
    chain.reset(0)
    mask = np.ones((1, len(ids)), dtype=np.int64)
    positions = np.arange(len(ids), dtype=np.int64)[None]
    for start in range(0, len(ids), CHUNK):
        hooks.check()
        end = min(start + CHUNK, len(ids))
        out = chain.forward(ids[None, start:end], mask[:, :end], positions[:, start:end],
                            Flag.ALL_POSITIONS | Flag.LOGITS)
        yield start, _log_softmax(out.logits[0])
    chain.reset(0)


def compare(reference: np.ndarray, chain, ids: np.ndarray, hooks: Hooks = NO_HOOKS) -> dict:
    """Perplexity, mean KL(reference || chain) and top-1 agreement over ``ids`` (the reference's
    log-probabilities per position, [positions, vocab])."""
    nll, kl, agree = [], [], []
    for start, ours in log_probs(chain, ids, hooks):
        ref = reference[start:start + len(ours)].astype(np.float64)
        kl.append((np.exp(ref) * (ref - ours)).sum(-1))
        agree.append(ref.argmax(-1) == ours.argmax(-1))
        following = ids[start + 1:start + 1 + len(ours)]
        nll.append(-ours[np.arange(len(following)), following])
    nll_all = np.concatenate(nll)
    return {"perplexity": round(float(np.exp(nll_all.mean())), 4),
            "kl_nats": round(float(np.concatenate(kl)[:-1].mean()), 5),
            "top1_agreement": round(float(np.concatenate(agree)[:-1].mean()), 4)}


def run_quality(model: str, *, weights: tuple[str, ...] | None = None, stages: tuple[int, ...] = (1, 2),
                text: Path | None = None, tokens: int = 2048, device: str = "CPU", parts: tuple[str, ...] = ("kl",),
                cases: int | None = None, llamacpp: bool = False, out: Path | None = None, log=print,
                hooks: Hooks = NO_HOOKS) -> dict:
    """``weights``: the formats to compare (default int4 and int8, and gguf for a GGUF source); an
    int4 format with an INT4 head is spelled ``int4/head-int4``.  ``parts``: ``kl`` (the
    divergence from the float reference) and ``humaneval`` (``engine.bench.tasks``: pass@1 of each
    format's ``stages[0]``-stage export served through our API, over ``cases`` problems, all
    164 by default); ``llamacpp``: llama.cpp's llama-server on the same GGUF answers HumanEval
    through the same API client."""
    unknown = set(parts) - set(PARTS)
    if unknown or not parts:
        raise FleetError(f"unknown parts {', '.join(sorted(unknown)) or '(none given)'}: "
                         f"the parts are {', '.join(PARTS)}")
    if weights is None:
        gguf = resolve_source(model).kind == "gguf"
        weights = ("int4", "gguf", "int8") if gguf else ("int4", "int8")
    rows, ratios = [], {}
    meta = {"model": model, "device": device, "parts": list(parts)}
    if "kl" in parts:
        kl_rows, kl_ratios, kl_meta = _kl_part(model, weights, stages, text, tokens, device, log, hooks)
        rows += kl_rows
        ratios.update(kl_ratios)
        meta.update(kl_meta)
    if "humaneval" in parts:
        task_rows, task_ratios, task_meta = _task_part(model, weights, stages[0], device, cases, llamacpp, rows,
                                                       log, hooks)
        rows += task_rows
        ratios.update(task_ratios)
        meta.update(task_meta)
    return write_report("quality", rows, ratios, out, settings=meta)


def _export(model: str, fmt: str, stages: int, hooks: Hooks):
    layers, _, head = fmt.partition("/head-")
    return export_model(model, stages=stages, weights=layers, head=head or "int8", cancel=hooks.cancel)


def _kl_part(model, weights, stages, text, tokens, device, log, hooks) -> tuple[list[dict], dict, dict]:
    reference_export = export_model(model, stages=1, weights="f32", cancel=hooks.cancel)
    tokenizer = ChatTokenizer(reference_export.folders[0])
    ids = tokenizer.prompt_ids(bench_text(text), chat=False)[0, :tokens]
    if len(ids) < 2:
        raise FleetError("the text holds fewer than 2 tokens")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        chain = LocalChain(reference_export.folders, device=device, config=compile_config("exact"))
        try:
            reference = None
            for start, part in log_probs(chain, ids, hooks):
                if reference is None:  # on disk: thousands of vocabulary-sized rows
                    reference = np.lib.format.open_memmap(Path(tmp) / "reference.npy", mode="w+",
                                                          dtype=np.float32, shape=(len(ids), part.shape[-1]))
                reference[start:start + len(part)] = part
        finally:
            chain.close()
        nll = -reference[np.arange(len(ids) - 1), ids[1:]]
        rows.append({"weights": "f32 (reference)", "stages": 1, "precision": "f32",
                     "perplexity": round(float(np.exp(nll.mean())), 4), "kl_nats": 0.0, "top1_agreement": 1.0,
                     "size_mb": round(sum(s.size_mb for s in reference_export.stages), 1)})
        log(f"reference: {len(ids)} tokens, perplexity {rows[0]['perplexity']}")
        for fmt in weights:
            for n in stages:
                export = _export(model, fmt, n, hooks)
                for precision, config in precisions(device).items():
                    chain = LocalChain(export.folders, device=device, config=config)
                    try:
                        row = {"weights": fmt, "stages": n, "precision": precision,
                               **compare(reference, chain, ids, hooks),
                               "size_mb": round(sum(s.size_mb for s in export.stages), 1),
                               "export_s": round(sum(s.seconds for s in export.stages), 1)}
                    finally:
                        chain.close()
                    rows.append(row)
                    hooks.row(row)
                    log(f"{fmt}, {n} stage(s), {precision}: perplexity {row['perplexity']}, KL {row['kl_nats']}, "
                        f"top-1 {row['top1_agreement']}")
        del reference
    base = rows[0]["perplexity"]
    ratios = {f"{r['weights']} {r['stages']}-stage {r['precision']}: perplexity vs reference":
              round(r["perplexity"] / base, 4) for r in rows[1:]}
    meta = {"tokens": int(len(ids)),
            "text": str(text) if text else "shipped (engine/bench/texts, and two engine modules)"}
    return rows, ratios, meta


def _task_part(model, weights, stages, device, cases, llamacpp, kl_rows, log, hooks) -> tuple[list[dict], dict, dict]:
    """HumanEval through the OpenAI API: each format's export behind ``fleet serve``'s API (the
    settings it serves with by default), then llama-server on the GGUF, one request at a time."""
    rows = []
    kl = {(r["weights"], r["stages"]): r["kl_nats"] for r in kl_rows if r["precision"] == "fast"}
    for fmt in weights:
        export = _export(model, fmt, stages, hooks)
        service = ChatService(LocalChain(export.folders, device=device, config=compile_config("fast")),
                              scheduling=Scheduling(streams=1))
        server = ApiServer(service, port=0, model_id=model).start()
        try:
            score = humaneval(server.url, model, cases=cases, log=log, hooks=hooks, label=f"fleet serve {fmt}")
        finally:
            server.stop()
            service.close()
        rows.append(_task_row("fleet serve", fmt, stages, "fast", score, kl.get((fmt, stages))))
        hooks.row(rows[-1])
    peer_note = "not asked for"
    if llamacpp:
        try:
            with LlamaServer(llamacpp_gguf(model), log=log) as peer:
                score = humaneval(peer.url, model, cases=cases, log=log, hooks=hooks, label="llama.cpp")
            peer_note = f"llama-server {LLAMACPP_VERSION}"
            rows.append(_task_row("llama.cpp", "gguf file", 1, "llama.cpp's own", score, None))
            hooks.row(rows[-1])
        except LlamaCppUnavailable as exc:
            peer_note = f"skipped: {exc}"
            log(f"llama.cpp row {peer_note}")
    ratios = {f"HumanEval pass@1 (%), {r['server']} {r['weights']}": round(100 * r["pass_at_1"], 1) for r in rows}
    theirs = next((r for r in rows if r["server"] == "llama.cpp"), None)
    if theirs:
        for r in rows:
            if r is not theirs:
                ratios[f"HumanEval pass@1, {r['weights']} - llama.cpp (points)"] = round(
                    100 * (r["pass_at_1"] - theirs["pass_at_1"]), 1)
    meta = {"humaneval": {"cases": rows[0]["cases"] if rows else 0, "max_tokens": TOKENS, "temperature": 0,
                          "prompt": INSTRUCTION, "time_limit_s": TIME_LIMIT_S, "sandbox": isolation(),
                          "stages": stages, "llamacpp": peer_note}}
    return rows, ratios, meta


def _task_row(server: str, fmt: str, stages: int, precision: str, score: dict, kl_nats: float | None) -> dict:
    row = {"part": "humaneval", "server": server, "weights": fmt, "stages": stages, "precision": precision,
           "pass_at_1": score["pass_at_1"], "passed": score["passed"], "cases": score["cases"]}
    if kl_nats is not None:
        row["kl_nats"] = kl_nats
    row.update({"reply_tokens": score["reply_tokens"], "seconds": score["seconds"], "results": score["results"]})
    return row
