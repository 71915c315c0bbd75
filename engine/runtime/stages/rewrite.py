"""Compile-time rewrites of a shard's graph: what the runtime wants that the shard format need not carry.

``keep_last_logits`` gives a last stage a ``logits_to_keep`` input: the head projects only that many
final positions.  A prefill wants one row of logits, not a vocabulary-sized row per prompt token
(for a 1,000-token prompt on a 150k vocabulary that is most of a forward's work); a speculative
verify keeps all of its positions.  The shard on disk stays as exported, so LLMPipeline still
loads it.
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
