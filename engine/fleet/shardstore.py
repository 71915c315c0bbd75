"""A node's store of received shards, addressed by content hash, with resumable verified transfers.

A shard's content hash is the sha256 of its ``manifest.json``: the manifest lists the sha256 of every
other file, so equal hashes mean equal shards.  A transfer writes into ``incoming/HASH/`` (each file
grows by appended chunks, so an interrupted transfer resumes where the bytes on disk end) and only
a complete folder whose every file matches the manifest moves into ``shards/HASH/``.  A file that
does not match is deleted and the transfer refused; nothing half-received is ever served.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

from engine.errors import ShardError
from engine.hashing import sha256_file
from engine.manifest import MANIFEST, Manifest, layer_span, load_manifest, part_name, parse_manifest, read_manifest
from engine.progress import byte_size

MAX_MANIFEST_BYTES = 1 << 20
_HEX = frozenset("0123456789abcdef")


def pruned_text(shards: int, unfinished: int) -> str:
    """What a prune removed: "2 shard(s)", or "2 shard(s) and 1 unfinished transfer(s)"."""
    return f"{shards} shard(s)" + (f" and {unfinished} unfinished transfer(s)" if unfinished else "")


def shard_text(entry: dict) -> str:
    """One entry of ``ShardStore.listing`` for people: "qwen2 part 2 of 2, layers 2-3, f32, 1.2 MB"."""
    part = part_name(entry.get("stage"), entry.get("count"))
    return (f"{entry.get('model')} {part}, {layer_span(*entry['layers'])}, {entry.get('weights')}, "
            f"{entry.get('bytes', 0) / 2**20:.1f} MB")


def content_hash(folder: Path) -> str:
    return hashlib.sha256((Path(folder) / MANIFEST).read_bytes()).hexdigest()


def check_hash(text: str) -> str:
    if not isinstance(text, str) or len(text) != 64 or not set(text) <= _HEX:
        raise ShardError(f"{str(text)[:80]!r} is not a shard content hash")
    return text


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ShardError(f"{str(name)[:80]!r} is not a plain file name")
    return name


def received_manifest(raw: bytes) -> Manifest:
    """A manifest a peer sent: bounded in size, and naming only files inside the shard folder."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ShardError(f"manifest of {len(raw)} bytes is larger than any shard's")
    manifest = parse_manifest(raw)
    for name in manifest.files:
        _check_name(name)
    return manifest


class ShardStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.done = self.root / "shards"
        self.incoming = self.root / "incoming"
        self.done.mkdir(parents=True, exist_ok=True)
        self.incoming.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def path(self, digest: str) -> Path:
        return self.done / check_hash(digest)

    def has(self, digest: str) -> bool:
        return (self.path(digest) / MANIFEST).exists()

    def listing(self) -> list[dict]:
        out = []
        for folder in sorted(self.done.iterdir()):
            try:
                m = read_manifest(folder)
            except ShardError:
                continue
            out.append({"hash": folder.name, "model": m.model_name, "fingerprint": m.fingerprint,
                        "stage": m.stage_index, "count": m.stage_count, "layers": list(m.layers),
                        "weights": m.weights,
                        "bytes": sum(p.stat().st_size for p in folder.iterdir() if p.is_file())})
        return out

    # --- receiving -----------------------------------------------------------------------------------

    def begin(self, digest: str, manifest_bytes: bytes, sizes: dict[str, int]) -> dict[str, int]:
        """Starts or resumes a transfer; returns how many bytes of each file are already here."""
        check_hash(digest)
        if hashlib.sha256(manifest_bytes).hexdigest() != digest:
            raise ShardError("the manifest does not match the announced content hash")
        manifest = received_manifest(manifest_bytes)
        if set(sizes) != set(manifest.files):
            raise ShardError("the announced files differ from the manifest's")
        if not all(isinstance(n, int) and n >= 0 for n in sizes.values()):
            raise ShardError("malformed file sizes")
        folder = self.incoming / digest
        have = {}
        for name, size in sizes.items():
            part = folder / name
            have[name] = part.stat().st_size if part.exists() else 0
            if have[name] > size:  # longer than announced: start that file over
                part.unlink()
                have[name] = 0
        need = sum(sizes.values()) - sum(have.values())
        if need > shutil.disk_usage(self.incoming).free:
            raise self._no_room(digest, need)
        folder.mkdir(exist_ok=True)
        (folder / MANIFEST).write_bytes(manifest_bytes)
        (folder / "sizes.json").write_text(json.dumps(sizes))
        return have

    def write(self, digest: str, name: str, offset: int, data: bytes) -> int:
        folder = self.incoming / check_hash(digest)
        sizes_file = folder / "sizes.json"
        if not sizes_file.exists():
            raise ShardError(f"no transfer of shard {digest[:12]} in progress")
        sizes = json.loads(sizes_file.read_text())
        if _check_name(name) not in sizes:
            raise ShardError(f"{name} is not a file of shard {digest[:12]}")
        part = folder / name
        have = part.stat().st_size if part.exists() else 0
        if offset != have:
            raise ShardError(f"chunk of {name} at byte {offset}, but {have} bytes are here (resume from {have})")
        if offset + len(data) > sizes[name]:
            raise ShardError(f"chunk runs past the announced size of {name} ({sizes[name]} bytes)")
        try:
            with open(part, "ab") as f:
                f.write(data)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # the disk filled up under the transfer: nothing half-received stays to take the space
            need = sum(sizes.values()) - offset
            for other, size in sizes.items():
                if other != name and (folder / other).exists():
                    need -= min(size, (folder / other).stat().st_size)
            shutil.rmtree(folder, ignore_errors=True)
            raise self._no_room(digest, need, "the disk filled up during the transfer; "
                                              "the partly received files were removed") from None
        return offset + len(data)

    def _no_room(self, digest: str, need: int, what: str = "") -> ShardError:
        free = shutil.disk_usage(self.root).free
        return ShardError(f"not enough disk space for shard {digest[:12]}: it needs {byte_size(need)} more, "
                          f"and {self.root} has {byte_size(free)} free{f' ({what})' if what else ''}. "
                          "Free up space on that computer (`fleet nodes prune` removes shards no worker "
                          "uses) and send it again")

    def finish(self, digest: str) -> Path:
        """Verifies every file against the manifest and moves the shard into the store."""
        folder = self.incoming / check_hash(digest)
        if not (folder / MANIFEST).exists():
            raise ShardError(f"no transfer of shard {digest[:12]} in progress")
        manifest = received_manifest((folder / MANIFEST).read_bytes())
        for name, expected in manifest.files.items():
            part = folder / name
            if not part.exists() or sha256_file(part) != expected:
                if part.exists():
                    part.unlink()
                raise ShardError(f"{name} of shard {digest[:12]} arrived corrupted (sha256 mismatch); "
                                 "it was discarded, send it again")
        (folder / "sizes.json").unlink()
        target = self.done / digest
        with self._lock:
            if target.exists():
                shutil.rmtree(folder)
            else:
                os.replace(folder, target)
        load_manifest(target)
        return target

    def drop(self, digest: str) -> None:
        for folder in (self.done / check_hash(digest), self.incoming / digest):
            if folder.exists():
                shutil.rmtree(folder)

    def drop_unfinished(self, idle_s: float) -> tuple[int, int]:
        """Drops the transfers no chunk has reached for ``idle_s`` (a cancelled send is kept to resume
        until then); returns how many and their bytes."""
        dropped = freed = 0
        for folder in list(self.incoming.iterdir()):
            files = [p.stat() for p in folder.iterdir()] if folder.is_dir() else []
            if time.time() - max((f.st_mtime for f in files), default=0.0) < idle_s:
                continue
            dropped, freed = dropped + 1, freed + sum(f.st_size for f in files)
            shutil.rmtree(folder, ignore_errors=True)
        return dropped, freed
