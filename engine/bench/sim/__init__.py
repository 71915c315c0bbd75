"""``fleet bench sim``: what loopback cannot measure, on a simulated office (``engine.fleet.sim.office``;
Linux, root): PCs of one core or less each, this machine the coordinator.

The run is made of parts, each in the module named after it, run in this order (``parts`` picks any):

- ``links``: deploying onto an empty PC, and a PC's cable cut mid-reply, at each link speed;
- ``office``: two PCs at 1 Gbit/s, ours and llama.cpp's, whole on one PC and split over both, at
  1-8 users (a GGUF source: llama.cpp runs the same file);
- ``big``: a model too big for one PC, the solver's split against llama.cpp whole on one (paging)
  and llama.cpp's split;
- ``slow``: a PC with a fifth of a core beside two of 0.9, the solver's placement with and without it;
- ``draft``: one user, and a second PC that drafts for the first;
- ``ranks``: one user on two PCs as tensor-parallel ranks, and what the fleet deploys for one user;
- ``layout``: the solver's layout (``engine.fleet.layout``) on 2 and on 3 PCs against N times one PC.

``links`` and ``office`` run the model split in two where both stages take the same time per token on
one core here (``balanced_boundary``); the report's rows and ratios are every part's, in that order.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.bench.harness import NO_HOOKS, Hooks
from engine.bench.llamacpp import LlamaCppUnavailable
from engine.bench.parity import llamacpp_gguf
from engine.bench.report import write_report
from engine.bench.sim import big, draft, layout, links, office, ranks, slow
from engine.bench.sim.shared import TLS, Sim, need_gguf, pin_process
from engine.config import DEFAULT_WEIGHTS
from engine.errors import FleetError
from engine.export.exporter import export_model
from engine.fleet.sim.netns import require_root
from engine.fleet.placement import ModelShape, balanced_split, even_split
from engine.fleet.profile import model_shape, profile_shards
from engine.fleet.survey import device_profile
from engine.fleetkey import access_of, create_key
from engine.manifest import load_manifest


@dataclass(frozen=True)
class Part:
    """One part of the run: what measures it (rows, ratios, and its settings for the report), its
    progress line, what it checks before anything runs, and whether it runs the 2-stage split or
    llama.cpp on the model's GGUF."""

    measure: Callable[[Sim, Hooks], tuple[list[dict], dict, dict]]
    what: str
    check: Callable[[Sim], None] = lambda sim: None
    split: bool = False
    gguf: bool = False


PARTS = {
    "links": Part(links.run, "deploying, and a cable cut, at each link speed", links.check, split=True),
    "office": Part(office.run, "the office: one PC against two, ours and llama.cpp's", need_gguf, split=True,
                   gguf=True),
    "big": Part(big.run, "a model too big for one PC", need_gguf, gguf=True),
    "slow": Part(slow.run, "a slow PC beside two fast ones"),
    "draft": Part(draft.run, "one user, and a second PC that drafts"),
    "ranks": Part(ranks.run, "one user on two PCs as tensor-parallel ranks", ranks.check, gguf=True),
    "layout": Part(layout.run, "the solver's layout on 2 and 3 PCs", layout.check),
}


def balanced_boundary(folders: list[Path], shape: ModelShape, core: int) -> int:
    """The layer where a 2-stage split of alike one-core PCs is balanced, from timing the stages of
    a 2-stage export (``folders``) on ``core``: on a CPU that computes in float the head costs less
    than its bytes say, so the split by bytes (``placement.even_split``) leaves stage 0 the busier."""
    before = pin_process({core})
    try:
        measured = profile_shards(folders, "CPU")
    finally:
        pin_process(before)
    return balanced_split(shape, device_profile("pc", measured), 2)[0]


def run_sim(model: str, *, rates=(100.0, 1000.0), tokens: int = 64, users=None, weights: str = DEFAULT_WEIGHTS,
            runs: int = 2, parts: tuple[str, ...] = tuple(PARTS), memory_mb: int = 1000,
            draft: str = "qwen2.5-coder-0.5b", out: Path | None = None, log=print, hooks: Hooks = NO_HOOKS) -> dict:
    """``users``: the user counts of every part that takes them (default: each part's own; the
    layout's offices run those with any of them)."""
    require_root("fleet bench sim")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise FleetError("fleet bench sim needs two CPUs: one for this PC, one for a simulated PC")
    if unknown := set(parts) - set(PARTS):
        raise FleetError(f"fleet bench sim measures {', '.join(PARTS)}, not {', '.join(sorted(unknown))}")
    chosen = [name for name in PARTS if name in parts]
    sim = Sim(model, weights, tokens, runs, tuple(users) if users else None, draft, memory_mb, tuple(rates), cores,
              log)
    if any(PARTS[name].gguf for name in chosen):
        try:
            sim.gguf = llamacpp_gguf(model)
        except LlamaCppUnavailable as exc:
            sim.gguf_missing = str(exc)
    for name in chosen:
        PARTS[name].check(sim)
    steps = len(chosen) + 1
    hooks.step(0, steps, "exporting the model")
    sim.whole = export_model(model, stages=1, weights=weights)
    sim.shape = ModelShape(**model_shape(load_manifest(sim.whole.folders[0])))
    rows, ratios = [], {}
    settings = {"model": model, "weights": weights, "tokens": tokens, "shaping": "tc tbf", "parts": list(parts)}
    if any(PARTS[name].split for name in chosen):
        by_bytes = even_split(sim.shape, 2)
        sim.split = export_model(model, split=by_bytes, weights=weights)
        boundary = balanced_boundary(sim.split.folders, sim.shape, cores[0])
        if [boundary] != by_bytes:
            sim.split = export_model(model, split=[boundary], weights=weights)
        settings |= {"stages": 2, "split": boundary, "pcs": "2, one core each",
                     "split_rule": f"both stages take the same measured decode time on one core here "
                                   f"(placement.balanced_split; by weight bytes: {by_bytes[0]})"}
    with tempfile.TemporaryDirectory(prefix="fleet-bench-sim-") as tmp:
        sim.root = Path(tmp)
        sim.access = access_of(create_key(sim.root / "fleet.key"), tls=TLS)
        sim.key = sim.access.key
        for index, name in enumerate(chosen, start=1):
            hooks.step(index, steps, PARTS[name].what)
            part_rows, part_ratios, part_settings = PARTS[name].measure(sim, hooks.part(index, steps))
            for row in part_rows:
                hooks.row(row)
            rows += part_rows
            ratios |= part_ratios
            settings |= part_settings
    return write_report("sim", rows, ratios, out, settings=settings)
