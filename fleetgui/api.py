"""The app's API switch: while it is on, the chat's service is also served as the OpenAI-compatible
API (``engine.serve``), so tools on this PC (or, with the API key, the office) use the same model.

The API follows the chat's service: it starts when the service opens (switching it on opens the
service), and stops before the service closes or when the switch goes off.  ``status`` says what it
is doing, for the fleet view's status line.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal

from engine.errors import FleetError
from engine.fleetkey import api_key_file, load_api_key

API_KEYS = ("api_enabled", "api_host", "api_port")


class ApiController(QObject):
    status = Signal(str)

    def __init__(self, chat, settings, parent: QObject | None = None):
        """``chat``: the window's ``ChatController`` (its ``service`` and ``service_changed``)."""
        super().__init__(parent)
        self.chat = chat
        self.settings = settings
        self.server = None
        self.text = ""
        chat.service_changed.connect(self._service_changed)

    def start(self) -> None:
        """Serves the chat's service if the switch is on (opening the service first if need be)."""
        if not self.settings.api_enabled:
            self._say("API: off (Settings → Serve the OpenAI-compatible API)")
            return
        if self.chat.service is None:
            self._say("API: waiting for the chat's model to start…")
            self.chat.open()
            return
        self._serve(self.chat.service)

    def apply_settings(self, settings) -> None:
        old, self.settings = self.settings, settings
        if self.server is None or any(getattr(old, k) != getattr(settings, k) for k in API_KEYS):
            self.stop()
            self.start()

    def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.stop()

    def _service_changed(self, service) -> None:
        self.stop()
        if service is not None and self.settings.api_enabled:
            self._serve(service)
        elif self.settings.api_enabled:
            self._say("API: waiting for the chat's model to start…")

    def _serve(self, service) -> None:
        # deferred: the API server (FastAPI, uvicorn) loads only once the API switch is on, not at app start
        from engine.serve.server import ApiServer, is_loopback

        host, port = self.settings.api_host, self.settings.api_port
        try:
            key = None if is_loopback(host) else load_api_key(create=True)
            self.server = ApiServer(service, host, port, key, max_body_mb=self.settings.api_max_body_mb,
                                    max_waiting=self.settings.api_max_waiting).start()
        except (FleetError, OSError) as exc:
            self._say(f"API: could not start: {exc}")
            return
        note = f"; clients need the API key in {api_key_file()}" if key else ""
        self._say(f"API: serving {self.server.model_id} at {self.server.url}{note}")

    def _say(self, text: str) -> None:
        self.text = text
        self.status.emit(text)
