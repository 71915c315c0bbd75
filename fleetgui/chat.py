"""The Chat view: conversations in tabs, each one stream of the engine's chat service.

``ChatController`` owns the service for the window: it opens it off the GUI thread on first use
(exporting or pulling the model if needed), queues requests until it is up, and relays the
service's callbacks (called on its scheduler thread) to the GUI thread through queued signals.
``ChatTab`` is one conversation: a streaming reply rendered as Markdown as it grows (at most every
``RENDER_EVERY_MS``, an unclosed code fence as a code block so far), Stop,
Regenerate (sampled anew), per-message Copy, Edit and Delete, a system prompt, the chat's sampling
settings, the context it uses and each reply's speed.  ``ChatView`` holds the model picker, the
tabs, the saved conversations (search, rename, export), the document collections chats answer from
(``fleetgui.documents``) and the live tok/s plot.
"""

from __future__ import annotations

import html
import itertools
import random
import time
from pathlib import Path
from urllib.parse import unquote

from PySide6.QtCore import QObject, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import (QDesktopServices, QKeySequence, QShortcut, QTextCursor, QTextDocument,
                           QTextDocumentFragment)
from PySide6.QtWidgets import (QApplication, QComboBox, QDialog, QDialogButtonBox, QFileDialog, QHBoxLayout,
                               QInputDialog, QLabel, QLineEdit, QListWidget, QListWidgetItem, QMessageBox,
                               QPlainTextEdit, QProgressBar, QPushButton, QTabWidget, QVBoxLayout, QWidget)

from engine.config import paths
from engine.errors import FleetError
from engine.fleet.fit import measured_key, record_measured
from engine.models.catalog import CATALOG
from engine.progress import Progress
from engine.runtime.decode.sampling import SamplingParams
from engine.runtime.decode.service import Reply
from engine.serve.tools import prepare
from fleetgui.chat_options import DEFAULT_PRESET, SamplingPanel, preset_options, sampling_params
from fleetgui.chat_options import describe as describe_options
from fleetgui.chat_tools import McpTools, ToolLoop, call_html, result_html
from fleetgui.documents import DocumentsPanel, sources_html, with_sources
from fleetgui.history import Conversation, HistoryStore, Message, to_json, to_markdown
from fleetgui.markdown import REPLY_LINK, Transcript, code_blocks, message_html
from fleetgui.model_cards import ModelBrowser
from fleetgui.plots import LiveRatePlot, RateMeter
from fleetgui.progress import ProgressPanel
from fleetgui.widgets import Banner, flow_bar, plain, plain_tip, splitter
from fleetgui.workers import TaskRunner

SAVE_EVERY_S = 1.0  # how often a reply in progress is written to the history (write-ahead)
RENDER_EVERY_MS = 100  # a streaming reply is rendered again at most this often, not per token
RENDER_SHARE = 0.25  # and a long reply's renders take at most about this share of the GUI thread
# settings whose change needs a new service (the rest apply per request)
SERVICE_KEYS = ("fleet_key_file", "default_model", "stages", "weights", "device", "mode", "local_workers",
                "streams", "k", "draft", "draft_model", "draft_at", "tls", "deadline_s", "rejoin_check_s")


def ask(parent: QWidget, title: str, question: str, action: str) -> bool:
    """Whether the user confirms ``question`` (the confirming button says ``action``)."""
    box = plain(QMessageBox(QMessageBox.Icon.Question, title, question,  # it may quote a reply's link
                            QMessageBox.StandardButton.Ok | QMessageBox.StandardButton.Cancel, parent))
    box.button(QMessageBox.StandardButton.Ok).setText(action)
    box.setDefaultButton(QMessageBox.StandardButton.Cancel)
    return box.exec() == QMessageBox.StandardButton.Ok


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
    progress = Signal(object)  # opening the service: a Progress, then None once it is open (or not)
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

    def submit(self, messages: list[dict], max_new_tokens: int, on_text, on_done, sampling=None, tools=None) -> int:
        """Queues a reply; ``on_text(piece, tokens)`` and ``on_done(Reply)`` run on the GUI thread.
        ``sampling``: the engine's ``SamplingParams`` (None: greedy); ``tools``: the ``ToolPlan`` of
        the tools the reply may call (``engine.serve.tools``)."""
        key = next(self._keys)
        self._listeners[key] = (on_text, on_done)
        if self.service is None:
            self._pending.append((key, messages, max_new_tokens, sampling, tools))
            self.open()
        else:
            self._send(key, messages, max_new_tokens, sampling, tools)
        return key

    def cancel(self, key: int | None, forget: bool = False) -> None:
        """Stops a reply (it still ends with ``on_done``, marked cancelled, unless ``forget``)."""
        if key is None:
            return
        if forget:
            self._listeners.pop(key, None)
        for i, (pending, *_) in enumerate(self._pending):
            if pending == key:
                del self._pending[i]
                self._on_done(key, Reply("", [], 0, "cancelled"))
                return
        handle = self._handles.get(key)
        if handle is not None:
            handle.cancel()

    def _send(self, key: int, messages: list[dict], max_new_tokens: int, sampling=None, tools=None) -> None:
        bridge = self._bridge
        extra = {}
        if tools is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            # tools in the prompt, earlier calls and results as the template takes them, the calls held
            # to their schemas
            messages, template_tools = prepare(messages, tools, self.service.tokenizer)
            extra = {"tools": template_tools, "grammar": tools.grammar if tools is not None else None}
        try:
            self._handles[key] = self.service.submit(
                messages, max_new_tokens, on_text=lambda piece, n: bridge.text.emit(key, piece, n),
                on_done=lambda reply: bridge.done.emit(key, reply), sampling=sampling, **extra)
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

    def _loading_progress(self, progress: Progress) -> None:
        self.progress.emit(progress)
        self.status.emit(f"Chat: {progress.text}…")

    def cancel_open(self) -> None:
        """Stops opening the service (a first-run export or pull); queued replies end as errors."""
        if self._loader is not None:
            self._loader.cancel()

    def _opened(self, service) -> None:
        self._loader = None
        self.progress.emit(None)
        if service is None:
            self._open_failed("cancelled")
            return
        self.service = service
        self.status.emit(f"Chat: {service.description}")
        self.service_changed.emit(service)
        pending, self._pending = self._pending, []
        for key, messages, max_new_tokens, sampling, tools in pending:
            self._send(key, messages, max_new_tokens, sampling, tools)
        self.ready.emit()

    def _open_failed(self, message: str) -> None:
        self._loader = None
        self.progress.emit(None)
        self.status.emit("Chat: not connected")
        pending, self._pending = self._pending, []
        for key, *_ in pending:
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
    """A reply's figures in plain words (speed, first token, length, why it ended); the
    speculative-decoding figures are in ``stats_tooltip``."""
    if not stats:
        return ""
    if stats.get("unfinished"):
        return "interrupted: the app closed before this reply ended"
    parts = [f"{stats.get('decode_tok_s', 0):.1f} tok/s", f"first token {stats.get('ttft_ms', 0):.0f} ms",
             f"{stats.get('new_tokens', 0)} tokens"]
    stopped = stats.get("stopped_by")
    parts.append({"cancelled": "stopped", "eos": "complete", "stop": "complete", "max_tokens": "length limit",
                  "error": "failed"}.get(stopped, stopped or ""))
    return " · ".join(p for p in parts if p)


def stats_tooltip(stats: dict) -> str:
    """The details behind a reply's stats line: prompt length, sampling seed, and (for speculative
    decoding) the share of drafted tokens the model accepted."""
    lines = []
    if "prompt_tokens" in stats:
        lines.append(f"Prompt: {stats['prompt_tokens']} tokens" +
                     (f" ({stats['cached_tokens']} reused from the cache)" if stats.get("cached_tokens") else ""))
    if stats.get("seed") is not None:
        lines.append(f"Sampled with seed {stats['seed']}")
    if "acceptance" in stats:
        lines.append(f"Speculative decoding: {stats['acceptance'] * 100:.0f}% of the drafted tokens were accepted "
                     "(higher is faster)")
    return "\n".join(lines)


class ChatTab(QWidget):
    """One conversation and its reply in progress."""

    streamed = Signal(str, int)  # a piece of the reply in progress and the tokens so far
    finished = Signal(object)  # Reply, once a reply ends (for whoever waits on it)
    title_changed = Signal()

    def __init__(self, view: "ChatView", conversation: Conversation, label: str):
        super().__init__()
        self.view = view
        self.conversation = conversation
        self.label = label  # the stream's key in the live plot
        if not conversation.options:
            conversation.options = preset_options(getattr(view.settings, "chat_preset", DEFAULT_PRESET),
                                                  view.settings.max_new_tokens)
        self.key: int | None = None
        self.reply: Message | None = None
        self.last_reply: Reply | None = None
        self._tokens = 0
        self._saved = 0.0  # when the reply in progress was last written to the history
        self._reply_at = 0  # where the reply in progress starts in the transcript's document
        self._render_timer = QTimer(self)
        self._render_timer.setSingleShot(True)
        self._render_timer.setInterval(RENDER_EVERY_MS)
        self._render_timer.timeout.connect(self._render_reply)
        self._regenerations = 0

        self.system = QLineEdit(conversation.system)
        self.system.setPlaceholderText("System prompt (optional): how the assistant should behave")
        self.sampling_button = QPushButton()
        self.sampling_button.setToolTip("this chat's sampling: preset, temperature, top-p, top-k, repetition "
                                        "penalty, max tokens, seed")
        self.sampling_button.clicked.connect(self.open_sampling)
        self.context = QProgressBar()
        self.context.setObjectName("context")
        self.context.setRange(0, 1)
        self.context.setValue(0)
        self.context.setFormat("context: —")
        self.context.setToolTip("how much of the model's context the conversation uses; when it is full the "
                                "oldest messages are left out")
        self.context.setFixedWidth(self.fontMetrics().horizontalAdvance("context: 00000 / 00000 tokens") +
                                   self.fontMetrics().averageCharWidth() * 4)  # the whole text on one line
        self.transcript = Transcript()
        self.transcript.setObjectName("transcript")
        self.transcript.setOpenLinks(False)
        self.transcript.anchorClicked.connect(self._link)
        self.stats = plain(QLabel())  # it names the tool that runs, as its MCP server calls it
        self.stats.setObjectName("stats")
        self.input = QPlainTextEdit()
        self.input.setPlaceholderText("Message (Ctrl+Enter sends)")
        self.input.setMaximumHeight(self.fontMetrics().lineSpacing() * 6)
        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("primary")
        self.stop_button = QPushButton("Stop")
        self.regenerate_button = QPushButton("Regenerate")
        self.regenerate_button.setToolTip("a new reply in place of the last one, sampled anew")
        self.copy_button = QPushButton("Copy chat")
        self.copy_button.setToolTip("the whole conversation as Markdown (each message has its own Copy link)")
        self.send_button.clicked.connect(self.send)
        self.stop_button.clicked.connect(self.stop)
        self.regenerate_button.clicked.connect(self.regenerate)
        self.copy_button.clicked.connect(self.copy)
        QShortcut(QKeySequence("Ctrl+Return"), self.input, activated=self.send)
        self.tools = ToolLoop(self)  # MCP tools: offered to each reply, each call asked about

        layout = QVBoxLayout(self)
        layout.addWidget(self.system)
        layout.addWidget(self.transcript, 1)
        layout.addWidget(self.stats)
        layout.addWidget(self.tools.bar)
        layout.addWidget(self.input)
        layout.addWidget(flow_bar(self.tools.mode, self.sampling_button, self.context, self.copy_button,
                                  self.regenerate_button, self.stop_button, self.send_button, align_right=True)[0])
        self.stats.setWordWrap(True)
        self.stats.hide()
        replies = [m for m in conversation.messages if m.role == "assistant"]
        if replies:  # an opened chat shows its last reply's figures where a new reply's appear
            self._set_stats(format_stats(replies[-1].stats))
            self.stats.setToolTip(stats_tooltip(replies[-1].stats))
        self._show_options()
        self.render()
        self._update_buttons()

    @property
    def busy(self) -> bool:
        return self.key is not None or self.tools.active

    def _set_stats(self, text: str) -> None:
        self.stats.setText(text)
        self.stats.setVisible(bool(text))  # no empty line above the input

    @property
    def options(self) -> dict:
        return self.conversation.options

    def title(self) -> str:
        title = self.conversation.title or "New chat"
        return title if len(title) <= 24 else title[:23] + "…"

    # --- sampling ------------------------------------------------------------------------------------

    def open_sampling(self) -> QDialog:
        """The chat's sampling settings in a small dialog; edits apply to the next reply."""
        dialog = QDialog(self)
        dialog.setWindowTitle(f"Sampling: {self.title()}")
        panel = SamplingPanel(self.options, dialog)
        panel.changed.connect(self.set_options)
        close = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        close.rejected.connect(dialog.reject)
        layout = QVBoxLayout(dialog)
        layout.addWidget(panel)
        layout.addWidget(close)
        dialog.panel = panel
        dialog.finished.connect(dialog.deleteLater)
        dialog.open()
        return dialog

    def set_options(self, options: dict) -> None:
        self.conversation.options = {**self.conversation.options, **options}  # keeps the chat's documents
        if self.conversation.id is not None:
            self.view.history.update(self.conversation)
        self._show_options()

    def _show_options(self) -> None:
        self.sampling_button.setText(describe_options(self.options))

    def _sampling(self, fresh: bool) -> tuple[SamplingParams | None, int | None]:
        """The engine's sampling for the next reply and its seed; ``fresh`` (Regenerate) draws with
        a seed of its own, so the new reply differs from the last."""
        options = self.options
        if options["temperature"] == 0:
            return None, None  # greedy: the engine's top-1 path (the same reply every time)
        seed = options.get("seed")
        if fresh or seed is None:
            seed = random.randrange(2**31)
        return sampling_params(options, seed), seed

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
            conv.id = history.create(conv.title, conv.system, conv.options)
            self.title_changed.emit()
        else:
            history.update(conv)
        message = Message("user", text)
        conv.messages.append(message)
        history.append(conv.id, message)
        self.view.conversations_changed()
        self._start_reply(fresh=False)

    def stop(self) -> None:
        self.view.controller.cancel(self.key)
        self.tools.cancel()

    def regenerate(self) -> None:
        """Replaces the last reply with a new one to the same conversation, sampled anew: to the
        user's message, or to the tool results it answered (the calls and their results stay)."""
        messages = self.conversation.messages
        if self.busy or not messages:
            return
        if messages[-1].role == "assistant":
            last = messages.pop()
            if last.id is not None:
                self.view.history.remove_message(last.id)
        if messages and messages[-1].role in ("user", "tool"):
            self._start_reply(fresh=True, question=messages[-1].role == "user")

    def copy(self) -> None:
        if self.conversation.messages:
            QApplication.clipboard().setText(to_markdown(self.conversation))

    def copy_message(self, index: int) -> None:
        QApplication.clipboard().setText(self.conversation.messages[index].content)

    def edit_message(self, index: int) -> None:
        """Puts message ``index`` (the user's) back in the input, and drops it and everything after
        it: Send asks again from there."""
        if self.busy:
            return
        message = self.conversation.messages[index]
        self._drop_from(index)
        self.input.setPlainText(message.content)
        self.input.setFocus()

    def delete_message(self, index: int) -> None:
        if self.busy:
            return
        message = self.conversation.messages.pop(index)
        if message.id is not None:
            self.view.history.remove_message(message.id)
        self.render()
        self._update_buttons()

    def _drop_from(self, index: int) -> None:
        messages = self.conversation.messages
        for message in messages[index:]:
            if message.id is not None:
                self.view.history.remove_message(message.id)
        del messages[index:]
        self.render()
        self._update_buttons()

    def _link(self, url) -> None:
        """A click on a link in the transcript: our own actions (copy, edit, delete, regenerate, copy
        code), or a link in a reply's text (``REPLY_LINK``), which at most opens in the browser, and
        only a web link, when the user says so."""
        text = url.toString()
        if text.startswith(REPLY_LINK):
            target = unquote(text[len(REPLY_LINK):])
            if target.lower().startswith(("http://", "https://")) and ask(
                    self, "Open link", f"Open this link from the reply in your browser?\n\n{target[:500]}", "Open"):
                QDesktopServices.openUrl(QUrl(target))
            return
        action, _, where = text.partition(":")
        parts = [int(p) for p in where.split(":") if p.isdigit()]
        if action == "copycode" and len(parts) == 2:
            blocks = code_blocks(self.conversation.messages[parts[0]].content)
            QApplication.clipboard().setText(blocks[parts[1]][1])
        elif action == "copy" and parts:
            self.copy_message(parts[0])
        elif action == "edit" and parts:
            self.edit_message(parts[0])
        elif action == "delete" and parts and parts[0] < len(self.conversation.messages):
            who = "your message" if self.conversation.messages[parts[0]].role == "user" else "this reply"
            if ask(self, "Delete message", f"Delete {who} from the chat? This cannot be undone.", "Delete"):
                self.delete_message(parts[0])
        elif action == "source" and len(parts) == 2 and parts[0] < len(self.conversation.messages):
            self.view.documents.show_source(self.conversation.messages[parts[0]].stats.get("sources", []), parts[1])
        elif action == "regenerate":
            self.regenerate()

    def last_text(self) -> str:
        replies = [m for m in self.conversation.messages if m.role == "assistant"]
        return replies[-1].content if replies else ""

    def close_tab(self) -> None:
        self.view.controller.cancel(self.key, forget=True)
        self.key = None
        self.tools.cancel()

    # --- the reply -----------------------------------------------------------------------------------

    def _start_reply(self, fresh: bool, question: bool = True) -> None:
        """Asks the model for a reply: to the user's message (``question``) or, after tool calls, to
        their results."""
        conv = self.conversation
        conv.system = self.system.text().strip()
        sources = self.view.documents.sources_for(conv)  # the chat's documents that answer the question
        prompt = with_sources(conv.prompt(), sources)
        sampling, seed = self._sampling(fresh)
        self.reply = Message("assistant", "", {"seed": seed} if seed is not None else {})
        if sources:
            self.reply.stats["sources"] = sources
        conv.messages.append(self.reply)
        self._tokens = 0
        self._saved = 0.0
        self._render_timer.setInterval(RENDER_EVERY_MS)
        self._set_stats("waiting for the model…" if self.view.controller.service is None else "generating…")
        self.stats.setToolTip("")
        self.render()
        self.view.meter.begin(self.label)
        self.view.live.set_name(self.label, self.title())
        self.key = self.view.controller.submit(prompt, int(self.options["max_tokens"]), self._on_text, self._on_done,
                                               sampling=sampling, tools=self.tools.next_plan(question))
        self._update_buttons()

    def _on_text(self, piece: str, tokens: int) -> None:
        if self.reply is None:
            return
        self._set_stats(f"generating… {tokens} tokens")
        self.reply.content += piece
        if time.monotonic() - self._saved >= SAVE_EVERY_S:  # write-ahead: a killed app keeps the reply so far
            self._saved = time.monotonic()
            self.reply.stats = {**self.reply.stats, "unfinished": True}
            self.view.history.save(self.conversation.id, self.reply)
        self.view.meter.add(self.label, tokens - self._tokens)
        self._tokens = tokens
        if not self._render_timer.isActive():
            self._render_timer.start()
        self.streamed.emit(piece, tokens)

    def _render_reply(self) -> None:
        """Renders the reply in progress as Markdown in place of what it showed before, leaving the
        rest of the transcript as it is."""
        index = next((i for i, m in enumerate(self.conversation.messages) if m is self.reply), None)
        if index is None:
            return
        bar = self.transcript.verticalScrollBar()
        following = bar.value() >= bar.maximum() - 4  # the reader is at the end: keep up with the text
        at = min(self._reply_at, self.transcript.document().characterCount() - 1)
        cursor = QTextCursor(self.transcript.document())
        cursor.setPosition(at)
        cursor.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()
        started = time.perf_counter()
        rendered = QTextDocument()
        rendered.setHtml(message_html(self.reply.content, index, self.view.settings.theme))
        cursor.insertFragment(QTextDocumentFragment(rendered))
        # the first block merged into the empty paragraph the reply starts in: give it its own format
        # back (a heading's level and margins)
        cursor.setPosition(at)
        cursor.setBlockFormat(rendered.firstBlock().blockFormat())
        if following:
            bar.setValue(bar.maximum())
        took_ms = (time.perf_counter() - started) * 1000
        self._render_timer.setInterval(max(RENDER_EVERY_MS, round(took_ms / RENDER_SHARE)))

    def _on_done(self, reply: Reply) -> None:
        self._render_timer.stop()  # the full render below shows the whole reply
        message, self.reply, self.key = self.reply, None, None
        self.last_reply = reply
        conv = self.conversation
        stats = reply.to_json()
        if message is not None:
            message.content = reply.text
            kept = {k: message.stats[k] for k in ("seed", "sources") if message.stats.get(k) is not None}
            message.stats = {**stats, **kept}
            stats = message.stats
            self.tools.take_calls(message, reply.text)  # its calls (if any) wait for the user
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
        self._set_stats(format_stats(stats) if reply.tokens else
                           ("stopped" if reply.stopped_by == "cancelled" else ""))
        self.stats.setToolTip(stats_tooltip(stats))
        self._show_context(reply)
        self.render()
        self._update_buttons()
        self.view.conversations_changed()
        self.tools.ask()
        self.finished.emit(reply)

    def _show_context(self, reply: Reply) -> None:
        service = self.view.controller.service
        limit = getattr(service, "max_length", None)
        if not limit or not reply.prompt_tokens:
            return
        used = min(limit, reply.prompt_tokens + len(reply.tokens))
        self.context.setRange(0, limit)
        self.context.setValue(used)
        self.context.setFormat(f"context: {used} / {limit} tokens")

    def _update_buttons(self) -> None:
        has_reply = any(m.role == "assistant" and m.content for m in self.conversation.messages)
        self.send_button.setEnabled(not self.busy)
        self.stop_button.setEnabled(self.busy)
        self.regenerate_button.setEnabled(not self.busy and bool(self.conversation.messages))
        self.copy_button.setEnabled(has_reply and not self.busy)

    def render(self) -> None:
        """The whole conversation, Markdown rendered, each message with its actions; a reply in
        progress is last, so ``_render_reply`` replaces just it as it grows."""
        theme = self.view.settings.theme
        parts = []
        messages = self.conversation.messages
        last_reply = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=-1)
        for i, m in enumerate(messages):
            who = "You" if m.role == "user" else "Assistant"
            if m.role == "tool":
                parts.append(result_html(m))
                continue
            if m is self.reply:
                parts.append(f"<p style='margin-top:0.8em'><b>{who}</b></p><p style='white-space:pre-wrap'></p>")
                continue
            links = [f"<a href='copy:{i}'>Copy</a>"]
            if m.role == "user":
                links.append(f"<a href='edit:{i}'>Edit</a>")
            elif i == last_reply and not self.busy:
                links.append("<a href='regenerate:'>Regenerate</a>")
            if not self.busy:
                links.append(f"<a href='delete:{i}'>Delete</a>")
            parts.append(f"<p style='margin-top:0.8em'><b>{who}</b>&nbsp;&nbsp;<small>{' · '.join(links)}</small></p>")
            parts.append(message_html(m.content, i, theme) if m.role == "assistant" else
                         f"<p style='white-space:pre-wrap'>{html.escape(m.content)}</p>")
            parts.append(sources_html(m.stats.get("sources"), i) if m.role == "assistant" else "")
            parts.extend(call_html(c) for c in m.stats.get("tool_calls", []))
            stats = format_stats(m.stats) if m.role == "assistant" and i != last_reply else ""
            if stats:  # the last reply's figures are in the line under the transcript
                parts.append(f"<p><small><i>{html.escape(stats)}</i></small></p>")
        if not parts:
            parts.append("<p><i>Ask something to start. Replies stream from the model as they are "
                         "generated.</i></p>")
        self.transcript.setHtml("".join(parts))
        if self.reply is not None:
            cursor = self.transcript.textCursor()
            cursor.movePosition(QTextCursor.MoveOperation.End)
            self.transcript.setTextCursor(cursor)
            self._reply_at = cursor.position()
            if self.reply.content:
                self._render_reply()
        self.transcript.verticalScrollBar().setValue(self.transcript.verticalScrollBar().maximum())


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
                tab.conversation.title = title
                self._retitle(tab)
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
        self.mcp.close()
