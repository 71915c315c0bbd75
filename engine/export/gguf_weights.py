"""GGUF quantized matrices carried into a shard as they are, instead of dequantized and quantized again.

A GGUF block type stores each group of a row as integer codes with a scale and, for some types, a
minimum.  ``decompose`` turns a tensor's raw blocks into codes ``[rows, groups, group]`` with a scale
and a zero point per group, so that ``(codes - zero_point) * scale`` is the float value the GGUF
stands for; ``carry_matmul`` builds it as the decompression pattern OpenVINO's CPU and GPU plugins run
inside their compressed MatMul (Constant u4/u8 codes and zero point -> Convert -> Subtract ->
Multiply -> Reshape), so the shard holds the GGUF's own codes.

Exact types: Q4_0, Q5_0, Q8_0 and Q6_K decode to exactly the GGUF's float32 values.  Types with a
minimum (Q4_1, Q5_1, Q4_K, Q5_K: ``scale * q + min``) have no integer zero point; theirs, ``-min /
scale``, decodes within an ulp or two of each value.  An integer zero point matters for speed: with
one the CPU plugin quantizes the activations to int8 on the fly, with a float one it keeps them in
float.  So a large matrix of such a type gets its zero point rounded to an integer, and what the
rounding moved, ``scale * (rounded - zero_point)`` per group, comes back through a second, small
MatMul over each group's sum of the activations; a small matrix keeps the float zero point, where
the extra ops would cost more than they save.  Measured on this CPU (OpenVINO 2026.4.1): an [8960,
1536] Q4_K matrix, one token, 289 us with a float zero point, 132 us rounded and corrected (NNCF's
INT4 at group 128: 115 us); whole models, decode: Qwen2.5-Coder-1.5B (matrices of 2.4-14M weights)
19.7 against 17.4 tok/s with the correction, SmolLM2-135M (0.3-0.9M) 82.6 against 96.4 without.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from engine.errors import ExportError

# GGML's type ids (ggml.h), with (elements per block, bytes per block)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
          Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K",
         Q6_K: "Q6_K"}
EXACT = frozenset({Q4_0, Q5_0, Q8_0, Q6_K})


@dataclasses.dataclass
class Quantized:
    """``(codes - zero_point) * scale`` per group: codes uint8 ``[rows, groups, group]``, scale and
    zero point float32 ``[rows, groups, 1]``."""

    codes: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray
    bits: int
    exact: bool  # the expression gives the GGUF's float32 values bit for bit

    def values(self) -> np.ndarray:
        """The float32 matrix ``[rows, columns]``, evaluated in the order the shard's graph does."""
        return ((self.codes.astype(np.float32) - self.zero_point) * self.scale).reshape(len(self.codes), -1)


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


def _with_minimum(codes, scale, minimum, bits) -> Quantized:
    """``scale * codes + minimum`` as a zero-point form; a group of scale 0 (all values equal to its
    minimum) becomes codes 0 - zero point 1 times the minimum, which is exact."""
    flat = scale == 0
    safe = np.where(flat, 1.0, scale)
    zero_point = np.where(flat, np.float32(1.0), -minimum / safe).astype(np.float32)
    codes = np.where(flat, np.uint8(0), codes).astype(np.uint8)
    scale = np.where(flat, -minimum, scale).astype(np.float32)
    return Quantized(codes, scale, zero_point, bits, exact=False)


def decompose(qtype: int, raw: np.ndarray, rows: int, columns: int) -> Quantized:
    """A GGUF tensor's raw blocks (``rows`` x ``columns`` values) as codes, scales and zero points."""
    if qtype not in BLOCKS:
        raise ExportError(f"GGML type {qtype} cannot be carried over")
    b = _blocks(raw, qtype, rows, columns)
    if qtype == Q4_0:
        d = _f16(b[..., 0:2])
        return Quantized(_nibbles(b[..., 2:18]), d, np.full_like(d, 8.0), 4, exact=True)
    if qtype == Q4_1:
        return _with_minimum(_nibbles(b[..., 4:20]), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 4)
    if qtype == Q5_0:
        d = _f16(b[..., 0:2])
        codes = _nibbles(b[..., 6:22]) | (_high_bits(b[..., 2:6]) << 4)
        return Quantized(codes, d, np.full_like(d, 16.0), 5, exact=True)
    if qtype == Q5_1:
        codes = _nibbles(b[..., 8:24]) | (_high_bits(b[..., 4:8]) << 4)
        return _with_minimum(codes, _f16(b[..., 0:2]), _f16(b[..., 2:4]), 5)
    if qtype == Q8_0:
        d = _f16(b[..., 0:2])
        codes = (np.ascontiguousarray(b[..., 2:34]).view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return Quantized(codes, d, np.full_like(d, 128.0), 8, exact=True)
    blocks = b.shape[1]
    if qtype in (Q4_K, Q5_K):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sub, mins = _k_scales(b[..., 4:16])
        scale = (d * sub).reshape(rows, blocks * 8, 1)  # exact in f32: 11-bit times 6-bit
        minimum = -(dmin * mins).reshape(rows, blocks * 8, 1)
        if qtype == Q4_K:
            codes = _k_nibbles(b[..., 16:144])
        else:
            high = (b[..., 16:48][..., None, :] >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
            codes = _k_nibbles(b[..., 48:176]) | (high << 4)
        return _with_minimum(codes.reshape(rows, blocks * 8, 32), scale, minimum, 4 if qtype == Q4_K else 5)
    # Q6_K: 16 groups of 16 per super-block, int8 scales, codes 0..63 around 32
    low = (b[..., 0:128].reshape(rows, blocks, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F
    high = (b[..., 128:192].reshape(rows, blocks, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 0x03
    codes = (low.reshape(rows, blocks, 8, 32) | (high.reshape(rows, blocks, 8, 32) << 4)).reshape(rows, blocks * 16, 16)
    sub = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    scale = (_f16(b[..., 208:210]) * sub).reshape(rows, blocks * 16, 1)  # exact in f32: 11-bit times 8-bit
    return Quantized(codes, scale, np.full_like(scale, 32.0), 6, exact=True)


def _f16_exact(values: np.ndarray) -> bool:
    return bool(np.array_equal(values.astype(np.float16).astype(np.float32), values))


def _small(values: np.ndarray) -> ov.Output:
    """A scale or correction table: f16 where that holds it exactly, else f32 (as f32 values)."""
    if _f16_exact(values):
        return ops.convert(ops.constant(values.astype(np.float16)), ov.Type.f32).output(0)
    return ops.constant(values.astype(np.float32)).output(0)


# From this many weights on, a matrix with a minimum rounds its zero point and corrects (see above).
CORRECTED_FROM = 2**21


def integral(q: Quantized) -> tuple[np.ndarray, np.ndarray | None]:
    """The zero points rounded to integers the codes' type holds, and what that moved per group,
    ``scale * (rounded - zero_point)`` ``[rows, groups]`` (None when nothing moved)."""
    rounded = np.clip(np.rint(q.zero_point), 0, 15 if q.bits <= 4 else 255)
    moved = (q.scale * (rounded - q.zero_point))[..., 0]
    return rounded.astype(np.uint8), (moved.astype(np.float32) if moved.any() else None)


def matrix(q: Quantized, zero_point: np.ndarray) -> ov.Output:
    """``(codes - zero_point) * scale`` as an f32 [rows, columns] graph output in the pattern the
    plugins fuse into their compressed MatMul: u4 codes (up to 4 bits) or u8, a zero point of the
    same type where it is an integer (uint8 here), else f16 or f32."""
    rows, groups, group = q.codes.shape
    kind = ov.Type.u4 if q.bits <= 4 else ov.Type.u8
    if zero_point.dtype == np.uint8:
        zero = ops.convert(ops.constant(zero_point, dtype=kind), ov.Type.f32).output(0)
    else:
        zero = _small(zero_point)
    centered = ops.subtract(ops.convert(ops.constant(q.codes, dtype=kind), ov.Type.f32), zero)
    scaled = ops.multiply(centered, _small(q.scale))
    return ops.reshape(scaled, ops.constant(np.array([rows, groups * group], dtype=np.int64)), False).output(0)


def _plan(q: Quantized, corrected_from: int) -> tuple[np.ndarray, np.ndarray | None]:
    """The zero points a matrix is built with, and its correction table (None: none)."""
    if q.exact:
        return q.zero_point.astype(np.uint8), None
    if q.codes.size < corrected_from:
        return q.zero_point, None
    return integral(q)


def carry_matmul(matmul, q: Quantized, corrected_from: int = CORRECTED_FROM) -> None:
    """Gives ``matmul`` (``x @ W.T``, x ``[batch, positions, columns]``) the GGUF's codes as its weight,
    plus, for a large matrix with a minimum, the correction of its rounded zero points."""
    zero_point, moved = _plan(q, corrected_from)
    matmul.input(1).replace_source_output(matrix(q, zero_point))
    if moved is None:
        return
    consumers = list(matmul.output(0).get_target_inputs())
    _, groups, group = q.codes.shape
    grouped = ops.reshape(matmul.input_value(0), ops.constant(np.array([0, 0, groups, group], dtype=np.int64)), True)
    sums = ops.reduce_sum(grouped, ops.constant(np.array([-1], dtype=np.int64)), False)
    total = ops.add(matmul.output(0), ops.matmul(sums, _small(moved), False, True))
    for consumer in consumers:
        consumer.replace_source_output(total.output(0))


def carried_values(q: Quantized, corrected_from: int = CORRECTED_FROM) -> np.ndarray:
    """The float32 matrix ``carry_matmul`` computes with, as a graph with an identity input would
    return it: codes less the zero points, times the scales, plus each group's correction if any."""
    zero_point, moved = _plan(q, corrected_from)
    if moved is None:  # the zero points as decomposed (an integral one is the same number in uint8)
        return q.values()
    values = (q.codes.astype(np.float32) - zero_point) * q.scale + moved[..., None]
    return values.reshape(len(q.codes), -1)


def fingerprint(array: np.ndarray) -> bytes:
    """What identifies a staged matrix among a stage's constants (its bytes, hashed)."""
    return hashlib.blake2b(memoryview(np.ascontiguousarray(array)).cast("B"), digest_size=16).digest()


def carry(model: ov.Model, ckpt, matrices: dict[bytes, tuple[str, int]]) -> dict:
    """Gives every MatMul whose weight constant holds a quantized GGUF matrix (``matrices``: the staged
    matrices' fingerprints -> (part, layer)) the GGUF's own codes; returns what was carried, by type,
    and what was not (kept as floats, then stored as the format's fp16)."""
    carried: dict[str, int] = {}
    kept: list[str] = []
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
        carry_matmul(op, decompose(qtype, raw, rows, columns))
        carried[NAMES[qtype]] = carried.get(NAMES[qtype], 0) + 1
    kept += [f"layer {layer} {part} (not found in the graph)" for part, layer in matrices.values()]
    return {"carried": carried, "inexact": sorted(n for n in carried if n not in {NAMES[t] for t in EXACT}),
            "kept_float": kept}


def carried_text(report: dict) -> str:
    """What ``carry`` did, in words."""
    done = ", ".join(f"{count} {name}" for name, count in sorted(report["carried"].items())) or "none"
    text = f"GGUF matrices carried over as they are: {done}"
    if report["inexact"]:
        text += (f" ({', '.join(report['inexact'])}: a minimum has no integer zero point, so these decode "
                 "within an ulp or two of the GGUF's values)")
    if report["kept_float"]:
        text += f"; kept as fp16: {', '.join(report['kept_float'])}"
    return text
