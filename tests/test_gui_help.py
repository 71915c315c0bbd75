"""The Help menu: About names the version, the license and the documentation; Documentation opens the
documentation on this PC (through Qt's own URL handling, caught here: no browser, no network);
Report a problem copies a summary with the versions, the OS, the CPU and the last log lines, and
without the fleet key, the API key or an MCP server's tokens."""

from __future__ import annotations

import logging
import platform

from gui_support import open_window, settings_store, tiny_settings
from PySide6.QtCore import QObject, QUrl, Slot
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import QApplication

import engine
from engine.config import paths
from engine.fleetkey import create_key, key_file, load_api_key
from engine.hostcpu import cpu_model
from fleetgui.help_menu import CHECKOUT, HIDDEN, documentation, redact

MCP_TOKEN = "ghp_abcdefghij0123456789"
MCP_URL_TOKEN = "s3cr3t-query-value"


class Opened(QObject):
    """Catches the URLs the app asks the desktop to open."""

    def __init__(self):
        super().__init__()
        self.urls: list[QUrl] = []

    @Slot(QUrl)
    def open(self, url: QUrl) -> None:
        self.urls.append(url)


def window_with_secrets(qtbot, tmp_path):
    settings = tiny_settings(tmp_path / "none", mcp_servers=[
        {"name": "github", "command": "github-mcp", "args": [], "env": {"GITHUB_TOKEN": MCP_TOKEN}, "enabled": False},
        {"name": "search", "url": f"https://search.example/mcp?key={MCP_URL_TOKEN}", "enabled": False}])
    window = open_window(qtbot, settings, settings_store(tmp_path / "s.ini"))
    return window


def test_the_help_menu_has_about_documentation_and_report(qtbot, gui_home, tmp_path):
    window = window_with_secrets(qtbot, tmp_path)
    titles = [a.text() for a in window.menuBar().actions()]
    assert titles[-1] == "&Help"
    help_menu = window.menuBar().actions()[-1].menu()
    assert [a.text() for a in help_menu.actions()] == ["&Documentation", "&Report a problem…", "&About fleetshard"]

    window.help_menu.about_action.trigger()
    box = window.help_menu.dialog
    qtbot.waitUntil(box.isVisible)
    text = box.text()
    assert f"fleetshard {engine.__version__}" in text and "License: Apache-2.0" in text
    assert "Help > Documentation" in text and str(documentation()) in text
    box.close()


def test_documentation_opens_the_pages_on_this_pc(qtbot, gui_home, tmp_path):
    window = window_with_secrets(qtbot, tmp_path)
    opened = Opened()
    QDesktopServices.setUrlHandler("file", opened, "open")
    try:
        assert window.help_menu.open_documentation()
    finally:
        QDesktopServices.unsetUrlHandler("file")
    (url,) = opened.urls
    page = url.toLocalFile()
    assert page == str(documentation()) and page.startswith(str(CHECKOUT))
    assert page.endswith(("site/index.html", "docs/guide.md"))


def test_a_problem_report_carries_the_facts_and_no_secret(qtbot, gui_home, tmp_path):
    fleet_key = create_key(key_file()).read_text().strip()
    api_key = load_api_key(create=True)
    window = window_with_secrets(qtbot, tmp_path)
    logs = paths().data / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "worker-127.0.0.1-7401.log").write_text(f"serving upstream 127.0.0.1:50000\nkey {fleet_key} seen\n")
    log = logging.getLogger("fleetgui.test")
    log.warning("the last thing before the report: stage 1 unreachable")
    log.warning("dialling with fleet key %s and Authorization: Bearer %s", fleet_key, api_key)
    log.warning("MCP server github started with GITHUB_TOKEN=%s", MCP_TOKEN)

    assert window.service_label.text().startswith("Chat: ")
    window.help_menu.report_action.trigger()
    text = QApplication.clipboard().text()
    assert text == window.help_menu.dialog.detailedText()
    assert text.startswith(f"fleetshard {engine.__version__} (Apache-2.0)\n")
    for fact in (f"OS: {platform.platform()}", f"CPU: {cpu_model()}", "OpenVINO: 20", "Python: ",
                 f"Status: {window.service_label.text()}", "stage 1 unreachable", "worker-127.0.0.1-7401.log",
                 "serving upstream 127.0.0.1:50000"):
        assert fact in text, fact
    for secret in (fleet_key, api_key, MCP_TOKEN, MCP_URL_TOKEN):
        assert secret not in text
    assert text.count(HIDDEN) >= 4


def test_redact_takes_out_what_looks_like_a_secret():
    assert redact("token=abc123 password: hunter2 Bearer xyz", []) == \
        f"token={HIDDEN} password: {HIDDEN} Bearer {HIDDEN}"
    assert redact("served 12 tokens, max_tokens=64", []) == "served 12 tokens, max_tokens=64"
    assert redact("the key is opensesame", ["opensesame"]) == f"the key is {HIDDEN}"
