"""The shard manifest: what a shard folder holds, written at export and verified on every load.

A shard folder is self-contained: ``openvino_model.xml/.bin`` (the stage graph), ``manifest.json``,
and for the first stage the tokenizer IRs and Hugging Face config files.  The manifest names the
model fingerprint, the stage's layer range and role, its graph interface and KV layout, the weight
format, and the sha256 of every other file in the folder; a shard whose files do not match is
refused.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from engine.errors import ShardError
from engine.hashing import sha256_file
from engine.models.architectures import ModelSpec

MANIFEST = "manifest.json"
MODEL_XML = "openvino_model.xml"
# The columns an INT4 format (int4, int4-awq...) shares one scale over, where the dimension allows.
INT4_GROUP = 128
FORMAT_VERSION = 1
KV_LAYOUT = "batch,kv_heads,seq,head_dim"
BEAM_IDX = "beam_idx"  # the cache-reorder input every stateful stage takes (always [0] at run time)


def role_of(start: int, end: int, num_layers: int) -> str:
    if start == 0 and end == num_layers:
        return "only"
    if start == 0:
        return "first"
    return "last" if end == num_layers else "middle"


def layer_numbers(start: int, end: int) -> str:
    """The layer range ``[start, end)`` as people read it, inclusive: "0-14", or "3" for one layer."""
    return str(start) if end - start == 1 else f"{start}-{end - 1}"


def layer_span(start: int, end: int) -> str:
    """"layers 0-14" or "layer 3": every range shown to a user (``--pin NODE:A-B`` reads the same way)."""
    return f"layer{'s' if end - start != 1 else ''} {layer_numbers(start, end)}"


def part_name(stage: int, count: int | None = None) -> str:
    """Stage ``stage`` (0-based) as a user reads it: "part 2 of 3", or "part 2" when the count is not
    known.  A node's reply may hold anything: what is not a number is shown as it came."""
    if not isinstance(stage, int):
        return f"part {stage}"
    return f"part {stage + 1}" + (f" of {count}" if isinstance(count, int) and count > 0 else "")


@dataclasses.dataclass
class Manifest:
    model_name: str
    fingerprint: str
    spec: ModelSpec
    stage_index: int
    stage_count: int
    layers: tuple[int, int]
    weights: str
    inputs: list[dict]
    outputs: list[dict]
    states: list[str]
    eos_token_ids: list[int] = dataclasses.field(default_factory=list)
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    export: dict = dataclasses.field(default_factory=dict)

    @property
    def role(self) -> str:
        return role_of(*self.layers, self.spec.num_layers)

    @property
    def first(self) -> bool:
        return self.layers[0] == 0

    @property
    def rank(self) -> int:
        """This shard's tensor-parallel rank (``engine.transport.mesh``; 0 of 1 when it is not split)."""
        return int(self.export.get("tensor_parallel", {}).get("rank", 0))

    @property
    def ranks(self) -> int:
        return int(self.export.get("tensor_parallel", {}).get("ranks", 1))

    @property
    def last(self) -> bool:
        return self.layers[1] == self.spec.num_layers

    def to_json(self) -> dict:
        return {
            "format": FORMAT_VERSION,
            "model": {"name": self.model_name, "fingerprint": self.fingerprint, "spec": self.spec.to_json()},
            "stage": {
                "index": self.stage_index,
                "count": self.stage_count,
                "layers": list(self.layers),
                "role": self.role,
            },
            "weights": self.weights,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "kv": {
                "layout": KV_LAYOUT,
                "seq_axis": 2,
                "num_kv_heads": self.spec.num_kv_heads,
                "head_dim": self.spec.head_dim,
                "states": self.states,
            },
            "hidden_size": self.spec.hidden_size,
            "eos_token_ids": self.eos_token_ids,
            "files": self.files,
            "export": self.export,
        }

    @classmethod
    def from_json(cls, raw: dict) -> "Manifest":
        if not isinstance(raw, dict):
            raise ShardError("the manifest is not a JSON object")
        if raw.get("format") != FORMAT_VERSION:
            raise ShardError(f"manifest format {raw.get('format')!r} is not supported (expected {FORMAT_VERSION})")
        _check_shape(raw)
        return cls(
            model_name=raw["model"]["name"],
            fingerprint=raw["model"]["fingerprint"],
            spec=ModelSpec.from_json(raw["model"]["spec"]),
            stage_index=raw["stage"]["index"],
            stage_count=raw["stage"]["count"],
            layers=tuple(raw["stage"]["layers"]),
            weights=raw["weights"],
            inputs=raw["inputs"],
            outputs=raw["outputs"],
            states=raw["kv"]["states"],
            eos_token_ids=raw.get("eos_token_ids", []),
            files=raw["files"],
            export=raw.get("export", {}),
        )

    def write(self, folder: Path) -> None:
        """Hashes every file of the folder into the manifest and writes it."""
        self.files = {
            p.name: sha256_file(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST
        }
        (folder / MANIFEST).write_text(json.dumps(self.to_json(), indent=2))


# what each part of a manifest must be: a peer's or a disk's damage ends in a ShardError naming the part
_SHAPE = {("model", "name"): str, ("model", "fingerprint"): str, ("model", "spec"): dict, ("stage", "index"): int,
          ("stage", "count"): int, ("stage", "layers"): list, ("weights",): str, ("inputs",): list,
          ("outputs",): list, ("kv", "states"): list, ("files",): dict}
_SCALARS = {"int": int, "float": (int, float), "bool": bool, "str": str}


def _check_shape(raw: dict) -> None:
    for path, kind in _SHAPE.items():
        value = raw
        for step in path:
            value = value.get(step) if isinstance(value, dict) else None
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ShardError(f"the manifest's {'.'.join(path)} is not a {kind.__name__}")
    layers = raw["stage"]["layers"]
    if len(layers) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in layers):
        raise ShardError(f"the manifest's stage.layers is not a layer range: {layers!r}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in raw["files"].items()):
        raise ShardError("the manifest's files do not map names to hashes")
    for name in raw["files"]:  # a file of the shard folder itself: nothing above it, nothing below
        if name in ("", ".", "..") or Path(name).name != name or "\\" in name:
            raise ShardError(f"the manifest lists {name!r}, which is not a plain file name")
    if not all(isinstance(s, str) for s in raw["kv"]["states"]):
        raise ShardError("the manifest's kv.states are not names")
    if not all(isinstance(i, int) for i in raw.get("eos_token_ids", [])) or not isinstance(raw.get("export", {}), dict):
        raise ShardError("the manifest's eos_token_ids or export are damaged")
    spec = raw["model"]["spec"]
    for field in dataclasses.fields(ModelSpec):
        kind = _SCALARS.get(str(field.type))
        if field.name in spec and kind and (not isinstance(spec[field.name], kind)
                                            or (kind is not bool and isinstance(spec[field.name], bool))):
            raise ShardError(f"the manifest's model.spec.{field.name} is not a {str(field.type)}")


def parse_manifest(raw: bytes | str, where: str | None = None) -> Manifest:
    """A manifest from its JSON text (``where``: the file it came from, for the error)."""
    try:
        return Manifest.from_json(json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw))
    except (KeyError, TypeError, ValueError, UnicodeDecodeError) as exc:
        what = f"{where} is damaged or" if where else "this is"
        raise ShardError(f"{what} not a fleetshard manifest ({exc})") from None


def read_manifest(folder: Path) -> Manifest:
    """Reads a shard's manifest without checking its files (cheap, for listings)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ShardError(f"shard folder {folder} does not exist")
    path = folder / MANIFEST
    if not path.exists():
        raise ShardError(f"{folder} is not a shard: it has no {MANIFEST}")
    return parse_manifest(path.read_bytes(), str(path))


def is_shard_set(source: str | Path) -> bool:
    """True when ``source`` is an exported shard folder or an export holding stage folders."""
    path = Path(source).expanduser()
    return path.is_dir() and ((path / MANIFEST).exists() or any(path.glob(f"stage*/{MANIFEST}")))


def expand_shard_dirs(dirs: list[Path | str]) -> list[Path]:
    """Accepts shard folders or export folders holding ``stage0``, ``stage1``, ...; returns shard folders."""
    folders: list[Path] = []
    for d in (Path(d).expanduser() for d in dirs):
        if not d.exists():
            raise ShardError(f"shard folder {d} does not exist")
        if (d / MANIFEST).exists():
            folders.append(d)
            continue
        stages = sorted((p for p in d.glob("stage*") if (p / MANIFEST).exists()), key=lambda p: int(p.name[5:] or 0))
        if not stages:
            raise ShardError(f"{d} is neither a shard folder nor an export holding stage folders")
        folders.extend(stages)
    return folders


def load_manifest(folder: Path) -> Manifest:
    """Reads a shard's manifest and verifies the sha256 of every file it lists."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    for name, expected in manifest.files.items():
        path = folder / name
        if not path.exists():
            raise ShardError(f"shard {folder} is incomplete: {name} is missing")
        if sha256_file(path) != expected:
            raise ShardError(f"shard {folder} was modified or corrupted: {name} does not match its manifest hash")
    if MODEL_XML not in manifest.files:
        raise ShardError(f"shard {folder} lists no {MODEL_XML}")
    return manifest


def check_chain(manifests: list[Manifest]) -> None:
    """Refuses a list of shards that is not one model's contiguous chain from layer 0 to the last."""
    if not manifests:
        raise ShardError("no shards given")
    head = manifests[0]
    for m in manifests:
        if m.fingerprint != head.fingerprint:
            raise ShardError(
                f"shard of stage {m.stage_index} belongs to another model ({m.model_name}, {m.fingerprint[:12]}) "
                f"than stage {head.stage_index} ({head.model_name}, {head.fingerprint[:12]})"
            )
    expected = 0
    for m in manifests:
        if m.layers[0] != expected:
            raise ShardError(f"shards are not contiguous: expected a stage starting at layer {expected}, "
                             f"got stage {m.stage_index} of {layer_span(*m.layers)}")
        expected = m.layers[1]
    if expected != head.spec.num_layers:
        raise ShardError(f"the shards hold {layer_span(0, expected)}, the model has {head.spec.num_layers} layers")
