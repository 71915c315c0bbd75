"""Running the API: uvicorn on a socket we bind ourselves (so a busy port is a clear error at once),
in a thread of the app or in the foreground of ``fleet serve``.

Off loopback the API is reachable by anyone on the network, so binding any other address requires
an API key; on loopback it answers only to loopback Host names (``guard``).  Before any of that, a
connection is held to two limits (``_LimitedHttp``), so that clients that open connections and send
nothing, or trickle a request's head, cannot take the process's file descriptors and leave
``/health`` unanswered: a request's line and headers must arrive within ``HEAD_DEADLINE_S`` (else
408 and the connection closed), and one client address keeps at most ``MAX_CONNECTIONS_PER_CLIENT``
connections open (another is answered 429 and closed at once).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import functools
import http
import json
import logging
import socket
import threading
import time

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from engine.config import Settings
from engine.documents.collection import Collection
from engine.errors import FleetError
from engine.runtime.decode.service import ChatService
from engine.serve.app import create_app
from engine.serve.guard import is_loopback
from engine.serve.request_log import RequestLog
from engine.serve.schema import ApiError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
HEAD_DEADLINE_S = 5.0  # a request's line and headers arrive within this (a client on the LAN sends them at once)
MAX_CONNECTIONS_PER_CLIENT = 64  # open connections from one address: room for the soak's 32 users on one PC,
# while the file descriptors (often 256 to 1024 a process) stay for the others

log = logging.getLogger(__name__)


class ApiServer:
    """The OpenAI-compatible API over ``service`` on ``host:port`` (port 0: any free port), taking
    request bodies up to ``max_body_mb``, with at most ``max_waiting`` requests waiting for a stream
    (more: 429), and the connection limits above; ``documents``: the collection that grounds its chat
    replies (``engine.serve.app``)."""

    def __init__(self, service: ChatService, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                 api_key: str | None = None, model_id: str | None = None,
                 max_body_mb: float = Settings.api_max_body_mb, max_waiting: int = Settings.api_max_waiting,
                 head_deadline_s: float = HEAD_DEADLINE_S,
                 max_connections_per_client: int = MAX_CONNECTIONS_PER_CLIENT, documents: Collection | None = None):
        if not is_loopback(host) and not api_key:
            raise FleetError(f"serving on {host} opens the model to the network: that needs an API key "
                             "(`fleet serve` creates one; clients send it as a bearer token)")
        self.model_id = model_id or service.chain.manifest.model_name
        self.api_key = api_key
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host.strip("[]"), port))
        except OSError as exc:
            self._sock.close()
            why = {errno.EADDRNOTAVAIL: f"this PC has no address {host}",
                   errno.EADDRINUSE: f"another program already uses port {port} there"}.get(exc.errno, exc.strerror)
            raise FleetError(f"cannot serve the API on {host}:{port}: {why}") from None
        self._sock.listen(2048)  # connections wait in the backlog until uvicorn runs: none is refused
        self.host, self.port = host, self._sock.getsockname()[1]
        self.log = RequestLog()  # the recent requests, for a person watching (the app's API server page)
        app = create_app(service, self.model_id, api_key, max_body_mb, local=is_loopback(host), max_waiting=max_waiting,
                         log=self.log, documents=documents)
        limits = _ClientLimits(head_deadline_s, max_connections_per_client)
        config = uvicorn.Config(app, http=functools.partial(_LimitedHttp, limits=limits), log_level="warning",
                                lifespan="off", timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def serve_forever(self) -> None:
        """Serves in this thread until ``stop`` (or Ctrl-C in the main thread)."""
        try:
            self._server.run(sockets=[self._sock])
        finally:
            self._sock.close()

    def start(self, timeout_s: float = 10.0) -> "ApiServer":
        """Serves in a background thread; returns once the server accepts connections."""
        self._thread = threading.Thread(target=self.serve_forever, name="api-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self._server.started:
            raise FleetError(f"the API server on {self.host}:{self.port} did not start")
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._sock.close()


class _ClientLimits:
    """The connection limits of one server, and its open connections per client address (only its
    event loop's thread touches them)."""

    def __init__(self, head_deadline_s: float, per_client: int):
        self.head_deadline_s, self.per_client = head_deadline_s, per_client
        self.open: collections.Counter[str] = collections.Counter()


class _LimitedHttp(AutoHTTPProtocol):
    """uvicorn's HTTP protocol held to ``_ClientLimits`` (the module docstring).  The head deadline
    runs from the connection's start, and from a later request's first byte (uvicorn's keep-alive
    timeout closes a connection idle between requests); it ends once uvicorn has the request's head
    (a new request cycle)."""

    def __init__(self, *args, limits: _ClientLimits, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._address: str | None = None  # counted in ``limits.open`` while the connection is open
        self._head_timer: asyncio.TimerHandle | None = None
        self._cycle_before = None  # the request cycle that was current when the head timer started

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        address = self.client[0] if self.client else ""
        if self.limits.open[address] >= self.limits.per_client:
            _answer_and_close(transport, ApiError(
                429, f"this client has {self.limits.open[address]} connections open to the API; at most "
                     f"{self.limits.per_client}: reuse them, or close some", code="too_many_connections",
                headers={"Retry-After": "1"}))
            return
        self._address = address
        self.limits.open[address] += 1
        self._start_head_timer()

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._start_head_timer()  # a further request's first bytes
        super().data_received(data)
        if self._head_timer is not None and self.cycle is not self._cycle_before:
            self._head_timer.cancel()  # its head is in: the request runs
            self._head_timer = None

    def connection_lost(self, exc) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self._address is not None:
            self.limits.open[self._address] -= 1
            if not self.limits.open[self._address]:
                del self.limits.open[self._address]
            self._address = None
        super().connection_lost(exc)

    def _start_head_timer(self) -> None:
        self._cycle_before = self.cycle
        self._head_timer = self.loop.call_later(self.limits.head_deadline_s, self._head_late)

    def _head_late(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            _answer_and_close(self.transport, ApiError(
                408, f"the request's line and headers did not arrive within {self.limits.head_deadline_s:g} s",
                code="request_timeout"))


def _answer_and_close(transport, error: ApiError) -> None:
    """Answers ``error`` on a connection whose request uvicorn has not taken (no route runs), and closes it."""
    body = json.dumps(error.body()).encode()
    head = [f"HTTP/1.1 {error.status} {http.HTTPStatus(error.status).phrase}", "Content-Type: application/json",
            f"Content-Length: {len(body)}", "Connection: close",
            *(f"{name}: {value}" for name, value in (error.headers or {}).items())]
    transport.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
    transport.close()
