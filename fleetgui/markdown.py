"""A chat message as rich text: Markdown through Qt's own parser (``QTextDocument.setMarkdown``), and
fenced code blocks syntax-highlighted with Pygments, each under a "Copy code" link.

A reply is untrusted text (a model can be led to write anything), so it never reaches the chat as
markup of its own: raw HTML in it shows as text, an image shows as a link to it, and every link in
it is wrapped in ``REPLY_LINK``, a scheme the chat takes for no action (``ChatTab._link`` only offers
to open a web link in the browser).  The transcript (``Transcript``) loads no resource of any scheme.

``code_blocks(text)`` gives the blocks' contents, so a link's index finds the code to copy.
"""

from __future__ import annotations

import html
import re
from urllib.parse import quote

from PySide6.QtGui import QTextDocument
from PySide6.QtWidgets import QTextBrowser

from fleetgui.widgets import unbidi

FENCE = re.compile(r"^```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)(?:^```[ \t]*$|\Z)", re.S | re.M)
CODE_BACKGROUND = {"light": "#f1f4f8", "dark": "#0f1318"}
PYGMENTS_STYLE = {"light": "default", "dark": "monokai"}
REPLY_LINK = "reply:"  # what a link in a reply's text becomes: the link, quoted, after this scheme
MARKDOWN = QTextDocument.MarkdownFeature(QTextDocument.MarkdownFeature.MarkdownDialectGitHub.value
                                         | QTextDocument.MarkdownFeature.MarkdownNoHTML.value)
# in the HTML Qt writes (attribute values in double quotes, escaped)
IMAGE = re.compile(r"<img\b[^>]*>")
ATTRIBUTE = re.compile(r'\b(src|alt|href)="([^"]*)"')
HREF = re.compile(r'\bhref="([^"]*)"')
# Qt lays out a run without a break point in time that grows with the square of its length (a
# reply of one line a million characters long froze the window), so a long run in the text between tags
# gets a zero-width space every RUN characters; attributes and entities (runs stop at "&") keep theirs
RUN = 256
LONG_RUN = re.compile(r"[^\s&\u200b]{%d}(?=[^\s&\u200b])" % RUN)
TEXT = re.compile(r"(?<=>)[^<]+|^[^<]+")  # the text between tags


class Transcript(QTextBrowser):
    """A text browser that loads nothing: no image or style sheet of any scheme (``file:``,
    ``http:``, a share's path), whatever the HTML it shows asks for."""

    def loadResource(self, kind, name):  # noqa: N802 (Qt's name)
        return None


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block, in order (an unclosed last block counts: a reply
    still streaming)."""
    return [(m.group(1), m.group(2).rstrip("\n")) for m in FENCE.finditer(text)]


def markdown_html(text: str) -> str:
    """The HTML body Qt makes of ``text`` as Markdown (GitHub dialect, raw HTML shown as text), its
    images turned into links and every link wrapped in ``REPLY_LINK``."""
    doc = QTextDocument()
    doc.setMarkdown(text, MARKDOWN)
    full = doc.toHtml()
    start = full.find(">", full.find("<body")) + 1
    end = full.rfind("</body>")
    if not (start > 0 and end > start):
        return f"<p style='white-space:pre-wrap'>{html.escape(text)}</p>"
    body = IMAGE.sub(_image_link, full[start:end])
    return HREF.sub(lambda m: f'href="{REPLY_LINK}{quote(html.unescape(m.group(1)), safe="")}"', body)


def _image_link(match: re.Match) -> str:
    """An image as a link to it (wrapped like every link by ``markdown_html``), never loaded."""
    found = dict(ATTRIBUTE.findall(match.group(0)))
    label = html.escape(f"image: {html.unescape(found.get('alt', ''))}".rstrip(": "))
    return f'<a href="{found.get("src", "")}">[{label}]</a>'


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
    background with a ``copycode:MESSAGE:BLOCK`` link above it.  Text that fails to render shows as
    plain text.  A long unbroken run gets break points (``breakable``); bidi controls go (``unbidi``)."""
    text = unbidi(text)
    try:
        body = _message_html(text, message_index, theme)
    except Exception:  # any failure of the parsers: the text itself, escaped, is always shown
        body = f"<p style='white-space:pre-wrap'>{html.escape(text)}</p>"
    return breakable(body)


def breakable(body: str) -> str:
    """``body`` with a zero-width space after every ``RUN`` characters of a run Qt could not break
    (see ``RUN``), in the text between tags only."""
    return TEXT.sub(lambda text: LONG_RUN.sub(lambda m: m.group(0) + "\u200b", text.group(0)), body)


def _message_html(text: str, message_index: int, theme: str) -> str:
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
