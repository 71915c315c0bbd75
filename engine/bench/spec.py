"""``fleet bench spec``: speculative decoding against the target alone and against OpenVINO GenAI's
own speculative decoding with the same draft.

Eight prompt categories, chat template applied the same way everywhere, greedy, EOS ignored.  Per
mode (``fast``: device defaults; ``exact``: the compile settings under which verify equals single
steps) and per K (fixed and ``auto``): tok/s, acceptance, and whether the output equals the target's
own greedy output in that mode.  Configurations run interleaved per prompt.
"""

from __future__ import annotations

from pathlib import Path
from statistics import mean

import numpy as np

from engine.bench.report import write_report
from engine.export.exporter import export_model
from engine.runtime.chain import LocalChain
from engine.runtime.generate import Generator
from engine.runtime.speculative import DraftModel, Hybrid, PromptLookup, check_draft_tokenizer
from engine.runtime.stage import REWIND, compile_config, device_config
from engine.runtime.tokenizer import ChatTokenizer

PROMPTS = {
    "short factual": "What is the boiling point of water at sea level, in Celsius and Fahrenheit?",
    "reasoning": "A train leaves at 3 pm going 60 km/h; another leaves the same station at 4 pm going 90 km/h. "
                 "When does the second catch up? Explain step by step.",
    "code": "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "list": "List ten common data structures and one typical use of each.",
    "creative": "Write a short poem about a lighthouse in a storm.",
    "technical explanation": "Explain how a hash map handles collisions.",
    "chat": "Hi! I'm planning a weekend trip to the mountains. Any tips?",
    "translation": "Translate into French: The meeting is moved to Thursday at ten, please bring the report.",
}


def _genai(folder: Path, draft: Path | None, tokens: int, k: int):
    """OpenVINO GenAI's LLMPipeline on the same export and compile settings, with ``draft`` as its
    draft model (or none)."""
    import openvino as ov
    import openvino_genai

    props = device_config("CPU")  # the same compile settings as our fast mode
    extra = {"draft_model": openvino_genai.draft_model(str(draft), "CPU", **props)} if draft else {}
    pipe = openvino_genai.LLMPipeline(str(folder), "CPU", **extra, **props)

    def run(ids: np.ndarray):
        config = pipe.get_generation_config()
        config.max_new_tokens = config.min_new_tokens = tokens
        config.ignore_eos = True
        config.do_sample = False
        config.apply_chat_template = False
        if draft:
            config.num_assistant_tokens = k
        inputs = openvino_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        result = pipe.generate(inputs, config)
        return result.perf_metrics.get_throughput().mean, list(result.tokens[0])

    return run


def run_spec(model: str, draft: str, *, tokens: int = 128, k: int = 3, modes=("fast", "exact"),
             weights: str = "int4", genai: bool = True, out: Path | None = None, log=print) -> dict:
    target_folders = export_model(model, stages=1, weights=weights).folders
    draft_folders = export_model(draft, stages=1, weights=weights).folders
    tok = ChatTokenizer(target_folders[0])
    prompts = {name: tok.prompt_ids(text) for name, text in PROMPTS.items()}
    rows = []
    genai_spec = _genai(target_folders[0], draft_folders[0], tokens, k) if genai else None
    genai_alone = _genai(target_folders[0], None, tokens, k) if genai else None
    for mode in modes:
        config = compile_config(mode)
        target = LocalChain(target_folders, config=config)
        draft_chain = LocalChain(draft_folders, config=config)
        check_draft_tokenizer(target.manifest, draft_chain.manifest, draft_folders[0])
        gen = Generator(target, 2048, rewind=REWIND[mode])
        configs = {
            f"model K={k}": (DraftModel(draft_chain, REWIND[mode]), k),
            "model K=auto": (DraftModel(draft_chain, REWIND[mode]), "auto"),
            f"lookup K={k}": (PromptLookup(), k),
            "hybrid K=auto": (Hybrid(PromptLookup(), DraftModel(draft_chain, REWIND[mode])), "auto"),
        }
        for name, ids in prompts.items():
            base = gen.generate(ids, tokens, ignore_eos=True)
            row = {"mode": mode, "prompt": name, "target_tok_s": round(base.decode_tok_s, 2)}
            for label, (drafter, kk) in configs.items():
                g = gen.generate(ids, tokens, ignore_eos=True, drafter=drafter, k=kk)
                row[f"{label} x"] = round(g.decode_tok_s / base.decode_tok_s, 3)
                row[f"{label} acc"] = round(g.acceptance, 2)
                row[f"{label} same"] = g.tokens == base.tokens
                if g.tokens != base.tokens:  # where fast mode's output first leaves plain greedy
                    pairs = enumerate(zip(g.tokens, base.tokens))
                    row[f"{label} diverges at"] = next((i for i, (a, b) in pairs if a != b), len(base.tokens))
            best_single = max(row["model K=auto x"], row[f"lookup K={k} x"])
            row["hybrid vs better of two"] = round(row["hybrid K=auto x"] / best_single, 3)
            if genai_spec and mode == "fast":
                alone, _ = genai_alone(ids)
                tps, _ = genai_spec(ids)
                row["genai_target_tok_s"] = round(alone, 2)
                row["genai_spec_tok_s"] = round(tps, 2)
                for label in (f"model K={k}", "model K=auto", "hybrid K=auto"):
                    row[f"{label} vs genai"] = round(row[f"{label} x"] * base.decode_tok_s / tps, 3)
            rows.append(row)
            log(f"{mode} {name}: " + ", ".join(f"{c}={row[f'{c} x']}" for c in configs))
    ratios = {}
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        for label in (f"model K={k}", "model K=auto", f"lookup K={k}", "hybrid K=auto"):
            ratios[f"{mode} {label} mean speedup"] = round(mean(r[f"{label} x"] for r in mine), 3)
            ratios[f"{mode} {label} identical"] = f"{sum(r[f'{label} same'] for r in mine)}/{len(mine)}"
        ratios[f"{mode} hybrid vs better of two (min)"] = min(r["hybrid vs better of two"] for r in mine)
        if genai and mode == "fast":
            for label in (f"model K={k}", "model K=auto", "hybrid K=auto"):
                ratios[f"fast {label} vs genai spec"] = round(mean(r[f"{label} vs genai"] for r in mine), 3)
            ratios["genai spec vs genai target"] = round(
                mean(r["genai_spec_tok_s"] / r["genai_target_tok_s"] for r in mine), 3)
    meta = {"model": model, "draft": draft, "tokens": tokens, "k": k, "weights": weights}
    return write_report("spec", rows, ratios, out, settings=meta)
