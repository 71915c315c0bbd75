"""Compile-time rewrites of a shard's graph: what the runtime wants that the shard format need not carry.

``keep_last_logits`` gives a last stage a ``logits_to_keep`` input: the head projects only that many
final positions.  A prefill wants one row of logits, not a vocabulary-sized row per prompt token
(for a 1,000-token prompt on a 150k vocabulary that is most of a forward's work); a speculative
verify keeps all of its positions.

``fuse_sibling_matmuls`` turns the compressed MatMuls that read the same input (a layer's q, k and
v; its gate and up) into one MatMul over their weights stacked, split after: one activation
quantization and one pass over the rows instead of three or two, which matters most for the small
k and v.  Their biases (Qwen's q, k, v) are stacked too and added before the split, where the
plugin folds them into the MatMul as it did for each alone.

The shard on disk stays as exported, so LLMPipeline still loads it.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops

LOGITS_TO_KEEP = "logits_to_keep"


def keep_last_logits(model: ov.Model) -> bool:
    """Slices the head's input to the last ``logits_to_keep`` positions; False (and the model
    untouched) when the logits do not come from a MatMul as ``graph.attach_vocabulary`` makes it."""
    result = model.outputs[0].get_node()
    head = result.input_value(0).get_node()
    if head.get_type_name() != "MatMul":
        return False
    keep = ops.parameter(ov.PartialShape([1]), ov.Type.i64, name=LOGITS_TO_KEEP)
    keep.get_output_tensor(0).set_names({LOGITS_TO_KEEP})
    hidden = head.input_value(0)
    last = ops.slice(hidden, ops.negative(keep), ops.constant(np.array([np.iinfo(np.int64).max])),
                     ops.constant(np.array([1])), ops.constant(np.array([1])))
    head.input(0).replace_source_output(last.output(0))
    model.add_parameters([keep])
    model.validate_nodes_and_infer_types()
    return True


PACKED = (ov.Type.i4, ov.Type.u4)  # 4-bit types: two values a byte


def _constant(output) -> tuple | None:
    """(Constant, the type a Convert makes of it or None) for a Constant, maybe behind a Convert."""
    node = output.get_node()
    converted = None
    if node.get_type_name() == "Convert":
        converted, node = node.get_output_element_type(0), node.input_value(0).get_node()
    if node.get_type_name() != "Constant":
        return None
    if node.get_element_type() in PACKED and int(np.prod(node.get_output_shape(0))) % 2:
        return None  # half a byte at its end: cannot be stacked byte-wise
    return node, converted


def _compressed_weight(matmul) -> tuple | None:
    """A MatMul ``x @ W.T`` whose W is a compressed pattern the export writes (Constant codes
    [rows, groups, group] -> Convert [-> Subtract(zero point)] -> Multiply(scale) -> Reshape
    [-> Convert]): (signature, leaves), where leaves are (codes, zero point or None, scale) as
    ``_constant`` pairs and MatMuls of one signature can be stacked; else None."""
    if matmul.get_type_name() != "MatMul" or matmul.get_attributes() != {"transpose_a": False, "transpose_b": True}:
        return None
    node, outer = matmul.input_value(1).get_node(), None
    if node.get_type_name() == "Convert":
        outer, node = node.get_output_element_type(0), node.input_value(0).get_node()
    scaled = node.input_value(0).get_node() if node.get_type_name() == "Reshape" else None
    if scaled is None or scaled.get_type_name() != "Multiply":
        return None
    centered, scale = scaled.input_value(0), _constant(scaled.input_value(1))
    zero = None
    if centered.get_node().get_type_name() == "Subtract":
        zero = _constant(centered.get_node().input_value(1))
        if zero is None:
            return None
        centered = centered.get_node().input_value(0)
    codes = _constant(centered)
    if codes is None or scale is None or codes[1] is None or len(codes[0].get_output_shape(0)) != 3:
        return None
    leaves = (codes, zero, scale)
    signature = (matmul.input_value(0).get_node().get_friendly_name(), matmul.input_value(0).get_index(), outer,
                 *((None,) if leaf is None else (leaf[0].get_element_type(), tuple(leaf[0].get_output_shape(0)[1:]),
                                                 leaf[1]) for leaf in leaves))
    return signature, leaves


def _stacked(constants: list) -> ov.Output:
    """The Constants (one element type, equal trailing dimensions) stacked along their first axis;
    4-bit ones as their packed bytes (``_constant`` takes only those of whole bytes)."""
    first = constants[0]
    shape = [sum(c.get_output_shape(0)[0] for c in constants), *first.get_output_shape(0)[1:]]
    tensor = ov.Tensor(first.get_element_type(), ov.Shape(shape))
    np.concatenate([c.get_data().reshape(-1) for c in constants], out=tensor.data.reshape(-1))
    return ov.op.Constant(tensor).output(0)


def _bias(matmul) -> tuple | None:
    """(the Add, its constant as ``_constant`` gives it) when a MatMul's one consumer adds a
    constant bias over its last axis ([1, ..., rows]), else None."""
    consumers = list(matmul.output(0).get_target_inputs())
    if len(consumers) != 1 or consumers[0].get_node().get_type_name() != "Add":
        return None
    add = consumers[0].get_node()
    found = _constant(add.input_value(1 - consumers[0].get_index()))
    if found is None or found[0].get_element_type() in PACKED:
        return None
    shape = list(found[0].get_output_shape(0))
    if not shape or shape[-1] != matmul.get_output_partial_shape(0)[-1].get_length() or any(d != 1 for d in shape[:-1]):
        return None
    return add, found


def fuse_sibling_matmuls(model: ov.Model) -> int:
    """Stacks the compressed weights of MatMuls that share their input and their weights' pattern
    (types, groups) into one MatMul and splits its output back; returns how many MatMuls were fused
    away."""
    siblings: dict = {}
    for op in model.get_ordered_ops():
        found = _compressed_weight(op)
        if found is not None:
            siblings.setdefault(found[0], []).append((op, found[1]))
    fused = 0
    for group in siblings.values():
        if len(group) < 2:
            continue
        matmuls, leaves = zip(*group)

        def stacked(i: int) -> ov.Output:
            converted = leaves[0][i][1]
            joint = _stacked([leaf[i][0] for leaf in leaves])
            return joint if converted is None else ops.convert(joint, converted).output(0)

        rows = [leaf[0][0].get_output_shape(0)[0] for leaf in leaves]
        groups, size = leaves[0][0][0].get_output_shape(0)[1:]
        weight = stacked(0) if leaves[0][1] is None else ops.subtract(stacked(0), stacked(1))
        weight = ops.reshape(ops.multiply(weight, stacked(2)),
                             ops.constant(np.array([sum(rows), groups * size], dtype=np.int64)), False)
        if matmuls[0].input_value(1).get_node().get_type_name() == "Convert":
            weight = ops.convert(weight, matmuls[0].input_value(1).get_element_type())
        joint = ops.matmul(matmuls[0].input_value(0), weight, False, True)
        # Biases (Qwen's q, k, v) are added before the split, where the plugin folds them into the MatMul.
        biases = [_bias(matmul) for matmul in matmuls]
        outputs = [matmul.output(0) for matmul in matmuls]
        if all(biases) and len({(b[1][0].get_element_type(), b[1][1], len(b[1][0].get_output_shape(0)))
                                for b in biases}) == 1:
            constant, converted = biases[0][1]
            shape = [*constant.get_output_shape(0)[:-1], sum(rows)]
            bias = ops.constant(np.concatenate([b[1][0].get_data().reshape(-1) for b in biases]).reshape(shape),
                                dtype=constant.get_element_type())
            joint = ops.add(joint, bias if converted is None else ops.convert(bias, converted))
            outputs = [b[0].output(0) for b in biases]
        parts = ops.variadic_split(joint, ops.constant(np.int64(-1)), ops.constant(np.array(rows, dtype=np.int64)))
        for i, output in enumerate(outputs):
            for consumer in list(output.get_target_inputs()):
                consumer.replace_source_output(parts.output(i))
        fused += len(matmuls) - 1
    if fused:
        model.validate_nodes_and_infer_types()
    return fused
