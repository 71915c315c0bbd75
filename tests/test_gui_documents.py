"""Chat with documents in the app, over a real chain of the tiny export: a folder indexed through the
Documents panel, a question whose prompt carries the passages as numbered sources, a reply with a
"Sources" line of our own links, a click on a citation that opens the passage, a changed file noticed
when the collection is picked again; files dropped on a chat;
a window that keeps handling events (and Cancel) while 1,000 files index; and a collection removed
while a slow file is read, at once."""

from __future__ import annotations

import threading
import time

import pytest
from gui_support import open_window, screenshot, settings_store, tiny_settings
from PySide6.QtCore import QMimeData, QPoint, QPointF, Qt, QTimer, QUrl
from PySide6.QtGui import QDragEnterEvent, QDropEvent, QTextCursor
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication, QFileDialog, QInputDialog
from test_documents import make_pdf

from fleetgui.markdown import REPLY_LINK, message_html


@pytest.fixture(scope="module")
def shards(tiny_exports):
    return tiny_exports["qwen2", "2"].out


def handbook(folder):
    folder.mkdir()
    (folder / "printers.md").write_text("# Printers\n\nToner cartridges are kept in the cupboard under the Heron "
                                        "printer.\n\nA held print job is deleted after a day.\n")
    (folder / "kitchen.txt").write_text("The fridge is emptied every Friday.\n")
    make_pdf(folder / "wifi.pdf", ["Visitors join the guest network.", "The guest password is at reception."])
    return folder


def hold_file(monkeypatch, name: str, timeout_s: float) -> tuple[threading.Event, threading.Event]:
    """The indexer's read of file ``name`` waits for the second event (at most ``timeout_s``) once it
    has set the first: (reached, release)."""
    import engine.documents.collection as collection_module

    reached, release = threading.Event(), threading.Event()
    real = collection_module.read_pages

    def read(path):
        if path.endswith(name):
            reached.set()
            release.wait(timeout_s)
        return real(path)

    monkeypatch.setattr(collection_module, "read_pages", read)
    return reached, release


def anchor_point(browser, href: str) -> QPoint:
    """Where on the browser's viewport the link ``href`` is (scrolled into view)."""
    document = browser.document()
    cursor = QTextCursor(document)
    for position in range(1, document.characterCount()):
        cursor.setPosition(position)
        if cursor.charFormat().anchorHref() == href:
            cursor.setPosition(position + 1)
            browser.setTextCursor(cursor)
            browser.ensureCursorVisible()
            return browser.cursorRect(cursor).center()
    raise AssertionError(f"no link {href} in the transcript")


def test_a_folder_indexed_in_the_panel_grounds_a_reply_whose_citation_opens_the_passage(
        qtbot, gui_home, tmp_path, shards, monkeypatch):
    folder = handbook(tmp_path / "handbook")
    window = open_window(qtbot, tiny_settings(shards), settings_store(tmp_path / "s.ini"))
    panel, tab = window.chat.documents, window.chat.all_tabs()[0]
    monkeypatch.setattr(QInputDialog, "getText", staticmethod(lambda *a, **k: ("Handbook", True)))
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", staticmethod(lambda *a, **k: str(folder)))
    panel.new_button.click()
    assert panel.selected() == "Handbook"
    with qtbot.waitSignal(panel.indexed, timeout=30000) as indexed:
        panel.folder_action.trigger()
        assert panel.progress.isVisible() and panel.indexing("Handbook")
    report = indexed.args[1]
    assert (report.files, report.read, report.skipped) == (3, 3, [])
    assert not panel.progress.isVisible() and "3 files" in panel.status.text()
    assert tab.documents_picker.findData("Handbook") > 0  # every chat can pick it now

    tab.documents_picker.setCurrentIndex(tab.documents_picker.findData("Handbook"))
    sent = []
    submit = window.chat.controller.submit
    monkeypatch.setattr(window.chat.controller, "submit", lambda messages, *a, **k: sent.append(messages) or
                        submit(messages, *a, **k))
    tab.input.setPlainText("Where are the toner cartridges kept?")
    with qtbot.waitSignal(tab.finished, timeout=60000) as done:
        tab.send()
    assert not done.args[0].error
    # the prompt: our instruction and the passage, numbered, in the system message, then the question
    system = sent[0][0]
    assert system["role"] == "system"
    assert "[1] printers.md\n# Printers\n\nToner cartridges are kept" in system["content"]
    assert sent[0][-1] == {"role": "user", "content": "Where are the toner cartridges kept?"}
    reply = tab.conversation.messages[-1]
    assert [s["file"] for s in reply.stats["sources"]] == [str(folder / "printers.md")]
    assert "Sources  [1] printers.md" in tab.transcript.toPlainText()
    screenshot(window, "documents")

    anchor = anchor_point(tab.transcript, "source:1:0")
    QTest.mouseClick(tab.transcript.viewport(), Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier, anchor)
    qtbot.waitUntil(lambda: panel.passage_dialog is not None and panel.passage_dialog.isVisible(), timeout=5000)
    dialog = panel.passage_dialog
    assert dialog.windowTitle() == "Source [1]: printers.md"
    assert dialog.file.text() == str(folder / "printers.md")
    assert dialog.text.toPlainText().startswith("# Printers\n\nToner cartridges are kept in the cupboard")
    dialog.close()

    # a PDF's passage names its page; the chat's collection and the sources outlive a restart
    with qtbot.waitSignal(tab.finished, timeout=60000):
        tab.input.setPlainText("What is the guest password?")
        tab.send()
    pdf = tab.conversation.messages[-1].stats["sources"][0]
    assert (pdf["file"], pdf["page"]) == (str(folder / "wifi.pdf"), 2)
    assert "[1] wifi.pdf, page 2" in tab.transcript.toPlainText()
    tab._link(QUrl("source:3:0"))
    assert panel.passage_dialog.page.text() == "Page 2"
    panel.passage_dialog.close()
    saved = window.history.load(tab.conversation.id)
    assert saved.options["documents"] == "Handbook"
    assert saved.messages[1].stats["sources"][0]["text"].startswith("# Printers")

    # picking the collection again notices the file changed since (and reads only that one)
    (folder / "kitchen.txt").write_text("The fridge is now emptied every Thursday evening.\n")
    tab.documents_picker.setCurrentIndex(0)
    assert "documents" not in tab.conversation.options
    with qtbot.waitSignal(panel.indexed, timeout=30000) as indexed:
        tab.documents_picker.setCurrentIndex(tab.documents_picker.findData("Handbook"))
    assert (indexed.args[1].read, indexed.args[1].kept, indexed.args[1].files) == (1, 2, 3)
    assert panel.collection("Handbook").search("thursday")[0].passage.file == str(folder / "kitchen.txt")

    # a reply cannot make a citation of its own: its links stay wrapped (never ``source:``)
    assert f'href="{REPLY_LINK}source%3A1%3A0"' in message_html("[1](source:1:0)", 1)


def test_files_dropped_on_a_chat_become_its_collection(qtbot, gui_home, tmp_path):
    folder = handbook(tmp_path / "Office handbook")
    window = open_window(qtbot, tiny_settings(tmp_path / "no-model"), settings_store(tmp_path / "s.ini"))
    panel, tab = window.chat.documents, window.chat.all_tabs()[0]
    data = QMimeData()
    data.setUrls([QUrl.fromLocalFile(str(folder))])
    # as a real drag: it enters the transcript (Qt delivers a drop only after that), then drops
    enter = QDragEnterEvent(QPoint(10, 10), Qt.DropAction.CopyAction, data, Qt.MouseButton.LeftButton,
                            Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(tab.transcript.viewport(), enter)
    assert enter.isAccepted()
    drop = QDropEvent(QPointF(10, 10), Qt.DropAction.CopyAction, data, Qt.MouseButton.LeftButton,
                      Qt.KeyboardModifier.NoModifier)
    with qtbot.waitSignal(panel.indexed, timeout=30000) as indexed:
        QApplication.sendEvent(tab.transcript.viewport(), drop)
    assert drop.isAccepted() and indexed.args[0] == "Office handbook" and indexed.args[1].files == 3
    assert tab.documents_picker.currentData() == "Office handbook"
    assert tab.conversation.options["documents"] == "Office handbook"
    assert [h.passage.file for h in panel.collection("Office handbook").search("fridge")] == [
        str(folder / "kitchen.txt")]
    assert tab.input.toPlainText() == ""  # the drop did not paste the path into the message


def test_the_window_handles_events_and_cancel_while_1000_files_index(qtbot, gui_home, tmp_path, monkeypatch):
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(1000):
        (folder / f"note{i:04}.txt").write_text(f"Note {i} is about topic{i}.\n")
    window = open_window(qtbot, tiny_settings(tmp_path / "no-model"), settings_store(tmp_path / "s.ini"))
    panel = window.chat.documents
    panel.create("Notes")

    # the indexer waits at file 100 until the GUI thread has run a timer: were indexing on the GUI
    # thread, the timer could not run, the wait would time out and Cancel would come too late
    at_gate, gate = hold_file(monkeypatch, "note0100.txt", 30)
    seen = {}

    def tick():
        # once the progress the indexer posted up to file 100 has reached the bar (the GUI thread runs)
        if at_gate.is_set() and not gate.is_set() and panel.progress.bar.maximum() > 0:
            seen["bar"] = (panel.progress.isVisible(), panel.progress.bar.value(), panel.progress.step.text())
            panel.progress.cancel_button.click()
            gate.set()

    timer = QTimer()
    timer.timeout.connect(tick)
    timer.start(5)
    with qtbot.waitSignal(panel.indexed, timeout=60000) as indexed:
        panel.add("Notes", [folder])
    timer.stop()
    report = indexed.args[1]
    assert gate.is_set() and report.cancelled and report.files == 101  # notes 0 to 100: cancelled at 100
    visible, value, step = seen["bar"]
    assert visible and 0 < value < 100 and step.startswith("Indexing Notes: ") and "of 1000 files" in step

    with qtbot.waitSignal(panel.indexed, timeout=60000) as indexed:
        panel.reindex_action.trigger()
    report = indexed.args[1]
    assert not report.cancelled and (report.files, report.kept, report.read) == (1000, 101, 899)
    assert panel.collection("Notes").search("topic737")[0].passage.file == str(folder / "note0737.txt")


def test_removing_a_collection_while_a_slow_file_is_read_returns_at_once(qtbot, gui_home, tmp_path, monkeypatch):
    folder = tmp_path / "docs"
    folder.mkdir()
    for name in ("a.txt", "b.txt", "c.txt"):
        (folder / name).write_text(f"Notes in {name}.\n")
    window = open_window(qtbot, tiny_settings(tmp_path / "no-model"), settings_store(tmp_path / "s.ini"))
    panel = window.chat.documents
    panel.create("Notes")

    # b.txt reads slowly (a large PDF, a file on a share that stalls): at most 5 s, the pipe before the fix
    slow, release = hold_file(monkeypatch, "b.txt", 5)
    panel.add("Notes", [folder])
    qtbot.waitUntil(slow.is_set, timeout=10000)
    started = time.perf_counter()
    panel.remove("Notes")
    took = time.perf_counter() - started
    assert took < 0.5, f"the window waited {took:.1f} s for the indexing"
    assert panel.names() == [] and panel.list.count() == 0 and panel.selected() is None

    release.set()  # the indexing stops after the slow file, then the index goes, not rewritten
    qtbot.waitUntil(lambda: not panel.indexing(), timeout=10000)
    assert panel.library.names() == [] and not panel.library.folder("Notes").exists()
    assert panel.status.text() == "Notes: removed"
    assert panel.create("Notes") == "Notes"  # the name is free again
