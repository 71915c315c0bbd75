"""Puts ``GGMLMatMul`` in a shard's graph in place of each carried GGUF matrix the exporter tagged
(``engine.export.gguf_weights.KERNEL_TAG``): the matrix's codes and scales, read back from the graph's
constants, become the GGUF's own blocks again (``gguf_weights.compose``), and the operation multiplies
by them; a matrix with offsets loses its second MatMul, since ggml's dot products include the
minimums.  Everything else in the graph stays as it is."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from engine.export.gguf_weights import CENTERS, KERNEL_TAG, NAMES, Q4_0, Q5_0, Q6_K, Q8_0, Quantized, Table, compose
from engine.kernels import OP

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


def _integers(output: ov.Output) -> np.ndarray:
    """The integer codes behind a Convert to f32."""
    return np.rint(_value(output)).astype(np.int16)


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
    codes = _integers(_op(product.input_value(0), "Convert").output(0)) + CENTERS[qtype]
    steps, _, _ = _table(product.input_value(1))
    q = Quantized(codes.astype(np.uint8), steps, CENTERS[qtype], 0, qtype=qtype)
    if qtype not in _NO_MINIMUM:  # a type with a minimum: its offsets come from a second MatMul
        adds = [t.get_node() for t in matmul.output(0).get_target_inputs() if t.get_node().get_type_name() == "Add"]
        if len(adds) != 1:
            raise ValueError("no offsets found")
        q.minimum = _minimum(adds[0], matmul)
        return q, adds[0].output(0)
    return q, matmul.output(0)


def swap_in(model: ov.Model, factory, kernel: int = 0) -> dict[str, int]:
    """Replaces every tagged matrix of ``model`` with ``GGMLMatMul`` (``factory``: the NodeFactory of
    ``engine.kernels.factory``); returns how many matrices of each type now run so.  A matrix whose
    graph does not have the expected form stays as it is."""
    swapped: dict[str, int] = {}
    for matmul in model.get_ordered_ops():
        if matmul.get_type_name() != "MatMul" or matmul.get_transpose_a() or not matmul.get_transpose_b():
            continue
        name = matmul.input_value(1).get_node().get_friendly_name()
        tag = name.rsplit("/", 1)[-1]
        if not tag.startswith(KERNEL_TAG) or tag[len(KERNEL_TAG):] not in _TYPES:
            continue
        qtype = _TYPES[tag[len(KERNEL_TAG):]]
        try:
            q, replaced = _quantized(matmul, qtype)
        except ValueError:
            continue
        blocks = compose(q)
        columns = q.codes.shape[1] * q.codes.shape[2]
        op = factory.create(OP, [matmul.input_value(0), ops.constant(blocks).output(0)],
                            {"ggml_type": qtype, "columns": columns, "kernel": kernel})
        op.set_friendly_name(matmul.get_friendly_name())
        for target in list(replaced.get_target_inputs()):
            target.replace_source_output(op.output(0))
        swapped[NAMES[qtype]] = swapped.get(NAMES[qtype], 0) + 1
    if swapped:
        model.validate_nodes_and_infer_types()
    return swapped

