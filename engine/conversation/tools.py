"""The agentic tool loop of a conversation: which tools each reply may call, the calls a finished
reply made (answered one at a time), and each call's result as the ``tool`` message the model reads
before it replies again, until it answers without a call (at most ``MAX_ROUNDS`` replies per question).

The tools are MCP servers' (``engine.serve.mcp``), offered through the grammar-held calls of
``engine.serve.tools``.  Who decides whether a call runs (the app asks the user), and where it runs
(off the app's GUI thread), is the front end's: ``ToolLoop`` only keeps the loop's state.
"""

from __future__ import annotations

import json

from engine.errors import FleetError
from engine.serve.mcp import McpHub, McpTool
from engine.serve.tools import ToolPlan, parse, plan_tools

MAX_ROUNDS = 8  # model replies per question; the last one may not call a tool
MODES = ("off", "auto", "required")  # no tools; the model decides; the first reply must call one
RESULT_CHARS = 20000  # a tool result longer than this is cut for the model (and the transcript)


class ToolLoop:
    """One conversation's tool calls between its replies."""

    def __init__(self):
        self.rounds = 0  # replies since the user's last message
        self.plan: ToolPlan | None = None  # the tools the reply in progress may call
        self.pending: list[dict] = []  # calls of the last reply not yet answered

    @property
    def active(self) -> bool:
        """Calls are waiting to be answered: the conversation is busy."""
        return bool(self.pending)

    def next_plan(self, tools: list[McpTool], mode: str, new_question: bool) -> ToolPlan | None:
        """The tools the next reply may call (None: none), per ``mode`` (one of ``MODES``): the first
        reply to a question may be made to call one, the last of ``MAX_ROUNDS`` may not.  Raises
        ``FleetError`` when the tools cannot be offered (a schema the grammar cannot hold)."""
        if new_question:
            self.rounds = 0
        self.rounds += 1
        self.plan = None
        if mode == "off" or not tools or self.rounds >= MAX_ROUNDS:
            return None
        choice = "required" if mode == "required" and self.rounds == 1 else "auto"
        self.plan = plan_tools([t.openai() for t in tools], choice, parallel=False)
        return self.plan

    def take_calls(self, text: str) -> tuple[str, list[dict]] | None:
        """A finished reply's text: its content beside the calls and the calls, which now wait to be
        answered; None when the reply was offered no tools or called none."""
        plan, self.plan = self.plan, None
        if plan is None or not text:
            return None
        content, calls = parse(text, plan.names)
        if not calls:
            return None
        self.pending = list(calls)
        return content or "", calls

    def answer(self, text: str, error: bool = False) -> tuple[str, dict]:
        """The first waiting call answered with ``text`` (its result, or why it did not run): the tool
        message's content (cut at ``RESULT_CHARS``) and what the message keeps beside it (the call's
        id and function, and whether it failed)."""
        call, self.pending = self.pending[0], self.pending[1:]
        if len(text) > RESULT_CHARS:
            text = text[:RESULT_CHARS] + f"\n[… cut: {len(text) - RESULT_CHARS} more characters]"
        kept = {"tool_call_id": call["id"], "name": call["function"]["name"]}
        return text, {**kept, "error": True} if error else kept

    def cancel(self) -> None:
        """Stop: the waiting calls are dropped."""
        self.pending = []


def arguments_of(call: dict, hub: McpHub | None) -> dict:
    """The arguments ``call`` passes, checked before it runs on ``hub``; ``FleetError`` with the reason
    (the model reads it as the call's result) when it cannot run."""
    try:
        arguments = json.loads(call["function"]["arguments"] or "{}")
    except ValueError as exc:
        raise FleetError(f"The arguments are not valid JSON: {exc}") from None
    if hub is None:
        raise FleetError("The MCP servers are turned off.")
    if not isinstance(arguments, dict):
        raise FleetError("The arguments must be a JSON object.")
    return arguments
