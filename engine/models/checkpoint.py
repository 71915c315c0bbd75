"""Selective checkpoint readers: one tensor at a time from a GGUF file or a Hugging Face folder.

An exporter asks for a stage part (``("q", 7)`` or ``"embed"``) and gets a float32 numpy array in
Hugging Face layout ([out, in] for projections).  Nothing else of the checkpoint is read, so memory
scales with the stage, not the model.
"""

from __future__ import annotations

import abc
import json
import math
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np

from engine.errors import SourceError
from engine.models.architectures import (
    NORM_PARTS,
    Architecture,
    ModelSpec,
    architecture,
    gguf_config_values,
    hf_config_values,
    spec_from_values,
)
from engine.models.gguf_header import read_gguf_header


_ROW_BLOCK = 4096


_PLAIN_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}


class _TensorInfo(NamedTuple):
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order (innermost first)
    data_offset: int
    n_bytes: int
    raw_dtype: np.dtype  # how the gguf package views the raw bytes
    raw_shape: tuple[int, ...]


class Checkpoint(abc.ABC):
    """Common interface: ``spec``, ``arch``, ``has(part, layer)``, ``read(part, layer)``."""

    spec: ModelSpec
    arch: Architecture

    @abc.abstractmethod
    def has(self, part: str, layer: int | None = None) -> bool:
        """Whether the checkpoint holds this part (biases and the head are optional)."""

    @abc.abstractmethod
    def read(self, part: str, layer: int | None = None, dtype=np.float32) -> np.ndarray:
        """The part in Hugging Face layout, as ``dtype``; a norm weight as the factor it multiplies by."""

    def read_blocks(self, part: str, layer: int | None = None) -> tuple[int, np.ndarray] | None:
        """A matrix as its quantized blocks, ``(GGML type, uint8 [rows, bytes per row])`` with the rows
        in the order ``read`` gives them; None where it is stored as floats (``read`` then)."""
        return None

    def read_head(self, dtype=np.float32) -> np.ndarray:
        """The output projection; the embedding matrix when the model ties them."""
        if not self.spec.tie_embeddings and self.has("lm_head"):
            return self.read("lm_head", dtype=dtype)
        return self.read("embed", dtype=dtype)


def _tensor_info(t, data_start: int) -> _TensorInfo:
    """Where tensor ``t`` of a GGUF header lies, and how the gguf package views its raw bytes."""
    import gguf

    kind = gguf.GGMLQuantizationType(t.ggml_type)
    block, type_size = gguf.GGML_QUANT_SIZES[kind]
    shape = tuple(reversed(t.dims))
    dtype = _PLAIN_DTYPES.get(kind.name)
    if dtype is None:  # quantized blocks: bytes per row
        dtype, shape = np.uint8, (*shape[:-1], shape[-1] // block * type_size)
    return _TensorInfo(kind, tuple(t.dims), data_start + t.offset, math.prod(t.dims) * type_size // block,
                       np.dtype(dtype), shape)


class GGUFCheckpoint(Checkpoint):
    def __init__(self, path: Path):
        try:
            header = read_gguf_header(path)
            self._tensors = {t.name: _tensor_info(t, header.data_start) for t in header.tensors}
        except (OSError, ValueError, KeyError, struct.error) as exc:
            raise SourceError(f"{path} is not a readable GGUF file ({exc})") from exc
        self.path = Path(path)
        # the scalars and strings (the arrays are the vocabulary's and merges; no spec field is one)
        self.metadata = {key: v for key, v in header.meta.items() if key not in header.arrays}
        arch_name = self.metadata.get("general.architecture")
        self.arch = architecture(arch_name or "unknown")
        values = gguf_config_values(arch_name, self.metadata)
        if "vocab_size" not in values:
            values["vocab_size"] = int(self._tensors[self.arch.gguf_global["embed"]].shape[-1])
        values["tie_embeddings"] = self.arch.gguf_global["lm_head"] not in self._tensors
        scaling = self.metadata.get(f"{arch_name}.rope.scaling.type")
        if scaling not in (None, "none"):
            raise SourceError(f"rope scaling {scaling!r} is not supported yet")
        self.spec = spec_from_values(self.arch, values)

    def _name(self, part, layer):
        table = self.arch.gguf_layer if layer is not None else self.arch.gguf_global
        return table[part].format(i=layer)

    def has(self, part, layer=None):
        return self._name(part, layer) in self._tensors

    def read(self, part, layer=None, dtype=np.float32):
        import gguf

        name = self._name(part, layer)
        if name not in self._tensors:
            raise SourceError(f"{self.path.name} has no tensor {name}")
        t = self._tensors[name]
        shape = list(reversed(t.shape))
        # Plain file reads rather than the reader's memory map (mapped pages would stay resident),
        # dequantized a block of rows at a time straight into the target dtype, so a large matrix
        # never exists in float32 all at once.
        n_rows = shape[0] if len(shape) > 1 else 1
        row_items = int(np.prod(t.raw_shape)) // n_rows
        row_bytes = row_items * t.raw_dtype.itemsize
        out = np.empty((n_rows, int(np.prod(shape)) // n_rows), dtype=dtype)
        with open(self.path, "rb") as f:
            for start in range(0, n_rows, _ROW_BLOCK):
                count = min(_ROW_BLOCK, n_rows - start)
                f.seek(t.data_offset + start * row_bytes)
                raw = np.frombuffer(f.read(count * row_bytes), dtype=t.raw_dtype).reshape(count, row_items)
                out[start:start + count] = gguf.quants.dequantize(raw, t.tensor_type).reshape(count, -1)
        data = out.reshape(shape)
        if self.arch.gguf_permuted_qk and part in ("q", "k"):
            heads = self.spec.num_heads if part == "q" else self.spec.num_kv_heads
            data = _unpermute_rotary(data, heads)
        return data


    def read_blocks(self, part, layer=None):
        name = self._name(part, layer)
        if name not in self._tensors:
            raise SourceError(f"{self.path.name} has no tensor {name}")
        t = self._tensors[name]
        if int(t.tensor_type) in FLOAT_TYPES or len(t.shape) != 2:
            return None
        with open(self.path, "rb") as f:
            f.seek(t.data_offset)
            raw = np.frombuffer(f.read(t.n_bytes), dtype=np.uint8).reshape(t.shape[1], -1)
        if self.arch.gguf_permuted_qk and part in ("q", "k"):
            raw = _unpermute_rotary(raw, self.spec.num_heads if part == "q" else self.spec.num_kv_heads)
        return int(t.tensor_type), raw


FLOAT_TYPES = (0, 1, 30)  # GGML's F32, F16 and BF16: nothing to carry over


def _unpermute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp interleaves the two rotary halves of each head's q/k rows; undo it."""
    half = w.shape[0] // heads // 2
    return np.ascontiguousarray(
        w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


class HFCheckpoint(Checkpoint):
    def __init__(self, folder: Path):
        folder = Path(folder)
        config_path = folder / "config.json"
        if not config_path.exists():
            raise SourceError(f"{folder} has no config.json: not a Hugging Face model folder")
        self.folder = folder
        self.config = json.loads(config_path.read_text())
        model_type = self.config.get("model_type", "unknown")
        self.arch = architecture(model_type)
        # transformers 5 keeps theta and scaling in "rope_parameters" (one dict per layer type for
        # Gemma 3); older configs use top-level keys.
        rope = self.config.get("rope_parameters") or self.config.get("rope_scaling") or {}
        for params in [v for v in rope.values() if isinstance(v, dict)] or [rope]:
            kind = params.get("rope_type", params.get("type"))
            if kind not in (None, "default"):
                raise SourceError(f"rope scaling {kind!r} is not supported yet")
        if self.config.get("use_sliding_window") and not self.arch.sliding_pattern:
            raise SourceError("sliding-window attention is not supported for this architecture yet")
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if self.config.get(key):
                raise SourceError(f"{key} is not supported yet")
        values = hf_config_values(self.config)
        if self.config.get("use_sliding_window") is False:
            values.pop("sliding_window", None)
        self.spec = spec_from_values(self.arch, values)
        self._files = self._index(folder)

    @staticmethod
    def _index(folder: Path) -> dict[str, Path]:
        index = folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: folder / fname for name, fname in weight_map.items()}
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise SourceError(f"{folder} holds no *.safetensors weights")
        from safetensors import safe_open

        names = {}
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                names.update({k: f for k in handle.keys()})
        return names

    def _name(self, part, layer):
        table = self.arch.hf_layer if layer is not None else self.arch.hf_global
        return table[part].format(i=layer)

    def has(self, part, layer=None):
        return self._name(part, layer) in self._files

    def read(self, part, layer=None, dtype=np.float32):
        import torch
        from safetensors import safe_open

        name = self._name(part, layer)
        if name not in self._files:
            raise SourceError(f"{self.folder} has no tensor {name}")
        with safe_open(str(self._files[name]), framework="pt") as handle:
            tensor = handle.get_tensor(name)
        if part in NORM_PARTS and self.arch.hf_norm_offset:
            tensor = tensor.float() + self.arch.hf_norm_offset
        return tensor.to(torch.float16 if dtype == np.float16 else torch.float32).numpy()


def open_checkpoint(kind: str, path: Path) -> Checkpoint:
    return GGUFCheckpoint(path) if kind == "gguf" else HFCheckpoint(path)
