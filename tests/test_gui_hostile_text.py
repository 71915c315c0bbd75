"""Text from elsewhere is shown as written: node names, file names, MCP servers' and workers' errors
and model output reach labels, message boxes, tooltips, tables and the status bar, and none of them
takes it for markup (an ``<img>`` in a file's name or a server's error loaded a local file, and
/dev/zero killed the app)."""

from __future__ import annotations

import sys

from gui_support import open_window, settings_store, tiny_settings
from PySide6.QtCore import QModelIndex, QTimer, QUrl
from PySide6.QtGui import Qt, QTextDocument
from PySide6.QtWidgets import QAbstractItemView, QApplication, QLabel, QMessageBox, QWidget

from engine.serve.mcp import McpServer
from fleetgui.fleet_view import NodeRow
from fleetgui.markdown import REPLY_LINK

MARK = "nonexistent"  # in every hostile text here: how the walk tells a widget that holds one
HOSTILE = "<img src=file:///nonexistent/x.png><b>bold</b> <a href='delete:0'>link</a>"
FILE_NAME = "<img src=file:&#47;&#47;&#47;nonexistent&#47;x.png>.txt"  # a file name cannot hold "/"
FAILING_SERVER = f"import sys; print({HOSTILE!r}, file=sys.stderr); sys.exit(3)"  # an MCP server that dies


class Spy(QTextDocument):
    def __init__(self):
        super().__init__()
        self.asked: list[str] = []

    def loadResource(self, kind, name):  # noqa: N802 (Qt's name)
        self.asked.append(name.toString())
        return super().loadResource(kind, name)


def shown_as_written(tip: str) -> str:
    """A tooltip of ``tip``, laid out as QToolTip does (rich text when Qt guesses it is), shows the
    markup as text and asks for no resource; returns the text shown."""
    document = Spy()
    if Qt.mightBeRichText(tip):
        document.setHtml(tip)
    else:
        document.setPlainText(tip)
    document.size()  # laid out: an image would be loaded here
    assert document.asked == [], (tip, document.asked)
    assert "<img src=file:" in document.toPlainText(), tip
    return document.toPlainText()


def indexes(model, parent=QModelIndex()):
    """Every index of ``model`` (a list's model has no public column count: columns go while they exist)."""
    for row in range(model.rowCount(parent)):
        column = 0
        while model.hasIndex(row, column, parent):
            index = model.index(row, column, parent)
            yield index
            yield from indexes(model, index)
            column += 1


def walk() -> set:
    """Checks every widget of every window that holds hostile text: a label or message box shows it as
    plain text, a tooltip (a widget's, or an item's in a view) as written; returns the widgets checked."""
    checked = set()
    for top in QApplication.topLevelWidgets():
        for widget in [top, *top.findChildren(QWidget)]:
            if isinstance(widget, (QLabel, QMessageBox)) and MARK in widget.text():
                assert widget.textFormat() == Qt.TextFormat.PlainText, (type(widget).__name__, widget.text())
                checked.add(widget)
            if MARK in widget.toolTip():
                shown_as_written(widget.toolTip())
                checked.add(widget)
            if isinstance(widget, QAbstractItemView) and widget.model() is not None:
                for index in indexes(widget.model()):
                    tip = index.data(Qt.ItemDataRole.ToolTipRole)
                    if isinstance(tip, str) and MARK in tip:
                        shown_as_written(tip)
                        checked.add(widget)
    return checked


def test_remote_text_shows_as_written_in_every_widget(qtbot, gui_home, tmp_path):
    from fleetgui.tray import WorkerController, WorkerWindow

    failing = McpServer("fragile", sys.executable, ["-c", FAILING_SERVER])
    window = open_window(qtbot, tiny_settings(tmp_path / "none", mcp_servers=[failing.to_json()]),
                         settings_store(tmp_path / "s.ini"))
    chat, fleet, panel = window.chat, window.fleet, window.chat.documents
    tab = chat.all_tabs()[0]

    # an MCP server's error: the chat's banner, and the tools button's tooltip
    qtbot.waitUntil(lambda: MARK in chat.banner.message, timeout=30000)
    assert {chat.banner.text, tab.tools.mode} <= walk()

    # nodes: one unreachable with its error, one holding a shard of a model named in markup
    fleet.model._append(NodeRow(key="a", name=HOSTILE, error=HOSTILE))
    fleet.model._append(NodeRow(key="b", name=HOSTILE, node_id="ab" * 8,
                                shards=[{"hash": "h", "layers": [0, 2], "model": HOSTILE, "bytes": 1}]))
    fleet.table.selectRow(len(fleet.model.rows) - 1)
    box = fleet._ask_prune()  # "Remove 1 shard(s) … from NAME?"
    fleet.rtt_table.show_matrix({"local": "this PC", "b": HOSTILE}, {("local", "b"): 1.5})
    assert fleet.rtt_table.horizontalHeaderItem(1).text() == HOSTILE  # a table's items are text
    assert fleet.rtt_table.value(HOSTILE, "this PC") == "1.50"

    # documents: a file named in markup, and one that cannot be read (named in the status line)
    readable, unreadable = tmp_path / FILE_NAME, tmp_path / FILE_NAME.replace(".txt", ".pdf")
    readable.write_text("The toner is in the cupboard.\n")
    unreadable.write_text("not a PDF")
    panel.create("handbook")
    with qtbot.waitSignal(panel.indexed, timeout=30000):
        panel.add("handbook", [readable, unreadable])
    assert MARK in panel.status.text() and MARK in panel.status.toolTip()
    assert {box, panel.status, fleet.table} <= walk()
    panel.refresh()  # the selected collection's line, its files in the tooltip
    assert f"{readable}\n{unreadable}" == shown_as_written(panel.status.toolTip())
    assert panel.status in walk()

    # the chat's fleet and status in the status bar, a saved chat's title, a reply's link, a worker's error
    window.chat_controller.use_model(FILE_NAME)  # the chat's pick, as the Chat view makes it
    window.chat.model_chosen.emit(FILE_NAME)
    window.chat_controller.fleet_event.emit(HOSTILE)
    assert window.statusBar().currentMessage() == f"Fleet: {HOSTILE}"  # the status bar paints text
    window.history.create(HOSTILE)
    chat.conversations_changed()
    worker = WorkerWindow(WorkerController(gui_home / "fleet.key"))
    qtbot.addWidget(worker)
    worker.controller.error = f"cannot start the node agent: {HOSTILE}"  # what a failed start leaves
    worker.refresh()
    worker.controller.failed.emit(worker.controller.error)
    assert {window.service_label, chat.saved, worker.status, worker.banner.text} <= walk()

    asked = []

    def answer():
        question = QApplication.activeModalWidget()
        asked.append((question.textFormat(), question.text()))
        question.reject()

    QTimer.singleShot(0, answer)
    tab._link(QUrl(REPLY_LINK + QUrl.toPercentEncoding("https://example.com/" + HOSTILE).data().decode()))
    assert asked == [(Qt.TextFormat.PlainText, "Open this link from the reply in your browser?\n\n"
                                               "https://example.com/" + HOSTILE)]


BIDI = "".join(map(chr, [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]))  # embeddings, overrides, isolates
BACKWARDS = f"invoice{BIDI}fdp.exe"  # "invoiceexe.pdf" on screen, with U+202E in it


def test_bidi_controls_never_reorder_what_is_shown(qtbot, gui_home):
    """Unicode's bidi embedding, override and isolate controls in a reply, a node's name or a log line
    are taken out wherever the app shows such text as plain text (``fleetgui.widgets.unbidi``): a label,
    a tooltip, the Fleet view's table, a reply, a tool's result and the tray worker's activity."""
    from fleetgui.chat_tools import result_html
    from fleetgui.fleet_view import NodesModel
    from fleetgui.history import Message
    from fleetgui.markdown import message_html
    from fleetgui.tray import WorkerController, WorkerWindow
    from fleetgui.widgets import plain, plain_tip, unbidi

    assert unbidi(BACKWARDS) == "invoicefdp.exe" and unbidi("שלום, world \u200f") == "שלום, world \u200f"
    label = plain(QLabel())
    label.setText(BACKWARDS)
    assert label.text() == "invoicefdp.exe"
    assert not set(BIDI) & set(plain_tip(BACKWARDS) + message_html(BACKWARDS, 0))
    assert not set(BIDI) & set(result_html(Message("tool", BACKWARDS, stats={"name": BACKWARDS})))
    model = NodesModel()
    model._append(NodeRow(key="a", name=BACKWARDS, os=BACKWARDS, error="x"))
    shown = [model.index(0, c).data() for c in range(model.columnCount())]
    assert "invoicefdp.exe" in shown and not any(set(BIDI) & set(s or "") for s in shown)
    worker = WorkerWindow(WorkerController(gui_home / "fleet.key"))
    qtbot.addWidget(worker)
    worker.log_line(f"stage 1: {BACKWARDS}")
    assert "invoicefdp.exe" in worker.activity.toPlainText() and not set(BIDI) & set(worker.activity.toPlainText())


def test_the_tray_icon_tooltip_is_plain_text(qtbot, gui_home):
    """The tray icon's tooltip has no text format to set, and Windows shows it as written while Qt's own
    icon guesses rich text: what a failed start leaves (or a model's name) shows as written on both."""
    from fleetgui.tray import WorkerController, WorkerTray

    controller = WorkerController(gui_home / "fleet.key")
    tray = WorkerTray(controller)
    controller.error = f"cannot start the node agent: {HOSTILE}{BIDI}"
    tray.refresh()
    tip = tray.icon.toolTip()
    assert not Qt.mightBeRichText(tip) and not set(BIDI) & set(tip)
    assert tip.replace("\u2060", "") == f"fleetshard worker: not running: cannot start the node agent: {HOSTILE}"
