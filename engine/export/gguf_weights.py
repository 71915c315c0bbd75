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
from engine.models.quantized import BLOCKS, FLOATS, KERNEL_TAG, NAMES, Quantized, Table, decompose
from engine.tuning import OFFSETS_FROM

def carries(path) -> bool:
    """Whether a GGUF file's matrices can all be carried over: every quantized one of a type in ``BLOCKS``,
    and most of them quantized (a float GGUF has nothing to carry).  Reads the header alone."""
    types = [t.ggml_type for t in read_gguf_header(path).tensors if len(t.dims) == 2]
    quantized = [kind for kind in types if kind not in FLOATS]
    return all(kind in BLOCKS for kind in quantized) and 2 * len(quantized) > len(types)


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
