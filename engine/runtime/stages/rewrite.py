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

``split_deep_matmuls`` cuts a compressed MatMul whose depth the CPU plugin's float path runs at
half speed (``SLOW_DEPTH``) into MatMuls over chunks of its columns, summed.

The stacked (and sliced) weights live in an unlinked file, mapped, not in the process's own memory: the CPU
plugin keeps the constants it was given beside its own repacked copy, and pages of a file the kernel
can drop under a memory cap, as it drops the shard's, where anonymous ones stay for good (Qwen2.5-
Coder-1.5B whole: 1,463 MB anonymous after the first token stacked in memory, 1,043 unfused).

The shard on disk stays as exported, so LLMPipeline still loads it.
"""

from __future__ import annotations

import mmap
import os
import tempfile

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from engine.kernels.swap import head_of
from engine.tuning import SLOW_DEPTH

LOGITS_TO_KEEP = "logits_to_keep"


def keep_last_logits(model: ov.Model) -> bool:
    """Slices the head's input to the last ``logits_to_keep`` positions; False (and the model
    untouched) when the logits do not come from a multiply as ``graph.attach_vocabulary`` makes it."""
    head = head_of(model)
    if head is None:
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
    signature = (matmul.input_value(0).get_node().get_name(), matmul.input_value(0).get_index(), outer,
                 *((None,) if leaf is None else (leaf[0].get_element_type(), tuple(leaf[0].get_output_shape(0)[1:]),
                                                 leaf[1]) for leaf in leaves))
    return signature, leaves


class _Spill:
    """Stacked constants written one after another into an unlinked file, then mapped at once."""

    ALIGN = 64  # each stack starts on a cache line, as an allocated tensor would

    def __init__(self, folder: str | None):
        try:
            self.file = tempfile.TemporaryFile(dir=folder)
        except OSError:  # a folder this process cannot write: the system's temporary one
            self.file = tempfile.TemporaryFile()
        self.pieces: list[tuple[int, int]] = []  # (offset, bytes) of each stack, in order
        self.map: mmap.mmap | None = None

    def write(self, arrays: list) -> int:
        """Writes the arrays' bytes in order; returns the stack's index for ``constant``."""
        offset = -(-self.file.tell() // self.ALIGN) * self.ALIGN
        self.file.seek(offset)
        for array in arrays:
            self.file.write(memoryview(np.ascontiguousarray(array)).cast("B"))
        self.pieces.append((offset, self.file.tell() - offset))
        return len(self.pieces) - 1

    def seal(self) -> None:
        """Maps what was written; the pages are clean on disk, so the kernel may drop any of them."""
        self.file.flush()
        if self.file.tell():
            os.fsync(self.file.fileno())
            self.map = mmap.mmap(self.file.fileno(), 0, access=mmap.ACCESS_COPY)  # writable, no write-back
        self.file.close()  # the mapping keeps the file

    def constant(self, index: int, shape: list[int], element_type: ov.Type) -> ov.Output:
        """Stack ``index`` as one Constant of ``shape`` over the mapped bytes (sub-byte types as their
        packed bytes)."""
        offset, size = self.pieces[index]
        data = np.frombuffer(self.map, dtype=np.uint8, count=size, offset=offset)
        return ov.op.Constant(ov.Tensor(data, ov.Shape(shape), element_type), shared_memory=True).output(0)


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


def fuse_sibling_matmuls(model: ov.Model, spill_dir: str | None = None) -> tuple[int, mmap.mmap | None]:
    """Stacks the compressed weights of MatMuls that share their input and their weights' pattern
    (types, groups) into one MatMul and splits its output back; returns how many MatMuls were fused
    away, and the mapping of the unlinked file in ``spill_dir`` (default: the system's temporary
    folder) that holds the stacks.  The stacked Constants do not keep that mapping alive: whoever
    compiles the graph keeps it for as long as the compiled model lives."""
    siblings: dict = {}
    for op in model.get_ordered_ops():
        found = _compressed_weight(op)
        if found is not None:
            siblings.setdefault(found[0], []).append((op, found[1]))
    groups = [list(zip(*group)) for group in siblings.values() if len(group) > 1]
    spill = _Spill(spill_dir)
    stacks = [[None if leaves[0][i] is None else spill.write([leaf[i][0].get_data() for leaf in leaves])
               for i in range(3)] for _, leaves in groups]
    spill.seal()
    fused = 0
    for (matmuls, leaves), stack in zip(groups, stacks):

        def stacked(i: int) -> ov.Output:
            converted, constants = leaves[0][i][1], [leaf[i][0] for leaf in leaves]
            shape = [sum(c.get_output_shape(0)[0] for c in constants), *constants[0].get_output_shape(0)[1:]]
            joint = spill.constant(stack[i], shape, constants[0].get_element_type())
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
    return fused, spill.map


DEPTH_UNIT = 256  # chunks end between K-quant super-blocks (and so between every format's groups)
_ARITHMETIC = {"Add": ops.add, "Subtract": ops.subtract, "Multiply": ops.multiply}


def split_deep_matmuls(model: ov.Model, spill_dir: str | None = None) -> tuple[int, mmap.mmap | None]:
    """Splits each compressed MatMul whose depth lies in ``SLOW_DEPTH`` into MatMuls over chunks of
    at most ``SLOW_DEPTH[0]`` input columns, summed: each chunk's weights are the same codes and
    scales, sliced between groups.  The CPU plugin's float path (a CPU without int8 dot products)
    runs such a depth at about half speed from a few rows up; a tensor-parallel rank's ``down``
    falls in the band (Qwen2.5-1.5B: 4352 and 4608 of 8960), as do the MLPs of Qwen2.5-0.5B (4864)
    and Llama 3.2 1B (8192).  Returns how many were split and the mapping that holds the
    slices (as ``fuse_sibling_matmuls``)."""
    found = []
    for op in model.get_ordered_ops():
        if op.get_type_name() != "MatMul" or op.get_attributes() != {"transpose_a": False, "transpose_b": True}:
            continue
        shape = op.input_value(1).get_partial_shape()
        if not shape.is_static or len(shape) != 2:
            continue
        rows, depth = shape[0].get_length(), shape[1].get_length()
        if SLOW_DEPTH[0] < depth <= SLOW_DEPTH[1] and depth % DEPTH_UNIT == 0:
            leaves: dict = {}
            if _sliceable(op.input_value(1), rows, depth, leaves):
                units, n = depth // DEPTH_UNIT, -(-depth // SLOW_DEPTH[0])
                bounds = [units * i // n * DEPTH_UNIT for i in range(n + 1)]
                found.append((op, depth, list(zip(bounds, bounds[1:])), leaves))
    spill = _Spill(spill_dir)
    written = {(name, chunk): spill.write([_slice(leaf, depth, *chunk)])
               for _, depth, chunks, leaves in found for name, leaf in leaves.items() for chunk in chunks}
    spill.seal()
    for op, depth, chunks, leaves in found:
        parts = ops.variadic_split(op.input_value(0), ops.constant(np.int64(-1)),
                                   ops.constant(np.array([b - a for a, b in chunks], dtype=np.int64)))
        total = None
        for i, chunk in enumerate(chunks):
            sliced = {name: spill.constant(written[name, chunk], _share(list(leaf.get_output_shape(0)), depth, chunk),
                                           leaf.get_element_type()) for name, leaf in leaves.items()}
            product = ops.matmul(parts.output(i), _rebuilt(op.input_value(1), depth, chunk, sliced), False, True)
            total = product if total is None else ops.add(total, product)
        for consumer in list(op.output(0).get_target_inputs()):
            consumer.replace_source_output(total.output(0))
    if found:
        model.validate_nodes_and_infer_types()
    return len(found), spill.map


def _spans(shape: list[int], rows: int, depth: int) -> bool:
    """Whether a constant of ``shape`` runs along the weight's depth on its axis 1, in pieces that
    chunks of ``DEPTH_UNIT`` columns cut whole."""
    return (len(shape) >= 2 and shape[0] in (rows, 1) and shape[1] > 1 and depth % shape[1] == 0
            and DEPTH_UNIT % (depth // shape[1]) == 0)


def _sliceable(output: ov.Output, rows: int, depth: int, leaves: dict) -> bool:
    """Whether the weight behind ``output`` is constants through element-wise ops and reshapes that
    keep rows on axis 0 and depth on axis 1; collects the constants to slice in ``leaves``."""
    node = output.get_node()
    kind = node.get_type_name()
    if kind == "Constant":
        shape = list(node.get_output_shape(0))
        if all(d == 1 for d in shape[1:]):
            return True  # the same for every column: taken whole
        if not _spans(shape, rows, depth):
            return False
        bits = _step_bits(node)
        if bits * (DEPTH_UNIT // (depth // shape[1])) % 8 or bits * shape[1] % 8:
            return False  # a chunk would begin inside a byte of packed codes
        leaves[node.get_name()] = node
        return True
    if kind == "Reshape":
        if not node.get_output_partial_shape(0).is_static or not _spans(list(node.get_output_shape(0)), rows, depth):
            return False
        return _sliceable(node.input_value(0), rows, depth, leaves)
    if kind == "Convert" or kind in _ARITHMETIC:
        return all(_sliceable(node.input_value(i), rows, depth, leaves) for i in range(node.get_input_size()))
    return False


def _step_bits(constant) -> int:
    """The bits of one step of a constant's axis 1."""
    return int(np.prod(list(constant.get_output_shape(0))[2:], dtype=np.int64)) * constant.get_element_type().bitwidth


def _share(shape: list[int], depth: int, chunk: tuple[int, int]) -> list[int]:
    """``shape`` (depth on its axis 1) for the input columns of ``chunk``."""
    return [shape[0], shape[1] * (chunk[1] - chunk[0]) // depth, *shape[2:]]


def _slice(constant, depth: int, start: int, end: int) -> np.ndarray:
    """The bytes of ``constant`` for input columns ``[start, end)`` (along its axis 1)."""
    shape = list(constant.get_output_shape(0))
    per, bits = depth // shape[1], _step_bits(constant)  # columns and bits per step of axis 1
    data = np.ascontiguousarray(constant.get_data()).view(np.uint8).reshape(shape[0], -1)  # sub-byte types packed
    return data[:, start // per * bits // 8: end // per * bits // 8]


def _rebuilt(output: ov.Output, depth: int, chunk: tuple[int, int], sliced: dict) -> ov.Output:
    """The weight behind ``output`` for the input columns of ``chunk``, its sliced constants from
    ``sliced`` (by name; the others are the same for every column)."""
    node = output.get_node()
    kind = node.get_type_name()
    if kind == "Constant":
        return sliced.get(node.get_name(), output)
    if kind == "Reshape":
        target = ops.constant(np.array(_share(list(node.get_output_shape(0)), depth, chunk), dtype=np.int64))
        return ops.reshape(_rebuilt(node.input_value(0), depth, chunk, sliced), target, False).output(0)
    inputs = [_rebuilt(node.input_value(i), depth, chunk, sliced) for i in range(node.get_input_size())]
    if kind == "Convert":
        return ops.convert(inputs[0], node.get_output_element_type(0)).output(0)
    return _ARITHMETIC[kind](*inputs).output(0)
