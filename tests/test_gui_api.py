"""The app's API switch: on, the chat's model is served as the OpenAI-compatible API and the fleet
view says where; the reply equals the chat service's own; off (in Settings), the port closes."""

from __future__ import annotations

import dataclasses
import socket

import openai
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
