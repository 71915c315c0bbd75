"""GGUF quantized matrices carried into a shard as they are, instead of dequantized and quantized again.

A GGUF block type stores each group of a row as integer codes with a scale and, for some types, a
minimum.  ``decompose`` turns a tensor's raw blocks into codes ``[rows, groups, group]`` with a scale
per group (and the minimums); ``carry_matmul`` builds them as the decompression pattern OpenVINO's
CPU and GPU plugins run inside their compressed MatMul (Constant codes -> Convert -> [Subtract] ->
Multiply -> Reshape), so the shard holds the GGUF's own codes.

Types without a minimum (Q4_0, Q5_0, Q8_0, Q6_K) become signed codes, ``codes - center``, times their
scale.  Types with a minimum (Q4_1, Q5_1, Q4_K, Q5_K: ``scale * codes + minimum``) have no integer
zero point.  Signed codes (or an integer zero point) matter for speed: with them a CPU with int8 dot
products (VNNI, AVX-512) quantizes the activations to int8 on the fly, with a float zero point it
keeps them in float.  So a large matrix of such a type runs its codes less their center, as signed
codes, and gets each group's offset, ``center * scale + minimum``, from a second, small MatMul over
each group's sum of the activations; the K-quants' offsets stay six-bit codes under the
super-block's ``d`` and ``dmin``, as in the GGUF.  A small matrix keeps a float zero point,
``-minimum / scale``, where the extra ops would cost more than they save.

Scales and zero points are stored as f16 where that holds them to 11 bits (``stored``; a K-quant's
``d * scale`` has up to 17): a weight moves by at most 2^-11 of itself, against the half step of
its 4-6 bit code the GGUF rounded it by.

Measured (OpenVINO 2026.4.1, one process, interleaved), Qwen2.5-Coder-1.5B decode on a CPU with int8
dot products (2026-11-27): 15.0 tok/s with the zero points rounded and the rounding corrected by an
f32 table, as before, 17.0-17.4 with the offsets; SmolLM2-135M's small Q4_1 matrices, float zero
points: 90 tok/s, offsets: 81; Q6_K's i8 codes in place of u8 less 32: 497 against 678 us for an
[1536, 8960] matrix.  On an AVX2 CPU without them (another host, the same day), where every
compressed MatMul runs in float: signed codes in place of u4 less a zero point of 8, 4.06 -> 4.63
tok/s.  f16 scales took the shard from 1,384 to 1,265 MB (the GGUF: 1,066) at the same KL from the
GGUF's weights (0.00013 nats per token at the f32 hint).

An embedding that is not also the head keeps its codes too (``lookup_table``): the CPU plugin's
Gather decodes the rows it looks up from them (Qwen2.5-Coder-1.5B's Q4_K table, 30 us a lookup),
which takes the shard from 1,440 to 1,384 MB against INT8 rows.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from engine.errors import ExportError
from engine.models.catalog import read_gguf_header

# GGML's type ids (ggml.h), with (elements per block, bytes per block)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
          Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K",
         Q6_K: "Q6_K"}
FLOATS = frozenset({0, 1, 30})  # F32, F16, BF16


def carries(path) -> bool:
    """Whether a GGUF file's matrices can all be carried over: every quantized one of a type above,
    and most of them quantized (a float GGUF has nothing to carry).  Reads the header alone."""
    types = [kind for dims, kind, _ in read_gguf_header(path).tensors if len(dims) == 2]
    quantized = [kind for kind in types if kind not in FLOATS]
    return all(kind in BLOCKS for kind in quantized) and 2 * len(quantized) > len(types)


@dataclasses.dataclass
class Table:
    """A ``[rows, groups]`` table: u8 ``codes [rows, blocks, per]`` times a ``scale [rows, blocks, 1]``
    (a K-quant super-block's six-bit scales or minimums under its f16 ``d`` or ``dmin``), or, with no
    codes, the values themselves ``[rows, groups, 1]`` (Q4_1's and Q5_1's f16 ones)."""

    scale: np.ndarray
    codes: np.ndarray | None = None

    def values(self) -> np.ndarray:
        if self.codes is None:
            return self.scale[..., 0]
        return (self.codes.astype(np.float32) * self.scale).reshape(len(self.scale), -1)


@dataclasses.dataclass
class Quantized:
    """A GGUF matrix per group: codes uint8 ``[rows, groups, group]``, scale float32 ``[rows, groups,
    1]``, the center of the codes' range and, for a type with a minimum, that minimum and the scales
    again as tables (``steps``): ``codes * scale + minimum``, the GGUF's own formula."""

    codes: np.ndarray
    scale: np.ndarray
    center: int
    bits: int
    minimum: Table | None = None
    steps: Table | None = None

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
        low = self.minimum.values()[..., None]
        flat = self.scale == 0
        zero_point = np.where(flat, np.float32(1.0), -low / np.where(flat, 1.0, self.scale)).astype(np.float32)
        codes = np.where(flat, np.uint8(0), self.codes).astype(np.uint8)
        return codes, np.where(flat, -low, self.scale).astype(np.float32), zero_point

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
    if qtype not in BLOCKS:
        raise ExportError(f"GGML type {qtype} cannot be carried over")
    b = _blocks(raw, qtype, rows, columns)
    if qtype == Q4_0:
        d = _f16(b[..., 0:2])
        return Quantized(_nibbles(b[..., 2:18]), d, 8, 4)
    if qtype == Q4_1:
        d = _f16(b[..., 0:2])
        return Quantized(_nibbles(b[..., 4:20]), d, 8, 4, minimum=Table(_f16(b[..., 2:4])), steps=Table(d))
    if qtype == Q5_0:
        d = _f16(b[..., 0:2])
        codes = _nibbles(b[..., 6:22]) | (_high_bits(b[..., 2:6]) << 4)
        return Quantized(codes, d, 16, 5)
    if qtype == Q5_1:
        d = _f16(b[..., 0:2])
        codes = _nibbles(b[..., 8:24]) | (_high_bits(b[..., 4:8]) << 4)
        return Quantized(codes, d, 16, 5, minimum=Table(_f16(b[..., 2:4])), steps=Table(d))
    if qtype == Q8_0:
        d = _f16(b[..., 0:2])
        codes = (np.ascontiguousarray(b[..., 2:34]).view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return Quantized(codes, d, 128, 8)
    blocks = b.shape[1]
    if qtype in (Q4_K, Q5_K):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sub, mins = _k_scales(b[..., 4:16])
        scale = (d * sub).reshape(rows, blocks * 8, 1)  # exact in f32: 11-bit times 6-bit
        minimum, steps = Table(-dmin, mins.astype(np.uint8)), Table(d, sub.astype(np.uint8))
        if qtype == Q4_K:
            codes = _k_nibbles(b[..., 16:144])
        else:
            high = (b[..., 16:48][..., None, :] >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
            codes = _k_nibbles(b[..., 48:176]) | (high << 4)
        bits = 4 if qtype == Q4_K else 5
        return Quantized(codes.reshape(rows, blocks * 8, 32), scale, 1 << (bits - 1), bits, minimum=minimum, steps=steps)
    # Q6_K: 16 groups of 16 per super-block, int8 scales, codes 0..63 around 32
    low = (b[..., 0:128].reshape(rows, blocks, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F
    high = (b[..., 128:192].reshape(rows, blocks, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 0x03
    codes = (low.reshape(rows, blocks, 8, 32) | (high.reshape(rows, blocks, 8, 32) << 4)).reshape(rows, blocks * 16, 16)
    sub = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    scale = (_f16(b[..., 208:210]) * sub).reshape(rows, blocks * 16, 1)  # exact in f32: 11-bit times 8-bit
    return Quantized(codes, scale, 32, 6)


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


# From this many weights on, a matrix with a minimum gets its offsets from a second MatMul (see
# above); a smaller one keeps a float zero point, where the extra ops cost more than they save.
OFFSETS_FROM = 2**21


def _pattern(codes: np.ndarray, kind: ov.Type, zero: ov.Output | None, scale: np.ndarray) -> ov.Output:
    """``(codes - zero) * scale`` reshaped to [rows, columns], the decompression pattern the plugins
    fuse into their compressed MatMul (no Subtract where ``zero`` is None)."""
    rows, groups, group = codes.shape
    centered = ops.convert(ops.constant(codes, dtype=kind), ov.Type.f32)
    if zero is not None:
        centered = ops.subtract(centered, zero)
    scaled = ops.multiply(centered, _small(scale))
    return ops.reshape(scaled, ops.constant(np.array([rows, groups * group], dtype=np.int64)), False).output(0)


def matrix(q: Quantized, offsets: bool) -> ov.Output:
    """The codes as an f32 [rows, columns] graph output: signed codes, ``codes - center`` (i4 up to 4
    bits, else i8), times their scales where there is no minimum and, with ``offsets``, where the
    offsets come after: the activations the CPU quantizes to int8 on the fly then meet centered
    codes (uncentered ones lost ten times more to that rounding on SmolLM2's Q4_1 matrices); else the
    codes less a float zero point (``Quantized.zero_point_form``), which keeps the activations in
    float."""
    if q.exact or offsets:
        signed = (q.codes.astype(np.int16) - q.center).astype(np.int8)
        return _pattern(signed, ov.Type.i4 if q.bits <= 4 else ov.Type.i8, None, q.scale)
    codes, scale, zero_point = q.zero_point_form()
    return _pattern(codes, ov.Type.u4 if q.bits <= 4 else ov.Type.u8, _small(zero_point), scale)


def _offsets(q: Quantized, offsets_from: int) -> bool:
    return not q.exact and q.codes.size >= offsets_from


def _offset_table(q: Quantized) -> ov.Output:
    """``[center * steps | minimum]`` as one f32 [rows, 2 * groups] graph output: for the K-quants
    their six-bit codes under ``center * d`` and ``dmin`` (a compressed MatMul's weight again, as
    small as the GGUF keeps them), else the f16 values."""
    steps, minimum = q.steps, q.minimum
    rows, groups = len(q.codes), q.codes.shape[1]
    scale = np.concatenate([np.float32(q.center) * steps.scale, minimum.scale], axis=1)
    if minimum.codes is None:
        return _small(scale[..., 0])
    codes = np.concatenate([steps.codes, minimum.codes], axis=1)
    table = ops.multiply(ops.convert(ops.constant(codes, dtype=ov.Type.u8), ov.Type.f32), _small(scale))
    return ops.reshape(table, ops.constant(np.array([rows, 2 * groups], dtype=np.int64)), False).output(0)


def carry_matmul(matmul, q: Quantized, sums: dict | None = None, offsets_from: int = OFFSETS_FROM) -> None:
    """Gives ``matmul`` (``x @ W.T``, x ``[batch, positions, columns]``) the GGUF's codes as its weight;
    for a large matrix with a minimum, centered, with each group's offset (``Quantized.offsets``)
    times the group's sum of ``x`` from a second MatMul.  ``sums`` shares those sums between the
    MatMuls of one input, whose second MatMuls can then be stacked as their first ones are."""
    offsets = _offsets(q, offsets_from)
    matmul.input(1).replace_source_output(matrix(q, offsets))
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
    total = ops.add(matmul.output(0), ops.matmul(shared[key], _offset_table(q), False, True))
    for consumer in consumers:
        consumer.replace_source_output(total.output(0))


def carried_values(q: Quantized, offsets_from: int = OFFSETS_FROM) -> np.ndarray:
    """The float32 matrix ``carry_matmul`` computes with, as a graph with an identity input returns
    it: the GGUF's values with the scales and zero points as ``stored`` keeps them."""
    if not q.exact and not _offsets(q, offsets_from):
        codes, scale, zero_point = q.zero_point_form()
        values = (codes.astype(np.float32) - stored(zero_point)) * stored(scale)
    else:
        values = (q.codes.astype(np.float32) - np.float32(q.center)) * stored(q.scale)
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
    return matrix(decompose(qtype, raw, raw.shape[0], raw.shape[1] // nbytes * size), offsets=False)


def fingerprint(array: np.ndarray) -> bytes:
    """What identifies a staged matrix among a stage's constants (its bytes, hashed)."""
    return hashlib.blake2b(memoryview(np.ascontiguousarray(array)).cast("B"), digest_size=16).digest()


def carry(model: ov.Model, ckpt, matrices: dict[bytes, tuple[str, int]]) -> dict:
    """Gives every MatMul whose weight constant holds a quantized GGUF matrix (``matrices``: the staged
    matrices' fingerprints -> (part, layer)) the GGUF's own codes; returns what was carried, by type,
    and what was not (kept as floats, then stored as the format's fp16)."""
    carried: dict[str, int] = {}
    kept: list[str] = []
    sums: dict = {}
    for op in model.get_ordered_ops():
        if op.get_type_name() != "MatMul":
            continue
        node = op.input_value(1).get_node()
        if node.get_type_name() == "Convert":
            node = node.input_value(0).get_node()
        if node.get_type_name() != "Constant":
            continue
        found = matrices.pop(fingerprint(node.get_data()), None)
        if found is None:
            continue
        part, layer = found
        blocks = ckpt.read_blocks(part, layer)
        if blocks is None or blocks[0] not in BLOCKS:
            kept.append(f"layer {layer} {part}" + (f" (GGML type {blocks[0]})" if blocks else " (floats)"))
            continue
        qtype, raw = blocks
        rows, columns = node.get_output_shape(0)
        carry_matmul(op, decompose(qtype, raw, rows, columns), sums)
        carried[NAMES[qtype]] = carried.get(NAMES[qtype], 0) + 1
    kept += [f"layer {layer} {part} (not found in the graph)" for part, layer in matrices.values()]
    return {"carried": carried, "kept_float": kept}


def carried_text(report: dict) -> str:
    """What ``carry`` did, in words."""
    done = ", ".join(f"{count} {name}" for name, count in sorted(report["carried"].items())) or "none"
    text = f"GGUF matrices carried over as they are: {done} (their codes, with scales held to 11 bits)"
    if report["kept_float"]:
        text += f"; kept as fp16: {', '.join(report['kept_float'])}"
    return text
