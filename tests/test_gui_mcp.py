"""MCP tools in the app: the chat offers mcp-server-time's tools (the real server from PyPI over
stdio) to the real SmolLM2, shows the call it makes with its arguments, runs it once the user
allows it, shows the result and the model's answer to it; "Always allow" is kept in the settings
and skips the question, for that very server only (one replaced under its name asks again); no
keystroke, and no click before the buttons are armed, answers the question; a server that crashes
during a call leaves a clear message and a usable chat; and the Settings view's MCP servers dialog
(import, test, save)."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
from gui_support import open_window, screenshot, settings_store, tiny_settings
from mcp_support import TIME_SERVER

from engine.config import Settings
from engine.serve.mcp import McpServer

CRASHING = textwrap.dedent("""
    import os, sys
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("fragile")

    @server.tool()
    def look_up(word: str) -> str:
        "Looks a word up."
        print("segfault (pretend)", file=sys.stderr, flush=True)
        os._exit(11)

    server.run()
""")


@pytest.fixture(autouse=True)
def slow_start(monkeypatch):
    """Servers start slowly on a busy test machine: only the timeout tests of test_mcp rely on timeouts."""
    monkeypatch.setattr("engine.serve.mcp.CONNECT_TIMEOUT_S", 300.0)


@pytest.fixture(scope="module")
def smollm2():
    from engine.export.exporter import export_model

    # module scope: made before a test's own home is set, so it lands in (and reuses) the user's cache
    return export_model("smollm2-135m", stages=1, weights="int4").out


def chat_settings(model, servers):
    from fleetgui.settings import GuiSettings

    return GuiSettings(default_model=str(model), stages=1, weights="int4", local_workers=False, draft="none", k="0",
                       streams=2, max_new_tokens=48, chat_preset="Greedy",
                       mcp_servers=[s.to_json() for s in servers])


def ask(qtbot, tab, text, timeout=300000):
    tab.input.setPlainText(text)
    with qtbot.waitSignal(tab.finished, timeout=timeout) as blocker:
        tab.send()
    return blocker.args[0]


def answer(qtbot, tab, button, timeout=300000):
    """Clicks Allow/Always/Deny once it is armed and waits for the model's next reply."""
    qtbot.waitUntil(button.isEnabled, timeout=5000)
    with qtbot.waitSignal(tab.finished, timeout=timeout) as blocker:
        button.click()
    return blocker.args[0]


def force_a_call(tab):
    tab.tools.mode.setCurrentIndex(tab.tools.mode.findData("required"))


@pytest.mark.real_model
def test_the_model_calls_the_time_server_once_allowed_and_answers(qtbot, gui_home, tmp_path, smollm2):
    window = open_window(qtbot, chat_settings(smollm2, [TIME_SERVER]), settings_store(tmp_path / "s.ini"))
    view = window.chat
    qtbot.waitUntil(lambda: len(view.mcp.tools) == 2, timeout=400000)
    tab = view.all_tabs()[0]
    assert tab.tools.mode.isVisible() and "time: 2 tools" in tab.tools.mode.toolTip()
    force_a_call(tab)  # the first reply must be a call (a 135M model rarely decides on one itself)

    ask(qtbot, tab, "What time is it in London right now?")
    call_message = tab.conversation.messages[-1]
    (call,) = call_message.stats["tool_calls"]
    name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
    assert name in ("get_current_time", "convert_time") and isinstance(arguments, dict)
    # the call and its arguments are in the transcript, as text; the chat waits for the user
    shown = tab.transcript.toPlainText()
    assert f"calls {name} with" in shown and all(str(v) in shown for v in arguments.values())
    assert tab.tools.bar.isVisible() and name in tab.tools.question.text()
    assert tab.busy and not tab.send_button.isEnabled() and tab.stop_button.isEnabled()
    screenshot(window, "tools")

    reply = answer(qtbot, tab, tab.tools.allow_button)
    roles = [m.role for m in tab.conversation.messages]
    assert roles[:4] == ["user", "assistant", "tool", "assistant"], roles
    result = tab.conversation.messages[2]
    assert result.stats["tool_call_id"] == call["id"] and result.stats["name"] == name
    assert "timezone" in result.content.lower()  # the server's answer (a time, or its own error about the zone)
    shown = tab.transcript.toPlainText()
    assert "Tool result" in shown and result.content.splitlines()[0] in shown
    while tab.tools.active:  # the model may call again on its own: say no until it answers
        reply = answer(qtbot, tab, tab.tools.deny_button)
    final = tab.conversation.messages[-1]
    assert final.role == "assistant" and final.content and not final.stats.get("tool_calls")
    assert reply.text and not tab.busy and tab.send_button.isEnabled() and not tab.tools.bar.isVisible()
    assert not Settings.load().mcp_always_allowed  # "once" is not remembered

    # the conversation, calls and results included, is in the history
    stored = window.history.load(tab.conversation.id)
    assert [m.role for m in stored.messages] == [m.role for m in tab.conversation.messages]
    assert stored.messages[1].stats["tool_calls"] == [call]

    # always allow: kept in the settings, and the next call of that tool runs without asking
    ask(qtbot, tab, "And in Tokyo?")
    (again,) = tab.conversation.messages[-1].stats["tool_calls"]
    tool = view.mcp.find(again["function"]["name"])
    answer(qtbot, tab, tab.tools.always_button)
    assert Settings.load().mcp_always_allowed == [tool.consent] and view.settings.mcp_always_allowed == [tool.consent]
    while tab.tools.active:
        answer(qtbot, tab, tab.tools.deny_button)
    if tool.name == "get_current_time":  # the tool remembered is the one the next question calls
        count = len(tab.conversation.messages)
        ask(qtbot, tab, "And in Paris?")
        qtbot.waitUntil(lambda: not tab.busy and tab.conversation.messages[-1].role == "assistant"
                        and len(tab.conversation.messages) > count + 2, timeout=300000)
        assert [m.role for m in tab.conversation.messages[count:count + 3]] == ["user", "assistant", "tool"]
        assert not tab.tools.bar.isVisible()


def test_a_tool_call_is_allowed_by_a_click_once_the_buttons_are_armed_never_by_a_keystroke(qtbot, gui_home, tmp_path):
    import time

    from PySide6.QtCore import Qt

    from fleetgui.chat_tools import CONSENT_DELAY_MS

    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    tab = window.chat.all_tabs()[0]
    tools = tab.tools
    tab.conversation.id = window.history.create("tools")
    tab.input.setFocus()
    qtbot.keyClicks(tab.input, "and what about")  # the user types the next question
    tools.pending = [{"id": "call_0", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
    asked = time.monotonic()
    tools.ask()  # the reply in progress called a tool
    assert tools.bar.isVisible() and window.focusWidget() is tab.input
    for key in (Qt.Key.Key_Space, Qt.Key.Key_Return, Qt.Key.Key_Enter, Qt.Key.Key_Space):
        qtbot.keyClick(window.focusWidget(), key)  # typing on: the keys go where typing goes
    assert tools.pending and tools.bar.isVisible()
    assert tab.input.toPlainText() == "and what about \n\n "  # none of them was lost
    for button in (tools.allow_button, tools.always_button, tools.deny_button):
        qtbot.mouseClick(button, Qt.MouseButton.LeftButton)  # a click meant for what was there before
    assert tools.pending and tools.bar.isVisible() and [m.role for m in tab.conversation.messages] == []

    qtbot.waitUntil(tools.allow_button.isEnabled, timeout=CONSENT_DELAY_MS + 5000)
    assert time.monotonic() - asked >= CONSENT_DELAY_MS / 1000
    qtbot.mouseClick(tools.allow_button, Qt.MouseButton.LeftButton)
    assert not tools.pending and not tools.bar.isVisible()
    result = tab.conversation.messages[0]  # allowed: the call ran (no server has that tool here)
    assert result.role == "tool" and result.content == "No tool named get_time is connected."


def test_always_allow_holds_for_the_server_allowed_not_one_that_replaces_it(qtbot, gui_home):
    from fleetgui.chat_tools import McpTools
    from fleetgui.workers import TaskRunner

    tasks = TaskRunner()
    settings = Settings(mcp_servers=[TIME_SERVER.to_json()])
    settings.save()
    mcp = McpTools(tasks, settings)
    try:
        qtbot.waitUntil(lambda: len(mcp.tools) == 2, timeout=60000)
        tool = mcp.find("get_current_time")
        assert not mcp.allowed(tool)
        mcp.remember(tool, settings)  # the user's "Always allow this tool"
        assert mcp.allowed(tool) and Settings.load().mcp_always_allowed == settings.mcp_always_allowed

        # an import replaces "time" by another server of that name, with a tool of that name: it asks again
        impostor = McpServer("time", sys.executable, ["-m", "mcp_server_time", "--local-timezone", "Europe/Paris"])
        replaced = Settings.load()
        replaced.mcp_servers = [impostor.to_json()]
        mcp.apply_settings(replaced)
        qtbot.waitUntil(lambda: len(mcp.tools) == 2, timeout=60000)
        assert not mcp.allowed(mcp.find("get_current_time"))
        assert mcp.allowed(tool)  # while the server allowed, as it was, still is
    finally:
        mcp.close()
        tasks.shutdown()


@pytest.mark.real_model
def test_a_server_that_crashes_during_a_call_leaves_a_clear_message(qtbot, gui_home, tmp_path, smollm2):
    script = tmp_path / "fragile.py"
    script.write_text(CRASHING)
    fragile = McpServer("fragile", sys.executable, [str(script)])
    window = open_window(qtbot, chat_settings(smollm2, [fragile]), settings_store(tmp_path / "s.ini"))
    view = window.chat
    qtbot.waitUntil(lambda: len(view.mcp.tools) == 1, timeout=400000)
    tab = view.all_tabs()[0]
    force_a_call(tab)
    ask(qtbot, tab, "Look up the word 'fleet'.")
    assert tab.tools.bar.isVisible()
    answer(qtbot, tab, tab.tools.allow_button)  # the model still answers, told of the failure
    result = next(m for m in tab.conversation.messages if m.role == "tool")
    assert result.stats.get("error") and "'fragile' stopped answering during look_up" in result.content
    assert "segfault (pretend)" in result.content
    assert "The tool call failed: MCP server 'fragile' stopped answering" in view.banner.message
    while tab.tools.active:
        answer(qtbot, tab, tab.tools.deny_button)
    assert not tab.busy and tab.send_button.isEnabled()


def test_settings_import_test_and_save_mcp_servers(qtbot, gui_home, tmp_path):
    from PySide6.QtWidgets import QDialogButtonBox

    from fleetgui.settings import GuiSettings, SettingsPage

    page = SettingsPage(GuiSettings(mcp_always_allowed=["time/get_current_time#0123456789abcdef"]))
    qtbot.addWidget(page)
    assert page.mcp_summary.text() == "none"
    dialog = page.edit_mcp_servers()
    assert dialog.always_label.text() == "Always allowed: time/get_current_time"
    dialog.forget.click()  # the chat asks before every call again
    importer = dialog.open_import()
    importer.text.setPlainText('{"mcpServers": {"time": {"command": "x", "url": "http://h"}}}')
    importer.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.Ok).click()
    assert "not both" in importer.problem.text() and dialog.list.count() == 0  # refused, said why
    importer.text.setPlainText(json.dumps({"mcpServers": {
        "time": {"command": sys.executable, "args": ["-m", "mcp_server_time"]},
        "web": {"url": "http://127.0.0.1:9/mcp"}}}))
    importer.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.Ok).click()
    assert dialog.list.count() == 2

    with qtbot.waitSignal(dialog.tested, timeout=400000) as tested:
        dialog.test(0)
    assert tested.args[0] == "time: 2 tools (get_current_time, convert_time)"
    with qtbot.waitSignal(dialog.tested, timeout=400000) as tested:
        dialog.test(1)  # nothing listens there
    assert tested.args[0].startswith("MCP server 'web'")

    with pytest.raises(Exception, match="already a server named 'time'"):
        dialog.add("time", "uvx mcp-server-time")
    dialog.add("files", "npx -y '@modelcontextprotocol/server-filesystem' /tmp", "DEBUG=1")
    dialog.remove(1)
    dialog.accept()
    assert page.mcp_summary.text() == "time, files"
    with qtbot.waitSignal(page.saved) as saved:
        page.save_button.click()
    settings = saved.args[0]
    settings.save(settings_store(tmp_path / "s.ini"))
    assert Settings.load().mcp_always_allowed == []
    kept = Settings.load().mcp_servers
    assert [s["name"] for s in kept] == ["time", "files"]
    assert kept[1] == {"name": "files", "command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem",
                                                                   "/tmp"], "env": {"DEBUG": "1"}, "enabled": True}
