"""``fleet bench spec``: speculative decoding against the target alone and against OpenVINO GenAI's
own speculative decoding with the same draft.

Eight prompt categories, chat template applied the same way everywhere, greedy, EOS ignored.  Per
mode (``fast``: device defaults; ``exact``: the compile settings under which verify equals single
steps) and per K (fixed and ``auto``): tok/s, acceptance, and whether the output equals the target's
own greedy output in that mode.  Configurations run interleaved per prompt; with ``runs`` > 1 each
prompt repeats, the order of the configurations reversed every other time, and a speedup is the mean
of each run's ratio to the target alone measured beside it (that ratio varies between runs).  The
hybrid runs between the lookup and the model draft (K auto) in either order, and "hybrid vs better
of two" compares it with each of them in the same run: the geometric mean over runs of its tok/s
over theirs, the lower of the two (the target alone is measured before the drafters, so a busy
machine's drift between the two is in every speed-up, but not in this comparison).  The model
draft (K auto) runs twice, side by side: "A/A" is the same comparison between two identical
configurations, the noise floor under which "hybrid vs better of two" says nothing.
"""

from __future__ import annotations

from pathlib import Path
from statistics import geometric_mean, mean

from engine.bench.harness import NO_HOOKS, PROMPTS, Hooks, genai_runner, prompt_ids
from engine.bench.report import write_report
from engine.config import DEFAULT_WEIGHTS
from engine.export.exporter import export_model
from engine.runtime.stages.chain import LocalChain
from engine.runtime.decode.generate import Generator
from engine.runtime.decode.speculative import draft_format, open_draft_chain, stream_drafters
from engine.runtime.stages.stage import REWIND, compile_config, device_config


AGAIN = "model K=auto, again"  # the A/A control


def _versus(samples: list[dict], others: list[dict]) -> float:
    """The geometric mean over runs of one configuration's tok/s over another's measured beside it."""
    return round(geometric_mean([s["tok_s"] / o["tok_s"] for s, o in zip(samples, others)]), 3)


def run_spec(model: str, draft: str, *, tokens: int = 128, k: int = 3, modes=("fast", "exact"), runs: int = 1,
             weights: str = DEFAULT_WEIGHTS, genai: bool = True, out: Path | None = None, log=print,
             hooks: Hooks = NO_HOOKS) -> dict:
    target_folders = export_model(model, stages=1, weights=weights, cancel=hooks.cancel).folders
    draft_folders = export_model(draft, stages=1, cancel=hooks.cancel, **draft_format(weights)).folders
    on_token = (lambda t: hooks.on_token(0, t)) if hooks.on_token else None
    total, done = len(modes) * len(PROMPTS) * runs, 0
    prompts = dict(zip(PROMPTS, prompt_ids(target_folders[0], PROMPTS)))
    rows = []
    sources = ("model K=auto", f"lookup K={k}")  # what the hybrid combines: compared with each
    if genai:  # the same compile settings as our fast mode
        props = device_config("CPU")
        genai_spec = genai_runner(target_folders[0], tokens, props=props, draft=draft_folders[0], k=k)
        genai_alone = genai_runner(target_folders[0], tokens, props=props)
    draft_chain = open_draft_chain(draft_folders)  # the same in both modes: only the target's settings matter
    for mode in modes:
        target = LocalChain(target_folders, config=compile_config(mode))

        def one(kind: str):
            return stream_drafters(kind, 1, target.manifest, draft_chain)[0]

        gen = Generator(target, 2048, rewind=REWIND[mode])
        configs = {
            f"model K={k}": (one("model"), k),
            f"lookup K={k}": (one("lookup"), k),
            "hybrid K=auto": (one("hybrid"), "auto"),
            "model K=auto": (one("model"), "auto"),
            AGAIN: (one("model"), "auto"),
        }
        # A fresh compiled model's first inferences are slow, and so is each request's first forward
        # past the longest cache or widest verify it has seen: every configuration runs one whole
        # generation first (a shorter warm-up leaves the first configuration measured slower).
        warm = next(iter(prompts.values()))
        gen.generate(warm, tokens, ignore_eos=True)
        for drafter, kk in configs.values():
            gen.generate(warm, tokens, ignore_eos=True, drafter=drafter, k=kk)
        if genai and mode == modes[0]:
            genai_alone(warm)
            genai_spec(warm)
        labels = list(configs)
        for name, ids in prompts.items():
            samples = {label: [] for label in labels}  # one per run
            alone, spec = [], []
            bases = []  # the target alone's tok/s, one per run
            for run in range(runs):
                hooks.step(done, total, f"{mode}: {name}" + (f" ({run + 1}/{runs})" if runs > 1 else ""))
                done += 1
                base = gen.generate(ids, tokens, ignore_eos=True, on_token=on_token, cancel=hooks.cancel)
                bases.append(base.decode_tok_s)
                for label in labels if run % 2 == 0 else labels[::-1]:
                    drafter, kk = configs[label]
                    g = gen.generate(ids, tokens, ignore_eos=True, drafter=drafter, k=kk, on_token=on_token,
                                     cancel=hooks.cancel)
                    hooks.check()
                    pairs = enumerate(zip(g.tokens, base.tokens))
                    diverges = next((i for i, (a, b) in pairs if a != b), len(base.tokens))
                    samples[label].append({"tok_s": g.decode_tok_s, "acc": g.acceptance,
                                           "same": g.tokens == base.tokens, "diverges": diverges})
                if genai and mode == "fast":
                    alone.append(genai_alone(ids)[0])
                    spec.append(genai_spec(ids)[0])
            row = {"mode": mode, "prompt": name,
                   "target_tok_s": round(mean(bases), 2)}
            for label in labels:
                runs_of = samples[label]
                speedups = [s["tok_s"] / b for s, b in zip(runs_of, bases)]
                row[f"{label} x"] = round(mean(speedups), 3)
                row[f"{label} acc"] = round(mean(s["acc"] for s in runs_of), 2)
                row[f"{label} same"] = all(s["same"] for s in runs_of)
                if not row[f"{label} same"]:  # where fast mode's output first leaves plain greedy
                    row[f"{label} diverges at"] = min(s["diverges"] for s in runs_of)
                if runs > 1:
                    row[f"{label} runs"] = [round(x, 3) for x in speedups]
            for label in sources:
                row[f"hybrid vs {label}"] = _versus(samples["hybrid K=auto"], samples[label])
            row["hybrid vs better of two"] = min(row[f"hybrid vs {label}"] for label in sources)
            row["A/A"] = _versus(samples[AGAIN], samples["model K=auto"])
            if genai and mode == "fast":
                row["genai_target_tok_s"] = round(mean(alone), 2)
                row["genai_spec_tok_s"] = round(mean(spec), 2)
                for label in (f"model K={k}", "model K=auto", "hybrid K=auto"):  # each run against its own
                    pairs = zip(samples[label], spec)
                    row[f"{label} vs genai"] = round(mean(s["tok_s"] / t for s, t in pairs), 3)
            rows.append(row)
            hooks.row(row)
            log(f"{mode} {name}: " + ", ".join(f"{c}={row[f'{c} x']}" for c in configs))
    hooks.step(total, total, "done")
    ratios = {}
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        for label in (f"model K={k}", "model K=auto", f"lookup K={k}", "hybrid K=auto"):
            ratios[f"{mode} {label} mean speedup"] = round(mean(r[f"{label} x"] for r in mine), 3)
            ratios[f"{mode} {label} identical"] = f"{sum(r[f'{label} same'] for r in mine)}/{len(mine)}"
        for label in sources:
            ratios[f"{mode} hybrid vs {label} (geomean)"] = round(
                geometric_mean(r[f"hybrid vs {label}"] for r in mine), 3)
        ratios[f"{mode} hybrid vs better of two (min)"] = min(r["hybrid vs better of two"] for r in mine)
        floor = [r["A/A"] for r in mine]
        ratios[f"{mode} A/A: model K=auto vs itself (min)"] = min(floor)
        ratios[f"{mode} A/A: model K=auto vs itself (max)"] = max(floor)
        if genai and mode == "fast":
            for label in (f"model K={k}", "model K=auto", "hybrid K=auto"):
                ratios[f"fast {label} vs genai spec"] = round(mean(r[f"{label} vs genai"] for r in mine), 3)
            ratios["genai spec vs genai target"] = round(
                mean(r["genai_spec_tok_s"] / r["genai_target_tok_s"] for r in mine), 3)
    meta = {"model": model, "draft": draft, "tokens": tokens, "k": k, "runs": runs, "weights": weights,
            **{f"draft_{k}": v for k, v in draft_format(weights).items()}}
    return write_report("spec", rows, ratios, out, settings=meta)
