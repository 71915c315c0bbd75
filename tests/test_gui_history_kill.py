"""Chat history survives a kill -9 of the app mid-reply: the app (a real process, offscreen) is
killed while a reply streams; the history file is whole, holds the user's message and the reply as
far as it was written, marked unfinished, and the app shows it so when it opens again."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap

from gui_support import open_window, settings_store, tiny_settings

APP = textwrap.dedent("""
    import sys, time
    from PySide6.QtWidgets import QApplication
    from PySide6.QtCore import QSettings
    app = QApplication([])
    sys.path.insert(0, {tests!r})
    from gui_support import tiny_settings
    from fleetgui.app import build_window
    window = build_window(tiny_settings({shards!r}, max_new_tokens=400),
                          store=QSettings({ini!r}, QSettings.Format.IniFormat))
    window.show()
    tab = window.chat.all_tabs()[0]
    def streamed(piece, tokens):
        if tokens >= 24:
            print("streaming", flush=True)
            time.sleep(120)  # the GUI thread holds here: the reply is still in progress when we are killed
    tab.streamed.connect(streamed)
    tab.input.setPlainText("The quick brown fox")
    tab.send()
    app.exec()
""")


def test_history_survives_a_kill_mid_reply(qtbot, gui_home, tmp_path, tiny_exports):
    shards = tiny_exports["qwen2", "2"].out
    script = APP.format(tests=os.path.dirname(__file__), shards=str(shards), ini=str(tmp_path / "s.ini"))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    try:
        assert proc.stdout.readline().strip() == "streaming"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
        proc.stdout.close()
    db = gui_home / "data" / "history.sqlite"
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        rows = conn.execute("SELECT role, content, stats FROM messages ORDER BY id").fetchall()
    assert [r[0] for r in rows] == ["user", "assistant"] and rows[0][1] == "The quick brown fox"
    assert rows[1][1] and '"unfinished": true' in rows[1][2]  # the reply so far, marked unfinished

    window = open_window(qtbot, tiny_settings(shards), settings_store(tmp_path / "s.ini"))
    window.chat.open_conversation(window.history.conversations()[0].id)
    tab = window.chat.tabs.currentWidget()
    assert rows[1][1] in tab.transcript.toPlainText()
    assert tab.stats.text() == "interrupted: the app closed before this reply ended"
