"""The ``fleet`` command's own documentation: an example for every subcommand (shown at the end of its
``--help``), and the CLI reference the docs site is built from, generated from the argparse
definitions themselves so that it cannot drift from them.

Every subcommand, at any depth, needs a one-line summary (its ``help=``) and an entry in
``EXAMPLES``; ``tests/test_docs.py`` fails when one lacks either.  ``docs/hooks/cli_reference.py`` writes the
reference into the site at every build.
"""

from __future__ import annotations

import argparse

EXAMPLES = {
    "models": "fleet models",
    "models list": "fleet models list",
    "models pull": "fleet models pull qwen2.5-coder-1.5b",
    "export": "fleet export --model smollm2-135m --stages 2 --weights int4",
    "generate": "fleet generate --model smollm2-135m --stages 2 --local-workers --prompt 'Capital of France?'",
    "serve": "fleet serve --model smollm2-135m --port 8000",
    "worker": "fleet worker --shard ./smollm2-135m-int4/stage1 --listen 0.0.0.0:7400",
    "key": "fleet key init",
    "key init": "fleet key init --tls",
    "key path": "fleet key path",
    "key api": "fleet key api",
    "bench": "fleet bench parity --json parity.json",
    "agent": "fleet agent --name office-laptop-3",
    "nodes": "fleet nodes --watch",
    "nodes add": "fleet nodes add 192.168.1.23:7390",
    "nodes remove": "fleet nodes remove 192.168.1.23:7390",
    "nodes prune": "fleet nodes prune 192.168.1.23:7390",
    "nodes join-code": "fleet nodes join-code",
    "nodes join": "fleet nodes join FS-AEBTN-...",
    "nodes scan": "fleet nodes scan",
    "nodes why": "fleet nodes why",
    "profile": "fleet profile --model qwen2.5-coder-1.5b --nodes all",
    "place": "fleet place --objective throughput --users 4 --pin laptop-2:14-27",
    "deploy": "fleet deploy --model qwen2.5-coder-1.5b --plan ~/.local/share/fleetshard/plan.json",
    "up": "fleet up --nodes all",
    "sim": "fleet sim --pcs 3 --memory 1024 --cpus '0;1' --rate 100 --delay-ms pc3=20",
}


def commands(parser: argparse.ArgumentParser, path: str = "") -> list[tuple[str, argparse.ArgumentParser, str]]:
    """Every subcommand below ``parser``: (path such as "nodes add", its parser, its one-line summary)."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            summaries = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                full = f"{path} {name}".strip()
                found.append((full, sub, summaries.get(name, "")))
                found += commands(sub, full)
    return found


def add_examples(parser: argparse.ArgumentParser) -> None:
    """Gives each subcommand's ``--help`` its summary at the top and its example at the end."""
    for path, sub, summary in commands(parser):
        sub.description = sub.description or summary
        if path in EXAMPLES:
            sub.epilog = f"example:\n  {EXAMPLES[path]}"
            sub.formatter_class = argparse.RawDescriptionHelpFormatter


def reference(parser: argparse.ArgumentParser) -> str:
    """The CLI reference in Markdown: every subcommand's summary, usage, options and example."""
    lines = ["# CLI reference", "", "Generated from the `fleet` command's own definitions "
             "(`engine/cli/docs.py`); `fleet COMMAND --help` says the same.", ""]
    for path, sub, summary in commands(parser):
        lines += [f"## fleet {path}", "", summary[:1].upper() + summary[1:] + ".", "", "```",
                  sub.format_usage().strip(), "```", ""]
        options = [a for a in sub._actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
                   and not isinstance(a, argparse._SubParsersAction)]
        if options:
            lines += ["| option | meaning |", "|---|---|"]
            for a in options:
                name = ", ".join(f"`{o}`" for o in a.option_strings) or f"`{a.dest}`"
                text = (a.help or "").replace("|", "\\|") % {"default": a.default} if a.help else ""
                lines.append(f"| {name} | {text} |")
            lines.append("")
        if path in EXAMPLES:
            lines += ["Example:", "", "```", EXAMPLES[path], "```", ""]
    return "\n".join(lines)
