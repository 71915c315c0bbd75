"""``fleet bench fleet``: how fast is my fleet?

What the chat runs on (its chat service: a deployment across PCs, or the model's parts as worker
processes on this PC) against the same model whole on this PC alone (every part in this process,
no network), each asked by 1 person and by ``users`` people at once, as chat replies: the tokens
of every reply over the wall time of them all.  The two take turns round by round (this machine is
noisy), after a warm-up round each; the ratios are the per-round ratios' median, and their spread
(half the range) says how much of a difference is noise.

The answer is a sentence (``engine.bench.summary``): "Your fleet is 2.3x faster than this PC
alone for 4 people at once."
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from statistics import median

from engine.bench.harness import NO_HOOKS, PROMPTS, Hooks, interleave
from engine.bench.report import half_range, write_report
from engine.config import DEFAULT_WEIGHTS, Settings
from engine.errors import FleetError
from engine.manifest import expand_shard_dirs
from engine.session import Launch, export, open_service

FLEET, ALONE = "your fleet", "this PC alone"
WAIT_S = 0.2  # how often a measurement looks at the cancel flag while the replies run


def run_fleet(model: str, *, users: int = 4, tokens: int = 32, runs: int = 3, weights: str = DEFAULT_WEIGHTS,
              shards=None, service=None, settings: Settings | None = None, out: Path | None = None, log=print,
              hooks: Hooks = NO_HOOKS) -> dict:
    """``service``: the chat service to measure (the app's own); None opens one as ``settings`` say
    (by default the saved settings with ``model`` and ``weights``), as the chat would.  This PC alone
    runs ``shards`` (the model's parts) in this process, or without them ``model`` exported whole."""
    settings = settings or dataclasses.replace(Settings.load(), default_model=model, weights=weights)
    users = max(1, int(users))
    folders = expand_shard_dirs(shards if isinstance(shards, (list, tuple)) else [shards]) if shards else \
        export(model, stages=1, weights=weights, cancel=hooks.cancel).folders
    opened = []
    try:
        hooks.step(0, 1, "starting what the chat runs on")
        if service is None:
            service = open_service(settings, cancel=hooks.cancel)
            if service is None:
                hooks.check()
            opened.append(service)
        hooks.step(0, 1, "starting the model on this PC alone")
        alone = open_service(dataclasses.replace(settings, local_workers=False, streams=max(settings.streams, 1)),
                             Launch(shards=list(folders), workers="none"), cancel=hooks.cancel)
        if alone is None:
            hooks.check()
        opened.append(alone)
        services = {FLEET: service, ALONE: alone}
        fleet_what = getattr(service, "description", "") or "the chat's model"
        counts = [1, users] if users > 1 else [1]
        keys = [(who, count) for count in counts for who in (FLEET, ALONE)]
        prompts = list(PROMPTS.values())

        def measure(key, _round: int) -> float:
            who, count = key
            return _replies(services[who], [prompts[i % len(prompts)] for i in range(count)], tokens, hooks)

        for who, chat in services.items():  # first replies compile and fill caches: not measured
            hooks.step(0, 1, f"warming up {who}")
            _replies(chat, prompts[:max(counts)], tokens, hooks)
        samples = interleave(measure, keys, runs, alternate=True, hooks=hooks, log=log,
                             label=lambda k: f"{k[0]}, {_people(k[1])}")
    finally:
        for thing in opened:
            thing.close()
    rows = []
    for (who, count), speeds in samples.items():
        rows.append({"config": f"{who}, {_people(count)}", "who": who, "users": count,
                     "tok_s": round(median(speeds), 2), "spread_tok_s": round(half_range(speeds) or 0.0, 2)})
        hooks.row(rows[-1])
    hooks.step(1, 1, "done")
    ratios, spread = {}, {}
    for count, key in zip(counts, ("fleet_vs_alone_1_user", "fleet_vs_alone_n_users")):
        per_round = [f / a for f, a in zip(samples[FLEET, count], samples[ALONE, count])]
        ratios[key] = round(median(per_round), 3)
        if half_range(per_round) is not None:
            spread[key] = round(half_range(per_round), 3)
    meta = {"model": model, "users": users, "tokens_per_reply": tokens, "runs": runs, "weights": weights,
            "fleet": fleet_what, "alone": f"{len(folders)} part{'s' if len(folders) > 1 else ''} in one process"}
    return write_report("fleet", rows, ratios, out, settings=meta, spread=spread)


def _people(count: int) -> str:
    return "1 person" if count == 1 else f"{count} people at once"


def _replies(service, prompts: list[str], tokens: int, hooks: Hooks) -> float:
    """Asks ``service`` every prompt at once (a reply of ``tokens`` tokens each, greedy); the
    tokens of all the replies per second of wall time."""
    hooks.check()
    handles = []
    start = time.perf_counter()
    try:
        for i, prompt in enumerate(prompts):
            on_text = (lambda _text, _n, i=i: hooks.on_token(i, 0)) if hooks.on_token else None
            handles.append(service.submit([{"role": "user", "content": prompt}], tokens, on_text,
                                          ignore_eos=True))
        replies = []
        for handle in handles:
            while (reply := handle.wait(WAIT_S)) is None:
                hooks.check()
            replies.append(reply)
    except BaseException:
        for handle in handles:
            handle.cancel()
        raise
    wall = time.perf_counter() - start
    failed = [r.error for r in replies if r.error]
    if failed:
        raise FleetError(f"a reply failed while measuring: {failed[0]}")
    return sum(len(r.tokens) for r in replies) / wall


