"""Saving the files the app and the ``fleet`` command share (settings, deployment record, fleet profile,
plan): whole or not at all, one writer at a time.

``write_atomic`` writes a temporary file in the target's folder, flushes and fsyncs it and renames it
over the target (``os.replace``), so a reader sees the old file or the new one, never half of one, and
a crash mid-write leaves the old file as it was.  Writers serialise on ``lock(path)``, a ``filelock``
lock file beside the target that every process of the app and the CLI takes; a read-modify-write
(``engine.config.remember_nodes``) holds it across the read too.

A file that holds secrets or the user's own text (the settings with MCP servers' tokens, a document
index) is written ``private``: readable by its owner only, in a folder only its owner can open
(``private_folder``), whatever mode an older version left it with.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import FleetError

if TYPE_CHECKING:
    import filelock

LOCK_TIMEOUT_S = 30.0  # a write takes milliseconds; a holder this slow is stuck
NEW_FILE_MODE = 0o644  # what a new file gets (an existing one keeps its own mode)
PRIVATE_FILE_MODE = 0o600  # a private file: its owner's alone
PRIVATE_FOLDER_MODE = 0o700

_locks: dict[str, filelock.FileLock] = {}
_locks_guard = threading.Lock()


def lock(path: Path | str) -> filelock.FileLock:
    """The inter-process lock of ``path`` (``PATH.lock`` beside it): one object per file in a process, so
    a thread that holds it may take it again (a save inside a read-modify-write)."""
    import filelock  # deferred: importing it costs ~10 ms that only a process that saves a file pays

    target = Path(path).expanduser().resolve()
    with _locks_guard:
        found = _locks.get(str(target))
        if found is None:
            target.parent.mkdir(parents=True, exist_ok=True)
            found = _locks[str(target)] = filelock.FileLock(str(target) + ".lock", timeout=LOCK_TIMEOUT_S)
        return found


def private_folder(path: Path | str) -> Path:
    """``path`` made if missing (with its parents) and closed to other users (POSIX modes; elsewhere
    the user's profile folders are theirs already)."""
    path = Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    if os.name == "posix":
        os.chmod(path, PRIVATE_FOLDER_MODE)
    return path


def write_atomic(path: Path | str, data: str | bytes, private: bool = False) -> Path:
    """Replaces ``path`` with ``data`` whole, under ``lock(path)``; returns the path.  ``private``: the
    file and its folder are closed to other users (see the module's docstring)."""
    path = Path(path).expanduser()
    raw = data.encode() if isinstance(data, str) else data
    if private:
        private_folder(path.parent)
    try:
        with lock(path):
            _replace(path, raw, PRIVATE_FILE_MODE if private else None)
    except TimeoutError:  # filelock.Timeout
        raise FleetError(f"cannot save {path}: another fleetshard process has held {path}.lock for "
                         f"{LOCK_TIMEOUT_S:.0f} s") from None
    return path


def write_json(path: Path | str, doc, indent: int | None = 2, private: bool = False) -> Path:
    return write_atomic(path, json.dumps(doc, indent=indent), private)


def _replace(path: Path, raw: bytes, mode: int | None) -> None:
    """Replaces ``path`` by ``raw`` through a temporary file (``mode`` None: the old file's, or
    ``NEW_FILE_MODE``)."""
    if mode is None:
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
        except FileNotFoundError:
            mode = NEW_FILE_MODE
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if os.name == "posix":  # the rename itself survives a power cut once the folder is synced
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
