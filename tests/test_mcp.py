"""MCP tools (engine.serve.mcp) against real servers over the official SDK: mcp-server-time from PyPI
over stdio (list, call, a server-side error as a result), a server of our own over stdio and
streamable HTTP with a tool that hangs and one that crashes the server, servers that exit at once
or never answer (each a clear error within its timeout), the common ``mcpServers`` JSON, and the
tools as our grammar-held tool calls take them."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from mcp_support import TIME_SERVER

from engine.serve.mcp import McpError, McpHub, McpServer, McpTool, offer, parse_mcp_servers, probe
from engine.serve.tools import plan_tools

SLOW_START_S = 300  # a server starting on a busy test machine; only the timeout tests rely on timeouts

OWN_SERVER = textwrap.dedent("""
    import os, sys, time
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("own")

    @server.tool()
    def echo(text: str) -> str:
        "Says the text back."
        return "echo: " + text

    @server.tool()
    def hang(seconds: float) -> str:
        "Sleeps."
        time.sleep(seconds)
        return "woke"

    @server.tool()
    def crash() -> str:
        "Ends the server."
        print("crashing on purpose", file=sys.stderr, flush=True)
        os._exit(5)

    if sys.argv[1:2] == ["http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
""")


@pytest.fixture
def hub():
    hub = McpHub(connect_timeout_s=SLOW_START_S, call_timeout_s=SLOW_START_S)
    yield hub
    hub.close()


@pytest.fixture
def own_script(tmp_path):
    path = tmp_path / "own_server.py"
    path.write_text(OWN_SERVER)
    return path


def test_the_time_server_from_pypi_lists_and_answers_over_stdio(hub):
    tools = hub.tools(TIME_SERVER)
    by_name = {t.name: t for t in tools}
    assert {"get_current_time", "convert_time"} <= set(by_name)
    schema = by_name["get_current_time"].schema
    assert schema["type"] == "object" and schema["required"] == ["timezone"] and "$schema" not in schema

    result = hub.call(by_name["get_current_time"], {"timezone": "Europe/London"})
    doc = json.loads(result.text)
    assert not result.is_error and doc["timezone"] == "Europe/London" and doc["datetime"][:2] == "20"

    wrong = hub.call(by_name["get_current_time"], {"timezone": "Nowhere/Atlantis"})  # the server's own error
    assert wrong.is_error and "Invalid timezone" in wrong.text

    offered, skipped = offer(tools)
    plan = plan_tools([t.openai() for t in offered], "required", parallel=False)
    assert skipped == [] and plan.grammar and set(plan.names) == {"get_current_time", "convert_time"}


def test_a_server_that_exits_at_once_says_why(hub):
    gone = McpServer("gone", sys.executable, ["-c", "import sys; print('no config file', file=sys.stderr); "
                                                    "sys.exit(3)"])
    with pytest.raises(McpError, match=r"'gone' ended before it listed its tools .*it said: no config file"):
        hub.tools(gone)
    missing = McpServer("missing", "/nonexistent/mcp-server-nothing")
    with pytest.raises(McpError, match=r"'missing' cannot start `/nonexistent/mcp-server-nothing`"):
        hub.tools(missing)


def test_a_server_that_never_answers_times_out_with_a_clear_error():
    hub = McpHub(connect_timeout_s=2)
    silent = McpServer("silent", sys.executable, ["-c", "import time\nwhile True: time.sleep(1)"])
    try:
        with pytest.raises(McpError, match=r"'silent' did not answer within 2 s of starting"):
            hub.tools(silent)
        assert "silent" not in hub._connections  # stopped, not left running
    finally:
        hub.close()


def test_a_hanging_call_and_a_crash_mid_call_are_errors_and_the_server_starts_anew(own_script):
    hub = McpHub(connect_timeout_s=SLOW_START_S, call_timeout_s=2)
    server = McpServer("own", sys.executable, [str(own_script)])
    try:
        tools = {t.name: t for t in hub.tools(server)}
        assert hub.call(tools["echo"], {"text": "hi"}).text == "echo: hi"
        with pytest.raises(McpError, match=r"'own': hang did not answer within 2 s; the server was stopped"):
            hub.call(tools["hang"], {"seconds": 60})
        tools = {t.name: t for t in hub.tools(server)}  # connects anew
        assert hub.call(tools["echo"], {"text": "again"}).text == "echo: again"
        with pytest.raises(McpError, match=r"'own' stopped answering during crash .*it said: crashing on purpose"):
            hub.call(tools["crash"], {})
        tools = {t.name: t for t in hub.tools(server)}
        assert hub.call(tools["echo"], {"text": "after"}).text == "echo: after"
    finally:
        hub.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_over_streamable_http(own_script):
    port = _free_port()
    process = subprocess.Popen([sys.executable, str(own_script), "http", str(port)], stderr=subprocess.DEVNULL)
    try:
        server = McpServer("web", url=f"http://127.0.0.1:{port}/mcp")
        for _ in range(100):  # until it listens
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                time.sleep(0.2)
        tools = probe(server, timeout_s=SLOW_START_S)
        assert {t.name for t in tools} == {"echo", "hang", "crash"}
        hub = McpHub(connect_timeout_s=SLOW_START_S)
        try:
            echo = next(t for t in hub.tools(server) if t.name == "echo")
            assert hub.call(echo, {"text": "over http"}).text == "echo: over http"
        finally:
            hub.close()
    finally:
        process.terminate()
        process.wait(10)


def test_mcp_servers_json_of_other_apps_is_read():
    servers = parse_mcp_servers(json.dumps({"mcpServers": {
        "time": {"command": "uvx", "args": ["mcp-server-time", "--local-timezone=Europe/Paris"]},
        "files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "/tmp"],
                  "env": {"DEBUG": "1"}, "disabled": True},
        "remote": {"url": "https://example.com/mcp"},
    }}))
    assert [(s.name, s.command, s.args, s.url, s.enabled) for s in servers] == [
        ("time", "uvx", ["mcp-server-time", "--local-timezone=Europe/Paris"], "", True),
        ("files", "npx", ["-y", "@modelcontextprotocol/server-filesystem", "/tmp"], "", False),
        ("remote", "", [], "https://example.com/mcp", True)]
    assert servers[1].env == {"DEBUG": "1"}
    assert McpServer.from_json("files", servers[1].to_json()) == servers[1]  # as settings keep it
    assert [s.name for s in parse_mcp_servers('{"servers": {"a": {"command": "a"}}}')] == ["a"]  # VS Code
    assert [s.name for s in parse_mcp_servers('{"b": {"url": "http://localhost:1/mcp"}}')] == ["b"]  # bare

    for text, error in (("{", "not valid JSON"), ("{}", "no MCP servers found"),
                        ('{"mcpServers": {"x": {"command": "a", "url": "http://h"}}}', "not both"),
                        ('{"mcpServers": {"x": {}}}', "not neither"),
                        ('{"mcpServers": {"x": {"command": "a", "args": "b c"}}}', "args must be a list"),
                        ('{"mcpServers": {"x": {"url": "ftp://h"}}}', "must start with http"),
                        ('{"mcpServers": {"x": {"command": "a", "env": {"K": 1}}}}', "env must map")):
        with pytest.raises(McpError, match=error):
            parse_mcp_servers(text)


def test_tools_are_offered_under_function_names_within_the_grammar_bounds():
    deep = {"type": "object", "properties": {"a": {}}}
    node = deep["properties"]["a"]
    for _ in range(70):
        node["items"] = {}
        node = node["items"]
    tools = [McpTool("one", "search", "", {"type": "object", "properties": {}}),
             McpTool("two", "search", "", {"type": "object", "properties": {"q": {"type": "string"}}}),
             McpTool("two", "read file", "", {"type": "object", "properties": {}}),
             McpTool("two", "deep", "", deep)]
    offered, skipped = offer(tools)
    assert [t.call_name for t in offered] == ["one_search", "two_search", "read_file"]
    assert len(skipped) == 1 and "two/deep" in skipped[0]
    assert offered[1].openai()["function"]["parameters"]["properties"] == {"q": {"type": "string"}}
