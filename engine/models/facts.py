"""What a model card shows: a model's size, parameters, weight format, context, license and the shape
facts placement is estimated from, for a catalog model, a GGUF file or a Hugging Face folder.

Only headers are read (a GGUF's key/value section and tensor table, a folder's ``config.json`` and
safetensors headers), with ``struct`` and ``json`` alone, so a card works on a worker install that
lacks the export packages and before a catalog model is pulled.  Facts a source does not state are
left at zero or empty; the card says what is known.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
from pathlib import Path

from engine.errors import SourceError
from engine.models.catalog import CATALOG, CardFacts, CatalogEntry
from engine.models.gguf_header import read_gguf_header

# llama.cpp's general.file_type values (LLAMA_FTYPE_*) for the formats in common use
GGUF_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
                   11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
                   17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}


@dataclasses.dataclass(frozen=True)
class ModelFacts(CardFacts):
    """A model card's facts about one source, whatever its kind."""

    name: str
    source: str  # the catalog name, or the file's or folder's path: what the export takes
    kind: str  # "catalog", "gguf" or "hf"
    size: int  # bytes of the weights file(s)
    architecture: str = ""
    description: str = ""
    fingerprint: str = ""  # a catalog model's sha256, which its exports carry as their fingerprint


def catalog_facts(e: CatalogEntry) -> ModelFacts:
    shared = {f.name: getattr(e, f.name) for f in dataclasses.fields(ModelFacts) if hasattr(e, f.name)}
    return ModelFacts(**shared, source=e.name, kind="catalog", fingerprint=e.sha256)


def gguf_header(path: Path) -> tuple[dict, int]:
    """A GGUF file's scalar and string metadata (arrays as their length) and its parameter count."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise SourceError(f"{path} is not a GGUF file (it does not start with b'GGUF')")
    try:
        header = read_gguf_header(path)
    except (struct.error, ValueError) as exc:
        raise SourceError(f"{path} is a truncated or corrupt GGUF file ({exc})") from None
    return header.meta, sum(math.prod(t.dims) for t in header.tensors)


def gguf_facts(path: str | Path) -> ModelFacts:
    path = Path(path).expanduser()
    meta, params = gguf_header(path)
    arch = str(meta.get("general.architecture", ""))

    def a(key: str) -> int:
        v = meta.get(f"{arch}.{key}", 0)
        return int(v) if isinstance(v, (int, float)) else 0

    heads = a("attention.head_count")
    hidden = a("embedding_length")
    file_type = meta.get("general.file_type")
    return ModelFacts(
        name=str(meta.get("general.name") or path.stem), source=str(path), kind="gguf", size=path.stat().st_size,
        parameters=params, weight_format="GGUF" + (f" {GGUF_FILE_TYPES.get(file_type, f'type {file_type}')}"
                                                   if file_type is not None else ""),
        context=a("context_length"), license=str(meta.get("general.license", "")), architecture=arch,
        num_layers=a("block_count"), hidden_size=hidden, intermediate_size=a("feed_forward_length"),
        num_heads=heads, num_kv_heads=a("attention.head_count_kv") or heads,
        head_dim=a("attention.key_length") or (hidden // heads if heads else 0),
        vocab_size=a("vocab_size") or int(meta.get("tokenizer.ggml.tokens", 0) or 0))


def hf_facts(folder: str | Path) -> ModelFacts:
    folder = Path(folder).expanduser()
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise SourceError(f"{folder} is not a Hugging Face model folder: no readable config.json ({exc})") from None
    config = {**config.get("text_config", {}), **config}  # multimodal configs nest the decoder's facts
    files = sorted(folder.glob("*.safetensors"))
    params, dtypes = 0, set()
    for t in files:
        try:
            with open(t, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(min(length, 100 << 20)))
        except (OSError, ValueError, struct.error):
            continue
        for key, tensor in header.items():
            if key != "__metadata__" and isinstance(tensor, dict):
                count = 1
                for d in tensor.get("shape", []):
                    count *= d
                params += count
                dtypes.add(str(tensor.get("dtype", "")).lower())
    heads = int(config.get("num_attention_heads") or 0)
    hidden = int(config.get("hidden_size") or 0)
    licence = ""
    readme = folder / "README.md"
    if readme.is_file():
        match = re.search(r"^license:\s*(\S+)", readme.read_text(errors="replace")[:4000], re.MULTILINE)
        licence = match.group(1) if match else ""
    fmt = str(config.get("torch_dtype") or config.get("dtype") or "/".join(sorted(d for d in dtypes if d)))
    return ModelFacts(
        name=folder.name, source=str(folder), kind="hf", size=sum(t.stat().st_size for t in files),
        parameters=params, weight_format="safetensors" + (f" {fmt}" if fmt else ""),
        context=int(config.get("max_position_embeddings") or 0), license=licence,
        architecture=str(config.get("model_type", "")), num_layers=int(config.get("num_hidden_layers") or 0),
        hidden_size=hidden, intermediate_size=int(config.get("intermediate_size") or 0), num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or (hidden // heads if heads else 0)),
        vocab_size=int(config.get("vocab_size") or 0))


def facts_of(source: str | Path) -> ModelFacts:
    """The card facts of a catalog name, a ``.gguf`` file or a Hugging Face folder."""
    if str(source) in CATALOG:
        return catalog_facts(CATALOG[str(source)])
    path = Path(source).expanduser()
    if path.is_dir():
        return hf_facts(path)
    if path.is_file():
        return gguf_facts(path)
    raise SourceError(f"{source!r} is neither a catalog model ({', '.join(CATALOG)}) nor an existing file or folder")


def found_models(folders: list[Path], most: int = 24) -> list[ModelFacts]:
    """The models a user keeps in ``folders`` (a downloads folder, a models folder): the ``.gguf`` files
    in each and the Hugging Face folders (a ``config.json`` beside ``.safetensors`` weights) one level
    below, at most ``most`` of them, newest first.  The catalog's own files, and files or folders
    whose headers cannot be read, are left out."""
    catalog_files = {e.filename for e in CATALOG.values()}
    candidates = []  # (modified, path)
    for folder in folders:
        try:
            entries = list(Path(folder).expanduser().iterdir())
        except OSError:
            continue
        for entry in entries:
            try:
                gguf = entry.is_file() and entry.suffix.lower() == ".gguf" and entry.name not in catalog_files
                hf = entry.is_dir() and (entry / "config.json").is_file() and any(entry.glob("*.safetensors"))
                if gguf or hf:
                    candidates.append((entry.stat().st_mtime, entry))
            except OSError:  # gone, or unreadable, while we looked
                continue
    found = []
    for _, path in sorted(candidates, key=lambda c: c[0], reverse=True):
        if len(found) == most:
            break
        try:
            found.append(facts_of(path))
        except (SourceError, OSError, ValueError, KeyError, struct.error):
            continue
    return found
