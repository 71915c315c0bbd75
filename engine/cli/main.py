"""The ``fleet`` entry point: the parser made of every command group, and ``main``.  Its help (and a
bare ``fleet``) opens with the command a new user runs first."""

from __future__ import annotations

import argparse
import importlib
import sys

import engine
from engine.cli.docs import add_examples
from engine.errors import FleetError

# each command group's module, in the order `fleet --help` lists them, and the commands it adds
GROUPS = {
    "models": ("models", "export"),
    "generate": ("generate",),
    "serve": ("serve",),
    "worker": ("worker",),
    "keys": ("key",),
    "bench": ("bench",),
    "fleet": ("agent", "nodes", "profile", "place", "deploy", "up", "sim"),
}

START_HERE = """Start here: fleet up (or fleet up --demo)
  fleet up              chat with the default model on this PC (a local fleet)
  fleet up --demo       try a fleet on this PC alone: demo nodes with simulated devices
  fleet up --nodes all  use the office's PCs that run the tray worker (fleetgui --worker)
  fleet models          the models you can use, and those already on this PC
"""


class _Fleet(argparse.ArgumentParser):
    """The top-level parser: its help opens with ``START_HERE``."""

    def format_help(self) -> str:
        return f"{START_HERE}\n{super().format_help()}"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole ``fleet`` parser, or (``command``) one with only that command's group: a worker or
    agent process then loads what it runs and not, say, the API server or the placement solver."""
    parser = _Fleet(prog="fleet", description="fleetshard: one LLM across a fleet of PCs")
    parser.add_argument("--version", action="version", version=f"fleet (fleetshard) {engine.__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True, parser_class=argparse.ArgumentParser)
    for group, commands in GROUPS.items():
        if command is None or command in commands:
            importlib.import_module(f"engine.cli.{group}").add_commands(sub)
    add_examples(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:  # a first try: the help, which says where to start
        print(build_parser().format_help())
        return 0
    known = {c for commands in GROUPS.values() for c in commands}
    args = build_parser(argv[0] if argv and argv[0] in known else None).parse_args(argv)
    try:
        return args.func(args)
    except FleetError as exc:
        # deferred: it brings the session's modules, which `fleet key` does not load until it fails
        from engine.cli.args import printable

        print(f"error: {printable(exc, lines=True)}", file=sys.stderr)  # it may quote a node or its agent
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
