"""The app's API switch: while it is on, the chat's service is also served as the OpenAI-compatible
API (``engine.serve``), so tools on this PC (or, with the API key, the office) use the same model.

The API follows the chat's service: it starts when the service opens (switching it on opens the
service), and stops before the service closes or when the switch goes off.  A new address is bound
before the old one is let go: an address the API cannot serve on (one this PC does not have, a port
another program holds) leaves it serving where it was, and ``error`` says why.  ``status`` says what
it is doing in a line (the fleet view's status line); ``changed`` tells the API server page to read
``state``, ``url``, ``api_key``, ``model_id``, ``error`` and ``requests`` again.
"""

from __future__ import annotations

import dataclasses

from PySide6.QtCore import QObject, QTimer, Signal

from engine.errors import FleetError
from engine.fleetkey import api_key_file, load_api_key

API_KEYS = ("api_enabled", "api_host", "api_port")
ADDRESS = ("api_host", "api_port")

STOPPED, STARTING, RUNNING, FAILED = "stopped", "starting", "running", "error"


class ApiController(QObject):
    status = Signal(str)
    changed = Signal()

    def __init__(self, chat, settings, parent: QObject | None = None):
        """``chat``: the window's ``ChatController`` (its ``service`` and ``service_changed``)."""
        super().__init__(parent)
        self.chat = chat
        self.settings = settings
        self.server = None
        self.text = ""
        self.error = ""  # why the last start or change of address failed; "" when it did not
        chat.service_changed.connect(self._service_changed)

    # --- what the server page shows ---------------------------------------------------------------------

    @property
    def state(self) -> str:
        """``running``, ``starting`` (on, waiting for the chat's model), ``error`` (on, but it could
        not start) or ``stopped`` (off)."""
        if self.server is not None:
            return RUNNING
        if not self.settings.api_enabled:
            return STOPPED
        return FAILED if self.error else STARTING

    @property
    def url(self) -> str:
        return self.server.url if self.server is not None else ""

    @property
    def api_key(self) -> str | None:
        """The key clients send (None: the API listens on this PC only and needs none)."""
        return self.server.api_key if self.server is not None else None

    @property
    def model_id(self) -> str:
        return self.server.model_id if self.server is not None else ""

    @property
    def requests(self):
        """The running server's ``engine.serve.request_log.RequestLog`` (None when stopped)."""
        return self.server.log if self.server is not None else None

    # --- running --------------------------------------------------------------------------------------

    def start(self) -> None:
        """Serves the chat's service if the switch is on (opening the service first if need be)."""
        if self.server is not None:
            return
        if not self.settings.api_enabled:
            self._say("API: off (Settings → Serve the OpenAI-compatible API)")
            return
        if self.chat.service is None:
            self._say("API: waiting for the chat's model to start…")
            self.chat.open()
            return
        self._serve(self.chat.service)

    def apply_settings(self, settings):
        """Takes new settings and returns them as they are in force: when the API serves and cannot
        serve on the new address, it keeps serving on the old one, which the settings returned keep
        (``error`` says why).  Starting waits for the window to apply the rest of the settings (the
        chat's model among them)."""
        old, self.settings = self.settings, settings
        if self.server is not None and not any(getattr(old, k) != getattr(settings, k) for k in API_KEYS):
            if self.error:  # the address in force is kept: what failed before is past
                self.error = ""
                self.changed.emit()
            return settings
        if not settings.api_enabled:
            self.error = ""
            self.stop()
            self._say("API: off (Settings → Serve the OpenAI-compatible API)")
            return settings
        if self.server is None:  # (the chat's model may change with these settings: it may close meanwhile)
            QTimer.singleShot(0, self, self.start)
            return settings
        if all(getattr(old, k) == getattr(settings, k) for k in ADDRESS):
            return settings
        if self._move(self.chat.service):
            return settings
        self.settings = dataclasses.replace(settings, **{k: getattr(old, k) for k in ADDRESS})
        return self.settings

    def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.stop()
            self.changed.emit()

    def _service_changed(self, service) -> None:
        self.stop()
        if service is not None and self.settings.api_enabled:
            self._serve(service)
        elif self.settings.api_enabled:  # the chat's model closed (new settings): the API opens the next one
            self._say("API: waiting for the chat's model to start…")
            QTimer.singleShot(0, self, self.start)

    def _server(self, service):
        """A server for ``service`` on the settings' address, started (FleetError, OSError if not)."""
        # deferred: the API server (FastAPI, uvicorn) loads only once the API switch is on, not at app start
        from engine.serve.server import ApiServer, is_loopback

        host, port = self.settings.api_host, self.settings.api_port
        key = None if is_loopback(host) else load_api_key(create=True)
        server = ApiServer(service, host, port, key, max_body_mb=self.settings.api_max_body_mb,
                           max_waiting=self.settings.api_max_waiting)
        try:
            return server.start()
        except FleetError:
            server.stop()
            raise

    def _serve(self, service) -> None:
        try:
            self.server = self._server(service)
        except (FleetError, OSError) as exc:
            self.error = str(exc)
            self._say(f"API: could not start: {exc}")
            return
        self.error = ""
        self._serving()

    def _move(self, service) -> bool:
        """Serves on the settings' address, then lets the old one go; False (and the old one kept)
        when the new one cannot be served.  A port the old server holds is let go first, and taken
        back if the new address fails."""
        old = self.server
        try:
            new = self._server(service)
        except (FleetError, OSError) as exc:
            if self.settings.api_port != old.port:
                return self._kept(exc)
            old.stop()
            try:
                new = self._server(service)
            except (FleetError, OSError) as again:
                self.settings, wanted = dataclasses.replace(self.settings, api_host=old.host, api_port=old.port), \
                    self.settings
                try:
                    self.server = self._server(service)
                except (FleetError, OSError) as lost:  # another program took the port meanwhile
                    self.server, self.settings = None, wanted
                    self.error = f"{again}; and the old address could not be served again: {lost}"
                    self._say(f"API: could not start: {self.error}")
                    return False
                return self._kept(again)
        else:
            old.stop()
        self.server, self.error = new, ""
        self._serving()
        return True

    def _kept(self, exc: Exception) -> bool:
        why = str(exc)
        self.error = f"{why[:1].upper()}{why[1:]}. The API keeps serving at {self.server.url}."
        self._say(f"API: serving {self.server.model_id} at {self.server.url} (the new address failed: {exc})")
        return False

    def _serving(self) -> None:
        note = f"; clients need the API key in {api_key_file()}" if self.server.api_key else ""
        self._say(f"API: serving {self.server.model_id} at {self.server.url}{note}")

    def _say(self, text: str) -> None:
        self.text = text
        self.status.emit(text)
        self.changed.emit()
