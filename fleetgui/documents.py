"""Chat with documents: the Documents sidebar of the Chat view, and the glue that grounds a chat's
replies in a collection (``engine.documents``).

``DocumentsPanel`` lists the named collections (New; Add files or a folder; Re-index, Remove) and
indexes off the GUI thread with a progress bar and Cancel.  Removing a collection while it indexes
cancels the indexing and returns at once: the collection leaves the list, and its index is deleted
when the indexing has stopped (the window never waits for a file being read).  ``attach(tab)`` gives
a chat tab its collection picker, beside its system prompt (the choice is kept in the conversation's
options, so a reopened chat keeps it), and takes files or folders dropped on the tab into that
collection (a new one named after them when the chat has none).  ``sources_for`` finds the passages for the chat's
last question (``engine.conversation.sources``, which also puts them in the prompt); ``sources_html`` writes
the "Sources" line under the reply: links of our own (``source:MESSAGE:N``) made from what was
retrieved, never from the reply's text (whose links ``fleetgui.markdown`` wraps in ``reply:``);
``cite`` makes the reply's markers ([1]) such links too, for the sources the reply has.  A
click opens ``PassageDialog`` with the passage.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

from PySide6.QtCore import QEvent, QObject, Qt, QUrl, Signal
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (QComboBox, QDialog, QDialogButtonBox, QFileDialog, QHBoxLayout, QInputDialog,
                               QLabel, QListWidget, QListWidgetItem, QMenu, QPlainTextEdit, QPushButton,
                               QVBoxLayout, QWidget)

from engine.conversation.sources import find_sources, source_where
from engine.documents.collection import Collection, Library, UpdateReport
from engine.documents.readers import DocumentError
from engine.progress import Progress
from fleetgui.progress import ProgressPanel
from fleetgui.widgets import flow_bar, plain, plain_tip, unbidi

OPTION = "documents"  # the conversation option that names the chat's collection
NO_DOCUMENTS = "No documents"


def sources_html(sources: list[dict] | None, message_index: int) -> str:
    """The reply's "Sources" line: one link per source, written by us from the retrieval."""
    if not sources:
        return ""
    links = " · ".join(f"<a href='source:{message_index}:{n}'>[{n + 1}] {html.escape(unbidi(source_where(s)))}</a>"
                       for n, s in enumerate(sources))
    return f"<p><small><b>Sources</b>&nbsp;&nbsp;{links}</small></p>"


MARKER = re.compile(r"\[(\d{1,2})\]")  # a citation marker in a reply's text: [1]
TAG = re.compile(r"(<[^>]*>)")


def cite(body: str, message_index: int, count: int) -> str:
    """A reply's HTML with each citation marker [N] of its text, N one of the reply's ``count``
    sources, made a link of ours (``source:MESSAGE:N-1``) that opens that passage.  The link is
    written from the number alone: the reply's text never chooses what opens (a marker in code or
    inside a link of the reply stays text)."""
    out, inside, spans = [], 0, []  # inside a <pre> or an <a> of the reply; the open spans (code: monospace)
    for part in TAG.split(body):
        if part.startswith("<"):
            name = part[1:].lstrip("/").split(None, 1)[0].rstrip(">").lower() if len(part) > 2 else ""
            closing = part.startswith("</")
            if name in ("pre", "a", "code"):
                inside += -1 if closing else 1
            elif name == "span" and closing:
                if spans:
                    spans.pop()
            elif name == "span":
                spans.append("monospace" in part)
            out.append(part)
        elif inside > 0 or any(spans):
            out.append(part)
        else:
            out.append(MARKER.sub(lambda m: f"<a href='source:{message_index}:{int(m.group(1)) - 1}'>{m.group(0)}</a>"
                                  if 1 <= int(m.group(1)) <= count else m.group(0), part))
    return "".join(out)


class PassageDialog(QDialog):
    """A cited passage: its file, page and text (shown as plain text), and a button to open the file."""

    def __init__(self, number: int, source: dict, parent: QWidget | None = None):
        super().__init__(parent)
        self.source = source
        self.setWindowTitle(unbidi(f"Source [{number}]: {source_where(source)}"))
        self.file = plain(QLabel(source["file"]))
        self.file.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.file.setWordWrap(True)
        self.page = QLabel("" if source.get("page") is None else f"Page {source['page']}")
        self.text = QPlainTextEdit(unbidi(source["text"]))
        self.text.setReadOnly(True)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        open_file = buttons.addButton("Open file", QDialogButtonBox.ButtonRole.ActionRole)
        open_file.setEnabled(Path(source["file"]).is_file())
        open_file.clicked.connect(lambda: QDesktopServices.openUrl(QUrl.fromLocalFile(source["file"])))
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(self.file)
        layout.addWidget(self.page)
        layout.addWidget(self.text, 1)
        layout.addWidget(buttons)
        self.page.setVisible(bool(self.page.text()))
        self.resize(self.fontMetrics().averageCharWidth() * 80, self.fontMetrics().lineSpacing() * 20)


class _Drops(QObject):
    """Takes drops of local files and folders on a chat tab's widgets into the tab's collection."""

    def __init__(self, panel: "DocumentsPanel", tab):
        super().__init__(tab)
        self.panel, self.tab = panel, tab

    def eventFilter(self, watched, event) -> bool:  # noqa: N802 (Qt's name)
        kind = event.type()
        if kind in (QEvent.Type.DragEnter, QEvent.Type.DragMove, QEvent.Type.Drop):
            files = [u.toLocalFile() for u in event.mimeData().urls() if u.isLocalFile()] \
                if event.mimeData().hasUrls() else []
            if files:
                event.acceptProposedAction()
                if kind == QEvent.Type.Drop:
                    self.panel.drop(self.tab, files)
                return True
        return False


class DocumentsPanel(QWidget):
    """The collections, their indexing, and what chats need of them (see the module's docstring)."""

    changed = Signal()  # collections added, removed or indexed
    indexed = Signal(str, object)  # collection name, UpdateReport (also when cancelled)
    index_failed = Signal(str, str)  # collection name, message

    def __init__(self, tasks, library: Library | None = None, parent: QWidget | None = None):
        super().__init__(parent)
        self.tasks = tasks
        self.library = library or Library()
        self.passage_dialog: PassageDialog | None = None
        self._open: dict[str, Collection] = {}  # for searching; dropped when an update rewrites the index
        self._running: dict[str, object] = {}  # name -> the Task indexing it
        self._queued: dict[str, list[str]] = {}  # paths to add once the running update ends
        self._removing: set[str] = set()  # removed while indexing: deleted once the indexing stops
        self._tabs: list = []

        title = QLabel("Documents")
        title.setObjectName("hint")
        self.list = QListWidget()
        self.list.setToolTip("collections of your files, indexed on this PC; pick one under a chat's input to "
                             "answer from it, or drop files or a folder on the chat")
        self.list.setMaximumHeight(self.fontMetrics().lineSpacing() * 4)
        self.list.currentItemChanged.connect(lambda *_: self._show_selected())
        # three buttons, the rest in their menus: the sidebar is narrow and shared with the saved chats
        self.new_button = QPushButton("New…")
        self.new_button.setToolTip("a new collection, named by you")
        self.new_button.clicked.connect(self._ask_new)
        self.add_button = QPushButton("Add")
        self.add_button.setToolTip("add files or a folder (searched recursively) to the selected collection")
        add_menu = QMenu(self.add_button)
        self.files_action = add_menu.addAction("Files…", self._ask_files)
        self.folder_action = add_menu.addAction("Folder…", self._ask_folder)
        self.add_button.setMenu(add_menu)
        self.manage_button = QPushButton("Index")
        manage_menu = QMenu(self.manage_button)
        self.reindex_action = manage_menu.addAction("Re-index: read new and changed files, drop deleted ones",
                                                    lambda: self.selected() and self.index(self.selected()))
        self.remove_action = manage_menu.addAction("Remove the collection (your files stay)",
                                                   lambda: self.selected() and self.remove(self.selected()))
        self.manage_button.setMenu(manage_menu)
        self.progress = ProgressPanel()
        self.progress.cancel_requested.connect(self.cancel_selected)
        self.status = plain(QLabel())  # collection names, file names and readers' errors
        self.status.setObjectName("hint")
        self.status.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(title)
        layout.addWidget(self.list)
        layout.addWidget(flow_bar(self.new_button, self.add_button, self.manage_button)[0])
        layout.addWidget(self.progress)
        layout.addWidget(self.status)
        self.refresh()

    # --- collections ---------------------------------------------------------------------------------

    def names(self) -> list[str]:
        return [n for n in self.library.names() if n not in self._removing]

    def selected(self) -> str | None:
        item = self.list.currentItem()
        return None if item is None else item.data(Qt.ItemDataRole.UserRole)

    def select(self, name: str) -> None:
        for i in range(self.list.count()):
            if self.list.item(i).data(Qt.ItemDataRole.UserRole) == name:
                self.list.setCurrentRow(i)

    def refresh(self) -> None:
        selected = self.selected()
        self.list.blockSignals(True)
        self.list.clear()
        for name in self.names():
            item = QListWidgetItem(unbidi(name))
            item.setData(Qt.ItemDataRole.UserRole, name)
            self.list.addItem(item)
            if name == selected:
                self.list.setCurrentItem(item)
        self.list.blockSignals(False)
        for tab in self._tabs:
            self._fill_picker(tab)
        self._show_selected()
        self.changed.emit()

    def collection(self, name: str) -> Collection:
        if name not in self._open:
            self._open[name] = self.library.open(name)
        return self._open[name]

    def create(self, name: str) -> str:
        if " ".join(name.split()) in self._removing:
            raise DocumentError(f"the collection {name!r} is still being removed: try again in a moment")
        name = self.library.create(name).name
        self.refresh()
        self.select(name)
        return name

    def remove(self, name: str) -> None:
        """Deletes the collection's index (the files stay); while it indexes, once the indexing stops."""
        task = self._running.get(name)
        if task is not None:
            self._removing.add(name)
            task.cancel()
        else:
            self.library.remove(name)
        self._queued.pop(name, None)
        self._open.pop(name, None)
        self.refresh()

    def _removed(self, name: str) -> bool:
        """Deletes a collection whose removal waited for its indexing to stop; whether it did."""
        if name not in self._removing:
            return False
        self.library.remove(name)
        self._removing.discard(name)
        self.status.setText(f"{name}: removed")
        self.refresh()
        return True

    def add(self, name: str, paths: list[str | Path]) -> None:
        """Adds files or folders to collection ``name`` and indexes it (after its running update, if any)."""
        if name in self._running:
            self._queued.setdefault(name, []).extend(map(str, paths))
            return
        self.collection(name).add(*paths)
        self.index(name)

    def index(self, name: str) -> None:
        """Brings the collection's index up to date off the GUI thread, with progress and Cancel."""
        if name in self._running:
            return
        library = self.library

        def work(report, cancel) -> UpdateReport:
            collection = library.open(name)  # its own copy: the GUI's keeps serving searches meanwhile
            return collection.update(report, cancel)

        self.progress.show_progress(Progress(f"Indexing {name}…"))
        self._running[name] = self.tasks.start(
            work, f"index {name}", progressed=self.progress.show_progress,
            succeeded=lambda report: self._finished(name, report),
            failed=lambda message: self._failed(name, message),
            cancelled=lambda: self._finished(name, UpdateReport(cancelled=True)))

    def indexing(self, name: str | None = None) -> bool:
        return bool(self._running) if name is None else name in self._running

    def cancel_selected(self) -> None:
        for task in self._running.values():
            task.cancel()

    def _finished(self, name: str, report: UpdateReport) -> None:
        self._running.pop(name, None)
        self._open.pop(name, None)  # the next search reads the new index
        self.progress.done()
        if self._removed(name):
            return
        self.status.setText(f"{name}: {report.describe()}")
        self.status.setToolTip(plain_tip("\n".join(report.skipped)))
        self.indexed.emit(name, report)
        queued = self._queued.pop(name, None)
        if queued:
            self.add(name, queued)
        self.changed.emit()

    def _failed(self, name: str, message: str) -> None:
        self._running.pop(name, None)
        self.progress.done()
        if self._removed(name):
            return
        self.status.setText(f"{name}: indexing failed: {message}")
        self.index_failed.emit(name, message)

    def _show_selected(self) -> None:
        name = self.selected()
        for button in (self.add_button, self.manage_button):
            button.setEnabled(name is not None)
        if name is None or self.indexing(name):
            return
        try:
            collection = self.collection(name)
        except DocumentError as exc:
            self.status.setText(str(exc))
            return
        self.status.setText(f"{name}: {len(collection.files)} files, {len(collection.passages)} passages")
        self.status.setToolTip(plain_tip("\n".join(collection.sources)))

    def _ask_new(self) -> None:
        name, ok = QInputDialog.getText(self, "New document collection", "Name")
        if ok and name.strip():
            try:
                self.create(name)
            except DocumentError as exc:
                self.status.setText(str(exc))

    def _ask_files(self) -> None:
        name = self.selected()
        if name is None:
            return
        files, _ = QFileDialog.getOpenFileNames(self, f"Add files to {name}", "",
                                                "Documents (*.txt *.md *.markdown *.pdf *.docx)")
        if files:
            self._add_reporting(name, files)

    def _ask_folder(self) -> None:
        name = self.selected()
        if name is None:
            return
        folder = QFileDialog.getExistingDirectory(self, f"Add a folder to {name}")
        if folder:
            self._add_reporting(name, [folder])

    def _add_reporting(self, name: str, paths: list[str]) -> None:
        try:
            self.add(name, paths)
        except DocumentError as exc:
            self.status.setText(str(exc))

    # --- chats ---------------------------------------------------------------------------------------

    def attach(self, tab) -> None:
        """Gives a chat tab its collection picker and takes drops of files on it."""
        picker = QComboBox()
        picker.setToolTip("the document collection this chat answers from (its passages go in the prompt and "
                          "the reply lists them as sources)")
        tab.documents_picker = picker
        self._tabs.append(tab)
        tab.destroyed.connect(lambda *_: self._tabs.remove(tab) if tab in self._tabs else None)
        self._fill_picker(tab)
        picker.currentIndexChanged.connect(lambda _: self._picked(tab))
        # beside the system prompt, which takes the rest of that line: the tab has no height to spare
        layout = tab.layout()
        at = layout.indexOf(tab.system)
        layout.removeWidget(tab.system)
        row = QWidget()
        line = QHBoxLayout(row)
        line.setContentsMargins(0, 0, 0, 0)
        line.addWidget(tab.system, 3)
        line.addWidget(picker, 1)
        layout.insertWidget(at, row)
        drops = _Drops(self, tab)
        for widget in (tab, tab.transcript, tab.transcript.viewport(), tab.input, tab.input.viewport()):
            widget.setAcceptDrops(True)
            widget.installEventFilter(drops)

    def _fill_picker(self, tab) -> None:
        picker = tab.documents_picker
        wanted = tab.conversation.options.get(OPTION)
        picker.blockSignals(True)
        picker.clear()
        picker.addItem(NO_DOCUMENTS, None)
        for name in self.names():
            picker.addItem(name, name)
        picker.setCurrentIndex(max(0, picker.findData(wanted)) if wanted else 0)
        picker.blockSignals(False)

    def _picked(self, tab) -> None:
        name = tab.documents_picker.currentData()
        self.use(tab, name)
        if name:
            self.index(name)  # notices files changed since it was indexed (reading only those)

    def use(self, tab, name: str | None) -> None:
        """Makes collection ``name`` (None: none) the one chat ``tab`` answers from."""
        options = dict(tab.conversation.options)
        if name:
            options[OPTION] = name
        else:
            options.pop(OPTION, None)
        tab.model.set_options(options)
        index = tab.documents_picker.findData(name) if name else 0
        if index >= 0 and tab.documents_picker.currentIndex() != index:
            tab.documents_picker.blockSignals(True)
            tab.documents_picker.setCurrentIndex(index)
            tab.documents_picker.blockSignals(False)
        tab.view.suggest_larger()

    def drop(self, tab, files: list[str]) -> None:
        """Files or folders dropped on a chat: into its collection, or a new one named after them."""
        name = tab.conversation.options.get(OPTION)
        try:
            if not name or name not in self.names():
                base = " ".join(Path(files[0]).name.split()) or "Documents"
                taken = set(self.names())
                name = next(n for n in (base, *(f"{base} ({i})" for i in range(2, 1000))) if n not in taken)
                self.create(name)
                self.use(tab, name)
            self.select(name)
            self.add(name, files)
        except DocumentError as exc:
            self.status.setText(str(exc))
            tab.view.banner.error(f"The documents could not be added: {exc}")

    def sources_for(self, conversation) -> list[dict]:
        """The passages of the chat's collection that best match its last question, as the reply's
        sources (file, page, offset, text, score); none without a collection or a match."""
        name = conversation.options.get(OPTION)
        question = next((m.content for m in reversed(conversation.messages) if m.role == "user"), "")
        if not name or not question.strip():
            return []
        try:
            return find_sources(self.collection(name), question)
        except DocumentError as exc:
            self.status.setText(str(exc))
            return []

    def show_source(self, sources: list[dict], number: int) -> PassageDialog | None:
        """Opens source ``number`` (from 0) of a reply in a dialog."""
        if not 0 <= number < len(sources):
            return None
        dialog = PassageDialog(number + 1, sources[number], self.window())
        dialog.finished.connect(dialog.deleteLater)
        self.passage_dialog = dialog
        dialog.open()
        return dialog
