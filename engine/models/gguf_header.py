"""A GGUF file's header: its metadata and where each tensor lies, walked directly from the file.

``gguf.GGUFReader`` builds a numpy view of every part of every field, a vocabulary's every token
included; the walk here steps over arrays, so a large vocabulary costs it next to nothing.  The
catalog checks files with it, the model facts and the checkpoint reader read it."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import NamedTuple

# GGUF value types -> struct format (8 = string, 9 = array are handled in the walker).
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class GGUFTensor(NamedTuple):
    name: str
    dims: list[int]  # GGUF order: innermost first
    ggml_type: int
    offset: int  # from the start of the tensor data (``GGUFHeader.data_start``)


class GGUFHeader(NamedTuple):
    meta: dict  # key -> scalar or string value; an array as its length
    arrays: frozenset  # the keys whose values are arrays
    tensors: list[GGUFTensor]
    data_start: int  # where the tensor data begins (the header's end, aligned)


def read_gguf_header(path: Path) -> GGUFHeader:
    """The header of the GGUF file at ``path``.  Raises ValueError (or struct.error) for a file that
    is not a GGUF of version 2 or later, or is cut short."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise ValueError("it does not start with b'GGUF'")
        pos = 4

        def take(fmt: str):
            nonlocal pos
            (value,) = struct.unpack_from("<" + fmt, m, pos)
            pos += struct.calcsize(fmt)
            return value

        def string() -> str:
            nonlocal pos
            n = take("Q")
            if pos + n > len(m):
                raise ValueError("a string runs past the end of the file")
            pos += n
            return m[pos - n:pos].decode("utf-8", "replace")

        def value(kind: int):
            nonlocal pos
            if kind == 8:
                return string()
            if kind == 9:
                item, count = take("I"), take("Q")
                if item in _SCALAR:
                    pos += count * struct.calcsize(_SCALAR[item])
                else:
                    for _ in range(count):
                        value(item)
                return count
            return take(_SCALAR[kind])

        version = take("I")
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        n_tensors, n_kv = take("Q"), take("Q")
        meta, arrays = {}, set()
        for _ in range(n_kv):
            key = string()
            kind = take("I")
            meta[key] = value(kind)
            if kind == 9:
                arrays.add(key)
        tensors = []
        for _ in range(n_tensors):
            name = string()
            dims = [take("Q") for _ in range(take("I"))]
            tensors.append(GGUFTensor(name, dims, take("I"), take("Q")))
        alignment = int(meta.get("general.alignment", 32))
        return GGUFHeader(meta, frozenset(arrays), tensors, -(-pos // alignment) * alignment)
