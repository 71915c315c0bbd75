"""Puts ``GGMLMatMul`` in a shard's graph in place of each carried GGUF matrix the exporter tagged
(``engine.models.quantized.KERNEL_TAG``): the matrix's codes and scales, read back from the graph's
constants, become our kernels' tiles (``engine.kernels.tiles``) or the GGUF's own blocks again
(``quantized.compose``), and the operation multiplies by them; a matrix with offsets loses its
second MatMul, since the kernels include the minimums.  A small 4-bit matrix the exporter gave a
float zero point (``Quantized.zero_point_form``) runs as Q4_1, ``d * code + m`` with ``m`` the zero
point's, within an f16 rounding of the shard's values.  Everything else in the graph stays as it is."""

from __future__ import annotations

import dataclasses

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from engine.kernels import GGML_KERNEL, OP, OWN, tile_width
from engine.kernels.tiles import TILE, TYPES, tiles
from engine.models.quantized import (CENTERS, KERNEL_TAG, NAMES, Q4_0, Q4_1, Q5_0, Q6_K, Q8_0, Quantized, Table,
                                     compose, int8_rows)

_TYPES = {name: qtype for qtype, name in NAMES.items()}
_NO_MINIMUM = (Q4_0, Q5_0, Q8_0, Q6_K)


def _value(output: ov.Output) -> np.ndarray:
    """A constant expression's value (Constants, Converts, Adds... evaluated here, op by op)."""
    return _tensor(output).data.copy()


def _tensor(output: ov.Output) -> ov.Tensor:
    node = output.get_node()
    if node.get_type_name() == "Constant":
        return node.get_tensor_view()
    inputs = [_tensor(value) for value in node.input_values()]
    results = [ov.Tensor(out.get_element_type(), out.get_shape()) for out in node.outputs()]
    if not node.evaluate(results, inputs):
        raise ValueError(f"cannot evaluate {node.get_type_name()} {node.get_friendly_name()}")
    return results[output.get_index()]


def _integers(output: ov.Output, center: int = 0) -> np.ndarray:
    """The integer codes behind a Convert to f32, plus ``center`` (uint8 where they then fit, else
    int16): a constant of 4 or 8 bits is read as it is stored (two 4-bit codes a byte, the first in
    the low nibble), any other evaluated."""
    source = output.get_node().input_value(0)
    node, kind = source.get_node(), source.get_element_type()
    if node.get_type_name() != "Constant" or kind not in _STORED:
        return np.rint(_value(output)).astype(np.int16) + np.int16(center)
    data = np.asarray(node.get_tensor_view().data).view(np.uint8).reshape(-1)
    shape = tuple(source.get_shape())
    signed = kind in (ov.Type.i4, ov.Type.i8)
    if kind in (ov.Type.u8, ov.Type.i8):
        values = data.view(np.int8) if signed else data
        if 0 <= int(values.min()) + center and int(values.max()) + center < 256:  # uint8's wrap is exact
            return (data + np.uint8(center % 256)).reshape(shape)
        return (values.astype(np.int16) + center).reshape(shape)
    codes = np.empty((data.size, 2), np.uint8)
    codes[:, 0], codes[:, 1] = data & 15, data >> 4
    if signed and center == 8:  # (code ^ 8) - 8 is the signed code; plus 8, it is code ^ 8
        codes ^= 8
    elif signed or center:
        codes = _narrow(((codes.astype(np.int16) ^ 8) - 8 if signed else codes.astype(np.int16)) + center)
    return codes.reshape(-1)[:int(np.prod(shape))].reshape(shape)


def _narrow(codes: np.ndarray) -> np.ndarray:
    return codes.astype(np.uint8) if codes.min() >= 0 and codes.max() < 256 else codes


_STORED = (ov.Type.u4, ov.Type.i4, ov.Type.u8, ov.Type.i8)


def _op(output: ov.Output, kind: str) -> ov.Node:
    node = output.get_node()
    if node.get_type_name() != kind:
        raise ValueError(f"expected {kind}, found {node.get_type_name()}")
    return node


def _table(values: ov.Output) -> tuple[Table, ov.Output | None, ov.Output]:
    """A scale table from its graph output (``_Parts.values``): Reshape(Multiply(Convert(codes),
    scale)) or the scale alone; with the codes' and the scale's outputs."""
    node = values.get_node()
    if node.get_type_name() == "Reshape":
        product = _op(node.input_value(0), "Multiply")
        codes = _op(product.input_value(0), "Convert")
        scale = product.input_value(1)
        return Table(_value(scale).astype(np.float32), _integers(codes.output(0))), codes, scale
    return Table(_value(values).astype(np.float32)), None, values


def _minimum(add: ov.Node, matmul: ov.Node) -> Table:
    """The minimums of a matrix with offsets, from its offset MatMul's table (``_offset_table``)."""
    other = add.input_value(1 if add.input_value(0).get_node() is matmul else 0)
    table = _op(_op(other, "MatMul").input_value(1), "Reshape").input_value(0).get_node()
    if table.get_type_name() == "Concat":  # legacy types: [center * d | minimum] as values
        return Table(_value(table.input_value(1)).astype(np.float32))
    product = _op(table.output(0), "Multiply")
    codes = _op(_op(product.input_value(0), "Convert").input_value(0), "Concat")
    scales = _op(product.input_value(1), "Concat")
    return Table(_value(scales.input_value(1)).astype(np.float32),
                 np.rint(_value(codes.input_value(1))).astype(np.int16))


def _quantized(matmul: ov.Node, qtype: int) -> tuple[Quantized, ov.Output]:
    """The carried matrix of ``matmul`` and the output the operation replaces (the MatMul's, or the
    Add of its offsets)."""
    product = _op(_op(matmul.input_value(1), "Reshape").input_value(0), "Multiply")
    if product.input_value(0).get_node().get_type_name() == "Subtract":
        return _zero_point_form(product, qtype), matmul.output(0)
    codes = _integers(_op(product.input_value(0), "Convert").output(0), CENTERS[qtype])
    steps, _, _ = _table(product.input_value(1))
    q = Quantized(codes.astype(np.uint8, copy=False), steps, CENTERS[qtype], 0, qtype=qtype)
    if qtype not in _NO_MINIMUM:  # a type with a minimum: its offsets come from a second MatMul
        adds = [t.get_node() for t in matmul.output(0).get_target_inputs() if t.get_node().get_type_name() == "Add"]
        if len(adds) != 1:
            raise ValueError("no offsets found")
        q.minimum = _minimum(adds[0], matmul)
        return q, adds[0].output(0)
    return q, matmul.output(0)


def _zero_point_form(product: ov.Node, qtype: int) -> Quantized:
    """A 4-bit matrix from ``(codes - zero point) * scale`` as Q4_1: ``d`` the scale, ``m`` minus the
    zero point times it."""
    if qtype in _NO_MINIMUM or CENTERS[qtype] != 8:  # 5 and 8-bit codes stay with the CPU plugin
        raise ValueError("not a 4-bit matrix with a minimum")
    subtract = product.input_value(0).get_node()
    codes = _integers(_op(subtract.input_value(0), "Convert").output(0))
    zero = _value(subtract.input_value(1)).astype(np.float32)
    scale = _value(product.input_value(1)).astype(np.float32)
    return Quantized(codes.astype(np.uint8, copy=False), Table(scale), 8, 4, minimum=Table(-zero * scale),
                     qtype=Q4_1)


HEADS = ("MatMul", OP)  # the head's multiply: graph.attach_vocabulary's, or swap_in's in its place


def head_of(model: ov.Model) -> ov.Node | None:
    """The multiply the logits come from (``HEADS``, input 0 the hidden states), past a tensor-parallel
    rank's AllGather; None when the graph is not one ``graph.attach_vocabulary`` made."""
    head = model.outputs[0].get_node().input_value(0).get_node()
    if head.get_type_name() == "AllGather":  # a tensor-parallel rank's share of the vocabulary
        head = head.input_value(0).get_node()
    return head if head.get_type_name() in HEADS else None


def _carried(matmul: ov.Node) -> int | None:
    """The GGML type of the matrix the exporter carried into ``matmul``, from its tag; None if none."""
    tag = matmul.input_value(1).get_node().get_friendly_name().rsplit("/", 1)[-1]
    return _TYPES.get(tag[len(KERNEL_TAG):]) if tag.startswith(KERNEL_TAG) else None


def int8_head(model: ov.Model) -> bool:
    """For the CPU plugin's own path (the stock path, and the other devices): a head carried with the
    GGUF's codes becomes INT8 rows again (``int8_rows``, from the codes' values), which the plugins run
    fastest; True if it did."""
    head = head_of(model)
    qtype = _carried(head) if head is not None and head.get_type_name() == "MatMul" else None
    if qtype is None or qtype not in _NO_MINIMUM:  # the exporter carries a head without offsets
        return False
    q, _ = _quantized(head, qtype)
    head.input(1).replace_source_output(int8_rows(q.values()))
    model.validate_nodes_and_infer_types()
    return True


def swap_in(model: ov.Model, factory, kernel: int = OWN, float_x: bool = False) -> dict[str, int]:
    """Replaces every tagged matrix of ``model`` with ``GGMLMatMul`` (``factory``: the NodeFactory of
    ``engine.kernels.factory``), in tiles for our kernels where ``kernel`` is ours and this CPU has
    one for the type, else as the GGUF's blocks for ggml's; returns how many matrices of each type now
    run so.  Matrices in tiles that share their input and type, each of whole tiles (q, k and v; gate
    and up), become one operation whose output is split back: one call a layer in place of several,
    each row's numbers the same.  With ``float_x`` (exact mode) the activations stay in float, which
    only our kernels do: a matrix they do not take keeps the stock MatMul.  A matrix whose graph does
    not have the expected form stays as it is."""
    ours = kernel != GGML_KERNEL and tile_width() > 0
    siblings: dict[tuple, list[_Swap]] = {}
    for matmul in model.get_ordered_ops():
        if matmul.get_type_name() != "MatMul" or matmul.get_transpose_a() or not matmul.get_transpose_b():
            continue
        qtype = _carried(matmul)
        if qtype is None:
            continue
        try:
            q, replaced = _quantized(matmul, qtype)
        except ValueError:
            continue
        qtype = q.qtype  # Q4_1 for a zero-point form
        tiled = ours and qtype in TYPES
        if float_x and not tiled:
            continue
        rows = len(q.codes)
        swap = _Swap(matmul, replaced, qtype, rows, q.codes.shape[1] * q.codes.shape[2], tiled,
                     tiles(q) if tiled else compose(q))
        x = matmul.input_value(0)
        key = (x.get_node().get_name(), x.get_index(), qtype) if tiled and rows % TILE == 0 else (matmul,)
        siblings.setdefault(key, []).append(swap)
    swapped: dict[str, int] = {}
    for group in siblings.values():
        first, rows = group[0], [swap.rows for swap in group]
        matrix = np.concatenate([swap.matrix for swap in group]) if len(group) > 1 else first.matrix
        op = factory.create(OP, [first.matmul.input_value(0), ops.constant(matrix).output(0)],
                            {"ggml_type": first.qtype, "rows": sum(rows), "columns": first.columns,
                             "kernel": kernel if first.tiled else GGML_KERNEL, "float_x": int(float_x)})
        op.set_friendly_name(first.matmul.get_friendly_name())
        outputs = [op.output(0)] if len(group) == 1 else \
            ops.variadic_split(op.output(0), ops.constant(np.int64(-1)), ops.constant(np.array(rows))).outputs()
        for swap, output in zip(group, outputs):
            for target in list(swap.replaced.get_target_inputs()):
                target.replace_source_output(output)
        swapped[NAMES[first.qtype]] = swapped.get(NAMES[first.qtype], 0) + len(group)
    if swapped:
        model.validate_nodes_and_infer_types()
    return swapped


@dataclasses.dataclass
class _Swap:
    """A carried matrix on its way into the operation: the MatMul, the output the operation replaces,
    the matrix's type, rows and columns, whether it runs our kernels, and its tiles or blocks."""

    matmul: ov.Node
    replaced: ov.Output
    qtype: int
    rows: int
    columns: int
    tiled: bool
    matrix: np.ndarray
