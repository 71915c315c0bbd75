"""The prefix cache: which token ids each stream's KV cache holds after a reply, so that the next
request goes to the stream that already holds most of its conversation and only the rest is
prefilled."""

from __future__ import annotations

import itertools
import threading

import numpy as np


class PrefixCache:
    """What each stream's cache holds (its prompt and every token emitted but the last), written by
    the scheduler and read by any thread (``longest``).  ``enabled=False`` holds nothing: every
    request is prefilled whole."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._held: dict[int, list[int]] = {}  # stream -> the token ids its cache holds, in order
        self._last_used: dict[int, int] = {}
        self._uses = itertools.count()
        self._lock = threading.Lock()

    def held(self, stream: int) -> list[int]:
        """The token ids ``stream``'s cache holds (none known: empty)."""
        with self._lock:
            return list(self._held.get(stream, [])) if self.enabled else []

    def longest(self, ids: list[int]) -> int:
        """The most of ``ids`` (from the start) that a stream's cache holds."""
        if not self.enabled:
            return 0
        with self._lock:
            held = list(self._held.values())
        return max((common_prefix(h, ids) for h in held), default=0)

    def pick(self, free: list[int], ids: list[int] | None) -> int:
        """The free stream worth most to a request for ``ids``: the tokens of it the stream's cache
        holds, less half of what the request would evict there (another conversation's turns, which
        it may still want), so that a shared chat-template prefix does not evict a whole
        conversation while a stream stands empty; among equals, the least recently used."""
        with self._lock:
            def score(stream: int):
                held = self._held.get(stream, []) if self.enabled and ids else []
                reused = common_prefix(held, ids or [])
                return reused - (len(held) - reused) / 2, -self._last_used.get(stream, -1)

            return max(free, key=score)

    def remember(self, stream: int, held: list[int] | None) -> None:
        """What a finished stream's cache holds now (None: nothing known, after an error or before
        a first token)."""
        with self._lock:
            self._last_used[stream] = next(self._uses)
            if held is None:
                self._held.pop(stream, None)
            else:
                self._held[stream] = held

    def clear(self) -> None:
        """Nothing is known of any stream's cache (the chain broke or was replaced)."""
        with self._lock:
            self._held.clear()


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    same = np.asarray(a[:n]) == np.asarray(b[:n])
    return n if same.all() else int(np.argmin(same))
