"""File hashing shared by the catalog (pulled GGUFs), the model fingerprint and the shard manifests.

``weights_sha256`` hashes a weight file whole, once: the digest is remembered in ``weight-hashes.json``
of the user cache folder by the file's resolved path, size, mtime, ctime and inode, so a 1 GB GGUF is
read once, and weights rewritten in place (same name, same size) are hashed again.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from engine.config import paths
from engine.errors import FleetError
from engine.files import lock, write_json

CACHE_NAME = "weight-hashes.json"
# A file written this recently may be written again within the same mtime tick without its stamp
# changing; its digest is not remembered (git's "racy clean" rule).
RACY_NS = 2_000_000_000


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def weights_sha256(path: Path | str) -> str:
    """The sha256 of a whole weight file, from the cache when the file is unchanged since it was hashed."""
    path = Path(path).resolve()
    stamp = _stamp(path)
    cache = paths().cache / CACHE_NAME
    known = _read(cache).get(str(path))
    if isinstance(known, dict) and known.get("stamp") == stamp and isinstance(known.get("sha256"), str):
        return known["sha256"]
    started = time.time_ns()
    digest = sha256_file(path)
    if started - stamp[1] > RACY_NS and _stamp(path) == stamp:
        try:
            with lock(cache):
                entries = {name: e for name, e in _read(cache).items() if os.path.exists(name)}
                entries[str(path)] = {"stamp": stamp, "sha256": digest}
                write_json(cache, entries, indent=None)
        except (OSError, FleetError):
            pass  # a cache that cannot be written only costs the next hashing
    return digest


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _read(cache: Path) -> dict:
    try:
        raw = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}
