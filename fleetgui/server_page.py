"""The API server page (a page of the sidebar, like LM Studio's Developer tab): whether the
OpenAI-compatible API runs, Start and Stop, its URL and API key to copy, the address it listens on
(an address it cannot serve on is said beside the field, and the API stays where it was), the
requests it answered, and an example ``curl`` command for the chat endpoint with the real URL and
model name.

It reads the window's ``ApiController`` (``fleetgui.api``), and asks for a change of settings
through ``saved``, as the Settings page does.  The request log is the server's own
(``engine.serve.request_log``), read a few times a second while it runs; what clients sent is
their text, shown as plain text only.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import time

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (QApplication, QCheckBox, QFormLayout, QHeaderView, QLabel, QLineEdit,
                               QPlainTextEdit, QPushButton, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget)

from engine.fleetkey import api_key_file
from fleetgui.api import FAILED, RUNNING, STARTING, STOPPED
from fleetgui.widgets import Banner, field_row, plain, spin_box

POLL_MS = 500  # how often the request log is read while the API runs
COLUMNS = ("Time", "Method", "Path", "Status", "Duration", "Client")
STATES = {RUNNING: "Running", STARTING: "Starting", STOPPED: "Stopped", FAILED: "Error"}


def curl_example(url: str, model: str, key: bool) -> str:
    """A ``curl`` command that asks the API's chat endpoint one question; ``key``: it sends the API
    key, read from its file."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say hello in one sentence."}]})
    lines = [f"curl {url}/chat/completions", '-H "Content-Type: application/json"']
    if key:
        lines.append(f'-H "Authorization: Bearer $(cat {shlex.quote(str(api_key_file()))})"')
    lines.append(f"-d {shlex.quote(body)}")
    return " \\\n  ".join(lines)


class ServerPage(QWidget):
    saved = Signal(object)  # GuiSettings: the API switched on or off, or moved to another address

    def __init__(self, api, settings, parent: QWidget | None = None):
        super().__init__(parent)
        self.api = api
        self.settings = settings
        self._log = None  # the request log shown (a new server has a new one)
        self._seen = 0  # the number of the last request shown
        self.banner = Banner()

        title = QLabel("API server")
        title.setObjectName("hint")
        intro = QLabel("Other programs on this PC (or, with the API key, in the office) can use the chat's model "
                       "through this address, as they would use OpenAI's API.")
        intro.setWordWrap(True)
        self.state = plain(QLabel())  # the state, and its error (a server's words)
        self.state.setWordWrap(True)
        self.state.setObjectName("serverState")
        self.start_button = QPushButton("Start")
        self.start_button.setObjectName("primary")
        self.start_button.clicked.connect(self.toggle)

        self.url = QLineEdit()
        self.url.setReadOnly(True)
        self.copy_url = QPushButton("Copy")
        self.copy_url.setToolTip("copy the URL")
        self.copy_url.clicked.connect(lambda: self._copy(self.url.text(), "URL"))
        self.key = QLineEdit()
        self.key.setReadOnly(True)
        self.key.setEchoMode(QLineEdit.EchoMode.Password)
        self.show_key = QCheckBox("Show")
        self.show_key.toggled.connect(lambda on: self.key.setEchoMode(
            QLineEdit.EchoMode.Normal if on else QLineEdit.EchoMode.Password))
        self.copy_key = QPushButton("Copy")
        self.copy_key.setToolTip("copy the API key")
        self.copy_key.clicked.connect(lambda: self._copy(self.api.api_key or "", "API key"))
        self.key_note = QLabel()
        self.key_note.setObjectName("hint")
        self.key_note.setWordWrap(True)

        self.host = QLineEdit()
        self.host.setPlaceholderText("127.0.0.1: this PC only; 0.0.0.0: the office (needs the API key)")
        self.port = spin_box(0, 65535, 8000)
        self.apply_button = QPushButton("Apply")
        self.apply_button.setToolTip("serve on this address (the API moves only once the new address works)")
        self.apply_button.clicked.connect(self.apply_address)
        self.address_error = plain(QLabel())  # why the API could not serve there (it quotes the address)
        self.address_error.setObjectName("apiError")
        self.address_error.setWordWrap(True)
        self.address_error.hide()

        form = QFormLayout()
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        form.addRow("Status", field_row(self.state, self.start_button))
        form.addRow("URL", field_row(self.url, self.copy_url))
        form.addRow("API key", field_row(self.key, self.show_key, self.copy_key))
        form.addRow("", self.key_note)
        form.addRow("Address", field_row(self.host, self.port, self.apply_button))
        form.addRow("", self.address_error)

        self.requests = QTableWidget(0, len(COLUMNS))
        self.requests.setObjectName("requests")
        self.requests.setHorizontalHeaderLabels(COLUMNS)
        self.requests.verticalHeader().hide()
        self.requests.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.requests.setSelectionBehavior(QTableWidget.SelectionBehavior.SelectRows)
        self.requests.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.requests.horizontalHeader().setSectionResizeMode(2, QHeaderView.ResizeMode.Stretch)
        self.requests.itemSelectionChanged.connect(self._show_body)
        self.body = plain(QLabel())  # the chosen request's body: the client's text, never markup
        self.body.setWordWrap(True)
        self.body.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.body.setObjectName("requestBody")
        self.bodies: list[str] = []  # per row of the table

        self.curl = QPlainTextEdit()
        self.curl.setReadOnly(True)
        self.curl.setMaximumHeight(self.fontMetrics().lineSpacing() * 6)
        self.copy_curl = QPushButton("Copy")
        self.copy_curl.setToolTip("copy the command")
        self.copy_curl.clicked.connect(lambda: self._copy(self.curl.toPlainText(), "command"))

        layout = QVBoxLayout(self)
        layout.addWidget(title)
        layout.addWidget(self.banner)
        layout.addWidget(intro)
        layout.addLayout(form)
        layout.addWidget(QLabel("Try it: ask the chat endpoint from a terminal"))
        layout.addLayout(field_row(self.curl, self.copy_curl))
        layout.addWidget(QLabel("Requests (the latest last)"))
        layout.addWidget(self.requests, 1)
        layout.addWidget(self.body)

        self.timer = QTimer(self)
        self.timer.setInterval(POLL_MS)
        self.timer.timeout.connect(self.read_log)
        api.changed.connect(self.refresh)
        self.apply_settings(settings)

    # --- what the API does ----------------------------------------------------------------------------

    def refresh(self) -> None:
        """Shows the API's state, URL, key, address error and example."""
        api = self.api
        state = api.state
        words = {RUNNING: f"Running: {api.model_id}",
                 STARTING: "Starting: waiting for the chat's model",
                 STOPPED: "Stopped",
                 FAILED: f"Error: {api.error}"}[state]
        self.state.setText(words)
        self.state.setProperty("state", state)
        on = state in (RUNNING, STARTING)
        self.start_button.setText("Stop" if on else "Start")
        self.url.setText(api.url)
        self.copy_url.setEnabled(bool(api.url))
        key = api.api_key
        self.key.setText(key or "")
        self.key.setEnabled(bool(key))
        self.show_key.setEnabled(bool(key))
        self.copy_key.setEnabled(bool(key))
        if state != RUNNING:
            self.key_note.setText("")
        elif key:
            self.key_note.setText(f"Clients send this key as a bearer token; it is kept in {api_key_file()}.")
        else:
            self.key_note.setText("None needed: the API answers programs on this PC only.")
        self.key_note.setHidden(not self.key_note.text())
        moved = state == RUNNING and api.error
        self.address_error.setText(api.error if moved or state == FAILED else "")
        self.address_error.setHidden(not self.address_error.text())
        if state == RUNNING:
            self.curl.setPlainText(curl_example(api.url, api.model_id, bool(key)))
        else:
            self.curl.setPlainText("Start the API to see a command that asks it a question.")
        self.copy_curl.setEnabled(state == RUNNING)
        if api.requests is not self._log:
            self._log, self._seen = api.requests, 0
            self.requests.setRowCount(0)
            self.bodies.clear()
            self.body.clear()
        if state == RUNNING:
            self.timer.start()
        else:
            self.timer.stop()
        self.read_log()

    def read_log(self) -> None:
        """Adds the requests the server logged since the last read; the table keeps as many as the
        log does (its oldest rows go)."""
        if self._log is None:
            return
        new = self._log.since(self._seen)
        if not new:
            return
        self._seen = new[-1].number
        for entry in new:
            row = self.requests.rowCount()
            self.requests.insertRow(row)
            status = "—" if entry.status is None else str(entry.status)
            cells = (time.strftime("%H:%M:%S", time.localtime(entry.at)), entry.method, entry.path, status,
                     f"{entry.duration_ms:.0f} ms", entry.client)
            for column, text in enumerate(cells):
                self.requests.setItem(row, column, QTableWidgetItem(text))
            self.bodies.append(entry.body)
        excess = self.requests.rowCount() - self._log.kept
        for _ in range(max(0, excess)):
            self.requests.removeRow(0)
            self.bodies.pop(0)
        self.requests.scrollToBottom()

    def _show_body(self) -> None:
        rows = self.requests.selectionModel().selectedRows()
        body = self.bodies[rows[0].row()] if rows and rows[0].row() < len(self.bodies) else ""
        self.body.setText(f"Request body:\n{body}" if body else "")

    # --- changing it ----------------------------------------------------------------------------------

    def toggle(self) -> None:
        """Start or Stop: switches the API on or off (kept in the settings, so it starts with the app)."""
        on = self.api.state in (RUNNING, STARTING)
        self.saved.emit(dataclasses.replace(self.settings, api_enabled=not on))

    def apply_address(self) -> None:
        host = self.host.text().strip()
        if not host:
            self.address_error.setText("Give an address, like 127.0.0.1 (this PC only) or 0.0.0.0 (the office).")
            self.address_error.show()
            return
        self.saved.emit(dataclasses.replace(self.settings, api_host=host, api_port=self.port.value()))

    def apply_settings(self, settings) -> None:
        self.settings = settings
        self.host.setText(settings.api_host)
        self.port.setValue(settings.api_port)
        self.refresh()

    def _copy(self, text: str, what: str) -> None:
        QApplication.clipboard().setText(text)
        self.banner.info(f"Copied the {what}.")
