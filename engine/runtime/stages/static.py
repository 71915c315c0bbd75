"""A shard compiled with static shapes, for devices whose compiler wants them (the NPU).

The shard on disk is the usual stateful export.  At compile time the KV variables become inputs
and outputs again (``stateful_to_stateless_transformation``), every present output is cut to the
new rows only, and the attention mask the graph derives from ``attention_mask`` is replaced by an
additive ``attention_bias`` input ``[1, 1, rows, capacity + rows]`` that this module builds.  Then
every shape is fixed: ``rows`` new tokens a forward, a cache of ``slots`` streams of ``window``
positions each.

One forward carries the new tokens of several streams along the token axis (the paper's packed
multi-slot mode): each row sees its own stream's cache positions and the earlier rows of its own
stream, nothing else; unused rows are padding that sees itself.  A stream's window is a ring whose
first ``sinks`` positions stay pinned (attention sinks): once a stream holds more than ``window``
positions the oldest others are overwritten, so a long conversation keeps going with the sinks and
the most recent tokens.  Within its window a stream's output is the dynamic path's (``exact``
settings, ``tests/test_paged.py``).  Sliding-window layers take their own bias, which also hides
what lies a model's window or more behind each row.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from engine.errors import ShardError
from engine.manifest import Manifest, load_manifest
from engine.runtime.interfaces import PackingStage
from engine.runtime.stages.packing import Part, as_part, check_parts
from engine.runtime.stages.stage import core, device_config, missing_device, read_for
from engine.runtime.stages.turns import NO_TURNS

BIAS = "attention_bias"
SLIDING_BIAS = "attention_bias_sliding"
MASKED = np.float32(np.finfo(np.float32).min)


def static_model(model: ov.Model, rows: int, capacity: int,
                 sliding: frozenset[int] = frozenset()) -> tuple[ov.Model, list[tuple[str, str]]]:
    """The stateless, fixed-shape form of a stage's graph; returns it and its (past input, new
    rows output) name pairs.  The layers counted in ``sliding`` (this stage's own indices) take
    their mask from a second input, ``attention_bias_sliding``."""
    from openvino._offline_transformations import stateful_to_stateless_transformation

    stateful_to_stateless_transformation(model)
    # in graph order, which is layer order: each layer's attention needs the previous layer's output
    attentions = [n for n in model.get_ordered_ops() if n.get_type_name() == "ScaledDotProductAttention"]
    if not attentions or (sliding and max(sliding) >= len(attentions)):
        raise ShardError("the shard lacks the attention ops to give a static mask: not a shard fleetshard exported")
    biases = {}
    for name in (BIAS, SLIDING_BIAS) if sliding else (BIAS,):
        biases[name] = ops.parameter(ov.PartialShape([1, 1, rows, capacity + rows]), ov.Type.f32, name=name)
        biases[name].get_output_tensor(0).set_names({name})
    for layer, node in enumerate(attentions):
        node.input(3).replace_source_output(biases[SLIDING_BIAS if layer in sliding else BIAS].output(0))
    pairs = []
    params = {p.get_any_name(): p for p in model.inputs}
    for result in model.get_results():
        name = result.output(0).get_any_name()
        concat = result.input_value(0).get_node()
        if not name.startswith("output_restored.") or concat.get_type_name() != "Concat":
            continue
        new_rows = concat.input_value(1)
        concat.output(0).get_tensor().set_names(set())
        new_rows.get_tensor().set_names({name})
        result.input(0).replace_source_output(new_rows)  # the new rows only
        past = "input_restored." + name[len("output_restored."):]
        if past not in params:
            raise ShardError(f"the shard's cache output {name} has no matching input")
        pairs.append((past, name))
    kept = [p for p in model.get_parameters() if p.get_output_tensor(0).get_any_name() != "attention_mask"]
    model = ov.Model(model.get_results(), kept + list(biases.values()), model.get_friendly_name())
    shapes = {}
    for port in model.inputs:
        name, shape = port.get_any_name(), port.get_partial_shape()
        if name in biases:
            continue
        if name.startswith("input_restored."):
            shapes[name] = [1, shape[1].get_length(), capacity, shape[3].get_length()]
        elif shape.rank.get_length() == 3:  # hidden states
            shapes[name] = [1, rows, shape[2].get_length()]
        else:
            shapes[name] = [1, rows]
    model.reshape(shapes)
    if any(port.get_partial_shape().is_dynamic for port in model.inputs + model.outputs):
        raise ShardError("the shard does not become fully static: not a shard fleetshard exported")
    return model, pairs


class StaticStage(PackingStage):
    """A verified shard compiled with static shapes for ``device``: ``rows`` new tokens a forward,
    ``slots`` streams of ``window`` cached positions, the first ``sinks`` of each pinned.  When more
    streams join than it has slots it compiles again with twice as many, up to ``max_slots``."""

    packs = True  # takes many streams' rows in one forward, rewinds by a shorter length

    def __init__(self, folder: Path, device: str = "NPU", config: dict | None = None,
                 manifest: Manifest | None = None, *, rows: int = 16, slots: int = 4, window: int = 1024,
                 sinks: int = 4, max_slots: int = 64, turns=None):
        self.folder = Path(folder)
        self.manifest = manifest or load_manifest(self.folder)
        if not 0 <= sinks < window or rows < 1 or not 1 <= slots <= max_slots:
            raise ShardError(f"a static stage needs rows ≥ 1, 1 ≤ slots ≤ max_slots and sinks below the window "
                             f"(rows {rows}, slots {slots} of {max_slots}, window {window}, sinks {sinks})")
        spec = self.manifest.spec
        self.sliding = frozenset(i - self.manifest.layers[0] for i in spec.sliding_layers
                                 if self.manifest.layers[0] <= i < self.manifest.layers[1])
        self.slide = spec.sliding_window if self.sliding else 0
        if self.slide > window - sinks:
            raise ShardError(f"a static stage's ring ({window} positions, {sinks} sinks) must hold the model's "
                             f"{self.slide}-token sliding window")
        self.device, self.config = device, device_config(device, config, self.manifest)  # as compiled
        self.first, self.last = self.manifest.first, self.manifest.last
        self.rows, self.window, self.sinks, self.max_slots = rows, window, sinks, max_slots
        self.turns = turns if turns is not None and device.upper().startswith("CPU") else NO_TURNS
        self.slots, self.compiles, self._cache = 0, 0, {}
        self._free: list[int] = []
        self._compile(slots)
        self._lock = threading.Lock()
        self._slot: dict[int, int] = {}  # stream -> its window of the cache
        self._held: dict[int, np.ndarray] = {}  # stream -> the logical position each ring entry holds (-1: none)
        self._length: dict[int, int] = {}

    def _compile(self, slots: int) -> None:
        """(Re)compiles for ``slots`` stream windows; the cached windows so far keep their place."""
        capacity = slots * self.window
        try:
            graph, mapped = read_for(self.folder, self.device, self.config)
            model, self._pairs = static_model(graph, self.rows, capacity, self.sliding)
            self.compiled = core().compile_model(model, self.device, self.config)
            self._mapped = mapped  # the fused weights it reads, kept as long as it runs
        except RuntimeError as exc:
            raise ShardError(missing_device(self.device) or f"cannot compile shard {self.folder} with static "
                             f"shapes on {self.device}: {exc}") from exc
        self.compiles += 1
        self._request = self.compiled.create_infer_request()
        self._input = self.compiled.inputs[0].get_any_name()
        cache = {past: np.zeros(list(self.compiled.input(past).get_shape()), np.float32) for past, _ in self._pairs}
        for past, old in self._cache.items():
            cache[past][:, :, : old.shape[2]] = old
        self._cache = cache
        self._free = list(range(slots - 1, self.slots - 1, -1)) + self._free
        self.slots, self.capacity = slots, capacity

    @property
    def kv_bytes(self) -> int:
        return sum(a.nbytes for a in self._cache.values())

    @property
    def streams(self) -> list[int]:
        return list(self._slot)

    def length(self, stream: int) -> int:
        return self._length.get(stream, 0)

    def reset(self, stream: int = 0) -> None:
        """Forgets a stream: its window goes back to the free ones."""
        if stream in self._slot:
            self._free.append(self._slot.pop(stream))
            del self._held[stream], self._length[stream]

    def keep(self, stream: int, slots: np.ndarray) -> None:
        """Rewind: only a prefix of a stream's positions can be kept."""
        if len(slots) and not (slots[0] == 0 and slots[-1] == len(slots) - 1 and len(slots) <= self.length(stream)):
            raise ShardError("a static stage keeps a prefix of a stream's positions only (rewind by trimming)")
        self._truncate(stream, len(slots))

    def _truncate(self, stream: int, length: int) -> None:
        if stream in self._held:
            self._held[stream][self._held[stream] >= length] = -1
            self._length[stream] = length

    def _ring(self, p: int) -> int:
        """Where in its window a stream keeps its logical position ``p``."""
        return p if p < self.sinks else self.sinks + (p - self.sinks) % (self.window - self.sinks)

    def forward(self, x: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                stream: int = 0, last_only: bool = False) -> np.ndarray:
        """The stateful stage's one-stream step (see ``PagedStage.forward``)."""
        part = as_part(x, attention_mask, position_ids, stream, self.length(stream), not last_only)
        return self.forward_parts([part])[0][None]

    def forward_parts(self, parts: list[Part]) -> list[np.ndarray]:
        """The parts' rows in forwards of ``rows`` rows each; per part its logits ``[keep, vocab]``
        (last stage) or hidden states ``[q, hidden]``."""
        with self._lock:
            return self._forward_parts(parts)

    def _forward_parts(self, parts: list[Part]) -> list[np.ndarray]:
        check_parts(parts, self.length)
        joining = [p.stream for p in parts if p.stream not in self._slot]
        if len(joining) > len(self._free):
            # a recompile stalls every stream once, so the slots double rather than grow by one
            wanted = len(self._slot) + len(joining)
            if wanted > self.max_slots:
                raise ShardError(f"the static cache is full: {len(joining)} streams join {len(self._slot)} "
                                 f"and a static stage holds at most {self.max_slots}")
            self._compile(min(self.max_slots, max(wanted, 2 * self.slots)))
        for stream in joining:
            self._slot[stream] = self._free.pop()
            self._held[stream] = np.full(self.window, -1, np.int64)
            self._length[stream] = 0
        for p in parts:
            self._truncate(p.stream, p.start)
        # every row: (part index, logical position, rotary position)
        todo = [(i, p.start + j, int(p.start + j if p.positions is None else p.positions[j]))
                for i, p in enumerate(parts) for j in range(len(p.x))]
        outs: list[list[np.ndarray]] = [[] for _ in parts]
        for begin in range(0, len(todo), self.rows):
            chunk = todo[begin:begin + self.rows]
            for (i, _, _), row in zip(chunk, self._run(parts, chunk)):
                outs[i].append(row)
        results = [np.stack(rows) for rows in outs]
        return [r[-p.keep:] for r, p in zip(results, parts)] if self.last else results

    def _sliding_bias(self, bias: np.ndarray, parts: list[Part], chunk: list[tuple[int, int, int]],
                      positions: np.ndarray) -> np.ndarray:
        """``bias`` less every column whose logical position lies a window or more behind the row's
        position (what the decoder's sliding mask hides).  Padding rows (position 0) keep themselves."""
        cap = self.capacity
        logical = np.zeros(cap + self.rows, np.int64)  # of each column; masked columns do not matter
        for stream in {parts[i].stream for i, _, _ in chunk}:
            base = self._slot[stream] * self.window
            logical[base:base + self.window] = self._held[stream]
        logical[cap:cap + len(chunk)] = [p for _, p, _ in chunk]
        near = logical[None, :] > positions[:, None] - self.slide
        return np.where(near, bias[0, 0], MASKED)[None, None]

    def _run(self, parts: list[Part], chunk: list[tuple[int, int, int]]) -> np.ndarray:
        """One static forward over ``chunk``'s rows (padded); writes their keys and values into the
        rows' windows and returns one output row per chunk row."""
        n, cap = len(chunk), self.capacity
        x = np.zeros((1, self.rows) + parts[0].x.shape[1:], parts[0].x.dtype)
        positions = np.zeros((1, self.rows), np.int64)
        bias = np.full((1, 1, self.rows, cap + self.rows), MASKED, np.float32)
        first_in_chunk: dict[int, int] = {}
        for r, (i, p, rotary) in enumerate(chunk):
            part = parts[i]
            x[0, r] = part.x[p - part.start]
            positions[0, r] = rotary
            stream = part.stream
            held = self._held[stream]
            first_in_chunk.setdefault(stream, p)
            # the stream's cached positions before this chunk, within the ring's reach of p
            seen = (held >= 0) & (held < first_in_chunk[stream]) & ((held < self.sinks)
                                                                   | (held > p - (self.window - self.sinks)))
            base = self._slot[stream] * self.window
            bias[0, 0, r, base:base + self.window][seen] = 0.0
            # its own rows in this chunk, up to this one
            for r2, (i2, _, _) in enumerate(chunk[: r + 1]):
                if parts[i2].stream == stream:
                    bias[0, 0, r, cap + r2] = 0.0
        for r in range(n, self.rows):  # padding rows see only themselves
            bias[0, 0, r, cap + r] = 0.0
        inputs = {self._input: x, "position_ids": positions, BIAS: bias, **self._cache}
        if self.slide:
            inputs[SLIDING_BIAS] = self._sliding_bias(bias, parts, chunk, positions[0])
        with self.turns:
            self._request.infer(inputs, share_inputs=True)
        for past, present in self._pairs:
            new = self._request.get_tensor(present).data  # [1, kv_heads, rows, head_dim]
            for r, (i, p, _) in enumerate(chunk):
                stream = parts[i].stream
                self._cache[past][0, :, self._slot[stream] * self.window + self._ring(p)] = new[0, :, r]
        for i, p, _ in chunk:
            stream = parts[i].stream
            self._held[stream][self._ring(p)] = p
            self._length[stream] = max(self._length[stream], p + 1)
        return self._request.get_output_tensor(0).data[0, :n].copy()
