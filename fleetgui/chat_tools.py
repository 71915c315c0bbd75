"""The chat's tools from MCP servers (``engine.serve.mcp``): ``McpTools`` keeps the window's
connections (opened off the GUI thread when the settings list servers) and the tools they offer;
``ToolConsent`` is one chat's face of the engine's tool loop (``engine.conversation.tools``): the
tools mode and the question asked before each call.

A reply that calls a tool (through the grammar-held calls of ``engine.serve.tools``) is shown with
its arguments as plain text, and the bar under the transcript asks: Allow once, Always allow this
tool (kept in the settings, for the server as it is: one replaced under its name asks again), or
Deny.  Only a click answers, and only once the buttons are armed (``CONSENT_DELAY_MS``): they never
take the keyboard's focus, which stays where the user types, so a keystroke meant for the next
message cannot run a tool.  An allowed call runs off the GUI thread; its result (or the error of a
server that crashed or timed out) becomes a ``tool`` message and the model is asked again, until it
answers without a call (the loop's rounds are the engine's).
"""

from __future__ import annotations

import html
import json

from PySide6.QtCore import QObject, Qt, QTimer, Signal
from PySide6.QtWidgets import QComboBox, QFrame, QHBoxLayout, QLabel, QPushButton

from engine.config import allow_tool
from engine.conversation.tools import ToolLoop, arguments_of
from engine.errors import FleetError
from engine.serve.mcp import McpError, McpHub, McpServer, McpTool, offer, servers_from_settings
from fleetgui.history import Message
from fleetgui.widgets import plain, plain_tip, unbidi

MODES = {"off": "Tools: off", "auto": "Tools: the model decides", "required": "Tools: call one first"}
# the consent buttons take a click only this long after a question shows: a click (or a double
# click's second half) aimed at what was there a moment before does not answer it
CONSENT_DELAY_MS = 600


class McpTools(QObject):
    """The enabled MCP servers of the settings, connected in the background, and their tools."""

    changed = Signal()  # the tools offered, or a server's state, changed
    failed = Signal(str)  # a server could not be connected

    def __init__(self, tasks, settings, parent: QObject | None = None):
        super().__init__(parent)
        self.tasks = tasks
        self.hub: McpHub | None = None
        self.servers: list[McpServer] = []
        self.listed: dict[str, list[McpTool]] = {}  # server name -> its tools
        self.errors: dict[str, str] = {}
        self.tools: list[McpTool] = []  # as offered to the model
        self.skipped: list[str] = []
        self.always: set[str] = set()
        self._generation = 0
        self.apply_settings(settings)

    def apply_settings(self, settings) -> None:
        """Connects the servers the settings enable (anew where one changed) and forgets the others."""
        self.always = set(getattr(settings, "mcp_always_allowed", []))
        try:
            servers = [s for s in servers_from_settings(getattr(settings, "mcp_servers", [])) if s.enabled]
        except McpError as exc:
            self.failed.emit(f"The MCP servers in the settings cannot be read: {exc}")
            servers = []
        if servers == self.servers:
            return
        self.servers = servers
        self._generation += 1
        self.listed, self.errors = {}, {}
        self._offer()
        if self.hub is not None:
            hub, self.hub = self.hub, None
            self.tasks.start(lambda report, cancel: hub.close(), "close MCP servers")
        if servers:
            self.hub = McpHub()
            for server in servers:
                self.connect(server)

    def connect(self, server: McpServer) -> None:
        hub, generation = self.hub, self._generation

        def listed(tools):
            if generation == self._generation:
                self.listed[server.name] = tools
                self.errors.pop(server.name, None)
                self._offer()

        def failed(message: str):
            if generation == self._generation:
                self.errors[server.name] = message
                self.failed.emit(message)
                self.changed.emit()

        self.tasks.start(lambda report, cancel: hub.tools(server), f"connect MCP server {server.name}",
                         succeeded=listed, failed=failed)

    def _offer(self) -> None:
        self.tools, self.skipped = offer([t for s in self.servers for t in self.listed.get(s.name, [])])
        self.changed.emit()

    def find(self, call_name: str) -> McpTool | None:
        return next((t for t in self.tools if t.call_name == call_name), None)

    def allowed(self, tool: McpTool) -> bool:
        """Whether the user chose "Always allow" for ``tool`` of its server as it is now."""
        return tool.consent in self.always

    def remember(self, tool: McpTool, settings) -> None:
        """"Always allow" for ``tool``: in ``settings`` (the window's) and the saved settings; a save that
        fails raises (``FleetError``, ``OSError``) with the tool allowed for this session."""
        self.always.add(tool.consent)
        settings.mcp_always_allowed = sorted(set(settings.mcp_always_allowed) | {tool.consent})
        allow_tool(tool.consent)

    def describe(self) -> str:
        """The servers' state in a line (the tools button's tooltip)."""
        if not self.servers:
            return "No MCP servers: add them in Settings → MCP servers"
        lines = []
        for server in self.servers:
            if server.name in self.errors:
                lines.append(f"{server.name}: {self.errors[server.name]}")
            elif server.name in self.listed:
                lines.append(f"{server.name}: {len(self.listed[server.name])} tools")
            else:
                lines.append(f"{server.name}: connecting…")
        return "\n".join(lines + [f"left out: {s}" for s in self.skipped])

    def close(self) -> None:
        hub, self.hub = self.hub, None
        self._generation += 1
        if hub is not None:
            hub.close()


def call_html(call: dict) -> str:
    """A tool call as the transcript shows it: the function and its arguments as text (the model's
    output is not trusted markup)."""
    arguments = call["function"]["arguments"]
    try:
        arguments = json.dumps(json.loads(arguments), ensure_ascii=False, indent=1)
    except ValueError:
        pass
    return (f"<p><small>The model calls <b>{html.escape(unbidi(call['function']['name']))}</b> with"
            f"</small></p><pre>{html.escape(unbidi(arguments))}</pre>")


def result_html(message: Message) -> str:
    note = " (error)" if message.stats.get("error") else ""
    return (f"<p style='margin-top:0.8em'><b>Tool result</b> <small>"
            f"{html.escape(unbidi(message.stats.get('name', '')))}{note}</small></p>"
            f"<pre style='white-space:pre-wrap'>{html.escape(unbidi(message.content))}</pre>")


class ToolConsent(QObject):
    """One chat's tool calls (``engine.conversation.tools.ToolLoop``): offers the tools to each reply,
    asks before each call, runs it off the GUI thread and asks the model again with its result."""

    def __init__(self, tab):
        super().__init__(tab)
        self.tab = tab
        self.mcp: McpTools = tab.view.mcp
        self.loop = ToolLoop()
        self.running = None  # the task of the call that runs
        self._cancelled = False

        self.mode = QComboBox(tab)  # a child from the start: shown, it never becomes a window of its own
        for key, label in MODES.items():
            self.mode.addItem(label, key)
        # the chat's own choice, kept with its sampling options ("auto" where it never chose)
        self.mode.setCurrentIndex(max(self.mode.findData(tab.options.get("tools", "auto")), 0))
        self.mode.currentIndexChanged.connect(lambda _: tab.set_options({"tools": self.mode.currentData()}))
        self.mode.setToolTip(plain_tip(self.mcp.describe()))
        self.mcp.changed.connect(self._servers_changed)
        self._servers_changed()

        self.bar = QFrame(tab)
        self.bar.setObjectName("toolbar")
        self.question = plain(QLabel())
        self.question.setWordWrap(True)
        self.allow_button = QPushButton("Allow once")
        self.always_button = QPushButton("Always allow this tool")
        self.deny_button = QPushButton("Deny")
        self.allow_button.clicked.connect(lambda: self.decide("once"))
        self.always_button.clicked.connect(lambda: self.decide("always"))
        self.deny_button.clicked.connect(lambda: self.decide("deny"))
        self.buttons = (self.allow_button, self.always_button, self.deny_button)
        row = QHBoxLayout(self.bar)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.question, 1)
        for button in self.buttons:
            button.setFocusPolicy(Qt.FocusPolicy.NoFocus)  # clicks only: no Space or Enter reaches them
            button.setAutoDefault(False)
            row.addWidget(button)
        self._arming = QTimer(self)
        self._arming.setSingleShot(True)
        self._arming.setTimerType(Qt.TimerType.PreciseTimer)  # never sooner (a coarse one may be 5% early)
        self._arming.setInterval(CONSENT_DELAY_MS)
        self._arming.timeout.connect(lambda: self._arm(True))
        self.bar.hide()

    @property
    def active(self) -> bool:
        """Calls are waiting for the user or running: the chat is busy."""
        return self.loop.active

    @property
    def pending(self) -> list[dict]:
        """The last reply's calls waiting for the user or running."""
        return self.loop.pending

    @pending.setter
    def pending(self, calls: list[dict]) -> None:
        self.loop.pending = calls

    def _servers_changed(self) -> None:
        self.mode.setVisible(bool(self.mcp.servers))
        self.mode.setToolTip(plain_tip(self.mcp.describe()))  # the servers' own error messages

    # --- a reply ---------------------------------------------------------------------------------------

    def next_plan(self, new_question: bool):
        """The tools the next reply may call (None: none), per the chat's mode."""
        try:
            return self.loop.next_plan(self.mcp.tools, self.mode.currentData(), new_question)
        except FleetError as exc:
            self.tab.view.banner.error(f"The MCP tools cannot be offered to the model: {exc}")
            return None

    def take_calls(self, message: Message, text: str) -> None:
        """A finished reply: its tool calls (if the reply was offered tools and made any) go to the
        message's stats, its text beside them stays its content, and the calls wait for the user."""
        taken = self.loop.take_calls(text)
        if taken is None:
            return
        message.content, message.stats["tool_calls"] = taken
        self._cancelled = False

    def ask(self) -> None:
        """Asks about the first waiting call, or runs it when its tool is always allowed."""
        if not self.pending or self.running is not None:
            return
        call = self.pending[0]
        tool = self.mcp.find(call["function"]["name"])
        if tool is not None and self.mcp.allowed(tool):
            self._run(call, tool)
            return
        where = f" (MCP server {tool.server})" if tool is not None else ""
        self.question.setText(f"Run the tool {call['function']['name']}{where} with the arguments shown?")
        self._arm(False)
        self._arming.start()
        self.bar.show()

    def _arm(self, on: bool) -> None:
        for button in self.buttons:
            button.setEnabled(on)

    def decide(self, answer: str) -> None:
        """The user's answer about the first waiting call: ``once``, ``always`` or ``deny``."""
        if not self.pending or self.running is not None:
            return
        self.bar.hide()
        call = self.pending[0]
        tool = self.mcp.find(call["function"]["name"])
        if answer == "deny":
            self._result(call, "The user did not allow this call.", error=True)
            return
        if tool is None:
            self._result(call, f"No tool named {call['function']['name']} is connected.", error=True)
            return
        if answer == "always":
            try:
                self.mcp.remember(tool, self.tab.view.settings)
            except (FleetError, OSError) as exc:
                self.tab.view.banner.error(f"“Always allow” could not be saved: {exc}")
        self._run(call, tool)

    def _run(self, call: dict, tool: McpTool) -> None:
        hub = self.mcp.hub
        try:
            arguments = arguments_of(call, hub)
        except FleetError as exc:
            self._result(call, str(exc), error=True)
            return
        self.tab._set_stats(f"running {tool.name} on {tool.server}…")
        self.running = self.tab.view.controller.tasks.start(
            lambda report, cancel: hub.call(tool, arguments), f"MCP call {tool.key}",
            succeeded=lambda result: self._ran(call, result.text, result.is_error),
            failed=lambda message: self._ran(call, message, True, crashed=True))

    def _ran(self, call: dict, text: str, error: bool, crashed: bool = False) -> None:
        self.running = None
        if crashed:
            self.tab.view.banner.error(f"The tool call failed: {text}")
        if self._cancelled:
            return
        self._result(call, text, error)

    def _result(self, call: dict, text: str, error: bool = False) -> None:
        """The call's result as a tool message; the next call is asked about, or, all answered, the
        model replies again."""
        tab = self.tab
        message = Message("tool", *self.loop.answer(text, error))
        tab.model.append(message)
        tab.render()
        if self.pending:
            self.ask()
        else:
            tab._start_reply(fresh=False, question=False)

    def cancel(self) -> None:
        """Stop: the waiting calls are dropped (a running one ends unheard) and the chat is free."""
        if not self.pending:
            return
        self._cancelled = True
        self.loop.cancel()
        self.bar.hide()
        self.tab._set_stats("stopped")
        self.tab.render()
        self.tab._update_buttons()

