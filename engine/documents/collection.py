"""Named document collections, each a BM25 index (bm25s) of its files' passages kept in the app's data
folder (``paths().data / "documents"``), and the update that keeps an index in step with the files.

A collection holds sources (files and folders, folders searched recursively for ``readers.SUFFIXES``).
``Collection.update`` lists the files, reads only those that are new or whose size or modification time
changed, drops those that are gone, and rebuilds the BM25 index from the stored passages (reading and
parsing the files is the slow part; indexing the passages in memory is not).  It reports each file read
to ``progress`` (``engine.progress``) and stops between files when its ``cancel`` event is set; what
it read by then is kept, the rest is read by the next update.  When no file changed, it writes nothing.

On disk, a collection is a folder: ``collection.json`` (name, sources, the files with their size, time
and passage count) names the generation of ``passages-N.json`` and ``bm25-N/`` it goes with, and is
replaced last and whole (``engine.files.write_json``), so a crash mid-update leaves the last complete
index.  The library's folder, each collection's, and every file in them are their owner's alone (0700
and 0600): the passages are the user's own text.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import threading
from pathlib import Path

from engine.config import paths
from engine.documents.passages import Passage, split_pages, terms
from engine.documents.readers import DocumentError, read_pages, supported
from engine.files import PRIVATE_FILE_MODE, private_folder, write_json
from engine.progress import Progress, Report, quiet

MAX_NAME = 80
INDEX_FILE = "collection.json"


def library_root() -> Path:
    return paths().data / "documents"


@dataclasses.dataclass(frozen=True)
class Hit:
    """One passage a search found, with its BM25 score (higher: more of the query's rarer words)."""

    passage: Passage
    score: float


@dataclasses.dataclass
class UpdateReport:
    files: int = 0  # files in the collection after the update
    passages: int = 0
    read: int = 0  # new or changed files read this time
    kept: int = 0  # unchanged files not read again
    dropped: int = 0  # files gone from disk (or from the sources) removed from the index
    skipped: list[str] = dataclasses.field(default_factory=list)  # "name: why", files that could not be read
    cancelled: bool = False

    def describe(self) -> str:
        text = (f"{self.files} files, {self.passages} passages (read {self.read}, unchanged {self.kept}, "
                f"removed {self.dropped})")
        if self.skipped:
            text += f"; {len(self.skipped)} skipped: " + "; ".join(self.skipped[:3]) + (
                " …" if len(self.skipped) > 3 else "")
        return ("cancelled: " if self.cancelled else "") + text


def check_name(name: str) -> str:
    name = " ".join(str(name).split())
    if not name:
        raise DocumentError("a collection needs a name")
    if len(name) > MAX_NAME:
        raise DocumentError(f"a collection's name is at most {MAX_NAME} characters")
    return name


def folder_name(name: str) -> str:
    """A file-system-safe folder for ``name`` (distinct names get distinct folders)."""
    slug = re.sub(r"[^\w-]+", "-", name.lower()).strip("-")[:40] or "collection"
    return f"{slug}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"


class Library:
    """The collections in a folder (default: the app's data folder)."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root else library_root()

    def names(self) -> list[str]:
        found = []
        if self.root.is_dir():
            for index in self.root.glob(f"*/{INDEX_FILE}"):
                try:
                    found.append(json.loads(index.read_text(encoding="utf-8"))["name"])
                except (OSError, ValueError, KeyError, TypeError):
                    continue  # a folder half written by another process, or not ours
        return sorted(found, key=str.lower)

    def folder(self, name: str) -> Path:
        return self.root / folder_name(check_name(name))

    def create(self, name: str) -> "Collection":
        name = check_name(name)
        if name in self.names():
            raise DocumentError(f"there is already a collection named {name!r}")
        collection = Collection(name, self.folder(name))
        collection.save()
        return collection

    def open(self, name: str) -> "Collection":
        folder = self.folder(name)
        if not (folder / INDEX_FILE).exists():
            raise DocumentError(f"no document collection named {name!r}")
        return Collection.load(folder)

    def remove(self, name: str) -> None:
        """Deletes the collection's index (the documents themselves stay where they are)."""
        shutil.rmtree(self.folder(name), ignore_errors=True)


class Collection:
    def __init__(self, name: str, folder: Path):
        self.name = name
        self.folder = Path(folder)
        self.sources: list[str] = []
        self.files: dict[str, dict] = {}  # path -> {"size", "mtime_ns", "passages", "error"?}
        self.generation = 0
        self.passages: list[Passage] = []
        self._bm25 = None
        self._lock = threading.Lock()

    # --- persistence ---------------------------------------------------------------------------------

    @classmethod
    def load(cls, folder: Path) -> "Collection":
        try:
            doc = json.loads((folder / INDEX_FILE).read_text(encoding="utf-8"))
            collection = cls(doc["name"], folder)
            collection.sources = list(doc["sources"])
            collection.files = dict(doc["files"])
            collection.generation = int(doc["generation"])
            if collection.generation:
                rows = json.loads((folder / f"passages-{collection.generation}.json").read_text(encoding="utf-8"))
                collection.passages = [Passage(*row) for row in rows]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DocumentError(f"the document index in {folder} is damaged ({exc}): re-create the collection") \
                from None
        return collection

    def save(self) -> None:
        private_folder(self.folder.parent)  # the library's folder: the collections' names are the user's too
        write_json(self.folder / INDEX_FILE, {"name": self.name, "sources": self.sources, "files": self.files,
                                              "generation": self.generation}, private=True)

    def _commit(self, passages: list[Passage]) -> None:
        """Writes a new generation of passages and index, then the collection file that names it, then
        removes the older generations."""
        import bm25s  # deferred: the index library loads only when a collection is indexed or searched

        generation = self.generation + 1
        private_folder(self.folder)
        fd = os.open(self.folder / f"passages-{generation}.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                     PRIVATE_FILE_MODE)
        with open(fd, "w", encoding="utf-8") as rows:
            json.dump([dataclasses.astuple(p) for p in passages], rows, ensure_ascii=False)
        bm25 = None
        if passages:
            bm25 = bm25s.BM25()
            bm25.index([terms(p.text) or [""] for p in passages], show_progress=False)
            index = private_folder(self.folder / f"bm25-{generation}")
            bm25.save(str(index), show_progress=False)
            for file in index.iterdir():  # bm25s writes them with the process's default mode
                file.chmod(PRIVATE_FILE_MODE)
        self.generation, self.passages, self._bm25 = generation, passages, bm25
        self.save()
        for old in self.folder.iterdir():
            number = re.fullmatch(r"(?:passages|bm25)-(\d+)(?:\.json)?", old.name)
            if number and int(number.group(1)) != generation:
                shutil.rmtree(old) if old.is_dir() else old.unlink(missing_ok=True)

    # --- sources -------------------------------------------------------------------------------------

    def add(self, *paths_: Path | str) -> list[str]:
        """Adds files or folders (the next ``update`` reads them); returns those not already in."""
        added = []
        for path in paths_:
            path = Path(path).expanduser().resolve()
            if not path.exists():
                raise DocumentError(f"{path}: no such file or folder")
            if not path.is_file() and not path.is_dir():
                raise DocumentError(f"{path.name}: neither a file nor a folder (a pipe or a device), not added")
            if path.is_file() and not supported(path):
                raise DocumentError(f"{path.name}: not a document this app reads (txt, md, pdf, docx)")
            if str(path) not in self.sources:
                self.sources.append(str(path))
                added.append(str(path))
        self.save()
        return added

    def remove_source(self, path: Path | str) -> None:
        self.sources = [s for s in self.sources if s != str(path)]
        self.save()

    def listed_files(self) -> dict[str, os.stat_result]:
        """The supported files under the sources now, with their own stat, not that of what a link points
        to (hidden files and folders skipped; links, pipes and devices listed, for the reader to refuse by
        name)."""
        found = {}
        for source in self.sources:
            root = Path(source)
            if root.is_file():
                found[str(root)] = root.lstat()
                continue
            for folder, dirs, names in os.walk(root):  # never follows links to folders: no loops
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(names):
                    path = Path(folder, name)
                    if supported(path):
                        try:
                            found[str(path)] = path.lstat()
                        except OSError:
                            continue  # gone between listing and stat
        return found

    # --- indexing ------------------------------------------------------------------------------------

    def update(self, progress: Report = quiet, cancel: threading.Event | None = None) -> UpdateReport:
        """Brings the index up to date with the files (see the module's docstring)."""
        with self._lock:
            listed = self.listed_files()
            report = UpdateReport()
            old: dict[str, list[Passage]] = {}
            for p in self.passages:
                old.setdefault(p.file, []).append(p)
            files: dict[str, dict] = {}
            fresh: dict[str, list[Passage]] = {}
            report.dropped = sum(1 for path in self.files if path not in listed)
            total = len(listed)
            for done, (path, st) in enumerate(listed.items()):
                entry = self.files.get(path)
                if entry and entry["size"] == st.st_size and entry["mtime_ns"] == st.st_mtime_ns:
                    files[path] = entry
                    fresh[path] = old.get(path, [])
                    report.kept += 1
                    continue
                if cancel is not None and cancel.is_set():
                    report.cancelled = True
                    if entry:  # changed but not read again: kept as it was, read next time
                        files[path], fresh[path] = entry, old.get(path, [])
                    continue
                progress(Progress(f"Indexing {self.name}: {done} of {total} files ({Path(path).name})", done / total))
                record = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
                try:
                    passages = split_pages(path, read_pages(path))
                except DocumentError as exc:
                    passages, record["error"] = [], str(exc)
                    report.skipped.append(str(exc))
                record["passages"] = len(passages)
                files[path], fresh[path] = record, passages
                report.read += 1
            if total:
                progress(Progress(f"Indexing {self.name}: {total} of {total} files", 1.0))
            if report.read or report.dropped or not self.generation:
                self.files = files
                self._commit([p for path in files for p in fresh[path]])
            # else nothing changed on disk: the index stays as it is (an update is then only a listing)
            report.files = len(files)
            report.passages = len(self.passages)
            return report

    # --- search --------------------------------------------------------------------------------------

    def _index(self):
        if self._bm25 is None and self.passages:
            import bm25s  # deferred: see _commit

            try:
                self._bm25 = bm25s.BM25.load(str(self.folder / f"bm25-{self.generation}"), show_progress=False)
            except (OSError, ValueError):  # the index files went missing: the passages rebuild it
                self._bm25 = bm25s.BM25()
                self._bm25.index([terms(p.text) or [""] for p in self.passages], show_progress=False)
        return self._bm25

    def search(self, query: str, k: int = 4) -> list[Hit]:
        """The ``k`` passages that match ``query`` best, best first (none when no word of it is indexed)."""
        bm25 = self._index()
        if bm25 is None or k < 1:
            return []
        words = [t for t in terms(query) if t in bm25.vocab_dict]
        if not words:
            return []
        found, scores = bm25.retrieve([words], k=min(k, len(self.passages)), show_progress=False)
        return [Hit(self.passages[int(i)], float(s)) for i, s in zip(found[0], scores[0]) if s > 0]
