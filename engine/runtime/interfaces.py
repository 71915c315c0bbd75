"""What the runtime's parts promise each other.

``Stage``: one compiled shard serving many streams, implemented by the three stage runners
(``stages.stage.StageRunner``, ``stages.paged.PagedStage``, ``stages.static.StaticStage``); a stage
that ``packs`` also runs several streams' rows in one forward (``forward_parts``).

``Chain``: a model's stages end to end, as the generation loop and the chat service drive them,
declared by the in-process ``stages.chain.LocalChain`` and the distributed ``relay.remote.RemoteChain``.
A forward goes in two halves, ``submit`` and ``collect``, so several streams can be in flight.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from engine.transport.wire import Flag

if TYPE_CHECKING:  # annotations only: the stages import this module
    from engine.manifest import Manifest
    from engine.models.architectures import ModelSpec
    from engine.runtime.stages.output import Output
    from engine.runtime.stages.packing import Part


class Stage(Protocol):
    folder: Path
    manifest: Manifest
    device: str
    first: bool
    last: bool
    packs: bool  # runs many streams' rows in one forward and rewinds by a shorter length
    compiles: int

    @property
    def streams(self) -> list[int]:
        """The streams that hold a cache here."""

    def reset(self, stream: int = 0) -> None:
        """Forgets the stream's cache: its next forward starts a new sequence."""

    def keep(self, stream: int, slots: np.ndarray) -> None:
        """Keeps only these physical KV slots of the stream, in order (the rewind)."""

    def forward(self, x: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                stream: int = 0, last_only: bool = False) -> np.ndarray:
        """One stream's step: logits (a last stage) or hidden states."""


class PackingStage(Stage, Protocol):
    def length(self, stream: int) -> int:
        """The positions the stream holds."""

    def forward_parts(self, parts: list[Part]) -> list[np.ndarray]:
        """One forward over several streams' parts; per part its logits or hidden states."""


class Chain(Protocol):
    manifest: Manifest  # stage 0's
    spec: ModelSpec
    paged: bool  # some stage rewinds by trimming (no masked holes)
    packs: bool  # every stage packs: waiting rounds of many streams go in one forward

    @property
    def first_folder(self) -> Path:
        """Stage 0's shard folder (the tokenizer lives there)."""

    def reset(self, stream: int = 0) -> None: ...

    def keep(self, stream: int, slots: np.ndarray) -> None: ...

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                flags: Flag = Flag.NONE, stream: int = 0) -> Output:
        """``submit`` then ``collect``."""

    def submit(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
               flags: Flag = Flag.NONE, stream: int = 0):
        """Starts a forward; returns a ticket for ``collect``."""

    def collect(self, ticket) -> Output:
        """The forward's output (waits for it)."""

    def flush(self) -> None:
        """Starts every submitted round still waiting to be packed now, instead of at the next
        ``collect``: a stream that keeps two rounds in flight (``Scheduling(speculate_ahead=True)``) has stage 0
        compute the second while the later stages compute the first."""

    def first_ready(self, tickets: list) -> int:
        """The index of a ticket whose output is (or will be first) ready."""

    def close(self) -> None: ...
