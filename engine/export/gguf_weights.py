"""GGUF quantized matrices carried into a shard as they are, instead of dequantized and quantized again,
so the shard answers as the GGUF does in llama.cpp.

``decompose`` turns a tensor's raw blocks into integer codes ``[rows, groups, group]`` with a scale
per group (and the minimums); ``carry_matmul`` builds them as the decompression pattern OpenVINO's
CPU and GPU plugins run inside their compressed MatMul (Constant codes -> Convert -> [Subtract] ->
Multiply -> Reshape), and ``lookup_table`` as a table the CPU plugin's Gather decodes row by row, for
an embedding that is not also the head.  Signed codes (or an integer zero point) let a CPU with int8
dot products run the MatMul on int8 activations, so a large matrix of a type with a minimum runs its
codes less their center and gets each group's offset from a second, small MatMul
(``OFFSETS_FROM``); docs/design.md ("The export") says how each block type is laid out.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from engine.errors import ExportError
from engine.models.gguf_header import read_gguf_header
from engine.tuning import OFFSETS_FROM

# GGML's type ids (ggml.h), with (elements per block, bytes per block)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
          Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K",
         Q6_K: "Q6_K"}
FLOATS = frozenset({0, 1, 30})  # F32, F16, BF16
# the center of each type's codes: what the shard's signed codes are less
CENTERS = {Q4_0: 8, Q4_1: 8, Q5_0: 16, Q5_1: 16, Q8_0: 128, Q4_K: 8, Q5_K: 16, Q6_K: 32}


def carries(path) -> bool:
    """Whether a GGUF file's matrices can all be carried over: every quantized one of a type above,
    and most of them quantized (a float GGUF has nothing to carry).  Reads the header alone."""
    types = [t.ggml_type for t in read_gguf_header(path).tensors if len(t.dims) == 2]
    quantized = [kind for kind in types if kind not in FLOATS]
    return all(kind in BLOCKS for kind in quantized) and 2 * len(quantized) > len(types)


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


def stored(values: np.ndarray) -> np.ndarray:
    """A scale, zero point or table as the shard stores it: f16 where f16 holds every value to its
    11 bits (within 2^-11 of itself, none outside f16's normal range), else f32.  A K-quant's ``d *
    scale`` has up to 17 significant bits; rounded to 11 it moves a weight by 2^-11 of itself at
    most, against the half step of its four or six-bit code the GGUF already rounded it by."""
    values = np.asarray(values, dtype=np.float32)
    half = values.astype(np.float16)
    if np.all(np.abs(half.astype(np.float32) - values) <= np.abs(values) * np.float32(2**-11)):
        return half
    return values


def _small(values: np.ndarray) -> ov.Output:
    """``stored(values)`` as an f32 graph output."""
    kept = stored(values)
    constant = ops.constant(kept)
    return (ops.convert(constant, ov.Type.f32) if kept.dtype == np.float16 else constant).output(0)


# The name a carried matrix's weight (the Reshape of its decompression pattern) ends in, after its
# MatMul's name: "<matmul>/ggml.Q4_K".  engine.kernels finds the matrices it can run by it.
KERNEL_TAG = "ggml."

def _reshape(x, shape) -> ov.Output:
    return ops.reshape(x, ops.constant(np.array(shape, dtype=np.int64)), False).output(0)


def _integers(values: np.ndarray, kind: ov.Type, six_bits: bool = True) -> ov.Output:
    """Integer ``values`` as a graph output of ``kind`` (i4, u4, i8 or u8).  With ``six_bits``, eight-bit
    values that span at most 64 are stored as u6 (plus their lowest value), which constant folding
    widens to ``kind`` at compile time: no plugin multiplies by six-bit codes, but the CPU plugin's
    compressed MatMul runs the eight-bit constant that results, so the shard holds six bits a code.
    Its Gather does not: a lookup table folded so becomes floats."""
    wide = values.astype(np.int16)
    low = int(wide.min()) if wide.size else 0
    if not six_bits or kind not in (ov.Type.i8, ov.Type.u8) or int(wide.max()) - low >= 64:
        return ops.constant(values, dtype=kind).output(0)
    widened = ops.convert(ops.constant((wide - low).astype(np.uint8), dtype=ov.Type.u6), kind)
    if low == 0:
        return widened.output(0)
    return ops.add(widened, ops.constant(np.array(low, dtype=np.int8 if kind == ov.Type.i8 else np.uint8))).output(0)


@dataclasses.dataclass
class _Parts:
    """A table's graph parts, built once and shared by the graph's uses of it: its codes (u8 or i8)
    and its scale (f32 ``[rows, blocks, 1]``), or, with no codes, its values (f32 ``[rows, groups, 1]``)."""

    codes: ov.Output | None
    scale: ov.Output

    @classmethod
    def of(cls, table: Table) -> "_Parts":
        codes = table.codes
        if codes is not None:
            codes = _integers(codes, ov.Type.i8 if codes.dtype == np.int8 else ov.Type.u8)
        return cls(codes, _small(table.scale))

    def values(self) -> ov.Output:
        """The table as an f32 ``[rows, groups, 1]`` graph output: codes times scale, exact in f32,
        which constant folding computes at compile time."""
        if self.codes is None:
            return self.scale
        rows, blocks, per = self.codes.get_shape()
        return _reshape(ops.multiply(ops.convert(self.codes, ov.Type.f32), self.scale), [rows, blocks * per, 1])


def _pattern(codes: ov.Output, zero: ov.Output | None, scale: ov.Output) -> ov.Output:
    """``(codes - zero) * scale`` reshaped to [rows, columns], the decompression pattern the plugins
    fuse into their compressed MatMul (no Subtract where ``zero`` is None)."""
    rows, groups, group = codes.get_shape()
    centered = ops.convert(codes, ov.Type.f32)
    if zero is not None:
        centered = ops.subtract(centered, zero)
    return _reshape(ops.multiply(centered, scale), [rows, groups * group])


def matrix(q: Quantized, offsets: bool, steps: _Parts | None = None, six_bits: bool = True) -> ov.Output:
    """The codes as an f32 [rows, columns] graph output: signed codes, ``codes - center`` (i4 up to 4
    bits, else i8), times their scales (``steps``, the GGUF's own scale codes where it has them)
    where there is no minimum and, with ``offsets``, where the offsets come after: the activations
    the CPU quantizes to int8 on the fly then meet centered codes (uncentered ones lost ten times
    more to that rounding on SmolLM2's Q4_1 matrices); else the codes less a float zero point
    (``Quantized.zero_point_form``), which keeps the activations in float.  ``six_bits``: see
    ``_integers``."""
    if q.exact or offsets:
        signed = (q.codes.astype(np.int16) - q.center).astype(np.int8)
        codes = _integers(signed, ov.Type.i4 if q.bits <= 4 else ov.Type.i8, six_bits)
        return _pattern(codes, None, (steps or _Parts.of(q.steps)).values())
    codes, scale, zero_point = q.zero_point_form()
    kind = ov.Type.u4 if q.bits <= 4 else ov.Type.u8
    return _pattern(_integers(codes, kind, six_bits), _small(zero_point), _small(scale))


def _offsets(q: Quantized, offsets_from: int) -> bool:
    return not q.exact and q.codes.size >= offsets_from


def _offset_table(q: Quantized, steps: _Parts) -> ov.Output:
    """``[center * steps | minimum]`` as one f32 [rows, 2 * groups] graph output: for the K-quants
    their six-bit codes under ``center * d`` and ``dmin`` (a compressed MatMul's weight again, as
    small as the GGUF keeps them, sharing the scales' codes and ``d`` with the matrix), else the f16
    values."""
    minimum = _Parts.of(q.minimum)
    rows, groups = len(q.codes), q.codes.shape[1]
    scale = ops.concat([ops.multiply(steps.scale, ops.constant(np.float32(q.center))), minimum.scale], 1)
    if minimum.codes is None:
        return _reshape(scale, [rows, 2 * groups])
    codes = ops.convert(ops.concat([steps.codes, minimum.codes], 1), ov.Type.f32)
    return _reshape(ops.multiply(codes, scale), [rows, 2 * groups])


def carry_matmul(matmul, q: Quantized, sums: dict | None = None, offsets_from: int = OFFSETS_FROM) -> None:
    """Gives ``matmul`` (``x @ W.T``, x ``[batch, positions, columns]``) the GGUF's codes as its weight;
    for a large matrix with a minimum, centered, with each group's offset (``Quantized.offsets``)
    times the group's sum of ``x`` from a second MatMul.  ``sums`` shares those sums between the
    MatMuls of one input, whose second MatMuls can then be stacked as their first ones are."""
    offsets = _offsets(q, offsets_from)
    steps = _Parts.of(q.steps)
    weight = matrix(q, offsets, steps)
    # engine.kernels finds the matrices it runs by this name (a float zero point's too: see engine.kernels.swap)
    weight.get_node().set_friendly_name(f"{matmul.get_friendly_name()}/{KERNEL_TAG}{NAMES[q.qtype]}")
    matmul.input(1).replace_source_output(weight)
    if not offsets:
        return
    consumers = list(matmul.output(0).get_target_inputs())
    _, groups, group = q.codes.shape
    x = matmul.input_value(0)
    key = (x.get_node().get_friendly_name(), x.get_index(), groups)
    shared = {} if sums is None else sums
    if key not in shared:
        grouped = ops.reshape(x, ops.constant(np.array([0, 0, groups, group], dtype=np.int64)), True)
        summed = ops.reduce_sum(grouped, ops.constant(np.array([-1], dtype=np.int64)), False)
        shared[key] = ops.concat([summed, summed], -1)
    total = ops.add(matmul.output(0), ops.matmul(shared[key], _offset_table(q, steps), False, True))
    for consumer in consumers:
        consumer.replace_source_output(total.output(0))


def own_head(ckpt) -> tuple[int, np.ndarray] | None:
    """The GGUF blocks of a head of the model's own (not its embedding) in a type carried over, else
    None: such a head is carried (``carry_head``) rather than re-quantized to INT8."""
    if ckpt.spec.tie_embeddings or not ckpt.has("lm_head"):
        return None
    blocks = ckpt.read_blocks("lm_head")
    return blocks if blocks is not None and blocks[0] in BLOCKS else None


def carry_head(model: ov.Model, blocks: tuple[int, np.ndarray], rows: slice) -> str:
    """Gives the last stage's head MatMul (``graph.attach_vocabulary``'s) the GGUF's own codes of its
    ``rows`` of the vocabulary; returns their type's name."""
    qtype, raw = blocks
    node = model.outputs[0].get_node().input_value(0).get_node()
    while node.get_type_name() != "MatMul":  # past a tensor-parallel rank's AllGather
        node = node.input_value(0).get_node()
    size, nbytes = BLOCKS[qtype]
    raw = np.ascontiguousarray(raw[rows])
    carry_matmul(node, decompose(qtype, raw, raw.shape[0], raw.shape[1] // nbytes * size))
    return NAMES[qtype]


def carried_values(q: Quantized, offsets_from: int = OFFSETS_FROM) -> np.ndarray:
    """The float32 matrix ``carry_matmul`` computes with, as a graph with an identity input returns
    it: the GGUF's values, with a float zero point (and its scale) as ``stored`` keeps them where
    there is one."""
    if not q.exact and not _offsets(q, offsets_from):
        codes, scale, zero_point = q.zero_point_form()
        values = (codes.astype(np.float32) - stored(zero_point)) * stored(scale)
    else:
        values = (q.codes.astype(np.float32) - np.float32(q.center)) * q.scale
        if not q.exact:
            values = values + q.offsets()[..., None]
    return values.astype(np.float32).reshape(len(q.codes), -1)


def lookup_table(ckpt) -> ov.Output | None:
    """The embedding table from its GGUF codes, as an f32 [vocab, hidden] graph output in the form the
    CPU plugin's Gather decompresses row by row (codes, scale and a float zero point or none: within
    an ulp or two of the GGUF's values, at its size rather than INT8's); None where the embedding is
    stored as floats or in a type not carried over."""
    blocks = ckpt.read_blocks("embed")
    if blocks is None or blocks[0] not in BLOCKS:
        return None
    qtype, raw = blocks
    size, nbytes = BLOCKS[qtype]
    return matrix(decompose(qtype, raw, raw.shape[0], raw.shape[1] // nbytes * size), offsets=False, six_bits=False)


def fingerprint(array: np.ndarray) -> bytes:
    """What identifies a staged matrix among a stage's constants (its bytes, hashed)."""
    return hashlib.blake2b(memoryview(np.ascontiguousarray(array)).cast("B"), digest_size=16).digest()


def weight_constants(model: ov.Model):
    """(MatMul, the Constant of its weight, behind a Convert or not) for every MatMul with one."""
    for op in model.get_ordered_ops():
        if op.get_type_name() != "MatMul":
            continue
        node = op.input_value(1).get_node()
        if node.get_type_name() == "Convert":
            node = node.input_value(0).get_node()
        if node.get_type_name() == "Constant":
            yield op, node


def carry(model: ov.Model, ckpt, matrices: dict[bytes, tuple[str, int, tuple | None]]) -> dict:
    """Gives every MatMul whose weight constant holds a quantized GGUF matrix (``matrices``: the staged
    matrices' fingerprints -> (part, layer, cut), ``cut`` the axis and slice a tensor-parallel rank
    keeps, ``engine.export.rankcut``) the GGUF's own codes; returns what was carried, by type, and
    what was not (kept as floats, then stored as the format's fp16)."""
    carried: dict[str, int] = {}
    kept: list[str] = []
    sums: dict = {}
    for op, node in weight_constants(model):
        found = matrices.pop(fingerprint(node.get_data()), None)
        if found is None:
            continue
        part, layer, cut = found
        blocks = ckpt.read_blocks(part, layer)
        if blocks is None or blocks[0] not in BLOCKS:
            kept.append(f"layer {layer} {part}" + (f" (GGML type {blocks[0]})" if blocks else " (floats)"))
            continue
        qtype, raw = blocks
        if cut is not None:
            raw = _cut(raw, qtype, *cut)
        rows, columns = node.get_output_shape(0)
        carry_matmul(op, decompose(qtype, raw, rows, columns), sums)
        carried[NAMES[qtype]] = carried.get(NAMES[qtype], 0) + 1
    kept += [f"layer {layer} {part} (not found in the graph)" for part, layer, _ in matrices.values()]
    return {"carried": carried, "kept_float": kept}


def _cut(raw: np.ndarray, qtype: int, axis: int, kept: slice) -> np.ndarray:
    """A rank's rows (``axis`` 0) or columns (1: whole blocks of every row) of a matrix's raw blocks."""
    if axis == 0:
        return raw[kept]
    size, nbytes = BLOCKS[qtype]
    if kept.start % size or kept.stop % size:
        raise ExportError(f"a tensor-parallel rank's columns {kept.start}-{kept.stop} cut {NAMES[qtype]} blocks "
                          f"of {size}")
    return np.ascontiguousarray(raw[:, kept.start // size * nbytes:kept.stop // size * nbytes])


def carried_text(report: dict) -> str:
    """What ``carry`` did, in words."""
    done = ", ".join(f"{count} {name}" for name, count in sorted(report["carried"].items())) or "none"
    text = f"GGUF matrices carried over as they are: {done} (their codes and scales)"
    if report["kept_float"]:
        text += f"; kept as fp16: {', '.join(report['kept_float'])}"
    return text
