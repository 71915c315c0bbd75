"""What the MCP tests share: the real time server from PyPI, started over stdio."""

from __future__ import annotations

import sys

from engine.serve.mcp import McpServer

TIME_SERVER = McpServer("time", sys.executable, ["-m", "mcp_server_time", "--local-timezone", "Etc/UTC"])
