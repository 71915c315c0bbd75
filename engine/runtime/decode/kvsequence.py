"""One stream's view of a stateful chain: which KV slots are live, and the positions the next tokens take.

Every token a stream decodes, plain or speculative, goes through its ``KVSequence``.
"""

from __future__ import annotations

import time

import numpy as np

from engine.transport.wire import Flag


class KVSequence:
    """One stream's bookkeeping over a stateful chain: the mask over physical KV slots, how many
    slots are filled, and the logical length that position_ids follow.  Rejected slots are either
    masked out (``rewind="mask"``, the cache keeps them) or cut off the cache (``"trim"``)."""

    def __init__(self, chain, max_length: int, stream: int = 0, rewind: str = "mask"):
        if rewind not in ("mask", "trim"):
            raise ValueError(f"rewind must be 'mask' or 'trim', not {rewind!r}")
        self.chain = chain
        self.stream = stream
        # a paged chain's cache holds no holes and cutting it costs nothing
        self.rewind = "trim" if getattr(chain, "paged", False) else rewind
        self.max_length = max_length
        self.mask = np.zeros((1, max_length), np.int64)
        self.positions = np.arange(max_length, dtype=np.int64)[None, :]
        self.physical = 0
        self.logical = 0
        self.trim_ms = 0.0
        self.compactions = 0

    def reset(self) -> None:
        """Empties the stream's cache; the trim time and compactions count from here."""
        self.chain.reset(self.stream)
        self.physical = self.logical = 0
        self.trim_ms = 0.0
        self.compactions = 0

    def forward(self, ids: list[int] | np.ndarray, flags: Flag = Flag.NONE):
        return self.chain.collect(self.submit(ids, flags))

    def submit(self, ids: list[int] | np.ndarray, flags: Flag = Flag.NONE):
        """Feeds ``ids`` as the next positions; the chain's ticket is collected later (micro-batching)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        q = ids.shape[1]
        if self.physical + q > self.max_length:
            self.compact()
            if self.physical + q > self.max_length:
                raise ValueError(f"the sequence ({self.logical + q} tokens) outgrows the context of {self.max_length}")
        p, n = self.physical, self.logical
        self.mask[0, p : p + q] = 1
        ticket = self.chain.submit(ids, self.mask[:, : p + q], self.positions[:, n : n + q], flags, self.stream)
        self.physical += q
        self.logical += q
        return ticket

    def skip(self, count: int) -> None:
        """Leaves the next ``count`` tokens out of the cache: later positions follow as if they were there."""
        self.logical += count

    def reject(self, count: int) -> None:
        """The last ``count`` tokens fed were wrong guesses: drop them from the sequence.

        With the mask rewind those tokens' slots need not be the last ``count``: a draft model's
        steps leave a masked guess behind each token it drafts (``DraftModel._step``), and a round's
        rejected drafts are spread between them."""
        if count <= 0:
            return
        self.logical -= count
        if self.rewind == "trim":
            start = time.perf_counter()
            self.chain.keep(self.stream, np.arange(self.physical - count, dtype=np.int32))
            self.trim_ms += (time.perf_counter() - start) * 1e3
            self.physical -= count
        else:
            live = np.flatnonzero(self.mask[0, : self.physical])
            self.mask[0, live[-count:]] = 0

    def truncate(self, length: int) -> None:
        """Keeps the sequence's first ``length`` tokens (a cached prefix) and drops the rest, as a
        rejected draft is dropped: masked out, or cut from every stage's cache with ``trim``."""
        live = np.flatnonzero(self.mask[0, : self.physical])
        self.trim_ms, self.compactions = 0.0, 0
        if length >= len(live):
            return
        if self.rewind == "trim":
            start = time.perf_counter()
            self.chain.keep(self.stream, live[:length].astype(np.int32))
            self.trim_ms += (time.perf_counter() - start) * 1e3
            self.physical = length
            self.mask[0, :length] = 1
            self.mask[0, length:] = 0
        else:
            self.mask[0, live[length:]] = 0
        self.logical = length

    def slots_for(self, length: int) -> int:
        """How many physical KV slots from the start hold the sequence's first ``length`` tokens."""
        live = np.flatnonzero(self.mask[0, : self.physical])
        return int(live[length - 1]) + 1 if 0 < length <= len(live) else 0

    def settle(self, length: int) -> None:
        """Cuts every stage's cache down to the sequence's first ``length`` tokens, whatever the
        rewind: after a stage was switched mid-round, stages may hold that round or not."""
        live = np.flatnonzero(self.mask[0, : self.physical])[:length].astype(np.int32)
        self.chain.keep(self.stream, live)
        self.physical = self.logical = len(live)
        self.mask[0, : self.physical] = 1
        self.mask[0, self.physical :] = 0

    def compact(self) -> None:
        """Squeezes the masked holes out of every stage's cache."""
        keep = np.flatnonzero(self.mask[0, : self.physical]).astype(np.int32)
        if len(keep) == self.physical:
            return
        self.chain.keep(self.stream, keep)
        self.physical = len(keep)
        self.mask[0, : self.physical] = 1
        self.mask[0, self.physical :] = 0
        self.compactions += 1

    @property
    def bloat(self) -> float:
        """Physical KV slots per logical token (1.0: no masked holes)."""
        return self.physical / self.logical if self.logical else 1.0
