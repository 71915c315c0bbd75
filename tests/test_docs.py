"""The documentation: every `fleet` subcommand has a summary and an example that parses, the CLI
reference is generated from the parser and lists every command, the README stays short and its links
resolve, and the site builds with mkdocs in strict mode (broken links fail it)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

from engine.cli.docs import EXAMPLES, commands, reference
from engine.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent


def test_every_command_has_a_summary_and_an_example_that_parses():
    parser = build_parser()
    found = commands(parser)
    assert {"serve", "nodes prune", "key api", "bench"} <= {path for path, _, _ in found}
    for path, sub, summary in found:
        assert summary and len(summary.splitlines()) == 1, f"`fleet {path}` has no one-line summary"
        assert path in EXAMPLES, f"`fleet {path}` has no example in engine/cli/docs.py EXAMPLES"
        words = shlex.split(EXAMPLES[path])
        assert words[: 1 + len(path.split())] == ["fleet", *path.split()], (path, EXAMPLES[path])
        build_parser().parse_args(words[1:])  # the example is a valid command line
        assert EXAMPLES[path] in sub.format_help() and summary in sub.format_help()
    assert set(EXAMPLES) == {path for path, _, _ in found}  # no example of a command that is gone


def test_the_reference_lists_every_command():
    parser = build_parser()
    text = reference(parser)
    for path, _, _ in commands(parser):
        assert f"## fleet {path}\n" in text
    assert "`--temperature`" in text and "`--require-key`" in text


def test_version():
    out = subprocess.run([sys.executable, "-m", "engine.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and re.fullmatch(r"fleet \(fleetshard\) \S+\n", out.stdout)


def test_the_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert text.splitlines()[3:5] == ["make run    # set up .venv, fetch + export the default model (SmolLM2-135M), "
                                      "open the app chatting through a 2-stage local fleet",
                                      "make test   # same set-up, then the test suite's fast tier (about 15 minutes; "
                                      "`make test-all`: both tiers)"]
    for link in re.findall(r"\]\(([^)#]+)", text):
        assert (ROOT / link).exists(), link


def test_the_site_builds_strictly(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    cli = (tmp_path / "cli" / "index.html").read_text()
    assert "fleet nodes prune" in cli and "fleet serve" in cli
