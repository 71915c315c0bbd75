"""Quantized weights as a shard holds them, shared by the export that writes them and the runtime that
reads them back: GGML's block types, decoded into codes and scales per group (``decompose``) and
composed into the GGUF's own blocks again (``compose``), and the vocabulary tables' INT8 rows
(``int8_rows``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from engine.errors import ExportError

ROW_BLOCK = 2048  # rows of a vocabulary table quantized at a time: a few float32 copies of a block, not of the table

# GGML's type ids (ggml.h), with (elements per block, bytes per block)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
          Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K",
         Q6_K: "Q6_K"}
FLOATS = frozenset({0, 1, 30})  # F32, F16, BF16
# the center of each type's codes: what the shard's signed codes are less
CENTERS = {Q4_0: 8, Q4_1: 8, Q5_0: 16, Q5_1: 16, Q8_0: 128, Q4_K: 8, Q5_K: 16, Q6_K: 32}

# The name a carried matrix's weight (the Reshape of its decompression pattern) ends in, after its
# MatMul's name: "<matmul>/ggml.Q4_K".  engine.kernels finds the matrices it can run by it.
KERNEL_TAG = "ggml."


@dataclasses.dataclass
class Table:
    """A ``[rows, groups]`` table: integer ``codes [rows, blocks, per]`` times a ``scale [rows, blocks,
    1]`` (a K-quant super-block's six-bit scales or minimums under its f16 ``d`` or ``dmin``, Q6_K's
    int8 scales under its ``d``), or, with no codes, the values themselves ``[rows, groups, 1]`` (the
    legacy types' f16 scales and minimums)."""

    scale: np.ndarray
    codes: np.ndarray | None = None

    def values(self) -> np.ndarray:
        if self.codes is None:
            return self.scale[..., 0]
        return (self.codes.astype(np.float32) * self.scale).reshape(len(self.scale), -1)


@dataclasses.dataclass
class Quantized:
    """A GGUF matrix per group: codes uint8 ``[rows, groups, group]``, the scales as a table
    (``steps``), the center of the codes' range and, for a type with a minimum, that minimum as a
    table: ``codes * scale + minimum``, the GGUF's own formula."""

    codes: np.ndarray
    steps: Table
    center: int
    bits: int
    minimum: Table | None = None
    qtype: int = 0  # the GGML type the codes came from

    @property
    def scale(self) -> np.ndarray:
        """float32 ``[rows, groups, 1]``, exact (a K-quant's ``d * scale`` is 11 bits times 6 or 8)."""
        return self.steps.values()[..., None]

    @property
    def exact(self) -> bool:
        """``(codes - center) * scale`` alone gives the GGUF's values (no minimum)."""
        return self.minimum is None

    def values(self) -> np.ndarray:
        """The float32 matrix ``[rows, columns]``: the GGUF's values bit for bit."""
        if self.minimum is not None:
            values = self.codes.astype(np.float32) * self.scale + self.minimum.values()[..., None]
        else:
            values = (self.codes.astype(np.float32) - np.float32(self.center)) * self.scale
        return values.reshape(len(self.codes), -1)

    def zero_point_form(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(codes, scale, zero point): ``(codes - zero point) * scale`` per group with a float zero
        point, ``-minimum / scale``, within an ulp or two of the values; a group of scale 0 (all its
        values equal to its minimum) becomes codes 0 - zero point 1 times the minimum, which is exact."""
        low, scale = self.minimum.values()[..., None], self.scale  # scale: computed from steps, once
        flat = scale == 0
        zero_point = np.where(flat, np.float32(1.0), -low / np.where(flat, 1.0, scale)).astype(np.float32)
        codes = np.where(flat, np.uint8(0), self.codes).astype(np.uint8)
        return codes, np.where(flat, -low, scale).astype(np.float32), zero_point

    def offsets(self) -> np.ndarray:
        """What each group adds to ``(codes - center) * scale``: ``center * scale + minimum``
        ``[rows, groups]``, as the graph's second MatMul sums it (in float32)."""
        return np.float32(self.center) * self.steps.values() + self.minimum.values()


def _blocks(raw: np.ndarray, qtype: int, rows: int, columns: int) -> np.ndarray:
    size, nbytes = BLOCKS[qtype]
    if columns % size:
        raise ExportError(f"a {NAMES[qtype]} row of {columns} values is not a whole number of blocks")
    return np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, columns // size, nbytes)


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [..., 1] float32."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 codes: the low nibbles first, then the high ones (the legacy block order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """A little-endian 32-bit word per block -> its 32 bits as 0/1 codes."""
    word = np.ascontiguousarray(qh).view(np.uint32)
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of a Q4_K/Q5_K super-block -> 8 six-bit scales and 8 six-bit minimums."""
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scales = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 8 groups of 32: group 2i takes the low nibbles of bytes 32i.., group 2i+1 the high."""
    q = qs.reshape(*qs.shape[:-1], 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    return (q & 0x0F).reshape(*qs.shape[:-1], 8, 32)


def decompose(qtype: int, raw: np.ndarray, rows: int, columns: int) -> Quantized:
    """A GGUF tensor's raw blocks (``rows`` x ``columns`` values) as codes, scales and minimums."""
    q = _decompose(qtype, raw, rows, columns)
    q.qtype = qtype
    return q


def _decompose(qtype: int, raw: np.ndarray, rows: int, columns: int) -> Quantized:
    if qtype not in BLOCKS:
        raise ExportError(f"GGML type {qtype} cannot be carried over")
    b = _blocks(raw, qtype, rows, columns)
    if qtype == Q4_0:
        d = _f16(b[..., 0:2])
        return Quantized(_nibbles(b[..., 2:18]), Table(d), 8, 4)
    if qtype == Q4_1:
        d = _f16(b[..., 0:2])
        return Quantized(_nibbles(b[..., 4:20]), Table(d), 8, 4, minimum=Table(_f16(b[..., 2:4])))
    if qtype == Q5_0:
        d = _f16(b[..., 0:2])
        codes = _nibbles(b[..., 6:22]) | (_high_bits(b[..., 2:6]) << 4)
        return Quantized(codes, Table(d), 16, 5)
    if qtype == Q5_1:
        d = _f16(b[..., 0:2])
        codes = _nibbles(b[..., 8:24]) | (_high_bits(b[..., 4:8]) << 4)
        return Quantized(codes, Table(d), 16, 5, minimum=Table(_f16(b[..., 2:4])))
    if qtype == Q8_0:
        d = _f16(b[..., 0:2])
        codes = (np.ascontiguousarray(b[..., 2:34]).view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return Quantized(codes, Table(d), 128, 8)
    blocks = b.shape[1]
    if qtype in (Q4_K, Q5_K):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sub, mins = _k_scales(b[..., 4:16])
        minimum, steps = Table(-dmin, mins.astype(np.uint8)), Table(d, sub.astype(np.uint8))
        if qtype == Q4_K:
            codes = _k_nibbles(b[..., 16:144])
        else:
            high = (b[..., 16:48][..., None, :] >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
            codes = _k_nibbles(b[..., 48:176]) | (high << 4)
        bits = 4 if qtype == Q4_K else 5
        return Quantized(codes.reshape(rows, blocks * 8, 32), steps, 1 << (bits - 1), bits, minimum=minimum)
    # Q6_K: 16 groups of 16 per super-block, int8 scales, codes 0..63 around 32
    low = (b[..., 0:128].reshape(rows, blocks, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F
    high = (b[..., 128:192].reshape(rows, blocks, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 0x03
    codes = (low.reshape(rows, blocks, 8, 32) | (high.reshape(rows, blocks, 8, 32) << 4)).reshape(rows, blocks * 16, 16)
    sub = np.ascontiguousarray(b[..., 192:208]).view(np.int8)
    return Quantized(codes, Table(_f16(b[..., 208:210]), sub), 32, 6)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """[..., 1] float32 values of f16 -> [..., 2] bytes."""
    return np.ascontiguousarray(values.astype(np.float16)).view(np.uint8)


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """32 codes -> 16 bytes, the inverse of ``_nibbles``."""
    return (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)


def _pack_high_bits(bits: np.ndarray) -> np.ndarray:
    """32 0/1 codes -> their little-endian 32-bit word's 4 bytes, the inverse of ``_high_bits``."""
    word = (bits.astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32)
    return np.ascontiguousarray(word[..., None]).view(np.uint8)


def _pack_k_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """8 six-bit scales and 8 six-bit minimums -> 12 bytes, the inverse of ``_k_scales``."""
    s, m = scales.astype(np.uint8), mins.astype(np.uint8)
    lo = s[..., :4] | ((s[..., 4:] & 0x30) << 2)
    mid = m[..., :4] | ((m[..., 4:] & 0x30) << 2)
    hi = (s[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)
    return np.concatenate([lo, mid, hi], axis=-1)


def _pack_k_nibbles(codes: np.ndarray) -> np.ndarray:
    """8 groups of 32 four-bit codes -> 128 bytes, the inverse of ``_k_nibbles``."""
    pairs = codes.reshape(*codes.shape[:-2], 4, 2, 32)
    return (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(*codes.shape[:-2], 128).astype(np.uint8)


def compose(q: Quantized) -> np.ndarray:
    """The GGUF's raw blocks ``[rows, bytes per row]`` of ``q`` (``q.qtype``), the inverse of
    ``decompose``: ``compose(decompose(t, raw, ...))`` gives ``raw`` back byte for byte."""
    qtype, rows = q.qtype, len(q.codes)
    if qtype not in BLOCKS:
        raise ExportError(f"GGML type {qtype} cannot be composed")
    size, _ = BLOCKS[qtype]
    codes = q.codes.reshape(rows, -1, size)
    blocks = codes.shape[1]
    if qtype in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0):
        parts = [_f16_bytes(q.steps.values()[..., None])]
        if q.minimum is not None:
            parts.append(_f16_bytes(q.minimum.values()[..., None]))
        if qtype == Q8_0:
            parts.append((codes.astype(np.int16) - 128).astype(np.int8).view(np.uint8))
        else:
            if qtype in (Q5_0, Q5_1):
                parts.append(_pack_high_bits(codes >> 4))
            parts.append(_pack_nibbles(codes & 0x0F))
        return np.concatenate(parts, axis=-1).reshape(rows, -1)
    if qtype in (Q4_K, Q5_K):
        groups = codes.reshape(rows, blocks, 8, 32)
        parts = [_f16_bytes(q.steps.scale), _f16_bytes(-q.minimum.scale),
                 _pack_k_scales(q.steps.codes, q.minimum.codes)]
        if qtype == Q5_K:
            high = (groups >> 4).astype(np.uint8) << np.arange(8, dtype=np.uint8).reshape(8, 1)
            parts.append(high.sum(axis=-2, dtype=np.uint8))
        parts.append(_pack_k_nibbles(groups & 0x0F))
        return np.concatenate(parts, axis=-1).reshape(rows, -1)
    # Q6_K: the low nibbles of groups (h, s, k) in byte h*64 + k*32 + e at shift 4s, the high two bits of
    # groups (h, t) in byte 128 + h*32 + e at shift 2t
    groups = codes.reshape(rows, blocks, 2, 4, 32)
    low = (groups & 0x0F).reshape(rows, blocks, 2, 2, 2, 32)  # (h, s, k, e)
    ql = (low[..., 0, :, :] | (low[..., 1, :, :] << 4)).reshape(rows, blocks, 128)
    high = ((groups >> 4) & 0x03) << (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)
    qh = high.sum(axis=-2, dtype=np.uint8).reshape(rows, blocks, 64)
    sub = np.ascontiguousarray(q.steps.codes.reshape(rows, blocks, 16).astype(np.int8)).view(np.uint8)
    return np.concatenate([ql, qh, sub, _f16_bytes(q.steps.scale)], axis=-1).reshape(rows, -1)


def int8_rows(table: np.ndarray) -> ov.Output:
    """A [vocab, hidden] matrix as asymmetric uint8 rows with a per-row scale and zero point (as NNCF's
    INT8_ASYM), quantized a block of rows at a time, in the decompression pattern the plugins fuse
    (Constant u8 -> Convert -> Subtract(zero point) -> Multiply(scale)), as an f32-valued graph output."""
    rows_total = table.shape[0]
    q = np.empty(table.shape, dtype=np.uint8)
    zero = np.empty((rows_total, 1), dtype=np.uint8)
    scale = np.empty((rows_total, 1), dtype=np.float16)
    for start in range(0, rows_total, ROW_BLOCK):
        rows = table[start:start + ROW_BLOCK].astype(np.float32)
        lo = np.minimum(rows.min(axis=1, keepdims=True), 0.0)
        hi = np.maximum(rows.max(axis=1, keepdims=True), 0.0)
        s = np.maximum(hi - lo, 1e-8) / 255.0
        zp = np.clip(np.rint(-lo / s), 0, 255)
        q[start:start + ROW_BLOCK] = np.clip(np.rint(rows / s) + zp, 0, 255).astype(np.uint8)
        zero[start:start + ROW_BLOCK] = zp.astype(np.uint8)
        scale[start:start + ROW_BLOCK] = s
    # shared_memory: the constant keeps the array alive instead of holding a second copy of it.
    centered = ops.subtract(ops.convert(ops.constant(q, shared_memory=True), ov.Type.f16),
                            ops.convert(ops.constant(zero), ov.Type.f16))
    return ops.convert(ops.multiply(centered, ops.constant(scale)), ov.Type.f32).output(0)
