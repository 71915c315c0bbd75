"""The ``fleet`` entry point: the parser made of every command group, and ``main``."""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import PackageNotFoundError, version

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


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole ``fleet`` parser, or (``command``) one with only that command's group: a worker or
    agent process then loads what it runs and not, say, the API server or the placement solver."""
    try:
        release = version("fleetshard")
    except PackageNotFoundError:  # a checkout that was never installed
        release = "unknown"
    parser = argparse.ArgumentParser(prog="fleet", description="fleetshard: one LLM across a fleet of PCs")
    parser.add_argument("--version", action="version", version=f"fleet (fleetshard) {release}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for group, commands in GROUPS.items():
        if command is None or command in commands:
            importlib.import_module(f"engine.cli.{group}").add_commands(sub)
    add_examples(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
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
