"""The app keeps chatting when its fleet loses a worker: the embedded local fleet (a node agent
process and its stage worker) has its worker killed, the next reply still comes, and the window
says what happened (status bar and the chat's banner)."""

from __future__ import annotations

import os
import signal

import psutil
from gui_support import open_window, settings_store, tiny_settings


def _send(qtbot, tab, text):
    tab.input.setPlainText(text)
    with qtbot.waitSignal(tab.finished, timeout=120000) as blocker:
        tab.send()
    return blocker.args[0]


def test_a_killed_worker_is_started_again_and_the_window_says_so(qtbot, gui_home, tmp_path, tiny_models):
    settings = tiny_settings(tiny_models["qwen2"], local_workers=True, max_new_tokens=24, mode="exact")
    window = open_window(qtbot, settings, settings_store(tmp_path / "s.ini"))
    events: list[str] = []
    window.chat_controller.fleet_event.connect(events.append)
    tab = window.chat.all_tabs()[0]
    first = _send(qtbot, tab, "The quick brown fox")
    assert first.error is None and window.service_label.text().endswith("local fleet")

    workers = [p for p in psutil.Process(os.getpid()).children(recursive=True) if "worker" in p.cmdline()]
    assert len(workers) == 1
    os.kill(workers[0].pid, signal.SIGKILL)
    again = _send(qtbot, window.chat.new_chat(), "The quick brown fox")  # a new chat: the same conversation
    assert again.error is None and again.rerouted == 1, (again.error, events)
    assert again.tokens == first.tokens  # the same conversation, greedy: the same reply
    assert any("starting its worker again" in e for e in events) and events[-1].startswith("placed: part 1")
    assert window.statusBar().currentMessage().startswith("Fleet: placed")
    assert window.chat.banner.message.startswith("Fleet: placed")
