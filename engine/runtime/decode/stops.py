"""Stop strings: a reply ends where its text first contains one of them, which is left out.

Text arrives in pieces; a piece's tail that could be the start of a stop string is held back until
the next piece tells, so nothing after a stop ever reaches the caller.
"""

from __future__ import annotations


class StopText:
    def __init__(self, stops: list[str] | tuple[str, ...] = ()):
        self.stops = [s for s in stops if s]
        self.hit: str | None = None  # the stop string found, once found
        self._held = ""
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    def push(self, piece: str) -> str:
        """The part of ``piece`` (with what was held back) that is safe to emit; after a hit, nothing."""
        if self.hit is not None:
            return ""
        if not self.stops:
            return piece
        text = self._held + piece
        found = [(text.find(s), s) for s in self.stops]
        found = [(i, s) for i, s in found if i >= 0]
        if found:
            at, self.hit = min(found)
            self._held = ""
            return text[:at]
        keep = 0
        for n in range(min(self._hold, len(text)), 0, -1):  # the longest tail that starts a stop string
            if any(s.startswith(text[-n:]) for s in self.stops):
                keep = n
                break
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """What was held back, once the reply has ended without a stop."""
        held, self._held = ("" if self.hit is not None else self._held), ""
        return held
