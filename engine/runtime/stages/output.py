"""What a last stage returns: top-1 compression of its logits (the token, and only what the caller asked for)."""

from __future__ import annotations

import dataclasses

import numpy as np

from engine.transport.wire import CANDIDATE_COUNT, Flag


def top_candidates(rows: np.ndarray, n: int = CANDIDATE_COUNT) -> tuple[np.ndarray, np.ndarray]:
    """The ``n`` largest logits of each row of ``rows`` [positions, vocab], most likely first."""
    n = min(n, rows.shape[-1])
    part = np.argpartition(rows, -n, axis=-1)[:, -n:]
    values = np.take_along_axis(rows, part, axis=-1)
    order = np.argsort(-values, axis=-1, kind="stable")
    return (np.take_along_axis(part, order, -1).astype(np.int64),
            np.take_along_axis(values, order, -1).astype(np.float32))


@dataclasses.dataclass
class Output:
    """What a chain returns for one forward: the top-1 token per returned position, optionally
    their probabilities or the full logits, and where the time went."""

    tokens: np.ndarray  # int64 [positions]
    probs: np.ndarray | None = None  # float32 [positions]
    logits: np.ndarray | None = None  # float32 [1, positions, vocab]
    candidates: tuple[np.ndarray, np.ndarray] | None = None  # ids int64, logits float32 [positions, CANDIDATE_COUNT]
    stage_ms: list[float] = dataclasses.field(default_factory=list)  # compute per stage
    network_ms: float = 0.0  # waiting on the wire and relaying, beyond the remote stages' compute


def select(logits: np.ndarray, flags: Flag) -> Output:
    """Top-1 compression of last-stage logits ``[1, q, vocab]``: what the caller asked for and no more."""
    rows = logits[0] if flags & Flag.ALL_POSITIONS else logits[0, -1:]
    out = Output(rows.argmax(-1).astype(np.int64))
    if flags & Flag.PROBS:
        top = rows.max(-1, keepdims=True)
        out.probs = (1.0 / np.exp(rows - top).sum(-1)).astype(np.float32)
    if flags & Flag.LOGITS:
        out.logits = np.array(rows[None], dtype=np.float32)
    if flags & Flag.CANDIDATES:
        out.candidates = top_candidates(rows)
    return out
