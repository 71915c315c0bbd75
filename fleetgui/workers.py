"""Running engine work off the GUI thread.

A ``Task`` runs one callable ``fn(report, cancel)`` on its own QThread: ``report(payload)`` (an
``engine.progress.Progress``, mostly) becomes the ``progressed`` signal and ``cancel`` is a
``threading.Event`` the engine polls (``is_set()``).  Its outcome arrives as ``succeeded(result)``,
``failed(message)`` or ``cancelled()``, queued to the GUI thread.  Errors become messages a person
can read; tracebacks go to the log only.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Callable

from PySide6.QtCore import QObject, QThread, QTimer, Signal

from engine.errors import FleetError

log = logging.getLogger(__name__)


def describe_error(exc: BaseException) -> str:
    """A message for a person: the engine's own errors say what happened; anything else is named
    by its type (the traceback goes to the log)."""
    if isinstance(exc, FleetError):
        return str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}" + (f": {exc.filename}" if exc.filename else "")
    return f"unexpected error ({type(exc).__name__}): {exc}"


class Task(QThread):
    progressed = Signal(object)
    succeeded = Signal(object)
    failed = Signal(str)
    cancelled = Signal()

    def __init__(self, fn: Callable[[Callable[[object], None], threading.Event], object], name: str = "task",
                 parent: QObject | None = None):
        super().__init__(parent)
        self.setObjectName(name)
        self._fn = fn
        self.cancel_event = threading.Event()

    def cancel(self) -> None:
        self.cancel_event.set()

    def run(self) -> None:
        try:
            result = self._fn(self.progressed.emit, self.cancel_event)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the GUI as a message
            if self.cancel_event.is_set():
                self.cancelled.emit()
                return
            if not isinstance(exc, FleetError):
                log.error("%s failed", self.objectName(), exc_info=exc)
            self.failed.emit(describe_error(exc))
            return
        if self.cancel_event.is_set() and result is None:
            self.cancelled.emit()
        else:
            self.succeeded.emit(result)


class TaskRunner(QObject):
    """Starts tasks, keeps them alive while they run, and cancels and waits for them at shutdown."""

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self._tasks: set[Task] = set()

    def start(self, fn, name: str = "task", *, progressed=None, succeeded=None, failed=None,
              cancelled=None) -> Task:
        task = Task(fn, name)
        for outcome, slot in ((task.progressed, progressed), (task.succeeded, succeeded), (task.failed, failed),
                              (task.cancelled, cancelled)):
            if slot is not None:
                outcome.connect(slot)
        task.finished.connect(lambda: self._forget(task))
        self._tasks.add(task)
        task.start()
        return task

    def _forget(self, task: Task) -> None:
        self._tasks.discard(task)
        task.deleteLater()

    @property
    def running(self) -> int:
        return sum(1 for t in self._tasks if t.isRunning())

    def shutdown(self, timeout_ms: int = 15000) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            task.wait(timeout_ms)


def on_signals(app, action: Callable[[], None], interval_ms: int = 300) -> None:
    """Runs ``action`` on the GUI thread at SIGINT or SIGTERM (Ctrl+C, ``kill``), so the app can end
    cleanly.  Python runs signal handlers only between bytecodes: a timer lets it in now and then."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: action())
    wake = QTimer(app)
    wake.timeout.connect(lambda: None)
    wake.start(interval_ms)
