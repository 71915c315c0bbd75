"""A shard compiled with OpenVINO's paged attention: the new tokens of many streams in one forward.

The shard on disk is the usual stateful export.  At compile time ``paged_attention_transformation``
(the rewrite OpenVINO's own continuous batching applies) replaces every layer's stateful attention
with a PagedAttention op whose keys and values live in a pool of fixed-size blocks that this module
owns.  One forward then carries any number of streams, each a run of new tokens after its own
cached positions, packed along one token axis; each stream attends to its own blocks alone.  A
stream's cache is its list of blocks and a length, so a rewind is setting a shorter length: the
mask/trim choice of the stateful path does not arise.

With the ``exact`` settings a stream's greedy tokens are the same decoded alone, packed with others,
or on the stateful path (``tests/test_paged.py`` checks it).

On a CPU, where the matrices run in our kernels (``engine.kernels``: constants every compile shares;
the plugin's own matrices it would repack each time), the stage also compiles the graph with its
token axis fixed: at one row (one user's next token, one stream) at once, and at a count of rows up
to ``FIXED_ROWS`` once forwards of that many rows recur (several users' next tokens, a speculative
round), in the background while the dynamic graph runs them, up to ``FIXED_GRAPHS`` graphs.  A
forward of such a count runs its fixed graph over the same caches.  The CPU plugin then runs every
node but attention on static shapes, skipping the shape inference and memory planning that a dynamic
shape costs each node at each call (for our kernels' nodes, a copy of the node made and validated),
a large share of a small model's token (docs/benchmarks.md, "One row, static shapes" and "Fixed
graphs for recurring row counts").
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from engine.errors import ShardError
from engine.kernels import OP
from engine.kernels.swap import head_of
from engine.manifest import Manifest, load_manifest
from engine.runtime.interfaces import PackingStage
from engine.runtime.stages.packing import Part, as_part, check_parts
from engine.runtime.stages.stage import core, device_config, missing_device, read_for
from engine.runtime.stages.turns import NO_TURNS
from engine.limits import process_memory
from engine.tuning import FIXED_GRAPHS, FIXED_HEADROOM_MB, FIXED_ROWS, FIXED_ROWS_AFTER

HIDDEN_IN = "inputs_embeds"  # the name the transformation expects for a stage's non-token input
LOGITS_ROWS = "logits_rows"

log = logging.getLogger(__name__)


def _rename_hidden_input(model: ov.Model) -> None:
    for port in model.inputs:
        if "hidden_states" in port.get_names():
            port.get_tensor().set_names({HIDDEN_IN})
            port.get_node().set_friendly_name(HIDDEN_IN)


def _fixed(model: ov.Model, rows: int) -> ov.Model:
    """A copy of the paged graph whose token axis is fixed at ``rows``: with one row, one stream's one new
    token (its stream inputs fixed too); with more, any streams' (their inputs stay dynamic).  The
    block tables, the caches and the context length stay dynamic."""
    fixed = model.clone()
    first = {"input_ids": rows, HIDDEN_IN: rows, "position_ids": rows}  # their first axis
    if rows == 1:
        first.update({"past_lens": 1, LOGITS_ROWS: 1, "subsequence_begins": 2, "block_indices_begins": 2})
    shapes = {}
    for port in fixed.inputs:
        if port.get_any_name() in first:
            shapes[port] = ov.PartialShape([first[port.get_any_name()], *list(port.get_partial_shape())[1:]])
    fixed.reshape(shapes)
    return fixed


def _join_compiles() -> None:
    """Waits for the fixed graphs still compiling in the background: a process does not exit under them."""
    for thread in list(_COMPILING):
        thread.join()


_COMPILING: set[threading.Thread] = set()
atexit.register(_join_compiles)


def _slide_windows(model: ov.Model, manifest: Manifest) -> None:
    """Gives the PagedAttention op of each sliding-window layer its window: the transformation
    leaves 0 (attend to everything), as it does not see the window in the graph's own mask.  The
    op's window counts the token itself, as ours does (one more or one less changes the tokens)."""
    sliding = set(manifest.spec.sliding_layers)
    if not sliding:
        return
    for node in model.get_ops():
        if node.get_type_name() != "PagedAttentionExtension":
            continue
        cache = node.input_value(3).get_node().get_friendly_name()  # key_cache.N: this stage's Nth layer
        old = node.input_value(10).get_node()  # the op's sliding_window input
        if (not cache.startswith("key_cache.") or old.get_type_name() != "Constant"
                or old.get_output_element_type(0) != ov.Type.i32 or len(old.get_output_shape(0)) != 0):
            raise ShardError("this OpenVINO's PagedAttention op has no sliding-window input where fleetshard "
                             "expects it: serve this model on stateful stages (paged=False)")
        if manifest.layers[0] + int(cache[len("key_cache."):]) in sliding:
            window = ops.constant(np.array(manifest.spec.sliding_window, np.int32))
            node.input(10).replace_source_output(window.output(0))
    model.validate_nodes_and_infer_types()


def _gather_logits_rows(model: ov.Model) -> None:
    """The head projects only the rows named by a ``logits_rows`` input (one row per token after
    the transformation), so a 1,000-token prefill computes one row of logits, not a thousand."""
    head = head_of(model)
    if head is None:
        raise ShardError("the last stage's logits do not come from a MatMul: not a shard fleetshard exported")
    rows = ops.parameter(ov.PartialShape([-1]), ov.Type.i64, name=LOGITS_ROWS)
    rows.get_output_tensor(0).set_names({LOGITS_ROWS})
    picked = ops.gather(head.input_value(0), rows, ops.constant(np.array(0, dtype=np.int64)))
    head.input(0).replace_source_output(picked.output(0))
    model.add_parameters([rows])
    model.validate_nodes_and_infer_types()


class BlockPool:
    """Which cache blocks each stream holds; freed blocks are reused at once."""

    def __init__(self, blocks: int, block_size: int):
        self.block_size = block_size
        self.capacity = blocks
        self._free = list(range(blocks - 1, -1, -1))
        self.held: dict[int, list[int]] = {}
        self.length: dict[int, int] = {}

    def extra_blocks(self, stream: int, length: int) -> int:
        """How many more blocks ``stream`` needs to hold ``length`` positions (negative: it frees)."""
        return -(-length // self.block_size) - len(self.held.get(stream, ()))

    def grow(self, blocks: int) -> None:
        self._free[:0] = range(blocks - 1, self.capacity - 1, -1)
        self.capacity = blocks

    def resize(self, stream: int, length: int) -> list[int]:
        """Makes ``stream`` hold exactly the blocks ``length`` positions need; returns its blocks."""
        if self.extra_blocks(stream, length) > len(self._free):
            raise ShardError(f"the KV pool is full: {len(self.held)} streams hold "
                             f"{sum(self.length.values())} of {self.capacity * self.block_size} positions")
        held = self.held.setdefault(stream, [])
        self.length[stream] = length
        need = -(-length // self.block_size)
        while len(held) < need:
            held.append(self._free.pop())
        while len(held) > need:
            self._free.append(held.pop())
        return held

    def release(self, stream: int) -> None:
        self._free.extend(reversed(self.held.pop(stream, [])))
        self.length.pop(stream, None)

    @property
    def free_blocks(self) -> int:
        return len(self._free)


class PagedStage(PackingStage):
    """A verified shard compiled with paged attention for ``device``.  Its KV pool starts with room
    for ``kv_positions`` cached positions over all streams and doubles when a forward needs more,
    up to ``max_kv_positions`` (None: as far as memory goes)."""

    packs = True  # takes many streams' rows in one forward, rewinds by a shorter length

    def __init__(self, folder: Path, device: str = "CPU", config: dict | None = None,
                 manifest: Manifest | None = None, kv_positions: int = 4096, turns=None,
                 max_kv_positions: int | None = None, fixed_rows: bool | None = None):
        """``fixed_rows``: also compile graphs with a fixed token axis (the module's docstring); None: on a
        CPU where our kernels run the matrices."""
        from openvino._offline_transformations import paged_attention_transformation

        self.folder = Path(folder)
        self.manifest = manifest or load_manifest(self.folder)
        self.device = device
        self.first, self.last = self.manifest.first, self.manifest.last
        self.turns = turns if turns is not None and device.upper().startswith("CPU") else NO_TURNS
        try:
            self.config = device_config(device, config, self.manifest)  # as compiled
            model, mapped = read_for(self.folder, device, self.config)
            _rename_hidden_input(model)
            paged_attention_transformation(model, False, False)
            _slide_windows(model, self.manifest)
            if self.last:
                _gather_logits_rows(model)
            self.compiled = core().compile_model(model, device, self.config)
            if fixed_rows is None:  # where the matrices are our kernels' constants, which every compile shares
                fixed_rows = (device.upper().startswith("CPU")
                              and any(op.get_type_name() == OP for op in model.get_ops()))
            # the graphs with a fixed token axis, by rows: one row's compiled now, others once they recur
            self._fixed = {1: self._compile(_fixed(model, 1))} if fixed_rows else {}
            self._model = model if fixed_rows else None  # what a later fixed graph is compiled from
            self._mapped = mapped  # the fused weights it reads
        except RuntimeError as exc:
            raise ShardError(missing_device(device) or f"cannot compile shard {self.folder} with paged "
                             f"attention on {device}: {exc}") from exc
        self.compiles = 1  # one compiled model serves every stream
        self._seen: Counter[int] = Counter()  # forwards of each count of rows without a fixed graph yet
        self._compiling: dict[int, threading.Thread] = {}
        self._request = self.compiled.create_infer_request()
        self._lock = threading.Lock()  # one request and one pool for all streams
        caches = [port for port in self.compiled.inputs if "_cache." in port.get_any_name()]
        # the value cache's third axis is the block size (a u8 key cache adds rows for its scales)
        value = next(port for port in caches if port.get_any_name().startswith("value_cache."))
        block_size = value.get_partial_shape()[2].get_length()
        self.pool = BlockPool(-(-kv_positions // block_size), block_size)
        self.max_blocks = -(-max_kv_positions // block_size) if max_kv_positions else None
        self._caches: dict[str, ov.Tensor] = {}
        for port in caches:
            shape = [self.pool.capacity] + [d.get_length() for d in list(port.get_partial_shape())[1:]]
            self._caches[port.get_any_name()] = ov.Tensor(port.get_element_type(), shape)
        for name, tensor in self._caches.items():
            for request in self._requests:
                request.set_tensor(name, tensor)
        self.last_request = self._request  # the request of the last forward (its counters, for a profile)
        self._input = "input_ids" if self.first else HIDDEN_IN

    @property
    def _requests(self) -> list[ov.InferRequest]:
        return [self._request, *self._fixed.values()]

    def _compile(self, model: ov.Model) -> ov.InferRequest:
        return core().compile_model(model, self.device, self.config).create_infer_request()

    @property
    def fixed_rows(self) -> list[int]:
        """The counts of rows that run a graph of their own (the module's docstring)."""
        return sorted(self._fixed)

    def fix_rows(self, rows: int, wait: bool = True) -> None:
        """Compiles the graph whose token axis is fixed at ``rows`` (in the background unless ``wait``);
        a forward of that many rows runs it from when it is ready.  Only where the stage has fixed graphs."""
        if self._model is None or rows in self._fixed:
            return
        thread = self._compiling.get(rows)
        if thread is None:
            thread = threading.Thread(target=self._add_fixed, args=(rows,), name=f"fixed graph of {rows} rows",
                                      daemon=True)
            self._compiling[rows] = thread
            _COMPILING.add(thread)
            thread.start()
        if wait:
            thread.join()

    def _add_fixed(self, rows: int) -> None:
        try:
            request = self._compile(_fixed(self._model, rows))
        except RuntimeError as exc:  # the dynamic graph keeps running this count
            log.warning("stage %s: the graph of %d rows did not compile: %s", self.folder, rows, exc)
            return
        finally:
            _COMPILING.discard(threading.current_thread())
        with self._lock:  # between forwards: the caches are the ones they use now
            for name, tensor in self._caches.items():
                request.set_tensor(name, tensor)
            self._fixed[rows] = request

    @property
    def kv_bytes(self) -> int:
        return sum(tensor.byte_size for tensor in self._caches.values())

    def _grow(self, blocks: int) -> None:
        """Moves every cache into tensors of ``blocks`` blocks (the held blocks keep their ids)."""
        old = self.pool.capacity
        for name, tensor in self._caches.items():
            bigger = ov.Tensor(tensor.get_element_type(), [blocks, *list(tensor.shape)[1:]])
            bigger.data[:old] = tensor.data
            self._caches[name] = bigger
            for request in self._requests:
                request.set_tensor(name, bigger)
        self.pool.grow(blocks)

    @property
    def streams(self) -> list[int]:
        return list(self.pool.held)

    def length(self, stream: int) -> int:
        return self.pool.length.get(stream, 0)

    def reset(self, stream: int = 0) -> None:
        """Forgets a stream: its blocks go back to the pool."""
        self.pool.release(stream)

    def keep(self, stream: int, slots: np.ndarray) -> None:
        """The stateful stage's rewind, for a paged one: only a prefix can be kept, and keeping it
        is just a shorter length."""
        if len(slots) and not (slots[0] == 0 and slots[-1] == len(slots) - 1 and len(slots) <= self.length(stream)):
            raise ShardError("a paged stage keeps a prefix of a stream's positions only (rewind by trimming)")
        self.pool.resize(stream, len(slots))

    def forward(self, x: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                stream: int = 0, last_only: bool = False) -> np.ndarray:
        """The stateful stage's one-stream step, for a paged one: ``x`` ``[1, q(, hidden)]`` follows
        the stream's cached positions, which the mask (``[1, cached + q]``) must cover without holes.
        Returns logits ``[1, kept, vocab]`` or hidden states ``[1, q, hidden]``."""
        part = as_part(x, attention_mask, position_ids, stream, self.length(stream), not last_only)
        return self.forward_parts([part])[0][None]

    def forward_parts(self, parts: list[Part]) -> list[np.ndarray]:
        """One forward over every part; per part, its logits ``[keep, vocab]`` (last stage) or its
        hidden states ``[q, hidden]``.  The results are copies."""
        with self._lock:
            return self._forward_parts(parts)

    def _count(self, rows: int) -> None:
        """Counts a forward of ``rows`` run by the dynamic graph; compiles its fixed graph once they recur,
        while the stage has fewer than ``FIXED_GRAPHS`` (each holds its own working memory, and the
        CPU plugin's own copy of any matrix it repacks, such as an INT8 head) and the process has
        ``FIXED_HEADROOM_MB`` of memory to spare; short of it, the count is asked again as often."""
        # the one-row graph is compiled at once; every other one has its compile thread
        if (self._model is None or rows > FIXED_ROWS or rows in self._compiling
                or 1 + len(self._compiling) >= FIXED_GRAPHS):
            return
        self._seen[rows] += 1
        if self._seen[rows] % FIXED_ROWS_AFTER:
            return
        available = process_memory()[1]
        if available >= FIXED_HEADROOM_MB << 20:
            self.fix_rows(rows, wait=False)
        elif self._seen[rows] == FIXED_ROWS_AFTER:  # said once, asked again as often
            log.info("stage %s: no graph of %d rows while %d MB of memory are to spare", self.folder, rows,
                     available >> 20)

    def _forward_parts(self, parts: list[Part]) -> list[np.ndarray]:
        check_parts(parts, self.length)
        # checked before any stream changes, so a refused forward leaves every stream as it was
        short = sum(max(0, self.pool.extra_blocks(p.stream, p.start + len(p.x))) for p in parts) - self.pool.free_blocks
        if short > 0:
            blocks = max(2 * self.pool.capacity, self.pool.capacity + short)
            if self.max_blocks is not None:
                blocks = min(blocks, self.max_blocks)
            if blocks < self.pool.capacity + short:
                raise ShardError(f"the KV pool is full: this forward needs {short * self.pool.block_size} "
                                 f"positions more than the {self.max_blocks * self.pool.block_size} it may hold")
            self._grow(blocks)
        sizes = [len(p.x) for p in parts]
        blocks = [list(self.pool.resize(p.stream, p.start + len(p.x))) for p in parts]
        begins = np.cumsum([0] + sizes).astype(np.int32)
        inputs = {
            self._input: np.concatenate([p.x.reshape(len(p.x), -1) if not self.first else p.x.reshape(-1)
                                         for p in parts]),
            "position_ids": np.concatenate([np.arange(p.start, p.start + len(p.x)) if p.positions is None
                                            else p.positions for p in parts]).astype(np.int64),
            "past_lens": np.array([p.start for p in parts], dtype=np.int32),
            "subsequence_begins": begins,
            "block_indices": np.array([b for held in blocks for b in held], dtype=np.int32),
            "block_indices_begins": np.cumsum([0] + [len(held) for held in blocks]).astype(np.int32),
            "max_context_len": np.array(max(p.start + len(p.x) for p in parts), dtype=np.int32),
        }
        if self.last:
            inputs[LOGITS_ROWS] = np.concatenate([np.arange(end - p.keep, end) for p, end in zip(parts, begins[1:])])
        request = self._fixed.get(int(begins[-1]))
        if request is None:
            request = self._request
            self._count(int(begins[-1]))
        with self.turns:
            request.infer(inputs, share_inputs=True)
        self.last_request = request
        out = request.get_output_tensor(0).data.copy()
        if self.last:
            splits = np.cumsum([p.keep for p in parts])[:-1]
            return [rows[:, 0] for rows in np.split(out, splits)]
        return [rows[:, 0] for rows in np.split(out, begins[1:-1])]
