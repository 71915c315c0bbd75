"""Packed forwards: several streams' new tokens in one forward of a paged or static stage.

A ``Part`` is one stream's share of a packed forward; ``packs_of`` groups queued rounds into forwards
of at most ``PACK_ROWS`` rows; ``check_parts`` refuses what no stage can run.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from engine.errors import ShardError
from engine.tuning import PACK_ROWS


@dataclasses.dataclass
class Part:
    """One stream's share of a packed forward: ``x`` (token ids ``[q]`` on a first stage, hidden
    states ``[q, hidden]`` after it) follows the first ``start`` cached positions, and whatever the
    stream held beyond ``start`` is dropped.  A last stage returns the logits of the final ``keep``
    positions; other stages return every position's hidden state."""

    stream: int
    x: np.ndarray
    start: int
    keep: int = 1
    positions: np.ndarray | None = None  # the rotary positions, when not start, start + 1, ...


def as_part(x: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, stream: int, cached: int,
            all_positions: bool) -> Part:
    """A stateful-style step of one stream as a Part: ``x`` ``[1, q(, hidden)]`` after a mask
    (``[1, cached + q]``) that must cover the stream's ``cached`` positions and the new ones without holes."""
    q = x.shape[1]
    start = attention_mask.shape[1] - q
    if start != cached or not attention_mask.all():
        raise ShardError(f"stream {stream}: a paged stage needs a mask over exactly its {cached} cached "
                         f"positions plus the new ones, without holes")
    return Part(stream, x[0].copy(), start, q if all_positions else 1, position_ids.reshape(-1).copy())


def packs_of(rounds: list, rows) -> list[list]:
    """``rounds`` in submission order, grouped into forwards of at most ``PACK_ROWS`` rows
    (``rows(round)``); a round longer than that goes alone.  A compiled model keeps the working memory
    of the largest forward it has run, so a failover's re-prefill of every reply in flight at once
    goes in several forwards rather than one that would grow the stage for good."""
    groups: list[list] = []
    total = 0
    for r in rounds:
        if not groups or total + rows(r) > PACK_ROWS:
            groups.append([])
            total = 0
        groups[-1].append(r)
        total += rows(r)
    return groups


def check_parts(parts: list[Part], length) -> None:
    """Refuses a packed forward a stage cannot run: a stream twice, a part that does not follow what
    its stream holds (``length(stream)``), or one with no positions or keeping none of them."""
    if len({p.stream for p in parts}) != len(parts):
        raise ShardError("a packed forward carries each stream at most once")
    for p in parts:
        if not 0 <= p.start <= length(p.stream):
            raise ShardError(f"stream {p.stream} holds {length(p.stream)} positions, it cannot continue from {p.start}")
        if len(p.x) == 0 or not 1 <= p.keep <= len(p.x):
            raise ShardError(f"stream {p.stream}: a part needs at least one position and keeps 1 to all of them")
