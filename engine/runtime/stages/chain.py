"""The in-process stage chain: every shard of a model in this process, called one after another."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from engine.config import parse_devices
from engine.manifest import check_chain, expand_shard_dirs, load_manifest
from engine.runtime.interfaces import Chain
from engine.runtime.stages.factory import open_stage
from engine.runtime.stages.output import Output, select
from engine.runtime.stages.packing import Part, as_part, packs_of
from engine.runtime.stages.turns import NO_TURNS
from engine.transport.wire import Flag


@dataclasses.dataclass
class _Ticket:
    """A round submitted to a packing chain: run with every other round submitted before its collect."""

    part: Part
    flags: Flag
    output: Output | None = None
    error: BaseException | None = None


class LocalChain(Chain):
    """All stages in one process; ``forward`` maps token ids to the last stage's top-1 tokens.

    When every stage is paged the chain packs: a submitted round waits until some round is
    collected, and then every waiting round (one per stream: decode steps, verify blocks, prefill
    chunks alike) goes through each stage in one forward."""

    def __init__(self, shard_dirs: list[Path | str], device: str = "CPU", config: dict | None = None,
                 isolate: bool = False, turns=None, paged: bool | None = None, static: bool | None = None,
                 mesh=None, fixed_rows: bool | None = None):
        """``device`` is one OpenVINO device for every stage, or one per stage: ``"CPU,GPU.1"``;
        ``isolate`` compiles each stage once per stream instead of sharing one compiled model;
        ``turns``: the compute turns this computer's stages share (``engine.runtime.stages.turns``);
        ``paged``: paged-attention stages (``engine.runtime.stages.paged``) instead of one stateful request
        per stream; None: wherever they are supported; ``static``: static-shape stages
        (``engine.runtime.stages.static``; None: on an NPU); ``mesh``: this process's tensor-parallel
        rank (``engine.transport.mesh``) for a shard split into ranks; ``fixed_rows``: paged stages'
        graphs with a fixed token axis (``engine.runtime.stages.paged``; None: on a CPU where our
        kernels run the matrices)."""
        folders = expand_shard_dirs(shard_dirs)
        manifests = [load_manifest(f) for f in folders]
        check_chain(manifests)
        devices = parse_devices(device, len(folders))
        self.turns = turns or NO_TURNS
        self.stages = [open_stage(f, dev, config, m, paged=paged, static=static, isolate=isolate, turns=self.turns,
                                  mesh=mesh, fixed_rows=fixed_rows)
                       for f, dev, m in zip(folders, devices, manifests)]
        # one paged (or static) stage is enough for the whole chain to rewind by trimming: it has no
        # holes to mask
        self.paged = any(stage.packs for stage in self.stages)
        self.packs = all(stage.packs for stage in self.stages)
        self._pending: list[_Ticket] = []
        self.manifest = manifests[0]
        self.spec = self.manifest.spec

    @property
    def first_folder(self) -> Path:
        return self.stages[0].folder

    def reset(self, stream: int = 0) -> None:
        self._run_pending(stream)
        for stage in self.stages:
            stage.reset(stream)

    def keep(self, stream: int, slots: np.ndarray) -> None:
        self._run_pending(stream)
        for stage in self.stages:
            stage.keep(stream, slots)

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                flags: Flag = Flag.NONE, stream: int = 0) -> Output:
        if self.packs:
            return self.collect(self.submit(input_ids, attention_mask, position_ids, flags, stream))
        x, stage_ms = input_ids, []
        for stage in self.stages:
            t = time.perf_counter()
            x = stage.forward(x, attention_mask, position_ids, stream, last_only=not flags & Flag.ALL_POSITIONS)
            stage_ms.append((time.perf_counter() - t) * 1e3)
        out = select(x, flags)
        out.stage_ms = stage_ms
        return out

    def submit(self, input_ids, attention_mask, position_ids, flags: Flag = Flag.NONE, stream: int = 0):
        """Stateful stages: the work is done now, ``collect`` hands it over.  Paged: it waits to be
        packed with the other streams' rounds."""
        if not self.packs:
            return self.forward(input_ids, attention_mask, position_ids, flags, stream)
        self._run_pending(stream)
        part = as_part(input_ids, attention_mask, position_ids, stream, self.stages[0].length(stream),
                       bool(flags & Flag.ALL_POSITIONS))
        ticket = _Ticket(part, flags)
        self._pending.append(ticket)
        return ticket

    def collect(self, ticket) -> Output:
        if isinstance(ticket, Output):
            return ticket
        if ticket.output is None and ticket.error is None:
            self._run_pending()
        if ticket.error is not None:
            raise ticket.error
        return ticket.output

    def flush(self) -> None:
        self._run_pending()

    def _run_pending(self, stream: int | None = None) -> None:
        """Runs every waiting round, at most ``PACK_ROWS`` rows a forward (``stream``: only if one of
        them is that stream's, whose next step must come after it)."""
        if stream is not None and all(t.part.stream != stream for t in self._pending):
            return
        pending, self._pending = self._pending, []
        groups = packs_of(pending, lambda t: len(t.part.x))
        for i, group in enumerate(groups):
            parts, stage_ms = [t.part for t in group], []
            try:
                for stage in self.stages:
                    began = time.perf_counter()
                    outs = stage.forward_parts(parts)
                    stage_ms.append((time.perf_counter() - began) * 1e3)
                    parts = [dataclasses.replace(p, x=out) for p, out in zip(parts, outs)]
            except BaseException as exc:
                for t in (t for later in groups[i:] for t in later):
                    t.error = exc
                raise
            for t, logits in zip(group, outs):
                t.output = select(logits[None], t.flags)
                t.output.stage_ms = list(stage_ms)

    def first_ready(self, tickets: list[Output]) -> int:
        return 0

    def close(self) -> None:
        pass
