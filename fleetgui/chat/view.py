"""The Chat view: ``ChatView`` holds the model picker, the conversations in tabs (``ChatTab``), the
saved conversations (search, rename, export), the document collections chats answer from
(``fleetgui.documents``) and the live tok/s plot.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Callable

from PySide6.QtCore import QPoint, Qt, Signal
from PySide6.QtWidgets import (QComboBox, QDialog, QFileDialog, QHBoxLayout, QInputDialog, QLabel, QLineEdit,
                               QListWidget, QListWidgetItem, QPushButton, QTabWidget, QVBoxLayout, QWidget)

from engine.errors import FleetError
from engine.fleet.fit import measured_key, record_measured
from engine.models.catalog import CATALOG
from engine.progress import Progress
from engine.runtime.decode.service import Reply
from fleetgui.chat.controller import ChatController
from fleetgui.chat.tab import ChatTab, ask
from fleetgui.chat_tools import McpTools
from fleetgui.documents import OPTION as DOCUMENTS
from fleetgui.documents import DocumentsPanel
from fleetgui.history import Conversation, HistoryStore, to_json, to_markdown
from fleetgui.model_cards import ModelBrowser
from fleetgui.plots import LiveRatePlot, RateMeter
from fleetgui.progress import ProgressPanel
from fleetgui.running import ON_DEPLOYMENT, catalog_name, deployment_where, model_choices, model_name
from fleetgui.widgets import Banner, flow_bar, plain_tip, splitter, unbidi

# parameters: a smaller model given documents tends to invent its answer where a larger one cites them,
# so a chat with documents on a smaller one is offered the largest catalog model
SMALL_MODEL = 1_000_000_000


def larger_model(source: str) -> str | None:
    """The catalog model to suggest when ``source`` answers from documents: the largest chat model,
    when ``source`` is a catalog model under ``SMALL_MODEL`` parameters; None otherwise."""
    entry = CATALOG.get(catalog_name(source))
    if entry is None or not entry.parameters or entry.parameters >= SMALL_MODEL:
        return None
    chat_models = [e for e in CATALOG.values() if e.has_chat_template and e.draft_for is None]
    best = max(chat_models, key=lambda e: e.parameters, default=None)
    return best.name if best is not None and best.parameters >= SMALL_MODEL else None


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
        # over the bottom of the tabs' column (the live plot), never in the layout: nothing moves when
        # it comes and goes
        self.progress = ProgressPanel(self)
        self.progress.setAutoFillBackground(True)
        self.progress.cancel_requested.connect(controller.cancel_open)
        controller.progress.connect(self._loading)

        self.model = QComboBox()
        self.model.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.model.setMinimumContentsLength(16)
        self.model.setToolTip("the model the chat runs: on this PC, on the fleet, or one to download (Models… "
                              "opens a GGUF file or a Hugging Face folder too); Settings keep their default model")
        self.node_names: Callable[[], dict[str, str]] = lambda: {}  # address -> name: the window sets it
        self.refresh_models()
        self.model.activated.connect(lambda _: self._model_picked())
        controller.service_changed.connect(lambda _: self.refresh_models())
        browse_models = QPushButton("Models…")
        browse_models.setToolTip("the catalog's models with their size, license, whether they fit this PC and the "
                                 "fleet, and their predicted and measured speed")
        browse_models.clicked.connect(lambda: self.browse_models())
        # shown while the active chat answers from documents on a small model (``suggest_larger``)
        self.larger = QPushButton()
        self.larger.setObjectName("primary")
        self.larger.clicked.connect(lambda: self.choose(self.larger.property("source")))
        self.larger.hide()

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
        self.tabs.currentChanged.connect(lambda _: self._follow_tab())
        self.tabs.currentChanged.connect(lambda _: self.suggest_larger())
        plus = QPushButton("+")
        plus.setToolTip("New chat tab")
        plus.setFlat(True)
        plus.clicked.connect(lambda: self.new_chat())
        self.tabs.setCornerWidget(plus, Qt.Corner.TopRightCorner)
        self.live = LiveRatePlot(self.meter, "Live tokens per second per chat", theme,
                                 x_label="seconds since the first token")
        self.speed_plot = QPushButton("Speed plot")  # the live plot folds away; the main window keeps the choice
        self.speed_plot.setCheckable(True)
        self.speed_plot.setChecked(True)
        self.speed_plot.setToolTip("Show or hide the live tokens-per-second plot under the chats")
        self.speed_plot.toggled.connect(self.live.setVisible)

        header = QHBoxLayout()
        header.addWidget(QLabel("Model"))
        header.addWidget(self.model, 1)
        header.addWidget(self.larger)
        header.addWidget(browse_models)
        header.addWidget(self.speed_plot)
        right = self._right = splitter(Qt.Orientation.Vertical, (self.tabs, 4), (self.live, 1))
        split = splitter(Qt.Orientation.Horizontal, (left, 1), (right, 4))
        for moved in (right, split):  # the panel over the plot follows the column's bottom
            moved.splitterMoved.connect(lambda *_: self._place_progress())
        chars = self.fontMetrics().averageCharWidth()
        split.setSizes([chars * 28, chars * 100])
        layout = QVBoxLayout(self)
        layout.addWidget(self.banner)
        layout.addLayout(header)
        layout.addWidget(split, 1)

        self.conversations_changed()
        recent = history.conversations()
        if recent:
            self.open_conversation(recent[0].id)
        else:
            self.new_chat()

    # --- the model -----------------------------------------------------------------------------------

    def refresh_models(self) -> None:
        """Fills the picker anew, on what the chat runs now."""
        deployment = self.controller.deployment
        self.model.blockSignals(True)
        self.model.clear()
        for label, source in model_choices(self.controller.current_model, deployment, self.node_names()):
            self.model.addItem(label, source)
            self.model.setItemData(self.model.count() - 1, plain_tip(label), Qt.ItemDataRole.ToolTipRole)
        self.model.setCurrentIndex(0)
        self.model.blockSignals(False)

    def _model_picked(self) -> None:
        source = self.model.currentData()
        if source:
            self.choose(source)

    def choose(self, source: str) -> bool:
        """Makes ``source`` the chat's model (Settings → Default model stays as it is).  When the chat
        runs on a fleet deployment, asks first: switching stops that deployment's workers."""
        deployment = self.controller.deployment
        if source == ON_DEPLOYMENT or (deployment is None and source == self.controller.current_model):
            return False
        if deployment is not None:
            question = (f"The chat runs on {model_name(deployment.model)} on the fleet "
                        f"({deployment_where(deployment, self.node_names())}). "
                        f"Switching to {model_name(source)} stops that deployment: its workers on those PCs "
                        "stop and free their memory.")
            if not ask(self, "Stop the fleet deployment?", question, "Stop it and switch"):
                self.refresh_models()
                return False
            backend, settings = self.controller.backend, self.settings
            self.controller.tasks.start(lambda report, cancel: backend.stop_deployment(deployment, settings),
                                        "stop the deployment", failed=lambda message: self.banner.error(
                                            f"The deployment's workers could not all be stopped: {message}"))
        self.controller.use_model(source)
        self.refresh_models()
        self.suggest_larger()
        self.model_chosen.emit(source)
        return True

    def suggest_larger(self) -> None:
        """Offers a larger model while the active chat answers from documents on a small one."""
        tab = self.tabs.currentWidget() if hasattr(self, "tabs") else None
        documents = tab is not None and bool(tab.conversation.options.get(DOCUMENTS))
        larger = larger_model(self.controller.current_model) if documents and not self.controller.deployment else None
        if larger is None:
            self.larger.hide()
            return
        self.larger.setText(f"Use {model_name(larger)} for documents")
        self.larger.setToolTip(f"{model_name(self.controller.current_model)} is small: given documents it may invent "
                               f"an answer; {model_name(larger)} answers from them with a citation")
        self.larger.setProperty("source", larger)
        self.larger.show()

    def browse_models(self, dialog: ModelBrowser | None = None) -> str | None:
        """Opens the model browser; the model chosen there becomes the chat's.  The dialog is deleted
        once it closes (a child of this view, it would otherwise stay for every time it was opened)."""
        dialog = dialog or ModelBrowser(self.controller.tasks, self.controller.current_model, self.settings.weights,
                                        self)
        try:
            name = dialog.chosen_source() if dialog.exec() == QDialog.DialogCode.Accepted else None
        finally:
            dialog.deleteLater()
        if name:
            self.choose(name)
        return name

    def _record_speed(self, reply: Reply) -> None:
        """Keeps the reply's decode speed as the model's measured figure (shown on its model card)."""
        if reply.error or len(reply.tokens) < 2:
            return
        deployment = getattr(self.controller, "deployment", None)
        key = measured_key(deployment.stage0, deployment.model) if deployment is not None else \
            measured_key(self.controller.current_model)
        try:
            record_measured(key, reply.decode_tok_s)
        except OSError:
            pass  # a card without its measured figure is no reason to disturb the chat

    def _loading(self, progress: Progress | None) -> None:
        if progress is None:
            self.progress.done()
        else:
            self.progress.show_progress(progress)
            self._place_progress()

    def _place_progress(self) -> None:
        at = self._right.mapTo(self, QPoint(0, 0))
        height = self.progress.sizeHint().height()
        self.progress.setGeometry(at.x(), at.y() + self._right.height() - height, self._right.width(), height)
        self.progress.raise_()

    def resizeEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        super().resizeEvent(event)
        self._place_progress()

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
        self.saved.blockSignals(True)
        self.saved.clear()
        for conv in self.history.conversations(self.search.text()):
            item = QListWidgetItem(unbidi(conv.title or "(untitled)"))
            item.setData(Qt.ItemDataRole.UserRole, conv.id)
            item.setToolTip(plain_tip(conv.title))
            self.saved.addItem(item)
        self.saved.blockSignals(False)
        self._follow_tab()

    def _follow_tab(self) -> None:
        """The saved chat of the active tab is the one highlighted (none for a chat not saved yet)."""
        current = self.current_id()
        ids = [self.saved.item(row).data(Qt.ItemDataRole.UserRole) for row in range(self.saved.count())]
        if current is not None and current in ids:
            self.saved.setCurrentRow(ids.index(current))
            return
        self.saved.setCurrentRow(-1)
        self.saved.clearSelection()

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
        self.refresh_models()
        for tab in self.all_tabs():
            if not tab.busy:
                tab.render()

    def shutdown(self) -> None:
        for tab in self.all_tabs():
            tab.close_tab()
        self.controller.shutdown()
