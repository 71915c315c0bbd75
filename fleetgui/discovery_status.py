"""The Fleet view's line on why discovery finds nothing (``engine.fleet.unicast.diagnose``): no multicast
seen, client isolation likely, a firewall on a known node's port.  The diagnosis listens for multicast
for a few seconds, so it runs off the GUI thread, and at most once every ``EVERY_S`` while it is asked."""

from __future__ import annotations

import time

from PySide6.QtWidgets import QLabel, QWidget

from fleetgui.widgets import plain
from fleetgui.workers import TaskRunner

EVERY_S = 30.0  # how often the diagnosis runs again while discovery finds nothing


class DiscoveryStatus(QLabel):
    """Hidden until a diagnosis has something to say."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        plain(self)
        self.setObjectName("hint")
        self.setWordWrap(True)
        self.diagnosis = None
        self._task = None
        self._last = float("-inf")
        self.hide()

    def check(self, discovery, tasks: TaskRunner, force: bool = False) -> None:
        """Runs ``discovery.diagnose()`` (an ``engine.fleet.unicast.Discovery``) off the GUI thread, unless
        one runs or ran within ``EVERY_S`` (``force``: whatever the time)."""
        if discovery is None or self._task is not None or (not force and time.monotonic() - self._last < EVERY_S):
            return
        self._last = time.monotonic()

        def diagnose(report, cancel):
            said = discovery.diagnose(cancel=cancel.is_set)
            return None if cancel.is_set() else said  # cancelled (the app quits): half a listen says nothing

        self._task = tasks.start(diagnose, "why no nodes", succeeded=self.show_diagnosis, failed=self._failed,
                                 cancelled=self._cancelled)

    def show_diagnosis(self, diagnosis) -> None:
        self._task = None
        self.diagnosis = diagnosis
        self.setText(diagnosis.text)
        self.setVisible(bool(diagnosis.lines) and not diagnosis.found)  # found meanwhile: nothing to explain

    def _cancelled(self) -> None:
        self._task = None

    def _failed(self, message: str) -> None:
        self._task = None
        self.setText(f"Could not tell why no node is found: {message}")
        self.show()

    def clear(self) -> None:
        """Nothing to explain any more (nodes are found)."""
        self.diagnosis = None
        self.setText("")
        self.hide()
