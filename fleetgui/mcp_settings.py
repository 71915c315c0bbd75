"""The MCP servers dialog of the Settings view: the servers whose tools the chat offers (a command
started over stdio, or an HTTP URL), added one by one or imported from the ``mcpServers`` JSON other
apps share (pasted or from a file), each one switched on or off, removed, or tested (its tools
listed off the GUI thread, or the error that stops it).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QDialog, QDialogButtonBox, QFileDialog, QFormLayout, QLabel, QLineEdit, QListWidget,
                               QListWidgetItem, QPlainTextEdit, QPushButton, QVBoxLayout, QWidget)

from engine.serve.mcp import McpError, McpServer, parse_mcp_servers, probe, servers_from_settings
from fleetgui.widgets import flow_bar, plain
from fleetgui.workers import Task

HELP = ("Tools from MCP servers: the chat offers them to the model and asks you before each call. "
        "A server is a command this PC starts (e.g. uvx mcp-server-time) or the URL of one that runs.")
_RUNNING: set[Task] = set()
EXAMPLE = '{"mcpServers": {"time": {"command": "uvx", "args": ["mcp-server-time"]}}}'


def summary(entries: list[dict]) -> str:
    """The servers in a line (the Settings view's row)."""
    if not entries:
        return "none"
    on = [e.get("name", "?") for e in entries if e.get("enabled", True)]
    off = len(entries) - len(on)
    return ", ".join(on) + (f" ({off} switched off)" if off else "") if on else f"{off} switched off"


class McpServersDialog(QDialog):
    """Edits a copy of the server list; ``servers()`` is the list as settings keep it."""

    tested = Signal(str)  # a test's outcome, in words

    def __init__(self, entries: list[dict], always: list[str] = (), parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("MCP servers")
        self.always = list(always)  # the tools the chat calls without asking ("server/tool#identity")
        try:
            servers = servers_from_settings(entries)
        except McpError:
            servers = []
        self.list = QListWidget()
        self.list.setToolTip("checked servers are offered to the chat")
        for server in servers:
            self._add_item(server)
        self.name = QLineEdit()
        self.name.setPlaceholderText("e.g. time")
        self.target = QLineEdit()
        self.target.setPlaceholderText("a command (uvx mcp-server-time) or a URL (http://localhost:8000/mcp)")
        self.env = QLineEdit()
        self.env.setPlaceholderText("optional: KEY=value KEY2=value for a command")
        add = QPushButton("Add")
        add.clicked.connect(self._add_clicked)
        remove = QPushButton("Remove")
        remove.clicked.connect(lambda: self.remove(self.list.currentRow()))
        import_button = QPushButton("Import mcpServers JSON…")
        import_button.setToolTip("paste (or open) the mcpServers JSON of Claude Desktop, Cursor, LM Studio or VS Code")
        import_button.clicked.connect(self.open_import)
        test = QPushButton("Test")
        test.setToolTip("start the selected server and list its tools")
        test.clicked.connect(lambda: self.test(self.list.currentRow()))
        self.status = plain(QLabel())
        self.status.setObjectName("hint")
        self.status.setWordWrap(True)
        self.tested.connect(self.status.setText)
        self.always_label = plain(QLabel())
        self.always_label.setWordWrap(True)
        self.forget = QPushButton("Ask before every call again")
        self.forget.clicked.connect(self.forget_always)
        self._show_always()
        form = QFormLayout()
        form.addRow("Name", self.name)
        form.addRow("Command or URL", self.target)
        form.addRow("Environment", self.env)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        hint = QLabel(HELP)
        hint.setObjectName("hint")
        hint.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.addWidget(hint)
        layout.addWidget(self.list, 1)
        layout.addWidget(flow_bar(test, remove, import_button)[0])
        layout.addLayout(form)
        layout.addWidget(flow_bar(add, align_right=True)[0])
        layout.addWidget(self.status)
        layout.addWidget(flow_bar(self.always_label, self.forget)[0])
        layout.addWidget(buttons)

    def _show_always(self) -> None:
        names = dict.fromkeys(key.rsplit("#", 1)[0] for key in self.always)  # "server/tool", the identity aside
        self.always_label.setText("Always allowed: " + (", ".join(names) or "none (the chat asks before every call)"))
        self.forget.setEnabled(bool(self.always))

    def forget_always(self) -> None:
        self.always = []
        self._show_always()

    def _add_item(self, server: McpServer) -> None:
        item = QListWidgetItem(f"{server.name} — {server.describe()}")
        item.setFlags(item.flags() | Qt.ItemFlag.ItemIsUserCheckable)
        item.setCheckState(Qt.CheckState.Checked if server.enabled else Qt.CheckState.Unchecked)
        item.setData(Qt.ItemDataRole.UserRole, server)
        self.list.addItem(item)

    def _names(self) -> list[str]:
        return [self.list.item(i).data(Qt.ItemDataRole.UserRole).name for i in range(self.list.count())]

    def servers(self) -> list[dict]:
        out = []
        for i in range(self.list.count()):
            item = self.list.item(i)
            server = item.data(Qt.ItemDataRole.UserRole)
            server.enabled = item.checkState() == Qt.CheckState.Checked
            out.append(server.to_json())
        return out

    def add(self, name: str, target: str, env: str = "") -> McpServer:
        """Adds a server: ``target`` a URL, or a command line (quoted as a shell would); ``env``
        ``KEY=value`` pairs.  A bad entry is an ``McpError`` saying what is wrong."""
        target = target.strip()
        if target.lower().startswith(("http://", "https://")):
            entry = {"url": target}
        else:
            try:
                words = shlex.split(target)
                pairs = shlex.split(env)
            except ValueError as exc:
                raise McpError(f"the command cannot be read: {exc}") from None
            if any("=" not in p for p in pairs):
                raise McpError("the environment is KEY=value pairs, separated by spaces")
            entry = {"command": words[0] if words else "", "args": words[1:],
                     "env": dict(p.split("=", 1) for p in pairs)}
        server = McpServer.from_json(name, entry)
        if server.name in self._names():
            raise McpError(f"there is already a server named {server.name!r}")
        self._add_item(server)
        return server

    def _add_clicked(self) -> None:
        try:
            server = self.add(self.name.text(), self.target.text(), self.env.text())
        except McpError as exc:
            self.status.setText(str(exc))
            return
        self.name.clear()
        self.target.clear()
        self.env.clear()
        self.list.setCurrentRow(self.list.count() - 1)
        self.status.setText(f"Added {server.name}: Test starts it and lists its tools.")

    def import_json(self, text: str) -> list[str]:
        """Adds the servers of an ``mcpServers`` JSON (one already listed by name is replaced);
        returns their names."""
        servers = parse_mcp_servers(text)
        for server in servers:
            for i in reversed(range(self.list.count())):
                if self.list.item(i).data(Qt.ItemDataRole.UserRole).name == server.name:
                    self.list.takeItem(i)
            self._add_item(server)
        self.status.setText(f"Imported {', '.join(s.name for s in servers)}.")
        return [s.name for s in servers]

    def open_import(self) -> QDialog:
        """A small dialog to paste the JSON into (or open it from a file)."""
        dialog = QDialog(self)
        dialog.setWindowTitle("Import mcpServers JSON")
        text = QPlainTextEdit()
        text.setPlaceholderText(EXAMPLE)
        problem = plain(QLabel())
        problem.setWordWrap(True)
        from_file = QPushButton("From file…")

        def choose():
            path, _ = QFileDialog.getOpenFileName(dialog, "mcpServers JSON", "", "JSON (*.json);;All files (*)")
            if path:
                try:
                    text.setPlainText(Path(path).read_text(encoding="utf-8"))
                except (OSError, UnicodeDecodeError) as exc:
                    problem.setText(f"cannot read {path}: {exc}")

        def accept():
            try:
                self.import_json(text.toPlainText())
            except McpError as exc:
                problem.setText(str(exc))
                return
            dialog.accept()

        from_file.clicked.connect(choose)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(accept)
        buttons.rejected.connect(dialog.reject)
        layout = QVBoxLayout(dialog)
        layout.addWidget(text, 1)
        layout.addWidget(problem)
        layout.addWidget(flow_bar(from_file, buttons)[0])
        dialog.text, dialog.problem = text, problem
        dialog.finished.connect(dialog.deleteLater)
        dialog.open()
        return dialog

    def remove(self, row: int) -> None:
        if 0 <= row < self.list.count():
            self.list.takeItem(row)

    def test(self, row: int) -> None:
        """Starts the server of ``row`` off the GUI thread and says how many tools it has, or why not."""
        if not 0 <= row < self.list.count():
            self.status.setText("Select a server to test.")
            return
        server = self.list.item(row).data(Qt.ItemDataRole.UserRole)
        self.status.setText(f"Starting {server.name}…")
        task = Task(lambda report, cancel: probe(server), f"test MCP server {server.name}")
        task.succeeded.connect(lambda tools: self._say(
            f"{server.name}: {len(tools)} tools ({', '.join(t.name for t in tools)})"))
        task.failed.connect(self._say)
        task.finished.connect(lambda: (_RUNNING.discard(task), task.deleteLater()))
        _RUNNING.add(task)  # a test outlives a dialog closed meanwhile (it ends on its timeout)
        task.start()

    def _say(self, text: str) -> None:
        try:
            self.tested.emit(text)
        except RuntimeError:  # the dialog has gone
            pass
