"""One compiled shard and its inference request: the unit a worker or the coordinator runs.

Only openvino and numpy are needed here; a worker laptop serves a shard with nothing else.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov

from engine.errors import ShardError
from engine.manifest import BEAM_IDX, MODEL_XML, Manifest, load_manifest

_core: ov.Core | None = None


def core() -> ov.Core:
    """The process-wide OpenVINO core (creating one per stage would reload the plugins)."""
    global _core
    if _core is None:
        _core = ov.Core()
    return _core


class StageRunner:
    """A verified shard compiled for ``device`` with one stateful request (one KV cache)."""

    def __init__(self, folder: Path, device: str = "CPU", config: dict | None = None,
                 manifest: Manifest | None = None):
        self.folder = Path(folder)
        self.manifest = manifest or load_manifest(self.folder)
        self.device = device
        try:
            self.compiled = core().compile_model(str(self.folder / MODEL_XML), device, config or {})
        except RuntimeError as exc:
            raise ShardError(f"cannot compile shard {self.folder} on {device}: {exc}") from exc
        self.request = self.compiled.create_infer_request()
        self.first = self.manifest.first
        self.last = self.manifest.last
        self._input = "input_ids" if self.first else "hidden_states"
        self._output = self.compiled.output(0)
        self._inputs = {"attention_mask": None, "position_ids": None}
        if any(BEAM_IDX in port.get_names() for port in self.compiled.inputs):
            self._inputs[BEAM_IDX] = np.zeros(1, dtype=np.int32)  # identity reorder: batch 1, no beams

    def reset(self) -> None:
        """Drops the KV cache: the next forward starts a new sequence."""
        self.request.reset_state()

    def forward(self, x: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """Runs one step. The result is a view of the request's output buffer, valid until the next call."""
        inputs = self._inputs
        inputs[self._input] = x
        inputs["attention_mask"] = attention_mask
        inputs["position_ids"] = position_ids
        self.request.infer(inputs, share_inputs=True, share_outputs=True)
        return self.request.get_tensor(self._output).data
