"""Running the API: uvicorn on a socket we bind ourselves (so a busy port is a clear error at once),
in a thread of the app or in the foreground of ``fleet serve``.

Off loopback the API is reachable by anyone on the network, so binding any other address requires
an API key; on loopback it answers only to loopback Host names (``guard``).
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import uvicorn

from engine.config import Settings
from engine.errors import FleetError
from engine.runtime.decode.service import ChatService
from engine.serve.app import create_app
from engine.serve.guard import is_loopback

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000

log = logging.getLogger(__name__)


class ApiServer:
    """The OpenAI-compatible API over ``service`` on ``host:port`` (port 0: any free port), taking
    request bodies up to ``max_body_mb``, with at most ``max_waiting`` requests waiting for a stream
    (more: 429)."""

    def __init__(self, service: ChatService, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                 api_key: str | None = None, model_id: str | None = None,
                 max_body_mb: float = Settings.api_max_body_mb, max_waiting: int = Settings.api_max_waiting):
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
            raise FleetError(f"cannot serve the API on {host}:{port}: {exc.strerror}") from None
        self._sock.listen(2048)  # connections wait in the backlog until uvicorn runs: none is refused
        self.host, self.port = host, self._sock.getsockname()[1]
        app = create_app(service, self.model_id, api_key, max_body_mb, local=is_loopback(host), max_waiting=max_waiting)
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
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
