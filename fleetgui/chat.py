"""The Chat view: conversations in tabs, each one stream of the engine's chat service.

``ChatController`` owns the service for the window: it opens it off the GUI thread on first use
(exporting or pulling the model if needed), queues requests until it is up, and relays the
service's callbacks (called on its scheduler thread) to the GUI thread through queued signals.
``ChatTab`` is one conversation: streaming text, Stop, Regenerate, Copy, a system prompt, and each
reply's speed.  ``ChatView`` holds the tabs, the saved conversations and the live tok/s plot.
"""

from __future__ import annotations

import html
import itertools
import time

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QKeySequence, QShortcut, QTextCursor
from PySide6.QtWidgets import (QApplication, QHBoxLayout, QLabel, QLineEdit, QListWidget, QListWidgetItem,
                               QPlainTextEdit, QPushButton, QTabWidget, QTextBrowser, QVBoxLayout,
                               QWidget)

from engine.errors import FleetError
from engine.runtime.decode.service import Reply
from fleetgui.history import Conversation, HistoryStore, Message
from fleetgui.plots import LiveRatePlot, RateMeter
from fleetgui.widgets import Banner, splitter
from fleetgui.workers import TaskRunner

SAVE_EVERY_S = 1.0  # how often a reply in progress is written to the history (write-ahead)
# settings whose change needs a new service (the rest apply per request)
SERVICE_KEYS = ("fleet_key_file", "default_model", "stages", "weights", "device", "mode", "local_workers",
                "streams", "k", "draft", "draft_model", "tls", "deadline_s")
# a deployment's phases (``engine.fleet.deploy``), as the status bar says them
DEPLOY_PHASES = {"export": "exporting", "send": "sending", "start": "starting", "connect": "connecting"}


class _Bridge(QObject):
    """Emitted on the service's scheduler thread, delivered on the GUI thread (queued)."""

    text = Signal(int, str, int)  # request key, text piece, tokens so far
    done = Signal(int, object)  # request key, Reply
    fleet = Signal(str)  # the chat's fleet lost a node, moved layers, started a worker again


class ChatController(QObject):
    status = Signal(str)  # a line for the status bar
    failed = Signal(str)  # the service could not be opened
    ready = Signal()
    service_changed = Signal(object)  # the service now open, or None before it closes
    fleet_event = Signal(str)  # what the chat's fleet does to recover, as it happens

    def __init__(self, backend, settings, tasks: TaskRunner, parent: QObject | None = None):
        super().__init__(parent)
        self.backend = backend
        self.settings = settings
        self.tasks = tasks
        self.service = None
        self.deployment = None  # a fleet deployment the chat runs on; None: the settings' model
        self._loader = None
        self._closing = False
        self._keys = itertools.count(1)
        self._listeners: dict[int, tuple] = {}
        self._handles: dict = {}
        self._pending: list[tuple[int, list[dict], int]] = []
        self._bridge = _Bridge()
        self._bridge.text.connect(self._on_text)
        self._bridge.done.connect(self._on_done)
        self._bridge.fleet.connect(self.fleet_event)
        backend.on_fleet_event = self._bridge.fleet.emit  # called on the service's scheduler thread

    # --- requests ------------------------------------------------------------------------------------

    def submit(self, messages: list[dict], max_new_tokens: int, on_text, on_done) -> int:
        """Queues a reply; ``on_text(piece, tokens)`` and ``on_done(Reply)`` run on the GUI thread."""
        key = next(self._keys)
        self._listeners[key] = (on_text, on_done)
        if self.service is None:
            self._pending.append((key, messages, max_new_tokens))
            self.open()
        else:
            self._send(key, messages, max_new_tokens)
        return key

    def cancel(self, key: int | None, forget: bool = False) -> None:
        """Stops a reply (it still ends with ``on_done``, marked cancelled, unless ``forget``)."""
        if key is None:
            return
        if forget:
            self._listeners.pop(key, None)
        for i, (pending, _, _) in enumerate(self._pending):
            if pending == key:
                del self._pending[i]
                self._on_done(key, Reply("", [], 0, "cancelled"))
                return
        handle = self._handles.get(key)
        if handle is not None:
            handle.cancel()

    def _send(self, key: int, messages: list[dict], max_new_tokens: int) -> None:
        bridge = self._bridge
        try:
            self._handles[key] = self.service.submit(
                messages, max_new_tokens, on_text=lambda piece, n: bridge.text.emit(key, piece, n),
                on_done=lambda reply: bridge.done.emit(key, reply))
        except FleetError as exc:
            self._on_done(key, Reply("", [], 0, "error", error=str(exc)))

    def _on_text(self, key: int, piece: str, tokens: int) -> None:
        listener = self._listeners.get(key)
        if listener:
            listener[0](piece, tokens)

    def _on_done(self, key: int, reply: Reply) -> None:
        self._handles.pop(key, None)
        listener = self._listeners.pop(key, None)
        if listener:
            listener[1](reply)

    # --- the service ---------------------------------------------------------------------------------

    @property
    def loading(self) -> bool:
        return self._loader is not None

    def open(self) -> None:
        """Opens the service off the GUI thread unless it is open or opening."""
        if self.service is not None or self._loader is not None or self._closing:
            return
        settings, backend = self.settings, self.backend

        deployment = self.deployment

        def load(report, cancel):
            if deployment is not None:
                service = backend.open_deployment(settings, deployment, report, cancel)
            else:
                service = backend.open_chat(settings, report, cancel)
            if service is not None and (self._closing or cancel.is_set()):
                service.close()
                return None
            return service

        self.status.emit(f"Chat: opening {deployment.model if deployment else settings.default_model}…")
        self._loader = self.tasks.start(load, "open chat service", progressed=self._loading_progress,
                                        succeeded=self._opened, failed=self._open_failed,
                                        cancelled=lambda: self._open_failed("cancelled"))

    def _loading_progress(self, payload: tuple) -> None:
        if payload[0] == "status":
            self.status.emit(f"Chat: {payload[1]}…")
        elif payload[0] == "pull":
            self.status.emit(f"Chat: pulling the model ({payload[1]}, {payload[2] * 100:.0f}%)…")
        elif payload[0] == "stage":
            self.status.emit(f"Chat: exporting stage {payload[1]} ({payload[2]}, {payload[3] * 100:.0f}%)…")
        elif payload[0] == "deploy":
            _, stage, phase, fraction = payload
            self.status.emit(f"Chat: {DEPLOY_PHASES.get(phase, phase)} stage {stage} ({fraction * 100:.0f}%)…")

    def _opened(self, service) -> None:
        self._loader = None
        if service is None:
            self._open_failed("cancelled")
            return
        self.service = service
        self.status.emit(f"Chat: {service.description}")
        self.service_changed.emit(service)
        pending, self._pending = self._pending, []
        for key, messages, max_new_tokens in pending:
            self._send(key, messages, max_new_tokens)
        self.ready.emit()

    def _open_failed(self, message: str) -> None:
        self._loader = None
        self.status.emit("Chat: not connected")
        pending, self._pending = self._pending, []
        for key, _, _ in pending:
            self._on_done(key, Reply("", [], 0, "error", error=f"could not start the model: {message}"))
        if message != "cancelled":
            self.failed.emit(message)

    def reconfigure(self, settings) -> None:
        """New settings: a service built on other values is closed (in the background); the next
        request opens a new one.  Another default model leaves a deployment for that model."""
        old, self.settings = self.settings, settings
        if old.default_model != settings.default_model:
            self.deployment = None
        if any(getattr(old, k) != getattr(settings, k) for k in SERVICE_KEYS):
            self.close_service()

    def use_deployment(self, deployment) -> None:
        """Chat on a fleet deployment from now on (None: back to the settings' model); the current
        service closes and the next request, or ``open()``, connects."""
        self.deployment = deployment
        self.close_service()

    def close_service(self) -> None:
        if self._loader is not None:
            self._loader.cancel()
            self._loader = None
        service, self.service = self.service, None
        if service is not None:
            self.service_changed.emit(None)
            self.tasks.start(lambda report, cancel: service.close(), "close chat service")
            self.status.emit("Chat: not connected")

    def shutdown(self) -> None:
        """At exit: cancel everything and close the service (its workers end with it)."""
        self._closing = True
        self._listeners.clear()
        if self._loader is not None:
            self._loader.cancel()
        if self.service is not None:
            self.service_changed.emit(None)
            self.service.close()
            self.service = None


def format_stats(stats: dict) -> str:
    if not stats:
        return ""
    if stats.get("unfinished"):
        return "interrupted: the app closed before this reply ended"
    parts = [f"{stats.get('decode_tok_s', 0):.1f} tok/s", f"first token {stats.get('ttft_ms', 0):.0f} ms",
             f"{stats.get('new_tokens', 0)} tokens"]
    if "acceptance" in stats:
        parts.append(f"acceptance {stats['acceptance']:.2f}")
    stopped = stats.get("stopped_by")
    parts.append({"cancelled": "stopped", "eos": "complete", "max_tokens": "length limit",
                  "error": "failed"}.get(stopped, stopped or ""))
    return " · ".join(p for p in parts if p)


class ChatTab(QWidget):
    """One conversation and its reply in progress."""

    streamed = Signal(str, int)  # a piece of the reply in progress and the tokens so far
    finished = Signal(object)  # Reply, once a reply ends (for whoever waits on it)
    title_changed = Signal()

    def __init__(self, view: "ChatView", conversation: Conversation, label: str):
        super().__init__()
        self.view = view
        self.conversation = conversation
        self.label = label  # the stream's name in the live plot
        self.key: int | None = None
        self.reply: Message | None = None
        self.last_reply: Reply | None = None
        self._tokens = 0
        self._saved = 0.0  # when the reply in progress was last written to the history

        self.system = QLineEdit(conversation.system)
        self.system.setPlaceholderText("System prompt (optional): how the assistant should behave")
        self.transcript = QTextBrowser()
        self.transcript.setObjectName("transcript")
        self.transcript.setOpenLinks(False)
        self.stats = QLabel()
        self.stats.setObjectName("stats")
        self.input = QPlainTextEdit()
        self.input.setPlaceholderText("Message (Ctrl+Enter sends)")
        self.input.setMaximumHeight(self.fontMetrics().lineSpacing() * 6)
        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("primary")
        self.stop_button = QPushButton("Stop")
        self.regenerate_button = QPushButton("Regenerate")
        self.copy_button = QPushButton("Copy")
        self.send_button.clicked.connect(self.send)
        self.stop_button.clicked.connect(self.stop)
        self.regenerate_button.clicked.connect(self.regenerate)
        self.copy_button.clicked.connect(self.copy)
        QShortcut(QKeySequence("Ctrl+Return"), self.input, activated=self.send)

        top = QHBoxLayout()
        top.addWidget(QLabel("System"))
        top.addWidget(self.system, 1)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        for b in (self.copy_button, self.regenerate_button, self.stop_button, self.send_button):
            buttons.addWidget(b)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addWidget(self.transcript, 1)
        layout.addWidget(self.stats)
        layout.addWidget(self.input)
        layout.addLayout(buttons)
        self.render()
        self._update_buttons()

    @property
    def busy(self) -> bool:
        return self.key is not None

    def title(self) -> str:
        title = self.conversation.title or "New chat"
        return title if len(title) <= 24 else title[:23] + "…"

    # --- actions -------------------------------------------------------------------------------------

    def send(self) -> None:
        text = self.input.toPlainText().strip()
        if not text or self.busy:
            return
        self.input.clear()
        conv, history = self.conversation, self.view.history
        conv.system = self.system.text().strip()
        if conv.id is None:
            conv.title = " ".join(text.split())[:60]
            conv.id = history.create(conv.title, conv.system)
            self.title_changed.emit()
        else:
            history.update(conv)
        message = Message("user", text)
        conv.messages.append(message)
        history.append(conv.id, message)
        self.view.conversations_changed()
        self._start_reply()

    def stop(self) -> None:
        self.view.controller.cancel(self.key)

    def regenerate(self) -> None:
        """Replaces the last reply with a new one to the same conversation."""
        messages = self.conversation.messages
        if self.busy or not messages:
            return
        if messages[-1].role == "assistant":
            last = messages.pop()
            if last.id is not None:
                self.view.history.remove_message(last.id)
        if messages and messages[-1].role == "user":
            self._start_reply()

    def copy(self) -> None:
        text = self.last_text()
        if text:
            QApplication.clipboard().setText(text)

    def last_text(self) -> str:
        replies = [m for m in self.conversation.messages if m.role == "assistant"]
        return replies[-1].content if replies else ""

    def close_tab(self) -> None:
        self.view.controller.cancel(self.key, forget=True)
        self.key = None

    # --- the reply -----------------------------------------------------------------------------------

    def _start_reply(self) -> None:
        conv = self.conversation
        conv.system = self.system.text().strip()
        prompt = conv.prompt()
        self.reply = Message("assistant", "")
        conv.messages.append(self.reply)
        self._tokens = 0
        self._saved = 0.0
        self.stats.setText("waiting for the model…" if self.view.controller.service is None else "generating…")
        self.render()
        self.key = self.view.controller.submit(prompt, self.view.settings.max_new_tokens, self._on_text,
                                               self._on_done)
        self._update_buttons()

    def _on_text(self, piece: str, tokens: int) -> None:
        if self.reply is None:
            return
        if not self.reply.content:
            self.stats.setText("generating…")
        self.reply.content += piece
        if time.monotonic() - self._saved >= SAVE_EVERY_S:  # write-ahead: a killed app keeps the reply so far
            self._saved = time.monotonic()
            self.reply.stats = {"unfinished": True}
            self.view.history.save(self.conversation.id, self.reply)
        self.view.meter.add(self.label, tokens - self._tokens)
        self._tokens = tokens
        cursor = self.transcript.textCursor()
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.insertText(piece)
        self.transcript.verticalScrollBar().setValue(self.transcript.verticalScrollBar().maximum())
        self.streamed.emit(piece, tokens)

    def _on_done(self, reply: Reply) -> None:
        message, self.reply, self.key = self.reply, None, None
        self.last_reply = reply
        conv = self.conversation
        if message is not None:
            message.content = reply.text
            message.stats = reply.to_json()
            if reply.text:
                self.view.history.save(conv.id, message)
            else:
                conv.messages.remove(message)
                if message.id is not None:
                    self.view.history.remove_message(message.id)
        if reply.tokens and len(reply.tokens) > self._tokens:
            self.view.meter.add(self.label, len(reply.tokens) - self._tokens)
        if reply.error:
            self.view.banner.error(f"The reply failed: {reply.error}")
        self.stats.setText(format_stats(reply.to_json()) if reply.tokens else
                           ("stopped" if reply.stopped_by == "cancelled" else ""))
        self.render()
        self._update_buttons()
        self.view.conversations_changed()
        self.finished.emit(reply)

    def _update_buttons(self) -> None:
        has_reply = any(m.role == "assistant" and m.content for m in self.conversation.messages)
        self.send_button.setEnabled(not self.busy)
        self.stop_button.setEnabled(self.busy)
        self.regenerate_button.setEnabled(not self.busy and bool(self.conversation.messages))
        self.copy_button.setEnabled(has_reply and not self.busy)

    def render(self) -> None:
        """The whole conversation; a reply in progress is the last paragraph, so streamed text is
        appended at the document's end."""
        parts = []
        for m in self.conversation.messages:
            who = "You" if m.role == "user" else "Assistant"
            parts.append(f"<p style='margin-top:0.8em'><b>{who}</b></p>")
            stats = format_stats(m.stats) if m.role == "assistant" and m is not self.reply else ""
            body = html.escape(m.content)
            parts.append(f"<p style='white-space:pre-wrap'>{body}</p>")
            if stats:
                parts.append(f"<p><small><i>{html.escape(stats)}</i></small></p>")
        if not parts:
            parts.append("<p><i>Ask something to start. Replies stream from the model as they are "
                         "generated.</i></p>")
        self.transcript.setHtml("".join(parts))
        if self.reply is not None:
            # the reply paragraph was rendered empty: put its text (if any) at the very end
            cursor = self.transcript.textCursor()
            cursor.movePosition(QTextCursor.MoveOperation.End)
            self.transcript.setTextCursor(cursor)
        self.transcript.verticalScrollBar().setValue(self.transcript.verticalScrollBar().maximum())


class ChatView(QWidget):
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

        self.saved = QListWidget()
        self.saved.setTextElideMode(Qt.TextElideMode.ElideRight)  # long titles end in "…" (the tooltip has it all)
        self.saved.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.saved.itemActivated.connect(lambda item: self.open_conversation(item.data(Qt.ItemDataRole.UserRole)))
        new_button = QPushButton("New chat")
        new_button.clicked.connect(lambda: self.new_chat())
        delete_button = QPushButton("Delete")
        delete_button.clicked.connect(self.delete_selected)
        left = QWidget()
        left_layout = QVBoxLayout(left)
        left_layout.setContentsMargins(0, 0, 0, 0)
        saved_label = QLabel("Saved chats")
        saved_label.setObjectName("hint")
        left_layout.addWidget(saved_label)
        left_layout.addWidget(self.saved, 1)
        row = QHBoxLayout()
        row.addWidget(new_button)
        row.addWidget(delete_button)
        left_layout.addLayout(row)

        self.tabs = QTabWidget()
        self.tabs.setTabsClosable(True)
        self.tabs.setMovable(True)
        self.tabs.tabCloseRequested.connect(self.close_tab)
        plus = QPushButton("+")
        plus.setToolTip("New chat tab")
        plus.setFlat(True)
        plus.clicked.connect(lambda: self.new_chat())
        self.tabs.setCornerWidget(plus, Qt.Corner.TopRightCorner)
        self.live = LiveRatePlot(self.meter, "Live tokens per second per chat", theme)

        right = splitter(Qt.Orientation.Vertical, (self.tabs, 4), (self.live, 1))
        split = splitter(Qt.Orientation.Horizontal, (left, 1), (right, 4))
        layout = QVBoxLayout(self)
        layout.addWidget(self.banner)
        layout.addWidget(split, 1)

        self.conversations_changed()
        recent = history.conversations()
        if recent:
            self.open_conversation(recent[0].id)
        else:
            self.new_chat()

    # --- tabs ----------------------------------------------------------------------------------------

    def tab(self, index: int) -> ChatTab:
        return self.tabs.widget(index)

    def all_tabs(self) -> list[ChatTab]:
        return [self.tabs.widget(i) for i in range(self.tabs.count())]

    def new_chat(self, conversation: Conversation | None = None) -> ChatTab:
        tab = ChatTab(self, conversation or Conversation(None, ""), f"chat {next(self._labels)}")
        tab.title_changed.connect(lambda: self._retitle(tab))
        index = self.tabs.addTab(tab, tab.title())
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
        return self.new_chat(conversation)

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

    # --- saved conversations -------------------------------------------------------------------------

    def conversations_changed(self) -> None:
        self.saved.clear()
        for conv in self.history.conversations():
            item = QListWidgetItem(conv.title or "(untitled)")
            item.setData(Qt.ItemDataRole.UserRole, conv.id)
            item.setToolTip(conv.title)
            self.saved.addItem(item)

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
        self.live.set_theme(settings.theme)

    def shutdown(self) -> None:
        for tab in self.all_tabs():
            tab.close_tab()
        self.controller.shutdown()
