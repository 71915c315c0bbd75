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
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from engine.bench.harness import NO_HOOKS, Hooks
from engine.bench.report import write_report
from engine.errors import FleetError
from engine.export.exporter import export_model
from engine.runtime.decode.tokenizer import ChatTokenizer
from engine.runtime.stages.chain import LocalChain
from engine.models.catalog import resolve_source
from engine.runtime.stages.stage import compile_config, core
from engine.transport.wire import Flag

TEXTS = Path(__file__).with_name("texts")
# the code it reads: modules of this project's own (they ship with it)
CODE = [Path(__file__).resolve().parents[1] / "runtime" / "stages" / "packing.py",
        Path(__file__).resolve().parents[1] / "runtime" / "decode" / "kvsequence.py"]
CHUNK = 256  # positions per forward: vocabulary-sized logits for each


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
    if device.upper().startswith("CPU") and "BF16" in core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
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
                text: Path | None = None, tokens: int = 2048, device: str = "CPU", out: Path | None = None,
                log=print, hooks: Hooks = NO_HOOKS) -> dict:
    """``weights``: the formats to compare (default int4 and int8, and gguf for a GGUF source); an
    int4 format with an INT4 head is spelled ``int4/head-int4``."""
    reference_export = export_model(model, stages=1, weights="f32", cancel=hooks.cancel)
    if weights is None:
        gguf = resolve_source(model).kind == "gguf"
        weights = ("int4", "gguf", "int8") if gguf else ("int4", "int8")
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
                layers, _, head = fmt.partition("/head-")
                export = export_model(model, stages=n, weights=layers, head=head or "int8", cancel=hooks.cancel)
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
    meta = {"model": model, "tokens": int(len(ids)), "device": device,
            "text": str(text) if text else "shipped (engine/bench/texts, and two engine modules)"}
    return write_report("quality", rows, ratios, out, settings=meta)
