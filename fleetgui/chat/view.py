"""The Chat view: ``ChatView`` holds the model picker, the conversations in tabs (``ChatTab``), the
saved conversations (search, rename, export), the document collections chats answer from
(``fleetgui.documents``) and the live tok/s plot.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QComboBox, QDialog, QFileDialog, QHBoxLayout, QInputDialog, QLabel, QLineEdit,
                               QListWidget, QListWidgetItem, QPushButton, QTabWidget, QVBoxLayout, QWidget)

from engine.config import paths
from engine.errors import FleetError
from engine.fleet.fit import measured_key, record_measured
from engine.models.catalog import CATALOG
from engine.progress import Progress
from engine.runtime.decode.service import Reply
from fleetgui.chat.controller import ChatController
from fleetgui.chat.tab import ChatTab
from fleetgui.chat_tools import McpTools
from fleetgui.documents import DocumentsPanel
from fleetgui.history import Conversation, HistoryStore, to_json, to_markdown
from fleetgui.model_cards import ModelBrowser
from fleetgui.plots import LiveRatePlot, RateMeter
from fleetgui.progress import ProgressPanel
from fleetgui.widgets import Banner, flow_bar, plain_tip, splitter

def model_choices(current: str) -> list[str]:
    """The models the picker offers: the current one, the exported shard sets in the cache (newest
    first), then the catalog."""
    try:
        exported = sorted((p for p in paths().shards.iterdir() if (p / "stage0").is_dir()),
                          key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        exported = []
    return list(dict.fromkeys([current, *map(str, exported), *CATALOG]))


class ChatView(QWidget):
    model_chosen = Signal(str)  # the user picked another model for the chat

    def __init__(self, controller: ChatController, history: HistoryStore, settings, theme: str = "light",
                 parent: QWidget | None = None):
        super().__init__(parent)
        self.controller = controller
        self.history = history
        self.settings = settings
        self.meter = RateMeter()
        self._labels = itertools.count(1)
        self.banner = Banner()
        controller.failed.connect(lambda m: self.banner.error(f"The model could not be started: {m}"))
        controller.fleet_event.connect(lambda text: self.banner.info(f"Fleet: {text}"))
        self.progress = ProgressPanel()
        self.progress.cancel_requested.connect(controller.cancel_open)
        controller.progress.connect(self._loading)

        self.model = QComboBox()
        self.model.setEditable(True)
        self.model.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.model.setMinimumContentsLength(16)
        self.model.setToolTip("the model this chat runs: an exported shard set, a catalog model, a GGUF file or a "
                              "Hugging Face folder")
        self._fill_models()
        self.model.activated.connect(lambda _: self._model_picked())
        self.model.lineEdit().returnPressed.connect(self._model_picked)
        browse_models = QPushButton("Models…")
        browse_models.setToolTip("the catalog's models with their size, license, whether they fit this PC and the "
                                 "fleet, and their predicted and measured speed")
        browse_models.clicked.connect(lambda: self.browse_models())

        self.search = QLineEdit()
        self.search.setPlaceholderText("Search chats")
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(lambda _: self.conversations_changed())
        self.saved = QListWidget()
        self.saved.setTextElideMode(Qt.TextElideMode.ElideRight)  # long titles end in "…" (the tooltip has it all)
        self.saved.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.saved.itemClicked.connect(lambda item: self.open_conversation(item.data(Qt.ItemDataRole.UserRole)))
        self.saved.itemActivated.connect(lambda item: self.open_conversation(item.data(Qt.ItemDataRole.UserRole)))
        new_button = QPushButton("New chat")
        new_button.clicked.connect(lambda: self.new_chat())
        rename_button = QPushButton("Rename…")
        rename_button.clicked.connect(self._ask_rename)
        export_button = QPushButton("Export…")
        export_button.setToolTip("save the selected chat as Markdown or JSON")
        export_button.clicked.connect(self._ask_export)
        delete_button = QPushButton("Delete")
        delete_button.clicked.connect(self.delete_selected)
        left = QWidget()
        left_layout = QVBoxLayout(left)
        left_layout.setContentsMargins(0, 0, 0, 0)
        saved_label = QLabel("Saved chats")
        saved_label.setObjectName("hint")
        left_layout.addWidget(saved_label)
        left_layout.addWidget(self.search)
        left_layout.addWidget(self.saved, 1)
        left_layout.addWidget(flow_bar(new_button, rename_button, export_button, delete_button)[0])
        self.documents = DocumentsPanel(controller.tasks)
        self.mcp = McpTools(controller.tasks, settings, self)
        self.mcp.failed.connect(lambda message: self.banner.error(message))
        left_layout.addWidget(self.documents)

        self.tabs = QTabWidget()
        self.tabs.setTabsClosable(True)
        self.tabs.setMovable(True)
        self.tabs.setUsesScrollButtons(True)
        self.tabs.setElideMode(Qt.TextElideMode.ElideRight)
        self.tabs.tabCloseRequested.connect(self.close_tab)
        plus = QPushButton("+")
        plus.setToolTip("New chat tab")
        plus.setFlat(True)
        plus.clicked.connect(lambda: self.new_chat())
        self.tabs.setCornerWidget(plus, Qt.Corner.TopRightCorner)
        self.live = LiveRatePlot(self.meter, "Live tokens per second per chat", theme,
                                 x_label="seconds since the reply started")

        header = QHBoxLayout()
        header.addWidget(QLabel("Model"))
        header.addWidget(self.model, 1)
        header.addWidget(browse_models)
        right = splitter(Qt.Orientation.Vertical, (self.tabs, 4), (self.live, 1))
        split = splitter(Qt.Orientation.Horizontal, (left, 1), (right, 4))
        chars = self.fontMetrics().averageCharWidth()
        split.setSizes([chars * 28, chars * 100])
        layout = QVBoxLayout(self)
        layout.addWidget(self.banner)
        layout.addWidget(self.progress)
        layout.addLayout(header)
        layout.addWidget(split, 1)

        self.conversations_changed()
        recent = history.conversations()
        if recent:
            self.open_conversation(recent[0].id)
        else:
            self.new_chat()

    # --- the model -----------------------------------------------------------------------------------

    def _fill_models(self) -> None:
        self.model.blockSignals(True)
        self.model.clear()
        self.model.addItems(model_choices(self.settings.default_model))
        self.model.setCurrentText(self.settings.default_model)
        self.model.blockSignals(False)

    def _model_picked(self) -> None:
        name = self.model.currentText().strip()
        if name and name != self.settings.default_model:
            self.model_chosen.emit(name)

    def browse_models(self, dialog: ModelBrowser | None = None) -> str | None:
        """Opens the model browser; the model chosen there becomes the chat's."""
        dialog = dialog or ModelBrowser(self.controller.tasks, self.settings.default_model, self.settings.weights, self)
        if dialog.exec() != QDialog.DialogCode.Accepted:
            return None
        name = dialog.chosen_source()
        if name and name != self.settings.default_model:
            self.model.setCurrentText(name)
            self.model_chosen.emit(name)
        return name

    def _record_speed(self, reply: Reply) -> None:
        """Keeps the reply's decode speed as the model's measured figure (shown on its model card)."""
        if reply.error or len(reply.tokens) < 2:
            return
        deployment = getattr(self.controller, "deployment", None)
        source = deployment.stage0 if deployment is not None else self.settings.default_model
        key = measured_key(source)
        if deployment is not None and key == source:
            key = deployment.model
        try:
            record_measured(key, reply.decode_tok_s)
        except OSError:
            pass  # a card without its measured figure is no reason to disturb the chat

    def _loading(self, progress: Progress | None) -> None:
        if progress is None:
            self.progress.done()
        else:
            self.progress.show_progress(progress)

    # --- tabs ----------------------------------------------------------------------------------------

    def tab(self, index: int) -> ChatTab:
        return self.tabs.widget(index)

    def all_tabs(self) -> list[ChatTab]:
        return [self.tabs.widget(i) for i in range(self.tabs.count())]

    def new_chat(self, conversation: Conversation | None = None) -> ChatTab:
        tab = ChatTab(self, conversation or Conversation(None, ""), f"chat {next(self._labels)}")
        tab.title_changed.connect(lambda: self._retitle(tab))
        tab.finished.connect(self._record_speed)
        self.documents.attach(tab)
        index = self.tabs.addTab(tab, tab.title())
        self.tabs.setTabToolTip(index, tab.conversation.title)
        self.tabs.setCurrentIndex(index)
        tab.input.setFocus()
        return tab

    def open_conversation(self, conversation_id: int) -> ChatTab | None:
        for tab in self.all_tabs():
            if tab.conversation.id == conversation_id:
                self.tabs.setCurrentWidget(tab)
                return tab
        conversation = self.history.load(conversation_id)
        if conversation is None:
            return None
        current = self.tabs.currentWidget()
        if current is not None and current.conversation.id is None and not current.busy:
            # an untouched "New chat" gives its place to the chat opened
            self.tabs.removeTab(self.tabs.indexOf(current))
            current.deleteLater()
        return self.new_chat(conversation)

    def open_ids(self) -> list[int]:
        """The saved conversations open in tabs, in tab order (what a restart opens again)."""
        return [t.conversation.id for t in self.all_tabs() if t.conversation.id is not None]

    def restore_tabs(self, ids: list[int], current: int | None = None) -> None:
        """Opens ``ids`` in tabs (those still in the history) in place of the start-up tab."""
        known = {c.id for c in self.history.conversations()}
        ids = [i for i in ids if i in known]
        if not ids:
            return
        for tab in self.all_tabs():  # the start-up tab goes: the tabs come back in their order
            if not tab.busy:
                self.tabs.removeTab(self.tabs.indexOf(tab))
                tab.deleteLater()
        for i in ids:
            self.open_conversation(i)
        if current in ids:
            self.open_conversation(current)

    def current_id(self) -> int | None:
        tab = self.tabs.currentWidget()
        return None if tab is None else tab.conversation.id

    def close_tab(self, index: int) -> None:
        tab = self.tab(index)
        tab.close_tab()
        self.tabs.removeTab(index)
        tab.deleteLater()
        if self.tabs.count() == 0:
            self.new_chat()

    def _retitle(self, tab: ChatTab) -> None:
        index = self.tabs.indexOf(tab)
        if index >= 0:
            self.tabs.setTabText(index, tab.title())
            self.tabs.setTabToolTip(index, tab.conversation.title)
            self.live.set_name(tab.label, tab.title())

    # --- saved conversations -------------------------------------------------------------------------

    def conversations_changed(self) -> None:
        selected = self.selected_id()
        self.saved.clear()
        for conv in self.history.conversations(self.search.text()):
            item = QListWidgetItem(conv.title or "(untitled)")
            item.setData(Qt.ItemDataRole.UserRole, conv.id)
            item.setToolTip(plain_tip(conv.title))
            self.saved.addItem(item)
            if conv.id == selected:
                self.saved.setCurrentItem(item)

    def selected_id(self) -> int | None:
        item = self.saved.currentItem()
        if item is not None:
            return item.data(Qt.ItemDataRole.UserRole)
        return self.current_id()

    def rename(self, conversation_id: int, title: str) -> None:
        title = " ".join(title.split())
        if not title:
            raise FleetError("a chat's title cannot be empty")
        self.history.rename(conversation_id, title)
        for tab in self.all_tabs():
            if tab.conversation.id == conversation_id:
                tab.model.retitled(title)
        self.conversations_changed()

    def _ask_rename(self) -> None:
        conversation_id = self.selected_id()
        conversation = self.history.load(conversation_id) if conversation_id is not None else None
        if conversation is None:
            return
        title, ok = QInputDialog.getText(self, "Rename chat", "Title", text=conversation.title)
        if ok:
            try:
                self.rename(conversation_id, title)
            except FleetError as exc:
                self.banner.error(str(exc))

    def export_conversation(self, conversation_id: int, path: str | Path) -> Path:
        """Writes the conversation to ``path``: JSON for a .json name, Markdown otherwise."""
        conversation = self.history.load(conversation_id)
        if conversation is None:
            raise FleetError(f"no saved chat {conversation_id}")
        path = Path(path)
        path.write_text(to_json(conversation) if path.suffix.lower() == ".json" else to_markdown(conversation),
                        encoding="utf-8")
        return path

    def _ask_export(self) -> None:
        conversation_id = self.selected_id()
        if conversation_id is None:
            return
        path, _ = QFileDialog.getSaveFileName(self, "Export chat", "chat.md", "Markdown (*.md);;JSON (*.json)")
        if path:
            try:
                self.export_conversation(conversation_id, path)
            except (OSError, FleetError) as exc:
                self.banner.error(f"The chat could not be exported: {exc}")

    def delete_selected(self) -> None:
        item = self.saved.currentItem()
        if item is None:
            return
        conversation_id = item.data(Qt.ItemDataRole.UserRole)
        for i, tab in enumerate(self.all_tabs()):
            if tab.conversation.id == conversation_id:
                self.close_tab(i)
                break
        self.history.delete(conversation_id)
        self.conversations_changed()

    # --- settings and shutdown -----------------------------------------------------------------------

    def apply_settings(self, settings) -> None:
        self.settings = settings
        self.controller.reconfigure(settings)
        self.mcp.apply_settings(settings)
        self.live.set_theme(settings.theme)
        self._fill_models()
        for tab in self.all_tabs():
            if not tab.busy:
                tab.render()

    def shutdown(self) -> None:
        for tab in self.all_tabs():
            tab.close_tab()
        self.controller.shutdown()
