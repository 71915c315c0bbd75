"""The app's API switch: on, the chat's model is served as the OpenAI-compatible API and the fleet
view says where; the reply equals the chat service's own; off (in Settings), the port closes."""

from __future__ import annotations

import dataclasses
import json
import socket

import openai
import pytest
from gui_support import open_window, settings_store, tiny_settings


def _refused(url: str) -> bool:
    host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return False
    except ConnectionRefusedError:
        return True


def test_the_api_switch_serves_the_chat_model_and_stops(qtbot, gui_home, tmp_path, tiny_exports):
    shards = tiny_exports["llama", "2"].out
    window = open_window(qtbot, tiny_settings(shards, api_enabled=True, api_port=0), settings_store(tmp_path / "s.ini"))
    label = window.fleet.api_label
    qtbot.waitUntil(lambda: "serving" in label.text(), timeout=60000)
    url = label.text().split(" at ")[1].split(";")[0]
    model = window.api.server.model_id
    messages = [{"role": "user", "content": "The quick brown fox"}]
    want = window.chat_controller.service.submit(messages, 12).wait(60)
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    got = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    assert got.choices[0].message.content == want.text

    dialog = window.open_settings()
    assert dialog.api_enabled.isChecked()
    dialog.api_enabled.setChecked(False)
    dialog.accept()
    assert label.text().startswith("API: off") and window.api.server is None and _refused(url)
    assert window.chat_controller.service is not None  # the chat keeps its model

    window.apply_settings(dataclasses.replace(window.settings, api_enabled=True))
    qtbot.waitUntil(lambda: "serving" in label.text(), timeout=30000)
    window.apply_settings(dataclasses.replace(window.settings, default_model=str(tiny_exports["qwen2", "2"].out)))
    # another model closes the chat's service: the API waits for the new one, then serves it
    qtbot.waitUntil(lambda: "serving" in label.text() and window.api.server.model_id != model, timeout=60000)


def test_an_address_this_pc_lacks_keeps_the_api_serving_where_it_was(qtbot, gui_home, tmp_path, tiny_exports):
    """Saving an API address this PC does not have binds nothing and stops nothing: the API keeps
    serving at its old address, the settings keep that address, and the error stands beside the
    address field, not a "Settings saved"."""
    shards = tiny_exports["llama", "2"].out
    window = open_window(qtbot, tiny_settings(shards, api_enabled=True, api_port=0), settings_store(tmp_path / "s.ini"))
    qtbot.waitUntil(lambda: window.api.server is not None, timeout=60000)
    server, url = window.api.server, window.api.server.url

    page = window.open_settings()
    page.api_host.setText("192.0.2.1")  # TEST-NET-1, never an address of this PC (bound to, never sent to)
    page.accept()
    assert window.api.server is server and not _refused(url)  # the old address keeps serving
    assert window.settings.api_host == "127.0.0.1"  # and stays the one in force
    assert "192.0.2.1" in page.api_error.text() and not page.api_error.isHidden()
    assert window.server_page.address_error.text() == page.api_error.text()  # and on the API server page
    assert window.statusBar().currentMessage() != "Settings saved"
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [server.model_id]

    page.api_host.setText("127.0.0.1")
    page.accept()  # a good address again: the error goes
    assert page.api_error.isHidden() and window.api.server is not None


def test_the_server_page_starts_stops_copies_and_logs_real_requests(qtbot, gui_home, tmp_path, tiny_exports):
    """The API server page: its state in words, the URL to copy, a curl example that works as
    shown, every request in the log (method, path, status, duration, client), a client's body shown
    as the text it is, and Stop and Start."""
    import subprocess

    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QApplication

    shards = tiny_exports["llama", "2"].out
    window = open_window(qtbot, tiny_settings(shards, api_enabled=True, api_port=0), settings_store(tmp_path / "s.ini"))
    page = window.show_view("API server")
    qtbot.waitUntil(lambda: page.state.text().startswith("Running"), timeout=60000)
    url, model = window.api.server.url, window.api.server.model_id
    assert page.url.text() == url and page.start_button.text() == "Stop"
    assert not page.copy_key.isEnabled() and "this PC only" in page.key_note.text()  # loopback: no key
    page.copy_url.click()
    assert QApplication.clipboard().text() == url

    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    hostile = "<img src=file:///dev/zero> <b>bold</b>"
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": hostile}], max_tokens=3)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    command = page.curl.toPlainText()
    assert url in command and model in command
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and json.loads(done.stdout)["object"] == "chat.completion", done.stderr

    qtbot.waitUntil(lambda: page.requests.rowCount() >= 3, timeout=10000)
    rows = [[page.requests.item(r, c).text() for c in range(page.requests.columnCount())]
            for r in range(page.requests.rowCount())]
    assert [(r[1], r[2], r[3]) for r in rows] == [("POST", "/v1/chat/completions", "200"),
                                                  ("GET", "/v1/models/no-such-model", "404"),
                                                  ("POST", "/v1/chat/completions", "200")]
    assert all(r[4].endswith(" ms") and r[5] == "127.0.0.1" for r in rows)
    page.requests.selectRow(0)
    assert page.body.textFormat() == Qt.TextFormat.PlainText and hostile in page.body.text()

    page.start_button.click()  # Stop
    assert page.state.text() == "Stopped" and _refused(url) and not window.settings.api_enabled
    assert page.start_button.text() == "Start" and not page.copy_curl.isEnabled()
    page.start_button.click()  # Start again
    qtbot.waitUntil(lambda: page.state.text().startswith("Running"), timeout=60000)
    assert window.settings.api_enabled and page.requests.rowCount() == 0  # a new server, a new log


def test_the_request_log_keeps_the_latest():
    from engine.serve.request_log import BODY_CHARS, RequestLog

    log = RequestLog(kept=3)
    for i in range(5):
        log.add("POST", f"/v1/{i}", 200, 0.0, "127.0.0.1", b"x" * (BODY_CHARS + 10))
    kept = log.since()
    assert [e.number for e in kept] == [3, 4, 5] and [e.number for e in log.since(4)] == [5]
    assert all(len(e.body) == BODY_CHARS for e in kept) and log.kept == 3
