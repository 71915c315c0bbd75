"""The API's recent requests, for a person watching the server (the app's API server page): each
request's method, path, status, duration and client, and the first bytes of its body, kept in a
bounded list that the server's thread appends to and any thread reads.

The body is the client's text, not ours: a reader shows it as plain text, never as markup.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass

KEPT = 200  # the requests the log keeps: the latest, the older ones dropped
BODY_CHARS = 2000  # the most of a request body kept (a chat's whole history can be megabytes)


@dataclass(frozen=True)
class LoggedRequest:
    number: int  # counts from 1 over the server's life: a reader asks for those after the last it saw
    at: float  # when it came in (time.time())
    method: str
    path: str
    status: int | None  # None: no answer was started (the client went away first)
    duration_ms: float
    client: str  # the client's address
    body: str  # its first BODY_CHARS characters, as the client sent them (untrusted text)


class RequestLog:
    """The latest ``kept`` requests (``LoggedRequest``), oldest first."""

    def __init__(self, kept: int = KEPT):
        self._entries: collections.deque[LoggedRequest] = collections.deque(maxlen=kept)
        self._lock = threading.Lock()
        self._count = 0

    def add(self, method: str, path: str, status: int | None, started: float, client: str, body: bytes) -> None:
        """Logs a request that came in at ``started`` (time.perf_counter()) and has just ended."""
        duration = (time.perf_counter() - started) * 1e3
        text = body[: BODY_CHARS * 4].decode("utf-8", "replace")[:BODY_CHARS]
        with self._lock:
            self._count += 1
            self._entries.append(LoggedRequest(self._count, time.time() - duration / 1e3, method, path, status,
                                               duration, client, text))

    @property
    def kept(self) -> int:
        """The most requests it keeps."""
        return self._entries.maxlen

    def since(self, number: int = 0) -> list[LoggedRequest]:
        """The kept requests after the ``number``-th (0: all kept)."""
        with self._lock:
            return [e for e in self._entries if e.number > number]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
