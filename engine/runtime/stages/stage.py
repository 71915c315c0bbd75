"""One compiled shard and its inference requests: the unit a worker or the coordinator runs.

Each stream (one user's sequence) has its own InferRequest and therefore its own KV cache.  Only
openvino and numpy are needed here; a worker laptop serves a shard with nothing else.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import openvino as ov

from engine.config import paths
from engine.errors import ShardError
from engine.hostcpu import NONE, int8_dot
from engine.manifest import BEAM_IDX, INT4_GROUP, MODEL_XML, Manifest, load_manifest
from engine import kernels
from engine.kernels.swap import int8_head, swap_in
from engine.pinned import pin_libraries
from engine.runtime.interfaces import Stage
from engine.transport import mesh as tensor_parallel
from engine.runtime.stages.rewrite import LOGITS_TO_KEEP, fuse_sibling_matmuls, keep_last_logits, split_deep_matmuls
from engine.runtime.stages.turns import NO_TURNS
from engine.tuning import SHAPE_CACHE

_core: ov.Core | None = None
_devices: tuple[str, ...] = ()

# Compile settings per correctness mode.  "exact": speculative decoding must give the very tokens of
# plain greedy decoding.  A K+1-position verify matches K+1 single steps only with f32 compute, an
# f32 KV cache and no dynamic activation quantization (at the bf16/u8 defaults the logits differ
# enough that near-ties flip).  "fast" keeps the device defaults below.
MODES = {
    "fast": {},
    "exact": {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"},
}

# How each mode drops rejected drafts.  In f32 a forward over a cache with masked holes differs from
# one over the trimmed cache by an ulp (the attention reduces over more slots), so "exact" trims.
REWIND = {"fast": "mask", "exact": "trim"}

# What each device family compiles with unless the mode or the user says otherwise.  On CPU an INT4
# model with the f32 hint runs its matmuls on dynamically int8-quantized activations, faster for a
# decode step and far faster for a verify than the bf16 default (on CPUs with AMX/avx512_bf16), which
# decompresses the weights to bf16 instead (docs/benchmarks.md, "CPU precision").
#
# Every new input shape of a dynamic-shape model leaves compiled kernels in two caches: the CPU
# plugin's per-model runtime cache (CPU_RUNTIME_CACHE_CAPACITY, 5,000 entries by default) and
# oneDNN's process-wide primitive cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY, 1,024).  A paged stage
# packing many streams sees a new shape almost every round, so both keep ``SHAPE_CACHE`` entries.
DEVICE_DEFAULTS = {"CPU": {"INFERENCE_PRECISION_HINT": "f32", "CPU_RUNTIME_CACHE_CAPACITY": str(SHAPE_CACHE)}}


def family(device: str) -> str:
    """The device family: "GPU" for GPU.1, "CPU" for cpu."""
    return device.split(".")[0].upper()


def shard_defaults(device: str, manifest: Manifest | None) -> dict:
    """What a CPU compile of this shard sets by default.  The f32 hint's int8 path quantizes the
    activations in groups of DYNAMIC_QUANTIZATION_GROUP_SIZE columns (32 unless set).  Where every
    matrix is INT4 in groups of 128, activation groups of 128 line up with the weight groups, which
    makes decode and the first token faster; where the groups do not line up (SmolLM2's 576 columns
    take groups of 64; a GGUF's groups of 32) larger activation groups are slower, so those keep the
    default."""
    if manifest is None or family(device) != "CPU" or manifest.weights.split("-")[0] != "int4":
        return {}
    spec = manifest.spec
    columns = (spec.hidden_size, spec.intermediate_size, spec.num_heads * spec.head_dim)
    if any(c % INT4_GROUP for c in columns):
        return {}
    return {"DYNAMIC_QUANTIZATION_GROUP_SIZE": str(INT4_GROUP)}


# At the f32 hint the CPU keeps its KV cache in u8 unless told otherwise.  f16 decodes a little faster
# at short and long contexts alike, and keeps answers the u8 cache changes (a paged SmolLM2-135M's
# "Paris" among them, LLMPipeline's too on the same export).
CPU_F32_CACHE = {"KV_CACHE_PRECISION": "f16"}
CACHE_KEYS = ("KV_CACHE_PRECISION", "KEY_CACHE_PRECISION", "VALUE_CACHE_PRECISION")


def device_config(device: str, config: dict | None = None, manifest: Manifest | None = None) -> dict:
    """The device family's defaults, then the shard's (``shard_defaults``), under ``config``; on CPU
    at the f32 hint an f16 KV cache unless a cache precision is given."""
    merged = {**DEVICE_DEFAULTS.get(family(device), {}), **shard_defaults(device, manifest), **(config or {})}
    if (family(device) == "CPU" and merged.get("INFERENCE_PRECISION_HINT") == "f32"
            and not any(key in merged for key in CACHE_KEYS)):
        merged.update(CPU_F32_CACHE)
    return merged


def compile_config(mode: str = "fast", precision: str | None = None) -> dict:
    if mode not in MODES:
        raise ShardError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    config = dict(MODES[mode])
    if precision:
        config["INFERENCE_PRECISION_HINT"] = precision
    return config


def core() -> ov.Core:
    """The process-wide OpenVINO core with its plugins loaded (one per stage would reload them)."""
    global _core, _devices
    if _core is None:
        # read by oneDNN at its first primitive, so before any compile (a user's setting stays)
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(SHAPE_CACHE))
        pin_libraries()
        _core = ov.Core()
        tensor_parallel.register(_core)
        # Loading the device plugins forks a short-lived child process; a fork while other threads
        # hold locks can leave that child hung forever.  Load them now, which callers do before
        # they start threads (agent, worker, app), instead of at the first compile on some thread.
        _devices = tuple(_core.available_devices)
    return _core


def has_bf16(device: str = "CPU") -> bool:
    """Whether ``device`` computes in bf16 when asked to: a CPU without AVX-512 bf16 or AMX quietly
    runs an ``INFERENCE_PRECISION_HINT`` of bf16 in f32."""
    return family(device) == "CPU" and "BF16" in core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


def devices() -> tuple[str, ...]:
    """This machine's OpenVINO devices, listed once per process.  Every listing makes OpenVINO try
    each plugin again, and a plugin whose driver is missing (the GPU's, without OpenCL) is mapped and
    unmapped each time; glibc 2.36 keeps thread-local storage bookkeeping wrong after enough of those,
    and a thread started later aborts the process ("Inconsistency detected by ld.so: dl-tls.c ...
    Assertion `listp != NULL' failed", exit status 127)."""
    core()
    return _devices


def read_for(folder: Path, device: str, config: dict | None = None) -> tuple[ov.Model, object]:
    """A shard's graph as ``device`` runs it best with the compile ``config``: on CPU each carried GGUF
    matrix in our kernels (or ggml's) where this process has them (``engine.kernels``), with the
    activations in int8, or in float where the config keeps them so (``exact``: our kernels' types
    only); a head carried from the GGUF that still runs the plugin's MatMul (on the other devices, or
    where the kernels are not) as INT8 rows; on CPU the MatMuls that
    share an input fused (``fuse_sibling_matmuls``; the same logits bit for bit), and, where the CPU
    multiplies compressed weights in float (no int8 dot products), MatMuls of a depth it runs slowly
    split (``split_deep_matmuls``).  Returns the graph and what its rewritten weights are mapped from: keep
    it while a model compiled from the graph lives."""
    model = core().read_model(str(Path(folder) / MODEL_XML))
    nodes = kernels.factory(core()) if family(device) == "CPU" else None
    if nodes is not None:
        float_x = (config or {}).get("DYNAMIC_QUANTIZATION_GROUP_SIZE") == "0"
        swap_in(model, nodes, kernels.kernel(), float_x)
    int8_head(model)  # the plugin's own MatMul runs a head carried from the GGUF faster as INT8 rows
    if family(device) != "CPU":
        return model, None
    spill = paths().cache  # on disk: a temporary folder may be memory (tmpfs)
    spill.mkdir(parents=True, exist_ok=True)
    mapped = [fuse_sibling_matmuls(model, str(spill))[1]]
    if int8_dot() == NONE:
        mapped.append(split_deep_matmuls(model, str(spill))[1])
    return model, [m for m in mapped if m is not None]


def missing_device(device: str) -> str | None:
    """Why ``device`` is not one of this machine's OpenVINO devices, or None if it is listed ("GPU"
    stands for GPU.0, GPU.1...; AUTO, HETERO:... and MULTI:... choose among them)."""
    available = devices()
    name = device.upper()
    if ":" in name or name == "AUTO" or name in available or name in {a.split(".")[0] for a in available} \
            or (name.endswith(".0") and name[:-2] in available):
        return None
    return f"this PC has no OpenVINO device {device}: it has {', '.join(available) or 'none'}"


class StageRunner(Stage):
    """A verified shard compiled for ``device``, with one stateful request per stream.

    By default the streams share one compiled model; ``isolate`` compiles one per stream (the paper's
    isolation choice), which costs a compile and the compiled model's working memory per stream."""

    packs = False  # one stream a forward; a rewind may mask slots out

    def __init__(self, folder: Path, device: str = "CPU", config: dict | None = None,
                 manifest: Manifest | None = None, isolate: bool = False, turns=None, mesh=None):
        """``turns``: the ``engine.runtime.stages.turns`` lock a CPU stage's inferences wait for (stages
        sharing this computer's cores); a GPU or NPU stage does not take turns.  ``mesh``: a
        tensor-parallel rank's connections to the other ranks (``engine.transport.mesh``)."""
        self.folder = Path(folder)
        self.manifest = manifest or load_manifest(self.folder)
        self.device = device
        self.isolate = isolate
        self.turns = turns if turns is not None and device.upper().startswith("CPU") else NO_TURNS
        self.config = device_config(device, config, self.manifest)  # as compiled
        self.compiles = 0
        self.mesh = mesh
        self._model, self._mapped = self._read()
        self.compiled = self._compile()
        self.first = self.manifest.first
        self.last = self.manifest.last
        self._input = "input_ids" if self.first else "hidden_states"
        self._output = self.compiled.output(0)
        self._beam = any(BEAM_IDX in port.get_names() for port in self.compiled.inputs)
        self._keep = any(LOGITS_TO_KEEP in port.get_names() for port in self.compiled.inputs)
        self._requests: dict[int, tuple[ov.InferRequest, dict]] = {}
        self.request(0)

    def _read(self) -> tuple[ov.Model, object]:
        """The graph every compile of this stage (one per stream when isolated) is made from."""
        try:
            model, mapped = read_for(self.folder, self.device, self.config)
        except RuntimeError as exc:
            raise ShardError(f"cannot read shard {self.folder}: {exc}") from exc
        if self.manifest.last:
            keep_last_logits(model)
        m = self.manifest
        if m.ranks > 1:
            if self.mesh is None or (self.mesh.rank, self.mesh.ranks) != (m.rank, m.ranks):
                have = "none" if self.mesh is None else f"rank {self.mesh.rank} of {self.mesh.ranks}"
                raise ShardError(f"shard {self.folder} is tensor-parallel rank {m.rank} of {m.ranks}: it runs "
                                 f"with a mesh of that rank (given {have})")
            tensor_parallel.bind(model, self.mesh)
        return model, mapped

    def _compile(self) -> ov.CompiledModel:
        self.compiles += 1
        try:
            return core().compile_model(self._model, self.device, self.config)
        except RuntimeError as exc:
            missing = missing_device(self.device)
            raise ShardError(missing or f"cannot compile shard {self.folder} on {self.device}: {exc}") from exc

    def request(self, stream: int) -> tuple[ov.InferRequest, dict]:
        entry = self._requests.get(stream)
        if entry is None:
            inputs = {"attention_mask": None, "position_ids": None}
            if self._beam:
                inputs[BEAM_IDX] = np.zeros(1, dtype=np.int32)  # identity reorder: batch 1, no beams
            compiled = self._compile() if self.isolate and self._requests else self.compiled
            entry = self._requests[stream] = (compiled.create_infer_request(), inputs)
        return entry

    @property
    def streams(self) -> list[int]:
        return list(self._requests)

    def reset(self, stream: int = 0) -> None:
        """Drops the stream's KV cache: its next forward starts a new sequence."""
        self.request(stream)[0].reset_state()

    def drop(self, stream: int) -> None:
        """Forgets a stream entirely (its request and cache memory)."""
        if stream:
            self._requests.pop(stream, None)
        else:
            self.reset(0)

    def keep(self, stream: int, slots: np.ndarray) -> None:
        """Keeps only these physical KV slots (in order) of every state: the physical rewind and the
        compaction of masked holes.  Sets copies: a state set from a view can corrupt a u8 cache."""
        request, _ = self.request(stream)
        contiguous = len(slots) == 0 or (slots[0] == 0 and slots[-1] == len(slots) - 1)
        for state in request.query_state():
            data = state.state.data
            kept = data[:, :, : len(slots)] if contiguous else np.take(data, slots, axis=2)
            state.state = ov.Tensor(np.ascontiguousarray(kept))

    def forward(self, x: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                stream: int = 0, last_only: bool = False) -> np.ndarray:
        """Runs one step. The result is a view of the request's output buffer, valid until its next call.
        ``last_only``: a last stage computes the logits of the final position alone."""
        request, inputs = self.request(stream)
        inputs[self._input] = x
        inputs["attention_mask"] = attention_mask
        inputs["position_ids"] = position_ids
        if self._keep:
            inputs[LOGITS_TO_KEEP] = np.array([1 if last_only else x.shape[1]], dtype=np.int64)
        with self.turns:
            request.infer(inputs, share_inputs=True, share_outputs=True)
        if self.mesh is not None:
            self.mesh.check()
        return request.get_tensor(self._output).data
