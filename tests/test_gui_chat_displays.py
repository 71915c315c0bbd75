"""Issue 81's chat bugs, each on the real window offscreen: the saved-chats list follows the active
tab, "first token" names a wait for the model to start, the view does not jump when the start-up
progress row goes, and picking a model in the Chat view keeps Settings' default model, asks before
it stops a fleet deployment and lists models by name."""

from __future__ import annotations

import re
import shutil

import pytest
from gui_support import open_window, settings_store, tiny_settings

from PySide6.QtCore import QPoint, Qt
from PySide6.QtWidgets import QApplication

from engine.config import paths
from engine.fleet.deploy import LOCAL, Deployment
from engine.fleet.span import StageSpan
from engine.progress import Progress
from fleetgui.history import Message


@pytest.fixture(scope="module")
def shards(tiny_exports):
    return tiny_exports["qwen2", "2"].out


def send(qtbot, tab, text, timeout=60000):
    tab.input.setPlainText(text)
    with qtbot.waitSignal(tab.finished, timeout=timeout) as blocker:
        tab.send()
    return blocker.args[0]


def test_the_saved_chats_list_follows_the_active_tab(qtbot, gui_home, tmp_path):
    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    view, history = window.chat, window.history
    ids = [history.create(title) for title in ("First", "Second", "Third")]
    for i in ids:
        history.append(i, Message("user", "hello"))
    view.conversations_changed()
    for i in ids:
        view.open_conversation(i)

    def highlighted():
        item = view.saved.currentItem()
        return None if item is None or not item.isSelected() else item.data(Qt.ItemDataRole.UserRole)

    for i in (ids[0], ids[2], ids[1], ids[0]):
        view.tabs.setCurrentWidget(next(t for t in view.all_tabs() if t.conversation.id == i))
        assert highlighted() == i
    view.search.setText("Th")  # the list filled anew keeps following the tab
    view.search.clear()
    assert highlighted() == ids[0]
    view.new_chat()  # a chat not saved yet: no saved chat is highlighted
    assert highlighted() is None


def test_first_token_names_the_wait_for_the_model_to_start(qtbot, gui_home, tmp_path, shards):
    window = open_window(qtbot, tiny_settings(shards), settings_store(tmp_path / "s.ini"))
    tab = window.chat.all_tabs()[0]
    assert window.chat_controller.service is None  # the first message starts the model
    send(qtbot, tab, "Paris is the capital of")
    line = tab.stats.text()
    assert re.search(r"first token [\d.]+ s after the model started \(start-up [\d.]+ s\)", line), line
    assert window.history.load(tab.conversation.id).messages[-1].stats["startup_s"] >= 0
    send(qtbot, tab, "and Berlin?")  # the model is up: nothing to name
    line = tab.stats.text()
    assert re.search(r"first token \d+ ms", line) and "start-up" not in line, line


def test_the_chat_does_not_jump_when_the_start_up_progress_ends(qtbot, gui_home, tmp_path):
    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    view = window.chat

    def tops():
        QApplication.processEvents()
        return [w.mapTo(window, QPoint(0, 0)).y() for w in (view.model, view.tabs, view.saved)]

    before = tops()
    window.chat_controller.progress.emit(Progress("Exporting the model: stage 1 of 2", 0.4))
    during = tops()
    assert view.progress.isVisible() and view.progress.bar.text() == "40%"
    window.chat_controller.progress.emit(None)
    assert not view.progress.isVisible()
    assert tops() == during == before


def test_picking_a_model_keeps_the_default_asks_before_stopping_a_deployment_and_shows_names(
        qtbot, gui_home, tmp_path, shards, monkeypatch):
    import fleetgui.chat.view
    from fleetgui.running import Node

    settings = tiny_settings(shards)
    # a profile's intermediate shard set in the cache: one stage of a split, not a model to chat with
    partial = paths().shards / "qwen2-f32-1-2-0123456789"
    partial.mkdir(parents=True)
    shutil.copytree(shards / "stage0", partial / "stage0")
    window = open_window(qtbot, settings, settings_store(tmp_path / "s.ini"))
    view, controller = window.chat, window.chat_controller

    texts = [view.model.itemText(i) for i in range(view.model.count())]
    sources = [view.model.itemData(i) for i in range(view.model.count())]
    assert texts[0].endswith("— on this PC") and sources[0] == str(shards)
    assert "SmolLM2 135M — download (98 MB)" in texts or "SmolLM2 135M — on this PC" in texts
    assert not any("/" in t or "\\" in t or str(paths().shards) in t for t in texts), texts
    assert str(partial) not in sources

    # the chat runs on a fleet deployment: picking another model asks before it stops it
    deployment = Deployment("qwen2", str(shards / "stage0"), "CPU", ["10.0.0.7:7001"],
                            [{"agent": "laptop-2:7000", "worker": "w1", "stage": 1}],
                            placement=[StageSpan(LOCAL, "CPU", 0, 1), StageSpan("laptop-2:7000", "CPU", 1, 2)])
    controller.use_deployment(deployment)
    view.refresh_models()
    assert view.model.itemText(0) == "qwen2 — fleet: this PC + laptop-2"
    window.running.set_nodes([Node("Anna's laptop", "laptop-2:7000", True)])  # named as the Fleet view knows it
    view.refresh_models()
    assert view.model.itemText(0) == "qwen2 — fleet: this PC + Anna's laptop"
    stopped, answers = [], [False, True]
    monkeypatch.setattr(window.backend, "stop_deployment", lambda d, s: stopped.append(d) or [])
    monkeypatch.setattr(fleetgui.chat.view, "ask", lambda parent, title, question, action: answers.pop(0))
    smollm2 = sources.index("smollm2-135m")

    view.model.setCurrentIndex(smollm2)
    view.model.activated.emit(smollm2)  # "no": the deployment stays the chat's
    assert controller.deployment is deployment and not stopped and view.model.currentIndex() == 0

    view.model.setCurrentIndex(view.model.findData("smollm2-135m"))
    view.model.activated.emit(view.model.currentIndex())  # "yes": its workers stop, the chat switches
    qtbot.waitUntil(lambda: stopped == [deployment], timeout=10000)
    assert controller.deployment is None and controller.model == "smollm2-135m"
    assert window.settings.default_model == str(shards)  # Settings → Default model is the user's own
    assert view.model.currentData() == "smollm2-135m"



def test_the_picker_names_every_pc_a_deployment_runs_on(qtbot, gui_home, tmp_path, monkeypatch):
    """A deployment with another copy of the model and a standby: the Chat view's picker names the
    PCs of all of them, as the Fleet view names them, and so does the question before it is stopped."""
    import fleetgui.chat.view
    from engine.fleet.standby import Standby
    from fleetgui.running import Node

    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    view = window.chat
    copy = Deployment("qwen2", "", "CPU", ["laptop-3:7001"], [{"agent": "laptop-3:7000", "worker": "w2", "stage": 0}],
                      placement=[StageSpan("laptop-3:7000", "CPU", 0, 2)])
    deployment = Deployment("qwen2", "/x/stage0", "CPU", ["10.0.0.7:7001"],
                            [{"agent": "laptop-2:7000", "worker": "w1", "stage": 1}],
                            placement=[StageSpan(LOCAL, "CPU", 0, 1), StageSpan("laptop-2:7000", "CPU", 1, 2)],
                            replicas=[copy.to_json()],
                            standbys=[Standby(1, "laptop-4:7000", "w3", "laptop-4:7002").to_json()])
    window.chat_controller.use_deployment(deployment)
    view.refresh_models()
    assert view.model.itemText(0) == "qwen2 — fleet: this PC + laptop-2, a copy on laptop-3, a standby on laptop-4"
    window.running.set_nodes([Node("Anna's laptop", "laptop-3:7000", True)])
    view.refresh_models()
    assert view.model.itemText(0) == ("qwen2 — fleet: this PC + laptop-2, a copy on Anna's laptop, "
                                      "a standby on laptop-4")
    asked = []
    monkeypatch.setattr(fleetgui.chat.view, "ask", lambda parent, title, question, action: asked.append(question))
    view.choose("smollm2-135m")
    assert "(this PC + laptop-2, a copy on Anna's laptop, a standby on laptop-4)" in asked[0]

def test_a_chat_with_documents_on_a_small_model_is_offered_a_larger_one(qtbot, gui_home, tmp_path):
    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    view = window.chat
    tab = view.tabs.currentWidget()
    view.choose("smollm2-135m")
    assert not view.larger.isVisible()  # no documents: nothing to suggest
    view.documents.use(tab, view.documents.create("notes"))
    assert view.larger.isVisible() and view.larger.text() == "Use Qwen2.5 Coder 1.5B for documents"
    view.larger.click()
    assert window.chat_controller.current_model == "qwen2.5-coder-1.5b" and not view.larger.isVisible()
    assert window.settings.default_model == str(tmp_path / "none")
    view.choose("smollm2-135m")
    assert view.larger.isVisible()
    view.documents.use(tab, None)  # the chat leaves its documents
    assert not view.larger.isVisible()


def test_citation_markers_open_only_the_passages_we_indexed(qtbot, gui_home, tmp_path):
    from PySide6.QtCore import QUrl

    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    view, history = window.chat, window.history
    source = {"file": str(tmp_path / "travel.md"), "page": None, "start": 0, "score": 1.0,
              "text": "Meals on a trip are covered up to 45 euros a day."}
    reply = ("Meals are covered up to 45 euros [1]. See also [2], `rows[1]` and [the page [1]](file:///etc/passwd).")
    cid = history.create("Meals")
    history.append(cid, Message("user", "How much for meals?"))
    history.append(cid, Message("assistant", reply, {"new_tokens": 9, "stopped_by": "eos", "sources": [source]}))
    tab = view.open_conversation(cid)
    rendered = tab.transcript.toHtml()
    # the marker [1] and the Sources line link the passage; [2] names no source, code and links stay text
    assert rendered.count('href="source:1:0"') == 2 and "source:1:1" not in rendered, rendered
    assert "[2]" in tab.transcript.toPlainText() and "rows[1]" in tab.transcript.toPlainText()
    tab._link(QUrl("source:1:0"))
    dialog = view.documents.passage_dialog
    assert dialog.text.toPlainText() == source["text"] and dialog.file.text() == source["file"]
    dialog.close()


def test_a_click_on_a_citation_marker_in_the_reply_opens_its_passage(qtbot, gui_home, tmp_path):
    """Clicked with the mouse, the marker [2] in the reply's sentence (not the Sources line below it)
    opens the second passage."""
    from PySide6.QtGui import QTextCursor
    from PySide6.QtTest import QTest

    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    view, history = window.chat, window.history
    sources = [{"file": str(tmp_path / name), "page": None, "start": 0, "score": 1.0, "text": text}
               for name, text in (("travel.md", "Meals on a trip are covered up to 45 euros a day."),
                                  ("hotels.md", "Hotels are booked by the office, up to 120 euros a night."))]
    cid = history.create("Trips")
    history.append(cid, Message("user", "What is covered?"))
    history.append(cid, Message("assistant", "Meals up to 45 euros [1] and hotels up to 120 euros [2] are covered.",
                                {"new_tokens": 12, "stopped_by": "eos", "sources": sources}))
    tab = view.open_conversation(cid)
    browser = tab.transcript
    document = browser.document()
    cursor = QTextCursor(document)
    point = None
    for position in range(1, document.characterCount()):
        cursor.setPosition(position)
        if cursor.charFormat().anchorHref() == "source:1:1" and "hotels up to" in cursor.block().text():
            cursor.setPosition(position + 1)
            browser.setTextCursor(cursor)
            browser.ensureCursorVisible()
            point = browser.cursorRect(cursor).center()
            break
    assert point is not None, browser.toHtml()  # the marker in the sentence is a link
    QTest.mouseClick(browser.viewport(), Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier, point)
    qtbot.waitUntil(lambda: view.documents.passage_dialog is not None and view.documents.passage_dialog.isVisible(),
                    timeout=5000)
    dialog = view.documents.passage_dialog
    assert dialog.windowTitle() == "Source [2]: hotels.md" and dialog.text.toPlainText() == sources[1]["text"]
    dialog.close()


def test_a_question_asked_leaves_no_message_box_behind(qtbot):
    """``ask`` answers with the button clicked, and deletes its message box once answered: no box is
    left among its parent's children, one per question."""
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QMessageBox, QWidget

    from fleetgui.chat.tab import ask

    parent = QWidget()
    qtbot.addWidget(parent)

    def answer(button):
        def click():
            (box,) = [b for b in parent.findChildren(QMessageBox) if b.isVisible()]
            box.button(button).click()
        return click

    for button, said in ((QMessageBox.StandardButton.Ok, True), (QMessageBox.StandardButton.Cancel, False)):
        QTimer.singleShot(0, answer(button))
        assert ask(parent, "Stop?", "Stop the reply?", "Stop") is said
    qtbot.waitUntil(lambda: not parent.findChildren(QMessageBox), timeout=5000)
