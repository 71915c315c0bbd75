"""A chat message as rich text: Markdown through Qt's own parser (``QTextDocument.setMarkdown``), and
fenced code blocks syntax-highlighted with Pygments, each under a "Copy code" link.

``code_blocks(text)`` gives the blocks' contents, so a link's index finds the code to copy.
"""

from __future__ import annotations

import html
import re

from PySide6.QtGui import QTextDocument

FENCE = re.compile(r"^```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)(?:^```[ \t]*$|\Z)", re.S | re.M)
CODE_BACKGROUND = {"light": "#f1f4f8", "dark": "#0f1318"}
PYGMENTS_STYLE = {"light": "default", "dark": "monokai"}


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block, in order (an unclosed last block counts: a reply
    still streaming)."""
    return [(m.group(1), m.group(2).rstrip("\n")) for m in FENCE.finditer(text)]


def markdown_html(text: str) -> str:
    """The HTML body Qt makes of ``text`` as Markdown (GitHub dialect)."""
    doc = QTextDocument()
    doc.setMarkdown(text, QTextDocument.MarkdownFeature.MarkdownDialectGitHub)
    full = doc.toHtml()
    start = full.find(">", full.find("<body")) + 1
    end = full.rfind("</body>")
    return full[start:end] if start > 0 and end > start else html.escape(text)


def highlight(code: str, language: str, theme: str) -> str:
    """``code`` as HTML spans with inline colours (no stylesheet: Qt's rich text takes inline styles)."""
    # deferred: Pygments loads its lexers only when a reply holds code
    from pygments import highlight as pygmentize  # deferred, see above
    from pygments.formatters import HtmlFormatter  # deferred, see above
    from pygments.lexers import TextLexer, get_lexer_by_name, guess_lexer  # deferred, see above
    from pygments.util import ClassNotFound  # deferred, see above

    try:
        lexer = get_lexer_by_name(language) if language else guess_lexer(code)
    except ClassNotFound:
        lexer = TextLexer()
    formatter = HtmlFormatter(noclasses=True, nowrap=True, style=PYGMENTS_STYLE.get(theme, "default"))
    return pygmentize(code, lexer, formatter)


def message_html(text: str, message_index: int, theme: str = "light") -> str:
    """A message's HTML: Markdown between the code blocks; each block highlighted on a tinted
    background with a ``copycode:MESSAGE:BLOCK`` link above it."""
    parts, last, block = [], 0, 0
    background = CODE_BACKGROUND.get(theme, CODE_BACKGROUND["light"])
    for match in FENCE.finditer(text):
        if text[last:match.start()].strip():
            parts.append(markdown_html(text[last:match.start()]))
        language, code = match.group(1), match.group(2).rstrip("\n")
        label = html.escape(language or "code")
        parts.append(f"<p style='margin:0'><small>{label} · <a href='copycode:{message_index}:{block}'>Copy code"
                     f"</a></small></p><table width='100%' cellpadding='6' cellspacing='0' bgcolor='{background}'>"
                     f"<tr><td><pre style='margin:0'>{highlight(code, language, theme)}</pre></td></tr></table>")
        block += 1
        last = match.end()
    if text[last:].strip():
        parts.append(markdown_html(text[last:]))
    return "".join(parts)
