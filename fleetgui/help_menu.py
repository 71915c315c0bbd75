"""The main window's Help menu: About (version, license, where the documentation is), Documentation
(the documentation on this PC: the built site, else the user guide's source) and Report a problem (a
summary for a problem report on the clipboard: versions, the OS, the CPU, the status line and the last
log lines, with the fleet key, the API key and the MCP servers' tokens taken out).

``HelpMenu(window)`` adds the menu to a main window's menu bar; the app's last log lines are kept from
the moment the first one is made (``RecentLog``, on the root logger)."""

from __future__ import annotations

import collections
import logging
import platform
import re
from pathlib import Path
from urllib.parse import urlsplit

from PySide6.QtCore import QObject, QUrl
from PySide6.QtGui import QAction, QDesktopServices, QKeySequence
from PySide6.QtWidgets import QApplication, QMainWindow, QMessageBox

import engine
from engine.config import paths
from engine.fleetkey import api_key_file
from engine.hostcpu import cpu_model, int8_dot
from fleetgui import keystore
from fleetgui.widgets import plain

CHECKOUT = Path(__file__).resolve().parent.parent  # the source tree this app runs from (docs/, site/)
LICENSE = "Apache-2.0"
LOG_LINES = 40  # the app's own last log lines a report carries
WORKER_LOG_LINES = 15  # and the newest worker log's
HIDDEN = "[hidden]"
# what looks like a secret wherever it appears: long hex (a fleet key), our API keys, bearer tokens,
# and the value after a word such as token, key, secret or password
LOOKS_SECRET = (re.compile(r"\b[0-9a-fA-F]{32,}\b"), re.compile(r"\bfs-[\w-]{16,}"),
                re.compile(r"(?i)\b(bearer\s+)\S+"),
                re.compile(r"(?i)\b((?:api[_-]?)?(?:token|key|secret|password|passwd)s?\b[\"']?\s*[:=]\s*[\"']?)[^\s\"',;&]+"))


class RecentLog(logging.Handler):
    """The app's last log lines, in memory (the app logs to the terminal, which an admin who started it
    from a menu never sees)."""

    def __init__(self, lines: int = LOG_LINES):
        super().__init__(logging.INFO)
        self.lines: collections.deque[str] = collections.deque(maxlen=lines)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(self.format(record))
        except Exception:  # a record that does not format: logging's own rule is never to raise
            self.handleError(record)


_recent: RecentLog | None = None


def recent_log() -> RecentLog:
    """The one ``RecentLog`` of this process, on the root logger."""
    global _recent
    if _recent is None:
        _recent = RecentLog()
        logging.getLogger().addHandler(_recent)
    return _recent


def documentation() -> Path | None:
    """The documentation on this PC: the site `make docs` built, else the user guide's source; None
    when neither came with this install (the worker bundle)."""
    for page in (CHECKOUT / "site" / "index.html", CHECKOUT / "docs" / "guide.md"):
        if page.is_file():
            return page
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return ""


def secrets_of(settings) -> list[str]:
    """The secrets this app knows of: the fleet key, the API key, and each MCP server's environment
    values, headers and the password and query of its address."""
    found = [_read(keystore.key_path(settings)), _read(api_key_file())]
    for entry in getattr(settings, "mcp_servers", []) or []:
        if not isinstance(entry, dict):
            continue
        for field in ("env", "headers"):
            values = entry.get(field)
            found += [v for v in values.values() if isinstance(v, str)] if isinstance(values, dict) else []
        url = entry.get("url") or entry.get("serverUrl")
        if isinstance(url, str) and url:
            try:
                parts = urlsplit(url)
            except ValueError:
                found.append(url)
            else:
                found += [parts.password or "", parts.query]
    return [s for s in found if len(s) >= 4]


def redact(text: str, secrets: list[str]) -> str:
    """``text`` with every known secret, and whatever looks like one, replaced by ``HIDDEN``."""
    for secret in sorted(set(secrets), key=len, reverse=True):
        text = text.replace(secret, HIDDEN)
    for pattern in LOOKS_SECRET:
        text = pattern.sub(lambda m: (m.group(1) if m.groups() else "") + HIDDEN, text)
    return text


def _openvino() -> str:
    try:
        import openvino  # deferred: the engine loads it anyway; the menu must not fail where it cannot

        return openvino.get_version()
    except Exception as exc:  # a broken install is itself worth reporting
        return f"not loaded ({type(exc).__name__}: {exc})"


def _qt() -> str:
    import PySide6  # deferred: only its version is wanted
    from PySide6 import QtCore

    return f"PySide6 {PySide6.__version__}, Qt {QtCore.qVersion()}"


def _worker_log() -> tuple[Path | None, list[str]]:
    """The newest log of a worker this PC started, and its last lines."""
    try:
        logs = sorted((paths().data / "logs").glob("*.log"), key=lambda p: p.stat().st_mtime)
    except OSError:
        return None, []
    if not logs:
        return None, []
    return logs[-1], _read(logs[-1]).splitlines()[-WORKER_LOG_LINES:]


def report(settings, status: str = "") -> str:
    """The summary a problem report carries, with no secret in it."""
    lines = [f"fleetshard {engine.__version__} ({LICENSE})",
             f"OS: {platform.platform()}",
             f"CPU: {cpu_model()}; int8 dot products: {int8_dot() or 'unknown'}",
             f"Python: {platform.python_version()}",
             f"OpenVINO: {_openvino()}",
             f"Qt: {_qt()}"]
    if status:
        lines.append(f"Status: {status}")
    lines += ["", "Last messages of the app:"]
    lines += list(recent_log().lines) or ["(none)"]
    worker, tail = _worker_log()
    if worker is not None:
        lines += ["", f"Last lines of {worker.name}:", *tail]
    return redact("\n".join(lines), secrets_of(settings)) + "\n"


class HelpMenu(QObject):
    """The Help menu of ``window`` (a main window with ``settings`` and, optionally, a ``service_label``
    whose text is the status line)."""

    def __init__(self, window: QMainWindow):
        super().__init__(window)
        self.window = window
        self.dialog: QMessageBox | None = None  # the last message this menu showed
        recent_log()
        menu = window.menuBar().addMenu("&Help")
        self.about_action = QAction("&About fleetshard", window)
        self.about_action.triggered.connect(self.about)
        self.docs_action = QAction("&Documentation", window)
        self.docs_action.setShortcut(QKeySequence.StandardKey.HelpContents)
        self.docs_action.triggered.connect(self.open_documentation)
        self.report_action = QAction("&Report a problem…", window)
        self.report_action.setToolTip("copy a summary of this PC and the app's last messages, without keys or "
                                      "tokens, to paste into a problem report")
        self.report_action.triggered.connect(self.report_problem)
        for action in (self.docs_action, self.report_action, self.about_action):
            menu.addAction(action)
        self.menu = menu

    def _show(self, title: str, text: str, details: str = "") -> QMessageBox:
        box = plain(QMessageBox(QMessageBox.Icon.Information, title, text, QMessageBox.StandardButton.Ok,
                                self.window))
        if details:
            box.setDetailedText(details)
        box.open()  # not modal to the whole app: the window keeps running while it shows
        self.dialog = box
        return box

    def about(self) -> QMessageBox:
        page = documentation()
        where = (f"On this PC: {page}" if page else
                 "It comes with the source: docs/ in the repository (`make docs` builds it as a site).")
        return self._show("About fleetshard", "\n\n".join([
            f"fleetshard {engine.__version__}",
            "One private AI chat server made of an office's own PCs: a model is cut into parts and each PC "
            "runs one.",
            f"License: {LICENSE}. OpenVINO {_openvino().split('-')[0]}.",
            f"Documentation: Help > Documentation, the user guide, the command reference and the design. {where}"]))

    def open_documentation(self) -> bool:
        """Opens the documentation on this PC in its usual program; False (and says where to find it)
        when this install has none."""
        page = documentation()
        if page is None:
            self._show("Documentation", "This install carries no documentation. It comes with the source: "
                       "docs/ in the repository (`make docs` builds it as a site).")
            return False
        return QDesktopServices.openUrl(QUrl.fromLocalFile(str(page)))

    def report_problem(self) -> str:
        label = getattr(self.window, "service_label", None)
        text = report(self.window.settings, label.text() if label is not None else "")
        QApplication.clipboard().setText(text)
        self._show("Report a problem", "A summary of this PC and the app's last messages is on the clipboard, "
                   "with the fleet key, the API key and the MCP servers' tokens taken out. Paste it into your "
                   "problem report, with what you did and what you expected.", text)
        return text
