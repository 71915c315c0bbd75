"""Tools from MCP servers (the Model Context Protocol, through the official ``mcp`` SDK): the servers
a user lists (a stdio command or a streamable-HTTP URL), the common ``{"mcpServers": {...}}`` JSON
other apps share them in, and ``McpHub``, which keeps a connection to each server and lists and
calls their tools with timeouts.

The SDK is async; the hub runs it on an event loop of its own thread, and its methods block the
caller (a worker thread, never a GUI's), each bounded by a timeout, so a server that crashes or
hangs ends in an ``McpError`` that says so, never a wait without end.  Tools are offered to a model
in OpenAI's format (``engine.serve.tools``), their schemas held to the grammar's bounds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import re
import tempfile
import threading
from concurrent.futures import TimeoutError as FutureTimeout

from engine.errors import FleetError
from engine.runtime.decode.grammar import MAX_SCHEMA_CHARS, GrammarError, check_schema

CONNECT_TIMEOUT_S = 60.0  # start (a first `uvx`/`npx` run downloads the server), handshake and tool list
CALL_TIMEOUT_S = 60.0
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's function names
CONNECTION_CLOSED = -32000  # the JSON-RPC error code of the SDK's "Connection closed"
STDERR_TAIL = 400  # characters of a failed server's own error output quoted in its message


class McpError(FleetError):
    """An MCP server that cannot be reached, crashed, timed out, or a listing that is malformed."""


@dataclasses.dataclass
class McpServer:
    """One MCP server: ``command`` (with ``args`` and ``env``) started over stdio, or ``url``
    (streamable HTTP)."""

    name: str
    command: str = ""
    args: list[str] = dataclasses.field(default_factory=list)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    url: str = ""
    enabled: bool = True

    @classmethod
    def from_json(cls, name: str, doc) -> "McpServer":
        """A server from its entry (``command``/``args``/``env`` or ``url``, as in ``mcpServers``);
        a malformed entry is an ``McpError`` naming the server and the field."""
        if not isinstance(name, str) or not name.strip():
            raise McpError("an MCP server needs a name")
        name = name.strip()
        if not isinstance(doc, dict):
            raise McpError(f"MCP server {name!r}: its entry must be a JSON object, not {type(doc).__name__}")
        command, url = doc.get("command", ""), doc.get("url", doc.get("serverUrl", ""))
        args, env, enabled = doc.get("args", []), doc.get("env", {}), doc.get("enabled", not doc.get("disabled", False))
        if not isinstance(command, str) or not isinstance(url, str):
            raise McpError(f"MCP server {name!r}: command and url must be text")
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise McpError(f"MCP server {name!r}: args must be a list of text")
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise McpError(f"MCP server {name!r}: env must map names to text")
        if bool(command.strip()) == bool(url.strip()):
            raise McpError(f"MCP server {name!r}: give either a command (stdio) or a url (HTTP), "
                           + ("not both" if command.strip() else "not neither"))
        if url.strip() and not url.strip().lower().startswith(("http://", "https://")):
            raise McpError(f"MCP server {name!r}: the url must start with http:// or https://, not {url!r}")
        return cls(name, command.strip(), list(args), dict(env), url.strip(), bool(enabled))

    def to_json(self) -> dict:
        """The entry as settings keep it (and as ``from_json`` reads it back)."""
        doc = {"url": self.url} if self.url else {"command": self.command, "args": self.args, "env": self.env}
        return {"name": self.name, **doc, "enabled": self.enabled}

    def describe(self) -> str:
        return self.url or " ".join([self.command, *self.args])

    def identity(self) -> str:
        """The server as it is reached, in 16 hex digits: a hash of its command, arguments and
        environment, or of its URL.  An "always allow" holds for this identity, so a server replaced
        under the same name (an import, an edit) is asked about again."""
        launch = json.dumps([self.command, self.args, self.env, self.url], sort_keys=True)
        return hashlib.sha256(launch.encode()).hexdigest()[:16]


def servers_from_settings(entries: list) -> list[McpServer]:
    """The servers of ``Settings.mcp_servers``; an entry that no longer reads is an ``McpError``."""
    return [McpServer.from_json(e.get("name", "") if isinstance(e, dict) else "", e) for e in entries]


def parse_mcp_servers(text: str) -> list[McpServer]:
    """The servers in the JSON other apps share them in: ``{"mcpServers": {name: {command, args,
    env} or {url}}}`` (Claude Desktop, Cursor, LM Studio), ``{"servers": {...}}`` (VS Code), or the
    inner mapping alone."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise McpError(f"the MCP servers are not valid JSON: {exc}") from None
    if isinstance(doc, dict):
        doc = doc.get("mcpServers", doc.get("servers", doc))
    if not isinstance(doc, dict) or not doc:
        raise McpError('no MCP servers found: expected {"mcpServers": {"name": {"command": ..., "args": [...]}}}')
    return [McpServer.from_json(name, entry) for name, entry in doc.items()]


@dataclasses.dataclass
class McpTool:
    """A tool of a server, under the name the model calls it by."""

    server: str
    name: str  # the server's name for it
    description: str
    schema: dict  # its input's JSON schema
    call_name: str = ""  # the function name offered to the model (``offer`` sets it)
    server_identity: str = ""  # its server's ``McpServer.identity``

    @property
    def key(self) -> str:
        """The tool in words: ``server/tool``."""
        return f"{self.server}/{self.name}"

    @property
    def consent(self) -> str:
        """What an "always allow" is remembered by: ``server/tool#identity`` (see ``McpServer.identity``)."""
        return f"{self.key}#{self.server_identity}"

    def openai(self) -> dict:
        return {"type": "function", "function": {"name": self.call_name or self.name,
                                                 "description": self.description, "parameters": self.schema}}


@dataclasses.dataclass
class ToolResult:
    text: str
    is_error: bool = False


def offer(tools: list[McpTool]) -> tuple[list[McpTool], list[str]]:
    """The tools a model can be offered (each named as its function: the tool's own name, or
    ``server_tool`` where two servers share it), and a line for each one left out (a name or schema
    our tool calls cannot take, or past the schemas' combined bound)."""
    counts: dict[str, int] = {}
    for tool in tools:
        counts[tool.name] = counts.get(tool.name, 0) + 1
    kept, skipped, total, seen = [], [], 0, set()
    for tool in tools:
        name = tool.name if counts[tool.name] == 1 else f"{tool.server}_{tool.name}"
        name = re.sub(r"[^A-Za-z0-9_-]", "_", name)[:64]
        if not NAME.match(name) or name in seen:
            skipped.append(f"{tool.key}: its name cannot be a function's")
            continue
        try:
            size = check_schema(tool.schema, f"{tool.key} input schema")
        except GrammarError as exc:
            skipped.append(str(exc))
            continue
        if total + size > MAX_SCHEMA_CHARS:
            skipped.append(f"{tool.key}: the tools' schemas together pass {MAX_SCHEMA_CHARS} characters")
            continue
        total += size
        seen.add(name)
        kept.append(dataclasses.replace(tool, call_name=name))
    return kept, skipped


def _schema(raw) -> dict:
    """A tool's input schema as a function's parameters (an object; MCP's own keys dropped)."""
    schema = dict(raw) if isinstance(raw, dict) else {}
    schema.pop("$schema", None)
    schema.setdefault("type", "object")
    if schema.get("type") == "object":
        schema.setdefault("properties", {})
    return schema


def _result_text(result) -> str:
    """A call's content as text: text parts as they are, others named (an image is no text)."""
    parts = []
    for item in getattr(result, "content", None) or []:
        kind = getattr(item, "type", "")
        if kind == "text":
            parts.append(item.text)
        elif kind == "resource" and getattr(item.resource, "text", None) is not None:
            parts.append(item.resource.text)
        else:
            parts.append(f"[{kind or 'unknown'} content]")
    structured = getattr(result, "structured_content", None)
    if not parts and structured is not None:
        parts.append(json.dumps(structured, ensure_ascii=False))
    return "\n".join(parts)


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


class _Connection:
    """One open server: a task on the hub's loop holds the SDK's client and runs the jobs queued to it."""

    def __init__(self, server: McpServer):
        self.server = server
        self.jobs: asyncio.Queue = asyncio.Queue()
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self.errlog = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
        self.task = asyncio.create_task(self._run(), name=f"mcp {server.name}")
        self.failure: str | None = None

    def _transport(self):
        # deferred (here and below): the SDK (pydantic, httpx, starlette) loads once a server is used,
        # not when the app starts
        from mcp import StdioServerParameters
        from mcp.client.stdio import stdio_client  # (deferred too)

        if self.server.url:
            return self.server.url
        params = StdioServerParameters(command=self.server.command, args=self.server.args,
                                       env=self.server.env or None)
        return stdio_client(params, errlog=self.errlog)

    async def _run(self) -> None:
        from mcp import Client  # deferred: see _transport

        try:
            async with Client(self._transport()) as client:
                listed, cursor = [], None
                while True:
                    page = await client.list_tools(cursor=cursor)
                    listed += page.tools
                    cursor = getattr(page, "next_cursor", None)
                    if not cursor or len(listed) > 10000:
                        break
                identity = self.server.identity()
                self.ready.set_result([McpTool(self.server.name, t.name, t.description or "",
                                               _schema(getattr(t, "input_schema", None)), server_identity=identity)
                                       for t in listed])
                while True:
                    job = await self.jobs.get()
                    if job is None:
                        return
                    name, arguments, future = job
                    try:
                        result = await client.call_tool(name, arguments)
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - the caller gets it, the connection stays
                        if not future.done():
                            future.set_exception(exc)
                    else:
                        if not future.done():  # (a caller that timed out has gone)
                            future.set_result(result)
        except asyncio.CancelledError:
            self.failure = self.failure or "closed"
            raise
        except BaseException as exc:  # noqa: BLE001 - whatever ends the server is its failure
            self.failure = self._describe(exc)
            if not self.ready.done():
                self.ready.set_exception(McpError(self.failure))
        finally:
            self.failure = self.failure or "the connection ended"
            while not self.jobs.empty():
                job = self.jobs.get_nowait()
                if job is not None and not job[2].done():
                    job[2].set_exception(McpError(self.failure))

    def _describe(self, exc: BaseException) -> str:
        leaves = _leaves(exc)
        reasons = "; ".join(dict.fromkeys(str(e) or type(e).__name__ for e in leaves))
        if any(isinstance(e, OSError) for e in leaves) and not self.server.url:
            head = f"cannot start `{self.server.command}`"
        else:
            head = "stopped answering" if self.ready.done() else "ended before it listed its tools"
        return f"MCP server {self.server.name!r} {head} ({reasons}){self.stderr_tail()}"

    def stderr_tail(self) -> str:
        try:
            self.errlog.flush()
            self.errlog.seek(0)
            text = self.errlog.read().strip()
        except (OSError, ValueError):
            return ""
        return f"; it said: {text[-STDERR_TAIL:]}" if text else ""

    async def close(self) -> None:
        if not self.task.done():
            self.jobs.put_nowait(None)
            try:
                await asyncio.wait_for(asyncio.shield(self.task), 5)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - closing: what went wrong is moot
                self.task.cancel()
                await asyncio.gather(self.task, return_exceptions=True)
        self.errlog.close()


class McpHub:
    """Connections to MCP servers, on an event loop of the hub's own thread.  Every method blocks
    its caller for at most its timeout (plus the few seconds a stuck server takes to be stopped)."""

    def __init__(self, connect_timeout_s: float | None = None, call_timeout_s: float | None = None):
        self.connect_timeout_s = connect_timeout_s or CONNECT_TIMEOUT_S
        self.call_timeout_s = call_timeout_s or CALL_TIMEOUT_S
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp", daemon=True)
        self._thread.start()
        self._connections: dict[str, _Connection] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _run(self, coro, timeout_s: float):
        if self._closed:
            coro.close()
            raise McpError("the MCP servers were closed (the settings changed or the app is closing)")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout_s)
        except FutureTimeout:
            future.cancel()
            raise

    async def _drop(self, name: str, connection: "_Connection") -> str:
        """Forgets and stops a server's connection (its next use starts it anew); returns the tail
        of what it wrote to stderr, for the message."""
        self._connections.pop(name, None)
        tail = connection.stderr_tail()
        await connection.close()
        return tail

    def tools(self, server: McpServer) -> list[McpTool]:
        """The server's tools, connecting first unless connected (a failed connection is tried anew)."""
        async def connect():
            connection = self._connections.get(server.name)
            if connection is None or connection.server != server or connection.task.done():
                if connection is not None:
                    await connection.close()
                connection = self._connections[server.name] = _Connection(server)
            try:
                return await asyncio.wait_for(asyncio.shield(connection.ready), self.connect_timeout_s)
            except asyncio.TimeoutError:
                tail = await self._drop(server.name, connection)
                raise McpError(f"MCP server {server.name!r} did not answer within {self.connect_timeout_s:g} s "
                               f"of starting{tail}") from None
            except McpError:
                await self._drop(server.name, connection)
                raise

        with self._lock:
            return self._run(connect(), self.connect_timeout_s + 15)

    def call(self, tool: McpTool, arguments: dict, timeout_s: float | None = None) -> ToolResult:
        """Calls ``tool`` (connected by ``tools``) with ``arguments``; a server error is a result
        marked ``is_error`` (the model reads it), a timeout or a crash an ``McpError``."""
        timeout_s = timeout_s or self.call_timeout_s

        async def call():
            connection = self._connections.get(tool.server)
            if connection is None or connection.task.done():
                reason = connection.failure if connection is not None else "it is not connected"
                raise McpError(f"MCP server {tool.server!r} cannot take the call: {reason}")
            future = asyncio.get_running_loop().create_future()
            connection.jobs.put_nowait((tool.name, arguments, future))
            try:
                result = await asyncio.wait_for(future, timeout_s)
            except asyncio.TimeoutError:
                # the server may still be busy with the call: start it anew for the next one
                tail = await self._drop(tool.server, connection)
                raise McpError(f"MCP server {tool.server!r}: {tool.name} did not answer within {timeout_s:g} s; "
                               f"the server was stopped{tail}") from None
            except McpError:
                raise
            except Exception as exc:  # noqa: BLE001 - the SDK's errors, said plainly
                leaves = _leaves(exc)
                if any(getattr(e, "code", None) == CONNECTION_CLOSED for e in leaves):
                    # the server ended (crashed) during the call: the next call starts it anew
                    tail = await self._drop(tool.server, connection)
                    raise McpError(f"MCP server {tool.server!r} stopped answering during {tool.name} "
                                   f"(it crashed or closed the connection){tail}") from None
                reasons = "; ".join(getattr(e, "message", None) or str(e) or type(e).__name__ for e in leaves)
                raise McpError(f"MCP server {tool.server!r}: {tool.name} failed: {reasons}") from None
            return ToolResult(_result_text(result), bool(getattr(result, "is_error", False)))

        return self._run(call(), timeout_s + 15)

    def disconnect(self, name: str) -> None:
        connection = self._connections.get(name)
        if connection is not None:
            async def close():
                self._connections.pop(name, None)
                await connection.close()
            self._run(close(), 15)

    def close(self) -> None:
        """Stops every server and the hub's thread."""
        for name in list(self._connections):
            try:
                self.disconnect(name)
            except (FutureTimeout, Exception):  # noqa: BLE001 - closing anyway
                pass
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def probe(server: McpServer, timeout_s: float | None = None) -> list[McpTool]:
    """Connects to ``server`` once and lists its tools (a settings dialog's "Test")."""
    hub = McpHub(connect_timeout_s=timeout_s)
    try:
        return hub.tools(server)
    finally:
        hub.close()
