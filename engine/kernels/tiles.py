"""The layout our kernels read a matrix in (``ggml_matmul.cpp``): the GGUF's own bits for each 16 rows
of the matrix (a tile), interleaved four columns at a time, so that one vector holds those 16 rows'
next four codes and one dot-product instruction multiplies them all by four values of x.  A tile is
its blocks one after the other (a K-quant's super-blocks of 256 columns, a legacy type's blocks of
32); rows past the matrix's last are zeros."""

from __future__ import annotations

import numpy as np

from engine.models.quantized import Q4_0, Q4_1, Q4_K, Q6_K, Quantized

TILE = 16  # matrix rows a tile holds
TYPES = (Q4_0, Q4_1, Q4_K, Q6_K)  # the types our kernels multiply by
BYTES = {Q4_K: 2368, Q6_K: 3360, Q4_0: 320, Q4_1: 320}  # a tile's block
COLUMNS = {Q4_K: 256, Q6_K: 256, Q4_0: 32, Q4_1: 32}  # a block's


def _records(codes: np.ndarray) -> np.ndarray:
    """Codes ``[tiles, 16, blocks, columns]`` (four bits each) -> ``[tiles, blocks, columns / 8 records
    of 64 bytes]``: record v holds each row's four codes of columns 8v.. in its low nibbles, of 8v+4..
    in the high ones."""
    tiles, _, blocks, columns = codes.shape
    quads = codes.reshape(tiles, TILE, blocks, columns // 8, 2, 4)
    packed = quads[..., 0, :] | (quads[..., 1, :] << 4)  # [tiles, 16, blocks, columns / 8, 4]
    return np.ascontiguousarray(packed.transpose(0, 2, 3, 1, 4)).reshape(tiles, blocks, columns * 8)


def _per_row(table: np.ndarray, tiles: int) -> np.ndarray:
    """``[tiles * 16, blocks, per]`` -> ``[tiles, blocks, per * 16]``: each entry for the tile's 16 rows."""
    _, blocks, per = table.shape
    return table.reshape(tiles, TILE, blocks, per).transpose(0, 2, 3, 1).reshape(tiles, blocks, per * TILE)


def _f16(table: np.ndarray, tiles: int) -> np.ndarray:
    """A ``[tiles * 16, blocks, 1]`` table of f16 values as each row's two bytes, per tile and block."""
    return np.ascontiguousarray(_per_row(table.astype(np.float16), tiles)).view(np.uint8)


def tiles(q: Quantized) -> np.ndarray:
    """A matrix's tiles, uint8 ``[tiles * blocks, BYTES[qtype]]``: of Q4_K or Q6_K, or of Q4_0 or Q4_1
    (``codes * d + m`` per 32, ``m`` -8 d for Q4_0's centered codes)."""
    if q.qtype not in TYPES:
        raise ValueError(f"no tiles for GGML type {q.qtype}")
    rows = len(q.codes)
    count = -(-rows // TILE)
    pad = count * TILE - rows

    def padded(a: np.ndarray) -> np.ndarray:
        return np.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))

    columns = COLUMNS[q.qtype]
    blocks = q.codes.size // rows // columns
    codes = padded(q.codes.reshape(rows, blocks, columns)).reshape(count, TILE, blocks, columns)
    if q.qtype in (Q4_0, Q4_1):
        d = q.steps.values()[..., None]
        m = -8 * d if q.minimum is None else q.minimum.values()[..., None]
        parts = [_records(codes), _f16(padded(d), count), _f16(padded(m), count)]
        return np.concatenate(parts, axis=-1).reshape(count * blocks, BYTES[q.qtype])
    d = _f16(padded(q.steps.scale), count)
    if q.qtype == Q4_K:
        scales = _per_row(padded(q.steps.codes).astype(np.uint8), count)
        mins = _per_row(padded(q.minimum.codes).astype(np.uint8), count)
        dmin = _f16(padded(-q.minimum.scale), count)
        parts = [_records(codes), scales, mins, d, dmin]
    else:  # Q6_K: low nibbles as Q4_K's codes, then record g's bits 2c.. are columns 16g+4c..'s high pairs
        high = (codes >> 4).reshape(count, TILE, blocks, 16, 4, 4).transpose(0, 2, 3, 1, 5, 4)
        pairs = (high << np.array([0, 2, 4, 6], np.uint8)).sum(-1, dtype=np.uint8).reshape(count, blocks, 1024)
        scales = _per_row(padded(q.steps.codes).astype(np.int8).view(np.uint8), count)
        parts = [_records(codes & 0x0F), pairs, scales, d]
    out = np.concatenate([p.reshape(count, blocks, -1) for p in parts], axis=-1)
    assert out.shape[-1] == BYTES[q.qtype]
    return out.reshape(count * blocks, BYTES[q.qtype])
