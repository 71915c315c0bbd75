"""The stage factory: which runner (stateful, paged or static) serves a shard on a device, and opening it."""

from __future__ import annotations

from pathlib import Path

from engine.manifest import Manifest, load_manifest
from engine.runtime.stages.paged import PagedStage
from engine.runtime.stages.stage import StageRunner
from engine.runtime.stages.static import StaticStage


def stage_kind(manifest: Manifest, device: str, *, paged: bool | None = None, static: bool | None = None,
               isolate: bool = False) -> str:
    """Which runner serves a stage: ``static`` shapes on an NPU (whose compiler wants them) or when
    asked for; else ``paged`` attention where it is supported or asked for; else ``stateful`` (also
    when ``isolate`` asks for one compiled model per stream)."""
    npu = device.upper().startswith("NPU")
    if manifest.ranks > 1:  # a tensor-parallel rank: every rank must run the very same forwards
        return "stateful"
    if static or (static is None and npu and not isolate):
        return "static"
    if paged or (paged is None and not npu and not isolate):
        return "paged"
    return "stateful"


def open_stage(folder: Path, device: str = "CPU", config: dict | None = None, manifest: Manifest | None = None,
               *, paged: bool | None = None, static: bool | None = None, isolate: bool = False, turns=None,
               mesh=None, fixed_rows: bool | None = None):
    """The stage runner ``stage_kind`` picks for a shard on ``device``; ``mesh`` for a
    tensor-parallel rank (``engine.transport.mesh``); ``fixed_rows``: a paged stage's graphs with a fixed token axis
    (``engine.runtime.stages.paged``; None: on a CPU where our kernels run the matrices)."""
    manifest = manifest or load_manifest(Path(folder))
    kind = stage_kind(manifest, device, paged=paged, static=static, isolate=isolate)
    if kind == "static":
        return StaticStage(folder, device, config, manifest, turns=turns)
    if kind == "paged":
        return PagedStage(folder, device, config, manifest, turns=turns, fixed_rows=fixed_rows)
    return StageRunner(folder, device, config, manifest, isolate, turns, mesh)
