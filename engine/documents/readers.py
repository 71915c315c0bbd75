"""A document file as pages of plain text: txt and md as they are, pdf through pypdf (one page per
page), docx through python-docx (paragraphs and tables, one page: a docx has no pages of its own).

A file that cannot be read raises ``DocumentError`` naming the file and why (damaged, encrypted,
no text to extract, too large).
"""

from __future__ import annotations

from pathlib import Path

from engine.errors import FleetError

TEXT_SUFFIXES = (".txt", ".md", ".markdown")
SUFFIXES = (*TEXT_SUFFIXES, ".pdf", ".docx")
MAX_FILE_MB = 64  # a bigger file is far more than a chat's context can use; it is skipped by name


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
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise DocumentError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if size > MAX_FILE_MB * 2**20:
        raise DocumentError(f"{path.name}: larger than {MAX_FILE_MB} MB, skipped")
    if suffix == ".pdf":
        pages = _pdf(path)
    elif suffix == ".docx":
        pages = _docx(path)
    else:
        pages = [(None, _text(path))]
    pages = [(number, text) for number, text in pages if text.strip()]
    if not pages:
        what = "no text to extract (a scanned PDF needs OCR first)" if suffix == ".pdf" else "empty"
        raise DocumentError(f"{path.name}: {what}")
    return pages


def _text(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DocumentError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if b"\0" in raw[:4096]:
        raise DocumentError(f"{path.name}: a binary file, not text")
    return raw.decode("utf-8-sig", errors="replace").replace("\r\n", "\n")


def _pdf(path: Path) -> list[tuple[int | None, str]]:
    import pypdf  # deferred: only a collection with PDFs pays for loading the parser

    try:
        reader = pypdf.PdfReader(str(path))
        if reader.is_encrypted and not reader.decrypt(""):
            raise DocumentError(f"{path.name}: the PDF is encrypted with a password")
        return [(number, page.extract_text() or "") for number, page in enumerate(reader.pages, 1)]
    except DocumentError:
        raise
    except Exception as exc:  # pypdf raises many kinds on a damaged file: each means "cannot read it"
        raise DocumentError(f"{path.name}: not a readable PDF ({type(exc).__name__}: {exc})") from None


def _docx(path: Path) -> list[tuple[int | None, str]]:
    import docx  # deferred: only a collection with Word files pays for loading the parser

    try:
        document = docx.Document(str(path))
    except Exception as exc:  # a damaged or renamed file fails in the zip or XML layers alike
        raise DocumentError(f"{path.name}: not a readable Word document ({type(exc).__name__}: {exc})") from None
    blocks = [p.text for p in document.paragraphs]
    for table in document.tables:
        for row in table.rows:
            blocks.append(" | ".join(cell.text.strip() for cell in row.cells))
    # paragraphs become blank-line separated blocks, as in a text file
    return [(None, "\n\n".join(b for b in blocks if b.strip()))]
