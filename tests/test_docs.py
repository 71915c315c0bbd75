"""The documentation: every `fleet` subcommand has a summary and an example that parses, the CLI
reference is generated from the parser and lists every command, the README stays short, no table cell
of the README or the docs runs past 200 characters, every link stays inside the repository and
resolves, and the site builds with mkdocs in strict mode (broken links fail it)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

from engine.cli.docs import EXAMPLES, commands, reference
from engine.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
CELL_CHARS = 200  # a longer cell is a paragraph: it belongs in the text, not in a table


def pages() -> list[Path]:
    """The Markdown a reader meets: the README and the docs site's pages."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The text without its fenced code blocks (a block shows commands and output, not links)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def cells(line: str) -> list[str]:
    """The cells of one Markdown table row (an escaped ``\\|`` stays inside its cell)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def links(text: str) -> list[str]:
    """What the text links to: Markdown links and images, HTML ``src`` and ``href`` (not inside code)."""
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(<?([^)\s>]+)", text) + re.findall(r"(?:src|href)=\"([^\"]+)\"", text)


def climbs(text: str) -> list[str]:
    """Paths quoted as code that climb out of their folder (``../``): a reader follows those too."""
    return re.findall(r"`((?:\.\./)+[^`\s]*)`", text)


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


def test_help_says_copies_of_the_model_as_the_app_does():
    """The product word is "copies" (the app's Placement view and status bar say it); the solver's
    internal "replicas" stays out of every command's help, while the flags users type still parse."""
    parser = build_parser()
    for path, sub, _ in commands(parser):
        assert "replica" not in sub.format_help().lower(), f"`fleet {path} --help` says replicas"
    assert "never copies of the model" in dict((p, s) for p, s, _ in commands(parser))["place"].format_help()
    assert build_parser().parse_args(["place", "--one-chain"]).one_chain


def test_the_reference_lists_every_command():
    parser = build_parser()
    text = reference(parser)
    for path, _, _ in commands(parser):
        assert f"## fleet {path}\n" in text
    assert "`--temperature`" in text and "`--require-key`" in text


def test_version():
    import engine

    out = subprocess.run([sys.executable, "-m", "engine.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == f"fleet (fleetshard) {engine.__version__}\n"


def test_the_version_is_written_in_the_pyproject_alone(monkeypatch, tmp_path):
    """The installed package's metadata first; a checkout never installed reads the pyproject beside the
    package; with neither, ``0+unknown``."""
    import importlib.metadata
    import tomllib

    import engine

    written = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert engine.__version__ == written and written not in (ROOT / "engine" / "__init__.py").read_text()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9.9")
    assert engine._version() == "9.9.9"

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert engine._version() == written
    monkeypatch.setattr(engine, "__file__", str(tmp_path / "engine" / "__init__.py"))
    assert engine._version() == "0+unknown"


def test_the_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert text.splitlines()[3:5] == ["make run    # set up .venv, fetch + export the default model (SmolLM2-135M), "
                                      "open the app chatting through a 2-stage local fleet",
                                      "make test   # same set-up, then the test suite's fast tier (about 15 minutes; "
                                      "`make test-all`: both tiers)"]


def test_no_table_cell_is_a_paragraph():
    long = [f"{page.relative_to(ROOT)}:{n}: {len(cell)} characters: {cell[:60]}..."
            for page in pages() for n, line in enumerate(page.read_text().splitlines(), 1)
            if line.lstrip().startswith("|") for cell in cells(line) if len(cell) > CELL_CHARS]
    assert not long, "\n".join(long)


def test_every_link_stays_in_the_repository_and_resolves():
    bad = []
    for page in pages():
        text = prose(page.read_text())
        for target in links(text) + climbs(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
                continue  # a web address (a public project's site) or an anchor on the same page
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.is_relative_to(ROOT):
                bad.append(f"{page.relative_to(ROOT)}: {target} leaves the repository")
            elif target in links(text) and not path.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} does not exist")
    assert not bad, "\n".join(bad)


def test_the_site_builds_strictly(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    cli = (tmp_path / "cli" / "index.html").read_text()
    assert "fleet nodes prune" in cli and "fleet serve" in cli
