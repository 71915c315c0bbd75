"""``fleet bench ahead``: speculating ahead (``Scheduling(speculate_ahead=True)``, PipeInfer's early
speculation) for one user on a pipeline, against the same speculation one round at a time.

One user, greedy, the end of text ignored, every prompt of the harness in turn.  Five
configurations, interleaved (the order reversed every other round): the whole model in this process
alone and with speculation, the split model over loopback TCP (stage 0 here, the rest in worker
processes) alone, with speculation, and with speculation ahead.  ``cpus`` pins each stage to its own
CPUs, as if each part had its own PC (the whole model runs on stage 0's); unpinned, the stages of one
machine take compute turns, and a round sent ahead has no idle computer to fill.

Per configuration: tok/s (the mean over prompts of each prompt's median over runs), acceptance, and,
speculating ahead, how many rounds went ahead and how many of those were kept.  The ratios compare
each configuration with the others measured in the same round (the geometric mean over prompts and
rounds of the paired ratios), with their spread over the rounds.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from statistics import geometric_mean, mean, median

from engine.bench.harness import NO_HOOKS, PROMPTS, Hooks, drafters, draft_export, interleave, loopback, \
    prompt_ids, split_export
from engine.bench.report import half_range, write_report
from engine.config import DEFAULT_WEIGHTS, Scheduling
from engine.export.exporter import export_model
from engine.runtime.decode.generate import Generator
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.stage import REWIND, compile_config

WHOLE, WHOLE_SPEC = "whole model", "whole model + speculation"
SPLIT, SPLIT_SPEC, AHEAD = "{n} parts", "{n} parts + speculation", "{n} parts + speculation ahead"


def run_ahead(model: str, draft: str = "", *, stages: int = 2, tokens: int = 128, runs: int = 3,
              draft_kind: str = "lookup", k: int = 3, mode: str = "fast", delay_ms: float = 0.0,
              cpu_sets: str = "", weights: str = DEFAULT_WEIGHTS, out: Path | None = None, log=print, shards=None,
              hooks: Hooks = NO_HOOKS) -> dict:
    """``draft_kind``: ``lookup``, or ``model``/``hybrid`` with ``draft`` (a model with the target's
    tokenizer); ``k``: the drafts per round; ``mode``: the stages' correctness mode (``exact``:
    speculation gives greedy's tokens, checked in the rows)."""
    whole = export_model(model, stages=1, weights=weights, cancel=hooks.cancel)
    split = split_export(model, stages, weights, shards, hooks)
    stages = len(split)
    draft_folders = draft_export(draft, draft_kind, weights)
    names = [WHOLE, WHOLE_SPEC, *(name.format(n=stages) for name in (SPLIT, SPLIT_SPEC, AHEAD))]
    prompts = dict(zip(PROMPTS, prompt_ids(whole.folders[0], PROMPTS)))
    length = max(ids.shape[1] for ids in prompts.values()) + tokens + 16
    on_token = (lambda t: hooks.on_token(0, t)) if hooks.on_token else None
    rewind = REWIND[mode]
    hooks.step(0, 1, "starting the pipeline")
    with loopback(split, delay_ms=delay_ms, mode=mode, cpu_sets=cpu_sets) as (chain, _):
        mono = LocalChain(whole.folders, config=compile_config(mode))  # on stage 0's CPUs
        drafter = {"whole": drafters(draft_kind, mono, draft_folders, 1)[0],
                   "split": drafters(draft_kind, chain, draft_folders, 1)[0]}
        drafter["ahead"] = drafter["split"]  # the same chain's
        configs = {  # name -> (its generator, whether it drafts)
            names[0]: ("whole", False), names[1]: ("whole", True),
            names[2]: ("split", False), names[3]: ("split", True), names[4]: ("ahead", True)}
        scheduling = Scheduling(k=k)
        generators = {"whole": Generator(mono, length, rewind=rewind, scheduling=scheduling),
                      "split": Generator(chain, length, rewind=rewind, scheduling=scheduling),
                      "ahead": Generator(chain, length, rewind=rewind,
                                         scheduling=dataclasses.replace(scheduling, speculate_ahead=True))}

        def decode(name: str, ids):
            how, spec = configs[name]
            result = generators[how].generate(ids, tokens, ignore_eos=True, on_token=on_token, cancel=hooks.cancel,
                                              drafter=drafter[how] if spec else None)
            hooks.check()
            return result

        warm = next(iter(prompts.values()))
        for name in names:  # first inferences and each request's first widest verify are slow
            decode(name, warm)

        def measure(name: str, _round: int) -> dict:
            return {prompt: decode(name, ids) for prompt, ids in prompts.items()}

        samples = interleave(measure, names, runs, alternate=True, hooks=hooks, log=log)
    greedy = {prompt: samples[WHOLE][0][prompt].tokens for prompt in prompts}
    split_greedy = {prompt: samples[names[2]][0][prompt].tokens for prompt in prompts}
    rows = []
    for name in names:
        results = [r for run in samples[name] for r in run.values()]
        drafted = sum(r.drafted for r in results)
        row = {"config": name,
               "tok_s": round(mean(median(run[p].decode_tok_s for run in samples[name]) for p in prompts), 2),
               "acceptance": round(sum(r.accepted for r in results) / drafted, 3) if drafted else None,
               "tokens_per_round": round(mean(len(r.tokens) / max(r.breakdown.rounds + 1, 1) for r in results), 2),
               "stage_ms": "/".join(f"{s:.2f}" for s in samples[name][0][next(iter(prompts))].breakdown.to_json()
                                    ["stage_compute_ms"]),
               # greedy's own tokens: the whole model's, or the split's for its rows (fast mode's graphs differ)
               "same_as_greedy": sum(run[p].tokens == (greedy if name in names[:2] else split_greedy)[p]
                                     for run in samples[name] for p in prompts),
               "of": len(results)}
        if name == names[4]:
            sent = sum(r.ahead for r in results)
            row.update(ahead=sent, ahead_kept=sum(r.ahead_kept for r in results),
                       kept_share=round(sum(r.ahead_kept for r in results) / sent, 3) if sent else None)
        rows.append(row)
        hooks.row(row)
    hooks.step(1, 1, "done")

    def paired(subject: str, against: str) -> tuple[float, float | None]:
        """The geometric mean of ``subject``'s tok/s over ``against``'s measured in the same round, and
        the spread of its per-round values."""
        per_round = [geometric_mean([a[p].decode_tok_s / b[p].decode_tok_s for p in prompts])
                     for a, b in zip(samples[subject], samples[against])]
        return round(geometric_mean(per_round), 3), half_range(per_round)

    ratios, spread = {}, {}
    for subject, against in ((names[4], names[3]), (names[4], WHOLE_SPEC), (names[3], WHOLE_SPEC),
                             (names[4], WHOLE), (names[2], WHOLE), (WHOLE_SPEC, WHOLE)):
        key = f"{subject} vs {against}"
        ratios[key], wide = paired(subject, against)
        if wide is not None:
            spread[key] = round(wide, 3)
    meta = {"model": model, "draft": draft if draft_folders else draft_kind, "stages": stages, "tokens": tokens,
            "runs": runs, "k": k, "mode": mode, "delay_ms": delay_ms, "cpu_sets": cpu_sets, "weights": weights,
            "prompts": len(prompts)}
    return write_report("ahead", rows, ratios, out, settings=meta, spread=spread)
