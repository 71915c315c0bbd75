"""Cutting a document's pages into passages a chat can quote: consecutive paragraphs up to
``PASSAGE_WORDS`` words (a longer paragraph is cut at word boundaries), each remembering its file,
page and character offset in the page, so a citation can show exactly where it came from.

``terms`` is the keyword analysis BM25 indexes and searches with: lower case, words of two characters
or more, English stop words dropped, plurals made singular (Harman's S-stemmer) so "printers" finds
"printer".
"""

from __future__ import annotations

import dataclasses
import re

PASSAGE_WORDS = 80  # a paragraph or so: several fit a small model's context with the question
BLOCK = re.compile(r"[^\n]*\S[^\n]*(?:\n[^\n]*\S[^\n]*)*")  # lines up to a blank line
WORD = re.compile(r"\S+")
TERM = re.compile(r"\w\w+")
STOP_WORDS = frozenset((
    "a an and are as at be but by for from has have he her his i if in into is it its me my no not of on or "
    "our she so such that the their them then there these they this to was we were what when where which who "
    "whom why will with would you your can do does did how should could may might must shall about after before "
    "than too very just also any all each other some only own same both more most").split())


@dataclasses.dataclass(frozen=True)
class Passage:
    file: str  # the file's absolute path
    page: int | None  # from 1; None for formats without pages
    start: int  # character offset of the passage in its page's text
    text: str

    def where(self) -> str:
        """ "guide.pdf, page 3" or "notes.md"."""
        name = self.file.replace("\\", "/").rsplit("/", 1)[-1]
        return name if self.page is None else f"{name}, page {self.page}"


def split_pages(file: str, pages: list[tuple[int | None, str]], words: int = PASSAGE_WORDS) -> list[Passage]:
    out = []
    for page, text in pages:
        spans = []  # (start, end, word count) of paragraphs, long ones cut into pieces of ``words``
        for block in BLOCK.finditer(text):
            found = list(WORD.finditer(text, block.start(), block.end()))
            for i in range(0, len(found), words):
                piece = found[i:i + words]
                spans.append((piece[0].start(), piece[-1].end(), len(piece)))
        start = end = count = 0
        for s, e, n in spans:
            if count and count + n > words:
                out.append(Passage(file, page, start, text[start:end]))
                count = 0
            if not count:
                start = s
            end, count = e, count + n
        if count:
            out.append(Passage(file, page, start, text[start:end]))
    return out


def _stem(word: str) -> str:
    """Harman's S-stemmer: "policies" -> "policy", "boxes" -> "boxe", "printers" -> "printer"."""
    if len(word) > 3 and word.endswith("ies") and not word.endswith(("eies", "aies")):
        return word[:-3] + "y"
    if len(word) > 3 and word.endswith("es") and not word.endswith(("aes", "ees", "oes")):
        return word[:-1]
    if len(word) > 3 and word.endswith("s") and not word.endswith(("us", "ss")):
        return word[:-1]
    return word


def terms(text: str) -> list[str]:
    return [_stem(t) for t in TERM.findall(text.lower()) if t not in STOP_WORDS]
