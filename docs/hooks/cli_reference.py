"""mkdocs hook: the CLI reference page is generated from the ``fleet`` command's argparse
definitions at every build (``engine.cli.docs.reference``), so it cannot drift from them."""

from __future__ import annotations


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == "cli.md":
        from engine.cli.main import build_parser
        from engine.cli.docs import reference

        return reference(build_parser())
    return markdown
