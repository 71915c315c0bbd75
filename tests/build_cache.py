"""What the suite builds once and keeps between runs, in the user's cache: a folder per input key
(a hash of what the build reads), made under a lock so that two runs at once build it once, and
made again when a run left it half-built or a test changed a file in it."""

from __future__ import annotations

import hashlib
import json
import shutil
from importlib import metadata
from pathlib import Path
from typing import Callable

import platformdirs
from filelock import FileLock

ROOT = Path(__file__).resolve().parent.parent
KEPT = 3  # folders kept per kind (other checkouts may need older ones)
RECORD = "complete.json"


def digest(files, packages=()) -> str:
    """A key for a build that reads ``files`` (their paths relative to the checkout, and contents)
    and depends on the installed versions of ``packages``."""
    h = hashlib.sha256()
    for path in sorted(Path(p).resolve() for p in files):
        h.update(str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path).encode())
        h.update(b"\0" + path.read_bytes())
    for package in packages:
        try:
            h.update(f"{package}=={metadata.version(package)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{package} missing".encode())
    return h.hexdigest()[:16]


def _stats(folder: Path) -> dict[str, list[int]]:
    return {p.relative_to(folder).as_posix(): [p.stat().st_size, p.stat().st_mtime_ns]
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink() and p.name != RECORD}


def cached(kind: str, key: str, build: Callable[[Path], None], root: Path | None = None) -> Path:
    """The folder of ``kind`` for ``key``: built by ``build(folder)`` unless an intact one is kept."""
    root = (root or platformdirs.user_cache_path("fleetshard") / "tests") / kind
    root.mkdir(parents=True, exist_ok=True)
    folder = root / key
    with FileLock(str(root / "lock")):
        record = folder / RECORD
        if not (record.exists() and json.loads(record.read_text()) == _stats(folder)):
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            record.write_text(json.dumps(_stats(folder)))
            others = sorted((p for p in root.iterdir() if p.is_dir() and p != folder), key=lambda p: p.stat().st_mtime)
            for old in others[:max(0, len(others) - (KEPT - 1))]:
                shutil.rmtree(old, ignore_errors=True)
        folder.touch()  # the most recently used folders are the ones kept
    return folder
