"""The in-process stage chain: every shard of a model in this process, called one after another."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from engine.errors import ShardError
from engine.manifest import MANIFEST, check_chain, load_manifest
from engine.runtime.stage import Output, StageRunner, select
from engine.runtime.turns import NO_TURNS
from engine.wire import Flag


def expand_shard_dirs(dirs: list[Path | str]) -> list[Path]:
    """Accepts shard folders or export folders holding ``stage0``, ``stage1``, ...; returns shard folders."""
    folders: list[Path] = []
    for d in map(Path, dirs):
        if not d.exists():
            raise ShardError(f"shard folder {d} does not exist")
        if (d / MANIFEST).exists():
            folders.append(d)
            continue
        stages = sorted((p for p in d.glob("stage*") if (p / MANIFEST).exists()), key=lambda p: int(p.name[5:] or 0))
        if not stages:
            raise ShardError(f"{d} is neither a shard folder nor an export holding stage folders")
        folders.extend(stages)
    return folders


def parse_devices(device: str, count: int) -> list[str]:
    """One OpenVINO device for every stage (``"CPU"``) or one per stage (``"CPU,GPU.1"``)."""
    devices = [d.strip() for d in device.split(",")]
    if len(devices) == 1:
        devices *= count
    if len(devices) != count or not all(devices):
        raise ShardError(f"{device!r} names {len(devices)} devices for {count} stages")
    return devices


class LocalChain:
    """All stages in one process; ``forward`` maps token ids to the last stage's top-1 tokens."""

    def __init__(self, shard_dirs: list[Path | str], device: str = "CPU", config: dict | None = None,
                 isolate: bool = False, turns=None):
        """``device`` is one OpenVINO device for every stage, or one per stage: ``"CPU,GPU.1"``;
        ``isolate`` compiles each stage once per stream instead of sharing one compiled model;
        ``turns``: the compute turns this computer's stages share (``engine.runtime.turns``)."""
        folders = expand_shard_dirs(shard_dirs)
        manifests = [load_manifest(f) for f in folders]
        check_chain(manifests)
        devices = parse_devices(device, len(folders))
        self.turns = turns or NO_TURNS
        self.stages = [StageRunner(f, dev, config, m, isolate, self.turns) for f, dev, m in zip(folders, devices, manifests)]
        self.manifest = manifests[0]
        self.spec = self.manifest.spec

    @property
    def first_folder(self) -> Path:
        return self.stages[0].folder

    def reset(self, stream: int = 0) -> None:
        for stage in self.stages:
            stage.reset(stream)

    def keep(self, stream: int, slots: np.ndarray) -> None:
        for stage in self.stages:
            stage.keep(stream, slots)

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                flags: Flag = Flag.NONE, stream: int = 0) -> Output:
        x, stage_ms = input_ids, []
        for stage in self.stages:
            t = time.perf_counter()
            x = stage.forward(x, attention_mask, position_ids, stream, last_only=not flags & Flag.ALL_POSITIONS)
            stage_ms.append((time.perf_counter() - t) * 1e3)
        out = select(x, flags)
        out.stage_ms = stage_ms
        return out

    def submit(self, input_ids, attention_mask, position_ids, flags: Flag = Flag.NONE, stream: int = 0) -> Output:
        """In process there is nothing to overlap: the work is done now, ``collect`` hands it over."""
        return self.forward(input_ids, attention_mask, position_ids, flags, stream)

    def collect(self, ticket: Output) -> Output:
        return ticket

    def first_ready(self, tickets: list[Output]) -> int:
        return 0

    def close(self) -> None:
        pass
