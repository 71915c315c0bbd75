"""The chat's service: ``ChatController`` owns the engine's chat service for the window.

It opens the service off the GUI thread on first use (exporting or pulling the model if needed),
queues requests until it is up, and relays the service's callbacks (called on its scheduler thread)
to the GUI thread through queued signals.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

from PySide6.QtCore import QObject, Signal

from engine.config import service_changes
from engine.errors import FleetError
from engine.progress import Progress
from engine.runtime.decode.service import Reply
from engine.serve.tools import prepare
from fleetgui.workers import TaskRunner


class _Bridge(QObject):
    """Emitted on the service's scheduler thread, delivered on the GUI thread (queued)."""

    text = Signal(int, str, int)  # request key, text piece, tokens so far
    done = Signal(int, object)  # request key, Reply
    fleet = Signal(str)  # the chat's fleet lost a node, moved layers, started a worker again
    recovered = Signal(object)  # the deployment as failover left it


class ChatController(QObject):
    status = Signal(str)  # a line for the status bar
    failed = Signal(str)  # the service could not be opened
    ready = Signal()
    service_changed = Signal(object)  # the service now open, or None before it closes
    deployment_changed = Signal(object)  # failover moved a stage: the deployment the same service runs on now
    progress = Signal(object)  # opening the service: a Progress, then None once it is open (or not)
    fleet_event = Signal(str)  # what the chat's fleet does to recover, as it happens

    def __init__(self, backend, settings, tasks: TaskRunner, parent: QObject | None = None):
        super().__init__(parent)
        self.backend = backend
        self.settings = settings
        self.tasks = tasks
        self.service = None
        self.deployment = None  # a fleet deployment the chat runs on; None: ``current_model``
        self.model: str | None = None  # the model the Chat view picked; None: the settings' default model
        self._loader = None
        self._closing = False
        self._keys = itertools.count(1)
        self._listeners: dict[int, tuple] = {}
        self._handles: dict = {}
        self._pending: list[tuple[int, list[dict], int]] = []
        self._queued_at: dict[int, float] = {}  # requests that wait for the model to start: since when
        self._startup: dict[int, float] = {}  # and, once it started, how long they waited (seconds)
        self._bridge = _Bridge()
        self._bridge.text.connect(self._on_text)
        self._bridge.done.connect(self._on_done)
        self._bridge.fleet.connect(self.fleet_event)
        backend.on_fleet_event = self._bridge.fleet.emit  # called on the service's scheduler thread
        self._bridge.recovered.connect(self._on_recovered)
        backend.on_recovered = self._bridge.recovered.emit

    # --- requests ------------------------------------------------------------------------------------

    def submit(self, messages: list[dict], max_new_tokens: int, on_text, on_done, sampling=None, tools=None) -> int:
        """Queues a reply; ``on_text(piece, tokens)`` and ``on_done(Reply)`` run on the GUI thread.
        ``sampling``: the engine's ``SamplingParams`` (None: greedy); ``tools``: the ``ToolPlan`` of
        the tools the reply may call (``engine.serve.tools``)."""
        key = next(self._keys)
        self._listeners[key] = (on_text, on_done)
        if self.service is None:
            self._pending.append((key, messages, max_new_tokens, sampling, tools))
            self._queued_at[key] = time.monotonic()
            self.open()
        else:
            self._send(key, messages, max_new_tokens, sampling, tools)
        return key

    def cancel(self, key: int | None, forget: bool = False) -> None:
        """Stops a reply (it still ends with ``on_done``, marked cancelled, unless ``forget``)."""
        if key is None:
            return
        if forget:
            self._listeners.pop(key, None)
        for i, (pending, *_) in enumerate(self._pending):
            if pending == key:
                del self._pending[i]
                self._on_done(key, Reply("", [], 0, "cancelled"))
                return
        handle = self._handles.get(key)
        if handle is not None:
            handle.cancel()

    def _send(self, key: int, messages: list[dict], max_new_tokens: int, sampling=None, tools=None) -> None:
        bridge = self._bridge
        extra = {}
        if tools is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            # tools in the prompt, earlier calls and results as the template takes them, the calls held
            # to their schemas
            messages, template_tools = prepare(messages, tools, self.service.tokenizer)
            extra = {"tools": template_tools, "grammar": tools.grammar if tools is not None else None}
        try:
            self._handles[key] = self.service.submit(
                messages, max_new_tokens, on_text=lambda piece, n: bridge.text.emit(key, piece, n),
                on_done=lambda reply: bridge.done.emit(key, reply), sampling=sampling, **extra)
        except FleetError as exc:
            self._on_done(key, Reply("", [], 0, "error", error=str(exc)))

    def _on_text(self, key: int, piece: str, tokens: int) -> None:
        listener = self._listeners.get(key)
        if listener:
            listener[0](piece, tokens)

    def _on_done(self, key: int, reply: Reply) -> None:
        self._handles.pop(key, None)
        self._queued_at.pop(key, None)
        listener = self._listeners.pop(key, None)
        if listener:
            listener[1](reply)
        self._startup.pop(key, None)

    def startup_wait(self, key: int | None) -> float | None:
        """How long request ``key`` waited for the model to start, in seconds (None: it did not wait);
        its reply's own figures (first token) count from when the model took it."""
        return self._startup.get(key)

    @property
    def current_model(self) -> str:
        """The model the chat runs when it is not on a deployment: the Chat view's pick, else the
        settings' default model (which the pick never changes)."""
        return self.model or self.settings.default_model

    def use_model(self, source: str) -> None:
        """Chat with ``source`` from now on (a catalog name, a shard folder, a GGUF file or a Hugging
        Face folder), leaving any deployment; the current service closes and the next request opens it."""
        self.model = source
        self.deployment = None
        self.close_service()

    # --- the service ---------------------------------------------------------------------------------

    @property
    def loading(self) -> bool:
        return self._loader is not None

    def open(self) -> None:
        """Opens the service off the GUI thread unless it is open or opening."""
        if self.service is not None or self._loader is not None or self._closing:
            return
        settings, backend = dataclasses.replace(self.settings, default_model=self.current_model), self.backend

        deployment = self.deployment

        def load(report, cancel):
            if deployment is not None:
                service = backend.open_deployment(settings, deployment, report, cancel)
            else:
                service = backend.open_chat(settings, report, cancel)
            if service is not None and (self._closing or cancel.is_set()):
                service.close()
                return None
            return service

        self.status.emit(f"Chat: opening {deployment.model if deployment else settings.default_model}…")
        self._loader = self.tasks.start(load, "open chat service", progressed=self._loading_progress,
                                        succeeded=self._opened, failed=self._open_failed,
                                        cancelled=lambda: self._open_failed("cancelled"))

    def _loading_progress(self, progress: Progress) -> None:
        self.progress.emit(progress)
        self.status.emit(f"Chat: {progress.text}…")

    def cancel_open(self) -> None:
        """Stops opening the service (a first-run export or pull); queued replies end as errors."""
        if self._loader is not None:
            self._loader.cancel()

    def _opened(self, service) -> None:
        self._loader = None
        self.progress.emit(None)
        if service is None:
            self._open_failed("cancelled")
            return
        self.service = service
        self.status.emit(f"Chat: {service.description}")
        self.service_changed.emit(service)
        pending, self._pending = self._pending, []
        now = time.monotonic()
        self._startup.update((key, now - self._queued_at.pop(key, now)) for key, *_ in pending)
        for key, messages, max_new_tokens, sampling, tools in pending:
            self._send(key, messages, max_new_tokens, sampling, tools)
        self.ready.emit()

    def _open_failed(self, message: str) -> None:
        self._loader = None
        self.progress.emit(None)
        self.status.emit("Chat: not connected")
        pending, self._pending = self._pending, []
        for key, *_ in pending:
            self._on_done(key, Reply("", [], 0, "error", error=f"could not start the model: {message}"))
        if message != "cancelled":
            self.failed.emit(message)

    def reconfigure(self, settings) -> None:
        """New settings: a service built on other values is closed (in the background); the next
        request opens a new one.  Another default model leaves a deployment, and the Chat view's pick,
        for that model."""
        old, self.settings = self.settings, settings
        if old.default_model != settings.default_model:
            self.deployment = None
            if self.model is not None:
                self.model = None
                self.close_service()
        if service_changes(old, settings):
            self.close_service()

    def use_deployment(self, deployment) -> None:
        """Chat on a fleet deployment from now on (None: back to the settings' model); the current
        service closes and the next request, or ``open()``, connects."""
        self.deployment = deployment
        self.close_service()

    def _on_recovered(self, deployment) -> None:
        """Failover moved a stage (to its standby, or elsewhere): the chat's deployment is the new one,
        its service unchanged."""
        if self.deployment is not None:
            self.deployment = deployment
            self.deployment_changed.emit(deployment)

    def close_service(self) -> None:
        if self._loader is not None:
            self._loader.cancel()
            self._loader = None
        service, self.service = self.service, None
        if service is not None:
            self.service_changed.emit(None)
            self.tasks.start(lambda report, cancel: service.close(), "close chat service")
            self.status.emit("Chat: not connected")

    def shutdown(self) -> None:
        """At exit: cancel everything and close the service (its workers end with it)."""
        self._closing = True
        self._listeners.clear()
        if self._loader is not None:
            self._loader.cancel()
        if self.service is not None:
            self.service_changed.emit(None)
            self.service.close()
            self.service = None
