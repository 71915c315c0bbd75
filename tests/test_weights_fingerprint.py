"""The model fingerprint covers the weights themselves: weights changed in place (same names, shapes and
sizes) export afresh, and a stage exported from the old weights is refused at the handshake."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
from test_catalog import write_gguf

from engine import hashing
from engine.config import FleetAccess
from engine.errors import StageError
from engine.export.exporter import export_model
from engine.fleetkey import access_of, create_key, load_key
from engine.models.catalog import resolve_source
from engine.runtime.relay.local_workers import LocalWorkers
from engine.runtime.relay.remote import RemoteChain

HOUR_NS = 3600 * 10**9


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETSHARD_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def poke(path, offset: int) -> None:
    """Adds 1 to the float32 at ``offset``: one weight changed, the file's size and layout kept."""
    with open(path, "r+b") as f:
        f.seek(offset)
        (value,) = struct.unpack("<f", f.read(4))
        f.seek(offset)
        f.write(struct.pack("<f", value + 1.0))


def safetensors_offset(path, name: str) -> int:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    assert header[name]["dtype"] == "F32"
    return 8 + length + header[name]["data_offsets"][0]


def test_a_gguf_weight_changed_in_the_middle_changes_the_fingerprint(home, tmp_path):
    path = write_gguf(tmp_path / "model.gguf", n=1 << 19)  # 4 MiB of tensors: the middle is past the first MiB
    size, before = path.stat().st_size, resolve_source(str(path)).fingerprint
    poke(path, size // 2 + 4096)
    assert path.stat().st_size == size
    after = resolve_source(str(path)).fingerprint
    assert after != before
    # The whole file's sha256, as a catalog entry's fingerprint is.
    assert after == hashing.sha256_file(path)


def test_a_weight_file_is_hashed_once_until_it_changes(home, tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "model.gguf")
    old = path.stat().st_mtime_ns - HOUR_NS
    os.utime(path, ns=(old, old))  # written an hour ago: past the window where a rewrite may keep the stamp
    reads = []
    real = hashing.sha256_file
    monkeypatch.setattr(hashing, "sha256_file", lambda p, *a: reads.append(p) or real(p, *a))
    first = resolve_source(str(path)).fingerprint
    assert resolve_source(str(path)).fingerprint == first and len(reads) == 1
    assert (home / "cache" / hashing.CACHE_NAME).is_file()
    # Rewritten in place with its old size and even its old mtime: hashed again, and the change shows.
    poke(path, path.stat().st_size - 8)
    os.utime(path, ns=(old, old))
    assert resolve_source(str(path)).fingerprint != first and len(reads) == 2


def test_weights_retrained_in_place_export_again_and_old_stages_are_refused(home, tiny_models, tmp_path):
    folder = shutil.copytree(tiny_models["llama"], tmp_path / "llama")
    out = tmp_path / "shards"
    first = export_model(str(folder), stages=2, weights="f32", out=out)
    assert export_model(str(folder), stages=2, weights="f32", out=out).cached  # unchanged weights: reused
    old_stage1 = shutil.copytree(first.folders[1], tmp_path / "old-stage1")

    tensors = folder / "model.safetensors"
    size = tensors.stat().st_size
    poke(tensors, safetensors_offset(tensors, "model.layers.0.mlp.down_proj.weight"))
    assert tensors.stat().st_size == size

    again = export_model(str(folder), stages=2, weights="f32", out=out)
    assert not again.cached
    key_file = create_key(tmp_path / "fleet.key")
    fleet = LocalWorkers([old_stage1], access_of(key_file), log_dir=tmp_path).start()
    try:
        with pytest.raises(StageError, match="fingerprint mismatch"):
            RemoteChain(again.folders[0], fleet.addresses, access=FleetAccess(load_key(key_file)), connect_timeout_s=10)
    finally:
        fleet.close()
    # The new stage 1 goes with the new stage 0.
    fleet = LocalWorkers([again.folders[1]], access_of(key_file), log_dir=tmp_path).start()
    try:
        RemoteChain(again.folders[0], fleet.addresses, access=FleetAccess(load_key(key_file)),
                    connect_timeout_s=10).close()
    finally:
        fleet.close()
