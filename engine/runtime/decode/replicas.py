"""Replicas: one chat service over several copies of the model, each request routed to one copy.

Where the model fits on a PC, the fleet's capacity is the sum of its PCs': each copy (a chain whole
in this process, or one whose short stage 0 here feeds a PC that holds the rest) serves its own
users with its own ``ChatService``.  ``Replicas`` has the part of the chat service's surface that
callers use (``submit``, ``busy``, ``queued``, ``close``, ``tokenizer``, ``max_length``, ``chain`` for
the model's facts) and sends a
request to the copy whose prefix cache holds most of it while that copy has a free stream, else to
the least busy copy: users spread evenly, and a conversation's next turn finds its cache.
"""

from __future__ import annotations

import threading

from engine.errors import FleetError
from engine.runtime.decode.service import ChatService, Handle


class Replicas:
    def __init__(self, services: list[ChatService]):
        if not services:
            raise FleetError("replicas need at least one chat service")
        self.services = list(services)
        first = self.services[0]
        self.tokenizer = first.tokenizer
        self.chain = first.chain  # the model's manifest and spec; every copy serves the same model
        self.max_length = min(s.max_length for s in self.services)
        self.streams = sum(s.streams for s in self.services)
        count = len(self.services)
        self.description = f"{first.description}, {count} {'copy' if count == 1 else 'copies'}"  # as the app says
        self.routed = [0] * len(self.services)  # requests sent to each copy
        self._lock = threading.Lock()

    def submit(self, messages: list[dict], *args, tools: list[dict] | None = None, chat: bool = True,
               **kwargs) -> Handle:
        """``ChatService.submit`` on the copy chosen for ``messages`` (see the module's docstring)."""
        if not messages:
            raise FleetError("nothing to reply to: the conversation is empty")
        ids = self.tokenizer.chat_ids(messages, chat, tools=tools).reshape(-1).tolist()
        with self._lock:  # two requests at once must not both pick the same idle copy
            i = self._route(ids)
            self.routed[i] += 1
            return self.services[i].submit(messages, *args, tools=tools, chat=chat, **kwargs)

    def _route(self, ids: list[int]) -> int:
        def score(i: int):
            service = self.services[i]
            busy = service.busy
            return busy < service.streams, service.cached_prefix(ids) if busy < service.streams else 0, -busy, -i

        return max(range(len(self.services)), key=score)

    @property
    def busy(self) -> int:
        return sum(s.busy for s in self.services)

    @property
    def queued(self) -> int:
        return sum(s.queued for s in self.services)

    def close(self, timeout: float = 10.0) -> None:
        for service in self.services:
            service.close(timeout)
