"""One conversation in a tab: ``ChatTab`` renders its ``ConversationModel`` and runs its replies.

A streaming reply is rendered as Markdown as it grows (at most every ``RENDER_EVERY_MS``, an
unclosed code fence as a code block so far); Stop, Regenerate (sampled anew), per-message Copy,
Edit and Delete, a system prompt, the chat's sampling settings, the context it uses and each
reply's speed.
"""

from __future__ import annotations

import html
import random
import time
from typing import TYPE_CHECKING
from urllib.parse import unquote

from PySide6.QtCore import QTimer, QUrl, Signal
from PySide6.QtGui import (QDesktopServices, QKeySequence, QShortcut, QTextCursor, QTextDocument,
                           QTextDocumentFragment)
from PySide6.QtWidgets import (QApplication, QDialog, QDialogButtonBox, QLabel, QLineEdit, QMessageBox,
                               QPlainTextEdit, QProgressBar, QPushButton, QVBoxLayout, QWidget)

from engine.conversation.sources import with_sources
from engine.runtime.decode.sampling import SamplingParams
from engine.runtime.decode.service import Reply
from fleetgui.chat.model import ConversationModel
from fleetgui.chat_options import DEFAULT_PRESET, SamplingPanel, preset_options, sampling_params
from fleetgui.chat_options import describe as describe_options
from fleetgui.chat_tools import ToolConsent, call_html, result_html
from fleetgui.documents import cite, sources_html
from fleetgui.history import Conversation, Message, to_markdown
from fleetgui.markdown import REPLY_LINK, Transcript, code_blocks, message_html
from fleetgui.widgets import flow_bar, plain, unbidi

if TYPE_CHECKING:
    from fleetgui.chat.view import ChatView

SAVE_EVERY_S = 1.0  # how often a reply in progress is written to the history (write-ahead)
RENDER_EVERY_MS = 100  # a streaming reply is rendered again at most this often, not per token
RENDER_SHARE = 0.25  # and a long reply's renders take at most about this share of the GUI thread


def ask(parent: QWidget, title: str, question: str, action: str) -> bool:
    """Whether the user confirms ``question`` (the confirming button says ``action``)."""
    box = plain(QMessageBox(QMessageBox.Icon.Question, title, question,  # it may quote a reply's link
                            QMessageBox.StandardButton.Ok | QMessageBox.StandardButton.Cancel, parent))
    box.button(QMessageBox.StandardButton.Ok).setText(action)
    box.setDefaultButton(QMessageBox.StandardButton.Cancel)
    try:
        return box.exec() == QMessageBox.StandardButton.Ok
    finally:
        box.deleteLater()  # not left among the parent's children, one per question



def format_stats(stats: dict) -> str:
    """A reply's figures in plain words (speed, first token, length, why it ended); the
    speculative-decoding figures are in ``stats_tooltip``."""
    if not stats:
        return ""
    if stats.get("unfinished"):
        return "interrupted: the app closed before this reply ended"
    first = f"first token {stats.get('ttft_ms', 0):.0f} ms"
    if stats.get("startup_s") is not None:  # the reply waited for the model to start: say so, apart
        first = (f"first token {stats.get('ttft_ms', 0) / 1000:.1f} s after the model started "
                 f"(start-up {stats['startup_s']:.0f} s)")
    parts = [f"{stats.get('decode_tok_s', 0):.1f} tok/s", first, f"{stats.get('new_tokens', 0)} tokens"]
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
        self.model = ConversationModel(view.history, conversation, self)
        self.model.title_changed.connect(self.title_changed)
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
        self._earlier: list[str] = []  # the replies a regeneration replaces, kept as its earlier versions

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
        self.tools = ToolConsent(self)  # MCP tools: offered to each reply, each call asked about

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
    def conversation(self) -> Conversation:
        return self.model.conversation

    @property
    def options(self) -> dict:
        return self.conversation.options

    def title(self) -> str:
        title = unbidi(self.conversation.title or "New chat")
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
        self.model.set_options({**self.conversation.options, **options})  # keeps the chat's documents
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
        self.conversation.system = self.system.text().strip()
        self.model.ask(text)
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
            old = self.model.remove(len(messages) - 1)
            self._earlier = list(old.stats.get("versions") or [old.content])
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
        self.model.remove(index)
        self.render()
        self._update_buttons()

    def _drop_from(self, index: int) -> None:
        self.model.drop_from(index)
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
        elif action == "version" and len(parts) == 2 and parts[0] < len(self.conversation.messages):
            self.show_version(parts[0], parts[1])

    def show_version(self, index: int, version: int) -> None:
        """Shows version ``version`` of reply ``index`` (a regenerated reply keeps the ones it
        replaced): the conversation carries on from the one shown."""
        message = self.conversation.messages[index]
        versions = message.stats.get("versions") or []
        if self.busy or not 0 <= version < len(versions):
            return
        message.content = versions[version]
        message.stats = {**message.stats, "version": version}
        self.model.write(message)
        self.render()

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
        if self._earlier:
            self.reply.stats["versions"], self._earlier = self._earlier, []
        self.model.insert(self.reply)
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
            self.model.write(self.reply)
        self.view.meter.add(self.label, tokens - self._tokens)
        self._tokens = tokens
        if not self._render_timer.isActive():
            self._render_timer.start()
        self.streamed.emit(piece, tokens)

    def _render_reply(self) -> None:
        """Renders the reply in progress as Markdown in place of what it showed before, leaving the
        rest of the transcript as it is."""
        index = self.model.index_of(self.reply)
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
        startup = self.view.controller.startup_wait(self.key)
        message, self.reply, self.key = self.reply, None, None
        self.last_reply = reply
        stats = reply.to_json()
        if startup is not None:
            stats["startup_s"] = round(startup, 1)
        if message is not None:
            message.content = reply.text
            kept = {k: message.stats[k] for k in ("seed", "sources") if message.stats.get(k) is not None}
            earlier = message.stats.get("versions") or []
            message.stats = {**stats, **kept}
            if earlier and not reply.text:  # nothing new: the last version stays
                message.content, message.stats = earlier[-1], {"versions": earlier, "version": len(earlier) - 1}
            elif earlier:
                message.stats |= {"versions": [*earlier, reply.text], "version": len(earlier)}
            stats = message.stats
            self.tools.take_calls(message, reply.text)  # its calls (if any) wait for the user
            if message.content or message.stats.get("tool_calls"):
                self.model.write(message)
            else:
                self.model.remove_message(message)
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
            versions = (m.stats.get("versions") or []) if m.role == "assistant" and not self.busy else []
            if len(versions) > 1:
                shown = m.stats.get("version", len(versions) - 1)
                links.append("version " + " ".join(f"<b>{k + 1}</b>" if k == shown else
                                                   f"<a href='version:{i}:{k}'>{k + 1}</a>"
                                                   for k in range(len(versions))))
            if not self.busy:
                links.append(f"<a href='delete:{i}'>Delete</a>")
            parts.append(f"<p style='margin-top:0.8em'><b>{who}</b>&nbsp;&nbsp;<small>{' · '.join(links)}</small></p>")
            if m.role == "assistant":
                parts.append(cite(message_html(m.content, i, theme), i, len(m.stats.get("sources") or [])))
            else:
                parts.append(f"<p style='white-space:pre-wrap'>{html.escape(unbidi(m.content))}</p>")
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

