"""The Fleet view's "Join code…" dialog: the ways to find the fleet where multicast does not pass
(``engine.fleet.unicast``).  It shows this fleet's join code (this PC's addresses and agent port, and
the fleet's id, never the key) to copy to the other PCs, takes a code pasted from another PC, and
scans this PC's subnet for agents that prove the fleet key.  Whatever it finds joins the settings'
known nodes, which discovery dials; the dialling and the scan run off the GUI thread."""

from __future__ import annotations

from typing import Callable

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QApplication, QDialog, QDialogButtonBox, QGroupBox, QLabel, QLineEdit, QPushButton,
                               QVBoxLayout, QWidget)

from engine.config import FleetAccess
from engine.errors import FleetError
from engine.fleet.unicast import AGENT_PORT, join, join_code, scan
from fleetgui.widgets import field_row, plain
from fleetgui.workers import TaskRunner


class JoinCodeDialog(QDialog):
    """``fleet_access()`` gives the fleet access (``engine.config.FleetAccess``: the key and its TLS
    contexts), raising FleetError when there is no key; ``known_changed`` fires when a code or a scan
    added known nodes, after ``learned`` said which and how."""

    known_changed = Signal()
    learned = Signal(str, list)  # how ("join code", "subnet scan"), the addresses it added to the known nodes

    def __init__(self, fleet_access: Callable[[], FleetAccess], tasks: TaskRunner, port: int = AGENT_PORT,
                 parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Join code")
        self._fleet_access, self.tasks, self.port = fleet_access, tasks, port
        self._task = None

        self.code = QLineEdit()
        self.code.setReadOnly(True)
        self.copy_button = QPushButton("Copy")
        self.copy_button.clicked.connect(self.copy)
        ours = QGroupBox("This fleet's join code")
        ours_layout = QVBoxLayout(ours)
        note = QLabel("Paste it on the other PCs of the fleet (Fleet view, Join code…) where mDNS does not find "
                      "them. It holds this PC's addresses and the fleet's id, never the key: a PC needs the "
                      "fleet key file as well.")
        note.setObjectName("hint")
        note.setWordWrap(True)
        ours_layout.addWidget(note)
        ours_layout.addLayout(field_row(self.code, self.copy_button))

        self.pasted = QLineEdit()
        self.pasted.setPlaceholderText("FS-… copied on another PC of the fleet")
        self.join_button = QPushButton("Add")
        self.join_button.clicked.connect(self.join)
        self.pasted.returnPressed.connect(self.join)
        theirs = QGroupBox("Add a PC by its join code")
        QVBoxLayout(theirs).addLayout(field_row(self.pasted, self.join_button))

        self.scan_button = QPushButton("Scan this network")
        self.scan_button.setToolTip(f"dial port {port} on every address of this PC's subnet (254 at most); the "
                                    "nodes that prove the fleet key are added")
        self.scan_button.clicked.connect(self.scan)
        self.outcome = plain(QLabel())
        self.outcome.setWordWrap(True)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)

        layout = QVBoxLayout(self)
        layout.addWidget(ours)
        layout.addWidget(theirs)
        layout.addWidget(self.scan_button)
        layout.addWidget(self.outcome)
        layout.addWidget(buttons)
        self._show_code()

    def _show_code(self) -> None:
        try:
            self.code.setText(join_code(self._fleet_access().key, port=self.port))
            self.copy_button.setEnabled(True)
        except FleetError as exc:
            self.code.setText("")
            self.copy_button.setEnabled(False)
            self.outcome.setText(f"No join code: {exc}")

    def copy(self) -> None:
        QApplication.clipboard().setText(self.code.text())
        self.outcome.setText("Join code copied.")

    def _busy(self, busy: bool) -> None:
        self.join_button.setEnabled(not busy)
        self.scan_button.setEnabled(not busy)

    def join(self) -> None:
        """Adds the pasted code's addresses to the known nodes and dials them, off the GUI thread."""
        text = self.pasted.text().strip()
        access = self._begin("Dialling the PC the code names…") if text else None
        if access is not None:
            self._task = self.tasks.start(lambda report, cancel: join(text, access), "join code",
                                          succeeded=self._joined, failed=self._failed)

    def _begin(self, doing: str) -> FleetAccess | None:
        """The fleet access for a dial or a scan about to start, with ``doing`` said; None when one is
        under way already, or the key cannot be read (said instead)."""
        if self._task is not None:
            return None
        try:
            access = self._fleet_access()
        except FleetError as exc:
            self.outcome.setText(str(exc))
            return None
        self._busy(True)
        self.outcome.setText(doing)
        return access

    def _joined(self, result) -> None:
        self._task = None
        self._busy(False)
        code, reached = result
        proved = [r for r in reached if r.proved]
        if proved:
            names = ", ".join(f"{r.name or r.node_id} at {r.address}" for r in proved)
            self.outcome.setText(f"Found {names}: it proved the fleet key and joins the fleet view.")
            self.pasted.clear()
        else:
            said = "; ".join(f"{r.address}: {_outcome(r.outcome)}" for r in reached)
            self.outcome.setText(f"Kept {', '.join(code.agents)}; that PC counts once its agent answers ({said}).")
        self.learned.emit("join code", list(code.agents))
        self.known_changed.emit()

    def scan(self) -> None:
        """Scans this PC's subnet, off the GUI thread (30 s at most, cancelled with the app)."""
        port = self.port
        access = self._begin(f"Scanning this PC's subnet on port {port}…")
        if access is not None:
            self._task = self.tasks.start(lambda report, cancel: scan(access, port=port, cancel=cancel.is_set),
                                          "scan the subnet", succeeded=self._scanned, failed=self._failed)

    def _scanned(self, done) -> None:
        self._task = None
        self._busy(False)
        where = ", ".join(done.networks) or "no network"
        if done.found:
            names = ", ".join(f"{r.name or r.node_id} at {r.address}" for r in done.found)
            self.outcome.setText(f"Scanned {where}: found {names}.")
            self.learned.emit("subnet scan", [r.address for r in done.found])
            self.known_changed.emit()
        else:
            self.outcome.setText(f"Scanned {where}: no agent there proved the fleet key"
                                 + (f" ({done.dialled} of {done.planned} addresses in time)." if done.cut_short
                                    else "."))

    def _failed(self, message: str) -> None:
        self._task = None
        self._busy(False)
        self.outcome.setText(message)


def _outcome(outcome: str) -> str:
    return {"refused": "no agent runs there", "timeout": "no answer", "unreachable": "no route to it",
            "key": "it holds another fleet key", "stalled": "it did not finish the handshake"}.get(outcome, outcome)
