"""From a traced decoder stage to a stateful OpenVINO graph with the ``beam_idx`` cache-reorder pattern.

Steps: ``torch.jit.trace`` with real tensors, ``openvino.convert_model`` with every input and output
named explicitly, then our own make-stateful pass that turns each ``past``/``present`` pair into a
ReadValue/Assign variable whose initializer is a zero-length cache with the batch size of the
current input, and routes every ReadValue through ``Gather(state, beam_idx, axis=0)``.  The Gather
is an identity at run time (``beam_idx = [0]``) but it is the pattern the CPU and GPU plugins need
to fuse ReadValue -> Concat -> attention into their stateful SDPA kernels.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import torch
from openvino.op.util import Variable, VariableInfo

from engine.export.decoder import DecoderStage
from engine.export.gguf_weights import fingerprint, weight_constants
from engine.manifest import BEAM_IDX
from engine.pinned import pin_libraries
from engine.transport.mesh import AllReduce, all_gather


def io_names(stage: DecoderStage) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """Input names, output names and (past input, present output) pairs of the final stage interface."""
    inputs = ["input_ids" if stage.first else "hidden_states", "attention_mask", "position_ids"]
    outputs = ["logits" if stage.last else "output_hidden_states"]
    pairs = []
    for layer in range(stage.start, stage.end):
        for kind in ("key", "value"):
            pairs.append((f"past_key_values.{layer}.{kind}", f"present.{layer}.{kind}"))
    return inputs + [p for p, _ in pairs], outputs + [r for _, r in pairs], pairs


def example_inputs(stage: DecoderStage, seq: int = 3, past: int = 2) -> tuple[torch.Tensor, ...]:
    spec = stage.spec
    hidden = torch.randn(1, seq, spec.hidden_size)
    mask = torch.ones(1, past + seq, dtype=torch.int64)
    pos = torch.arange(past, past + seq)[None]
    kv = [torch.randn(1, stage.kv_heads, past, spec.head_dim) for _ in range(2 * (stage.end - stage.start))]
    return (hidden, mask, pos, *kv)


def convert_stage(stage: DecoderStage) -> ov.Model:
    """Trace and convert a stage's layers to a stateless IR with named, dynamically shaped ports.

    The traced graph takes and returns hidden states; ``attach_vocabulary`` then gives the first
    stage its ``input_ids`` and the last its ``logits``.
    """
    spec = stage.spec
    in_names, out_names, _ = io_names(stage)
    in_names[0], out_names[0] = "hidden_states", "output_hidden_states"
    example = example_inputs(stage)
    with torch.no_grad():
        traced = torch.jit.trace(stage.eval(), example, check_trace=False)
    kv_shape = ov.PartialShape([-1, stage.kv_heads, -1, spec.head_dim])
    shapes = [ov.PartialShape([-1, -1, spec.hidden_size]), ov.PartialShape([-1, -1]), ov.PartialShape([-1, -1])]
    shapes += [kv_shape] * (len(in_names) - 3)
    types = [ov.Type.f32, ov.Type.i64, ov.Type.i64] + [ov.Type.f32] * (len(in_names) - 3)
    pin_libraries()  # convert_model loads and unloads every frontend
    model = ov.convert_model(traced, example_input=example, input=list(zip(shapes, types)))
    for port, name in zip(model.inputs, in_names):
        # LLMPipeline's paged-attention conversion finds ``input_ids`` by the node's friendly name.
        port.get_node().set_friendly_name(name)
        port.get_tensor().set_names({name})
    for port, name in zip(model.outputs, out_names):
        port.get_tensor().set_names({name})
    if stage.ranks > 1:
        add_all_reduces(model, stage)
    return model


def add_all_reduces(model: ov.Model, stage: DecoderStage) -> None:
    """Puts an ``AllReduce`` after each layer's output projections (found by their weights' bytes),
    whose outputs on a tensor-parallel rank are partial sums."""
    wanted = {fingerprint(getattr(layer, part).detach().numpy()) for layer in stage.layers for part in ("o", "down")}
    found = 0
    for op, node in list(weight_constants(model)):
        if fingerprint(node.get_data()) not in wanted:
            continue
        targets = list(op.output(0).get_target_inputs())
        reduced = AllReduce(op.output(0))
        for target in targets:
            target.replace_source_output(reduced.output(0))
        found += 1
    if found != 2 * len(stage.layers):
        raise RuntimeError(f"found {found} output projections to reduce across ranks, expected {2 * len(stage.layers)}")


def attach_vocabulary(model: ov.Model, embed: ov.Output | None, head: ov.Output | None,
                      embed_scale: float | None = None, ranks: int = 1) -> ov.Model:
    """Gives a first stage ``input_ids -> Gather(embed)`` in place of its hidden-state input, and a
    last stage ``MatMul(hidden, head^T) -> logits`` in place of its hidden-state output.

    ``embed`` and ``head`` are f32 outputs of the vocabulary tables (``compress.vocab_table``); a
    tied single-stage model passes the same table twice.  ``embed_scale`` multiplies the looked-up
    embeddings (Gemma scales them by sqrt(hidden_size)).  With ``ranks`` > 1 ``head`` is this
    rank's share of the vocabulary, and an ``AllGather`` puts the ranks' logits side by side.
    """
    params = list(model.get_parameters())
    if embed is not None:
        hidden = params[0]
        ids = ops.parameter(ov.PartialShape([-1, -1]), ov.Type.i64, name="input_ids")
        ids.get_output_tensor(0).set_names({"input_ids"})
        gathered = ops.gather(embed, ids, ops.constant(0))
        if embed_scale is not None:
            gathered = ops.multiply(gathered, ops.constant(np.float32(embed_scale)))
        for target in list(hidden.output(0).get_target_inputs()):
            target.replace_source_output(gathered.output(0))
        params[0] = ids
    results = list(model.get_results())
    if head is not None:
        normed = results[0].input_value(0)
        logits = ops.matmul(normed, head, transpose_a=False, transpose_b=True)
        if ranks > 1:
            logits = all_gather(logits.output(0), ranks)
        results[0].input(0).replace_source_output(logits.output(0))
    rebuilt = ov.Model(results, params, model.get_friendly_name())
    if head is not None:
        rebuilt.outputs[0].get_tensor().set_names({"logits"})
    rebuilt.validate_nodes_and_infer_types()
    return rebuilt


def make_stateful(model: ov.Model, pairs: list[tuple[str, str]], batch_source: str, beam_idx: bool = True) -> ov.Model:
    """Fold each (past input, present output) pair into a variable read through the beam_idx Gather.

    ``beam_idx=False`` leaves the Gathers out: only the parity benchmark wants that, to show what
    the pattern is worth.
    """
    params = {p.get_output_tensor(0).get_any_name(): p for p in model.get_parameters()}
    results = {out.get_any_name(): out.get_node() for out in model.outputs}
    # A zero-length cache shaped [batch, kv_heads, 0, head_dim], batch taken from the current input,
    # so the first concat of a fresh request sees a proper empty tensor.
    batch = ops.gather(ops.shape_of(params[batch_source]), ops.constant([0]), ops.constant(0))
    beam = ops.parameter(ov.PartialShape([-1]), ov.Type.i32, name=BEAM_IDX) if beam_idx else None
    if beam is not None:
        beam.get_output_tensor(0).set_names({BEAM_IDX})
    sinks = []
    for past, present in pairs:
        param, result = params[past], results[present]
        pshape = param.get_output_partial_shape(0)
        init_shape = ops.concat(
            [batch, ops.constant(np.array([pshape[1].get_length(), 0, pshape[3].get_length()], dtype=np.int64))], 0
        )
        init = ops.broadcast(ops.constant(np.float32(0.0)), init_shape)
        info = VariableInfo()
        info.variable_id = past
        info.data_shape = pshape
        info.data_type = ov.Type.f32
        variable = Variable(info)
        state = ops.read_value(init, variable)
        source = ops.gather(state, beam, ops.constant(0)) if beam is not None else state
        for target in list(param.output(0).get_target_inputs()):
            target.replace_source_output(source.output(0))
        sinks.append(ops.assign(result.input_value(0).get_node(), variable))
        model.remove_result(result)
        model.remove_parameter(param)
    model.add_sinks(sinks)
    if beam is not None:
        model.add_parameters([beam])
    model.validate_nodes_and_infer_types()
    return model


def count_beam_gathers(model: ov.Model) -> int:
    """How many KV ReadValues flow through a Gather indexed by the beam_idx Parameter."""
    count = 0
    for node in model.get_ops():
        if node.get_type_name() != "Gather":
            continue
        src, idx = node.input_value(0).get_node(), node.input_value(1).get_node()
        if src.get_type_name() == "ReadValue" and idx.get_friendly_name() == BEAM_IDX:
            count += 1
    return count
