"""A document file as pages of plain text: txt and md as they are, pdf through pypdf (one page per
page), docx through python-docx (paragraphs and tables, one page: a docx has no pages of its own).

Only a regular file is read, never through a link and never a named pipe or a device (whose reads
may never end, or never start), and at most ``MAX_FILE_MB`` of it; a Word file (a zip) is read only
when its parts unpack to at most ``MAX_UNZIPPED_MB``, of which at most ``MAX_XML_MB`` of XML.  A file
that cannot be read raises ``DocumentError`` naming the file and why (a link, not a regular file,
damaged, encrypted, no text to extract, too large).
"""

from __future__ import annotations

import errno
import io
import os
import stat
import zipfile
from pathlib import Path

from engine.errors import FleetError

TEXT_SUFFIXES = (".txt", ".md", ".markdown")
SUFFIXES = (*TEXT_SUFFIXES, ".pdf", ".docx")
MAX_FILE_MB = 64  # a bigger file is far more than a chat's context can use; it is skipped by name
# what a Word file's parts may unpack to, checked from the zip's directory before any part is unpacked:
# python-docx holds the parts in memory (all of them: MAX_UNZIPPED_MB) and parses the XML ones into trees
# about 12 times their size (16 MB of XML measured ~200 MB), so a small file that unpacks to much (a zip
# bomb) would take the app's memory; a long document's text is a few MB of XML
MAX_UNZIPPED_MB = 64
MAX_XML_MB = 16
MARKUP_RATIO = 4  # a part that unpacks to more than this many times its packed size counts as XML
# opened without following a link or waiting for a pipe's writer (flags a platform lacks count as none)
OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)


class DocumentError(FleetError):
    """A document file or collection cannot be read, indexed or found."""


def supported(path: Path) -> bool:
    return path.suffix.lower() in SUFFIXES and not path.name.startswith((".", "~$"))


def read_pages(path: Path | str) -> list[tuple[int | None, str]]:
    """(page number from 1, or None when the format has no pages; text) for each page with text."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise DocumentError(f"{path.name}: not a document this app reads (it reads {', '.join(SUFFIXES)})")
    raw = _read(path)
    if suffix == ".pdf":
        pages = _pdf(path, raw)
    elif suffix == ".docx":
        pages = _docx(path, raw)
    else:
        pages = [(None, _text(path, raw))]
    pages = [(number, text) for number, text in pages if text.strip()]
    if not pages:
        what = "no text to extract (a scanned PDF needs OCR first)" if suffix == ".pdf" else "empty"
        raise DocumentError(f"{path.name}: {what}")
    return pages


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a link to another file, not followed (add the file itself)"
    if stat.S_ISFIFO(mode):
        return "a named pipe, not a regular file"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device, not a regular file"
    if stat.S_ISSOCK(mode):
        return "a socket, not a regular file"
    return "not a regular file"


def _read(path: Path) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``MAX_FILE_MB`` (see the module's docstring)."""
    limit = MAX_FILE_MB * 2**20
    try:
        mode = os.lstat(path).st_mode  # the reason in words; the open below holds to it on POSIX
        if not stat.S_ISREG(mode):
            raise DocumentError(f"{path.name}: {_kind(mode)}")
        fd = os.open(path, OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # it became a link after the check
            raise DocumentError(f"{path.name}: {_kind(stat.S_IFLNK)}") from None
        raise DocumentError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as file:
        found = os.fstat(file.fileno())  # what was opened, which may differ from what was checked
        if not stat.S_ISREG(found.st_mode):
            raise DocumentError(f"{path.name}: {_kind(found.st_mode)}")
        if found.st_size > limit:
            raise DocumentError(f"{path.name}: larger than {MAX_FILE_MB} MB, skipped")
        try:
            raw = file.read(limit + 1)  # bounded: a file that grows while read stops here
        except OSError as exc:
            raise DocumentError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if len(raw) > limit:
        raise DocumentError(f"{path.name}: larger than {MAX_FILE_MB} MB, skipped")
    return raw


def _text(path: Path, raw: bytes) -> str:
    if b"\0" in raw[:4096]:
        raise DocumentError(f"{path.name}: a binary file, not text")
    return raw.decode("utf-8-sig", errors="replace").replace("\r\n", "\n")


def _pdf(path: Path, raw: bytes) -> list[tuple[int | None, str]]:
    import pypdf  # deferred: only a collection with PDFs pays for loading the parser

    try:
        reader = pypdf.PdfReader(io.BytesIO(raw))
        if reader.is_encrypted and not reader.decrypt(""):
            raise DocumentError(f"{path.name}: the PDF is encrypted with a password")
        return [(number, page.extract_text() or "") for number, page in enumerate(reader.pages, 1)]
    except DocumentError:
        raise
    except Exception as exc:  # pypdf raises many kinds on a damaged file: each means "cannot read it"
        raise DocumentError(f"{path.name}: not a readable PDF ({type(exc).__name__}: {exc})") from None


def _check_unzipped(path: Path, raw: bytes) -> None:
    """Refuses a Word file whose parts unpack to more than the caps, as its zip's directory declares
    them (unpacking a part stops at its declared size); a file that is no zip is left to the parser,
    which says it is damaged."""
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            members = archive.infolist()
    except Exception:  # damaged, or zipped by a version zipfile cannot read: the parser says which
        return
    total = sum(m.file_size for m in members)
    # XML by its name, or by how it packs: a picture barely packs, while markup (whatever its name says:
    # the content types decide what is parsed) and a bomb's filler pack several times over
    xml = sum(m.file_size for m in members
              if m.filename.lower().endswith((".xml", ".rels")) or m.file_size > MARKUP_RATIO * m.compress_size)
    for size, cap, what in ((xml, MAX_XML_MB, "its text and markup unpack"), (total, MAX_UNZIPPED_MB, "it unpacks")):
        if size > cap * 2**20:
            raise DocumentError(f"{path.name}: {what} to {size / 2**20:.0f} MB, more than {cap} MB, skipped "
                                "(a damaged file, or one made to fill memory)")


def _docx(path: Path, raw: bytes) -> list[tuple[int | None, str]]:
    import docx  # deferred: only a collection with Word files pays for loading the parser

    _check_unzipped(path, raw)
    try:
        document = docx.Document(io.BytesIO(raw))
    except Exception as exc:  # a damaged or renamed file fails in the zip or XML layers alike
        raise DocumentError(f"{path.name}: not a readable Word document ({type(exc).__name__}: {exc})") from None
    blocks = [p.text for p in document.paragraphs]
    for table in document.tables:
        for row in table.rows:
            blocks.append(" | ".join(cell.text.strip() for cell in row.cells))
    # paragraphs become blank-line separated blocks, as in a text file
    return [(None, "\n\n".join(b for b in blocks if b.strip()))]
