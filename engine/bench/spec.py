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
from engine.runtime.stage import compile_config
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


def _genai(folder: Path, draft: Path, tokens: int, k: int):
    import openvino as ov
    import openvino_genai

    pipe = openvino_genai.LLMPipeline(str(folder), "CPU", draft_model=openvino_genai.draft_model(str(draft), "CPU"))

    def run(ids: np.ndarray):
        config = pipe.get_generation_config()
        config.max_new_tokens = config.min_new_tokens = tokens
        config.ignore_eos = True
        config.do_sample = False
        config.apply_chat_template = False
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
    genai_run = _genai(target_folders[0], draft_folders[0], tokens, k) if genai else None
    for mode in modes:
        config = compile_config(mode)
        target = LocalChain(target_folders, config=config)
        draft_chain = LocalChain(draft_folders, config=config)
        check_draft_tokenizer(target.manifest, draft_chain.manifest, draft_folders[0])
        gen = Generator(target, 2048)
        configs = {
            f"model K={k}": (DraftModel(draft_chain), k),
            "model K=auto": (DraftModel(draft_chain), "auto"),
            f"lookup K={k}": (PromptLookup(), k),
            "hybrid K=auto": (Hybrid(PromptLookup(), DraftModel(draft_chain)), "auto"),
        }
        for name, ids in prompts.items():
            base = gen.generate(ids, tokens, ignore_eos=True)
            row = {"mode": mode, "prompt": name, "target_tok_s": round(base.decode_tok_s, 2)}
            for label, (drafter, kk) in configs.items():
                g = gen.generate(ids, tokens, ignore_eos=True, drafter=drafter, k=kk)
                row[f"{label} x"] = round(g.decode_tok_s / base.decode_tok_s, 3)
                row[f"{label} acc"] = round(g.acceptance, 2)
                row[f"{label} same"] = g.tokens == base.tokens
            if genai_run and mode == "fast":
                tps, _ = genai_run(ids)
                row["genai_spec_tok_s"] = round(tps, 2)
                row[f"model K={k} vs genai"] = round(row[f"model K={k} x"] * base.decode_tok_s / tps, 3)
            rows.append(row)
            log(f"{mode} {name}: " + ", ".join(f"{c}={row[f'{c} x']}" for c in configs))
    ratios = {}
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        for label in (f"model K={k}", "model K=auto", f"lookup K={k}", "hybrid K=auto"):
            ratios[f"{mode} {label} mean speedup"] = round(mean(r[f"{label} x"] for r in mine), 3)
            ratios[f"{mode} {label} identical"] = f"{sum(r[f'{label} same'] for r in mine)}/{len(mine)}"
        if genai and mode == "fast":
            ratios[f"fast model K={k} vs genai spec"] = round(mean(r[f"model K={k} vs genai"] for r in mine), 3)
    meta = {"model": model, "draft": draft, "tokens": tokens, "k": k, "weights": weights}
    return write_report("spec", rows, ratios, out, settings=meta)
