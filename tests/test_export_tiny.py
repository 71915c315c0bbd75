"""Export of tiny random Llama, Qwen2 and Gemma 3 models: per-stage numerics against Hugging Face, greedy
equality across 1/2/3-stage chains, the beam_idx pattern, INT4 constants that do not depend on the split,
and refusal of damaged shards."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
import torch

from engine.errors import ExportError, ShardError, SourceError
from engine.export.compress import INT4_ASYMMETRIC
from engine.export.exporter import plan_split
from engine.manifest import MODEL_XML, check_chain, load_manifest
from engine.runtime.decode.generate import Generator
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.stage import StageRunner, core
from engine.transport.wire import Flag

F32 = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
# Stage outputs against the Hugging Face forward of the same layers, all in f32: the graphs differ
# only in op order and fusions, so anything above this is a real mismatch.
TOLERANCE = 1e-4
ARCHS = ("llama", "qwen2", "gemma3")
IDS = np.array([[5, 17, 42, 101, 7, 250, 33, 64, 9]], dtype=np.int64)


def _hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_every_stage_matches_hf_forward_of_its_layers(arch, tiny_models, tiny_exports):
    model = _hf(tiny_models[arch])
    n = IDS.shape[1]
    with torch.no_grad():
        out = model(torch.from_numpy(IDS), output_hidden_states=True)
    hidden = [h.numpy() for h in out.hidden_states]
    mask, pos = np.ones((1, n), np.int64), np.arange(n)[None]
    for folder in tiny_exports[arch, "3"].folders:
        stage = StageRunner(folder, config=F32)
        start, end = stage.manifest.layers
        x = IDS if stage.first else hidden[start]
        got = stage.forward(x, mask, pos)
        want = out.logits.numpy() if stage.last else hidden[end]
        assert got.shape == want.shape
        assert np.abs(got - want).max() < TOLERANCE, f"{arch} stage {start}-{end}"


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_decode_step_matches_hf_full_forward(arch, tiny_models, tiny_exports):
    model = _hf(tiny_models[arch])
    chain = LocalChain(tiny_exports[arch, "2"].folders, config=F32)
    n = IDS.shape[1]
    chain.forward(IDS, np.ones((1, n), np.int64), np.arange(n)[None])
    step = chain.forward(np.array([[11]]), np.ones((1, n + 1), np.int64), np.array([[n]]), Flag.LOGITS).logits
    with torch.no_grad():
        want = model(torch.from_numpy(np.concatenate([IDS, [[11]]], axis=1))).logits[:, -1:].numpy()
    assert np.abs(step - want).max() < TOLERANCE


def test_a_prefill_projects_only_its_last_position_onto_the_vocabulary(tiny_exports):
    last = StageRunner(tiny_exports["qwen2", "1"].folders[0], config=F32)
    n = IDS.shape[1]
    mask, pos = np.ones((1, n), np.int64), np.arange(n)[None]
    every = last.forward(IDS, mask, pos).copy()
    last.reset()
    final = last.forward(IDS, mask, pos, last_only=True)
    assert every.shape[1] == n and final.shape[1] == 1
    assert np.abs(final[0, -1] - every[0, -1]).max() < TOLERANCE


def _hf_greedy(model, ids, steps):
    seq = torch.from_numpy(ids)
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    return seq[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_one_two_three_stage_chains_give_hf_greedy_tokens(arch, tiny_models, tiny_exports):
    want = _hf_greedy(_hf(tiny_models[arch]), IDS, 24)
    for label in ("1", "2", "3"):
        for paged in (False, True):
            chain = LocalChain(tiny_exports[arch, label].folders, config=F32, paged=paged)
            got = Generator(chain, max_length=128).generate(IDS, 24, ignore_eos=True).tokens
            assert got == want, f"{arch} {label}-stage {'paged' if paged else 'stateful'} chain"


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kv_state_flows_through_a_beam_idx_gather_and_fuses(arch, tiny_exports):
    from engine.export.graph import count_beam_gathers

    for folder in tiny_exports[arch, "3"].folders:
        manifest = load_manifest(folder)
        layers = manifest.layers[1] - manifest.layers[0]
        model = core().read_model(str(folder / MODEL_XML))
        assert [p.get_any_name() for p in model.inputs][1:] == ["attention_mask", "position_ids", "beam_idx"]
        assert count_beam_gathers(model) == 2 * layers
        assert len(model.get_sinks()) == 2 * layers
        runtime = core().compile_model(model, "CPU").get_runtime_model()
        fused = [op for op in runtime.get_ops()
                 if op.get_rt_info()["layerType"].astype(str) == "ScaledDotProductAttention"
                 and op.get_output_size() == 3]
        assert len(fused) == layers, "the CPU plugin did not fuse the stateful attention"


def test_manifest_describes_the_stage(tiny_exports):
    folders = tiny_exports["qwen2", "3"].folders
    manifests = [load_manifest(f) for f in folders]
    assert [m.role for m in manifests] == ["first", "middle", "last"]
    assert [tuple(m.layers) for m in manifests] == [(0, 1), (1, 3), (3, 4)]
    first = manifests[0]
    assert first.spec.arch == "qwen2" and first.spec.hidden_size == 64 and first.weights == "f32"
    assert first.inputs[0]["name"] == "input_ids" and manifests[1].inputs[0]["name"] == "hidden_states"
    assert manifests[-1].outputs[0]["name"] == "logits"
    assert first.states == ["past_key_values.0.key", "past_key_values.0.value"]
    assert "openvino_tokenizer.xml" in first.files and "openvino_tokenizer.xml" not in manifests[1].files
    assert first.eos_token_ids, "the first stage carries the stop tokens"
    check_chain(manifests)


def test_tampered_shard_is_refused(tiny_exports, tmp_path):
    src = tiny_exports["llama", "2"].folders[1]
    bad = tmp_path / "stage1"
    shutil.copytree(src, bad)
    data = bytearray((bad / "openvino_model.bin").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / "openvino_model.bin").write_bytes(bytes(data))
    with pytest.raises(ShardError, match="modified or corrupted"):
        load_manifest(bad)
    with pytest.raises(ShardError, match="modified or corrupted"):
        LocalChain([tiny_exports["llama", "2"].folders[0], bad])
    incomplete = tmp_path / "incomplete"
    shutil.copytree(src, incomplete)
    (incomplete / "openvino_model.xml").unlink()
    with pytest.raises(ShardError, match="openvino_model.xml is missing"):
        load_manifest(incomplete)


def test_chain_of_two_models_or_with_gaps_is_refused(tiny_exports):
    llama, qwen = tiny_exports["llama", "2"].folders, tiny_exports["qwen2", "2"].folders
    with pytest.raises(ShardError, match="another model"):
        LocalChain([llama[0], qwen[1]])
    with pytest.raises(ShardError, match="not contiguous"):
        LocalChain([tiny_exports["llama", "3"].folders[0], llama[1]])
    with pytest.raises(ShardError, match="hold layers 0-1, the model has 4 layers"):
        LocalChain([llama[0]])
    with pytest.raises(ShardError, match="does not exist"):
        LocalChain(["/nonexistent/shard"])


def test_export_reuses_a_complete_export(tiny_models, tiny_exports):
    from engine.export.exporter import export_model

    first = tiny_exports["llama", "2"]
    again = export_model(str(tiny_models["llama"]), stages=2, weights="f32", out=first.out)
    assert again.cached and again.folders == first.folders


def test_split_planning():
    assert plan_split(30, stages=2) == [(0, 15), (15, 30)]
    assert plan_split(30, split=[12]) == [(0, 12), (12, 30)]
    assert plan_split(10, stages=3) == [(0, 4), (4, 7), (7, 10)]
    assert plan_split(4, stages=4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    for bad in ({"stages": 0}, {"stages": 31}, {"split": [15, 10]}, {"split": [30]}, {"split": [0, 10]}):
        with pytest.raises(ExportError):
            plan_split(30, **bad)


def test_unsupported_architecture_is_named(tiny_models, tmp_path):
    import json

    from engine.models.checkpoint import HFCheckpoint

    folder = tmp_path / "gpt2"
    shutil.copytree(tiny_models["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SourceError, match="unsupported architecture 'gpt2'; supported: gemma3, llama, mistral, qwen2"):
        HFCheckpoint(folder)


@pytest.mark.parametrize("weights, layer_type", [("int4", ov.Type.u4 if INT4_ASYMMETRIC else ov.Type.i4),
                                                 ("int8", ov.Type.u8), ("fp16", ov.Type.f16)])
def test_compressed_exports_of_a_tiny_model_run(tiny_models, tmp_path, weights, layer_type):
    from engine.export.exporter import export_model

    result = export_model(str(tiny_models["qwen2"]), stages=2, weights=weights, out=tmp_path / weights)
    manifests = [load_manifest(f) for f in result.folders]
    assert all(m.weights == weights for m in manifests)
    assert all(s.peak_rss_mb > 0 for s in result.stages)
    for folder in result.folders:
        model = core().read_model(str(folder / MODEL_XML))
        # Every matrix-sized constant (the smallest is k: 32 x 64) is stored in the chosen format.
        big = {c.get_element_type() for c in model.get_ops() if c.get_type_name() == "Constant"
               and int(np.prod(c.get_output_shape(0))) >= 32 * 64}
        assert layer_type in big, f"{weights}: matrices stored as {big}"
        assert ov.Type.f32 not in big
    tokens = Generator(LocalChain(result.folders), max_length=64).generate(IDS, 8, ignore_eos=True).tokens
    assert len(tokens) == 8


def test_cancelled_export_leaves_nothing_half_done(tiny_models, tmp_path):
    import threading

    from engine.export.exporter import export_model

    cancel = threading.Event()
    steps = []

    def progress(p):
        steps.append((p.stage, p.step))
        if p.step == "convert":
            cancel.set()

    with pytest.raises(ExportError, match="cancelled during stage 0"):
        export_model(str(tiny_models["llama"]), stages=2, weights="f32", out=tmp_path / "c",
                     progress=progress, cancel=cancel)
    assert ("0", "convert") in [(str(s), n) for s, n in steps]
    assert not any(p.name.startswith("stage") and p.is_dir() for p in (tmp_path / "c").iterdir())


def test_int4_head_for_draft_models(tiny_models, tmp_path):
    """``head="int4"``: the last stage's vocabulary-sized matrix is INT4, a separate cache folder,
    and the shard still runs; it is refused with any other weight format."""
    from engine.errors import ExportError
    from engine.export.exporter import export_model

    plain = export_model(str(tiny_models["qwen2"]), stages=1, weights="int4", out=tmp_path / "int8head")
    small = export_model(str(tiny_models["qwen2"]), stages=1, weights="int4", head="int4", out=tmp_path / "int4head")

    def vocab_types(folder):
        model = core().read_model(str(folder / MODEL_XML))
        return {c.get_element_type() for c in model.get_ops() if c.get_type_name() == "Constant"
                and int(np.prod(c.get_output_shape(0))) == 384 * 64}  # vocab x hidden

    assert vocab_types(plain.folders[0]) == {ov.Type.u8}  # INT8 embedding and head
    assert vocab_types(small.folders[0]) == {ov.Type.u8, ov.Type.u4}  # INT8 embedding, INT4 head
    assert load_manifest(small.folders[0]).export["head"] == "int4"
    tokens = Generator(LocalChain(small.folders), max_length=64).generate(IDS, 8, ignore_eos=True).tokens
    assert len(tokens) == 8
    with pytest.raises(ExportError, match="INT4 head goes with --weights int4"):
        export_model(str(tiny_models["qwen2"]), stages=1, weights="int8", head="int4", out=tmp_path / "x")


def test_int4_shards_quantize_activations_in_the_weights_groups(tiny_exports):
    """An INT4 shard whose matrices all take groups of 128 compiles with activation groups of 128 on
    CPU; any other shard, another device family or the exact mode keeps its own setting.  The KV
    cache is f16 on CPU but in the exact mode."""
    from engine.runtime.stages.stage import INT4_GROUP, compile_config, shard_defaults

    folder = tiny_exports["qwen2", "1"].folders[0]
    tiny = load_manifest(folder)
    wide = dataclasses.replace(tiny.spec, hidden_size=2 * INT4_GROUP, intermediate_size=6 * INT4_GROUP)
    heads = tiny.spec.num_heads * tiny.spec.head_dim
    assert heads % INT4_GROUP, "the tiny model's attention width must not be a multiple of the group"
    wide = dataclasses.replace(wide, head_dim=2 * INT4_GROUP // tiny.spec.num_heads)
    int4 = dataclasses.replace(tiny, weights="int4-awq", spec=wide)
    assert shard_defaults("CPU", int4) == {"DYNAMIC_QUANTIZATION_GROUP_SIZE": str(INT4_GROUP)}
    assert shard_defaults("GPU.1", int4) == {}
    assert shard_defaults("CPU", dataclasses.replace(int4, weights="gguf")) == {}
    assert shard_defaults("CPU", dataclasses.replace(int4, spec=tiny.spec)) == {}  # SmolLM2's 576 columns alike
    grouped = StageRunner(folder, manifest=int4)
    assert grouped.compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE") == INT4_GROUP
    assert grouped.compiled.get_property("KV_CACHE_PRECISION") == ov.Type.f16  # the CPU's own default: u8
    exact = StageRunner(folder, manifest=int4, config=compile_config("exact"))
    assert exact.compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE") == 0
    assert exact.compiled.get_property("KV_CACHE_PRECISION") == ov.Type.f32


def test_int4_head_codes_keep_the_table_closer_than_plain_ranges():
    """The INT4 head's codes decode within their groups' ranges, and the searched ranges leave less
    error than each group's plain min..max (and than symmetric codes, the layers' kind)."""
    from engine.export.compress import int4_head_codes

    table = np.random.default_rng(0).standard_t(4, (300, 256)).astype(np.float16)  # heavy tails, as a head's
    codes, zero, scale = int4_head_codes(table, 128)
    assert codes.max() <= 15 and zero.max() <= 15 and scale.dtype == np.float16
    x = table.astype(np.float32).reshape(300, 2, 128)
    decoded = (codes.astype(np.float32) - zero) * scale.astype(np.float32)

    def error(q):
        return float(((q - x) ** 2).sum())

    lo, hi = np.minimum(x.min(2, keepdims=True), 0), np.maximum(x.max(2, keepdims=True), 0)
    s = (hi - lo) / 15
    z = np.rint(-lo / s)
    plain = (np.clip(np.rint(x / s) + z, 0, 15) - z) * s
    s = np.abs(x).max(2, keepdims=True) / 7
    symmetric = np.clip(np.rint(x / s), -8, 7) * s
    assert error(decoded) < 0.95 * error(plain) and error(decoded) < error(symmetric)


def test_int4_matmuls_sharing_an_input_run_as_one_with_the_same_logits(tiny_models, tmp_path):
    """q, k, v (and gate, up) of an INT4 shard run as one stacked MatMul on CPU; the logits are
    those of the graph as exported, bit for bit."""
    from engine.export.exporter import export_model
    from engine.runtime.stages.rewrite import fuse_sibling_matmuls, keep_last_logits
    from engine.runtime.stages.stage import compile_config

    folder = export_model(str(tiny_models["qwen2"]), stages=1, weights="int4", out=tmp_path / "int4").folders[0]
    model = core().read_model(str(folder / MODEL_XML))
    spec = load_manifest(folder).spec
    spill = tmp_path / "spill"
    spill.mkdir()
    fused, mapped = fuse_sibling_matmuls(model, str(spill))
    assert fused == spec.num_layers * 3  # q+k+v -> 1 and gate+up -> 1, each layer
    # the stacks are pages of an unlinked file, which the kernel may drop under a memory cap
    assert any(line.endswith(" (deleted)") and f"{spill}/" in line
               for line in Path("/proc/self/maps").read_text().splitlines()), "stacked in anonymous memory"
    assert not list(spill.iterdir()) and len(mapped) > 0
    assert fuse_sibling_matmuls(model)[0] == 0  # what is fused stays fused

    plain = core().read_model(str(folder / MODEL_XML))
    keep_last_logits(plain)
    compiled = core().compile_model(plain, "CPU", compile_config("exact"))
    exported = compiled.create_infer_request()
    stage = StageRunner(folder, config=compile_config("exact"))

    def matmuls(model) -> int:
        return sum(op.get_rt_info()["layerType"].astype(str).startswith("FullyConnected")
                   for op in model.get_runtime_model().get_ops())

    def elementwise(model) -> int:
        return sum(op.get_rt_info()["layerType"].astype(str) == "Eltwise" for op in model.get_runtime_model().get_ops())

    assert matmuls(stage.compiled) == matmuls(compiled) - spec.num_layers * 3
    # q, k, v biases still folded into the MatMul: the one element-wise op more a layer is the gate's
    # activation, which a MatMul of gate and up cannot take as its own
    assert elementwise(stage.compiled) == elementwise(compiled) + spec.num_layers
    n = IDS.shape[1]
    mask, positions = np.ones((1, n), np.int64), np.arange(n)[None]
    want = exported.infer({"input_ids": IDS, "attention_mask": mask, "position_ids": positions,
                           "beam_idx": np.zeros(1, np.int32), "logits_to_keep": np.array([n])})[0]
    got = stage.forward(IDS, mask, positions)
    assert np.array_equal(got, want)


def _compressed_matmul(rows: int, depth: int, layout: str) -> ov.Model:
    """``x @ W.T`` with W as the exports write it: ``q6`` a Q6_K-like u6 matrix whose group scales are
    int8 codes under an f16 factor per 256 columns, ``i4`` INT4 codes less u4 zero points in groups
    of 32, ``row`` int8 codes with one scale per row."""
    rng = np.random.default_rng(depth)
    x = ov.op.Parameter(ov.Type.f32, ov.PartialShape([1, -1, depth]))
    if layout == "q6":
        codes = ov.opset13.convert(ov.opset13.constant(rng.integers(0, 64, (rows, depth // 16, 16)).astype(np.uint8),
                                                       dtype=ov.Type.u6), ov.Type.i8)
        centered = ov.opset13.convert(ov.opset13.add(codes, ov.opset13.constant(np.int8(-32))), ov.Type.f32)
        steps = ov.opset13.multiply(ov.opset13.convert(ov.opset13.constant(
            rng.integers(-127, 128, (rows, depth // 256, 16)).astype(np.int8)), ov.Type.f32),
            ov.opset13.convert(ov.opset13.constant(rng.random((rows, depth // 256, 1)).astype(np.float16)),
                               ov.Type.f32))
        scale = ov.opset13.reshape(steps, ov.opset13.constant(np.array([rows, depth // 16, 1])), False)
    elif layout == "i4":
        codes = ov.opset13.subtract(ov.opset13.convert(ov.opset13.constant(
            rng.integers(0, 16, (rows, depth // 32, 32)).astype(np.uint8), dtype=ov.Type.u4), ov.Type.f32),
            ov.opset13.convert(ov.opset13.constant(rng.integers(0, 16, (rows, depth // 32, 1)).astype(np.uint8),
                                                   dtype=ov.Type.u4), ov.Type.f32))
        centered, scale = codes, ov.opset13.constant(rng.random((rows, depth // 32, 1)).astype(np.float32) / 50)
    else:
        centered = ov.opset13.convert(ov.opset13.constant(rng.integers(-127, 128, (rows, 1, depth)).astype(np.int8)),
                                      ov.Type.f32)
        scale = ov.opset13.constant(rng.random((rows, 1, 1)).astype(np.float32) / 100)
    weight = ov.opset13.reshape(ov.opset13.multiply(centered, scale), ov.opset13.constant(np.array([rows, depth])),
                                False)
    return ov.Model([ov.opset13.matmul(x, weight, False, True)], [x])


@pytest.mark.parametrize("depth, layout, chunks", [(4352, "q6", 2), (8192, "i4", 2), (4864, "i4", 2),
                                                   (4096, "q6", 1), (8960, "q6", 1), (4352, "row", 1)])
def test_a_matmul_the_cpu_runs_slowly_at_its_depth_runs_in_chunks_with_the_same_result(tmp_path, depth, layout,
                                                                                       chunks):
    """A compressed MatMul of 4096 < depth <= 8192 input columns becomes MatMuls over chunks of its
    codes and scales, summed; others (and a weight whose groups span every column) stay whole."""
    from engine.runtime.stages.rewrite import split_deep_matmuls
    from engine.runtime.stages.stage import compile_config

    model = _compressed_matmul(64, depth, layout)
    want = core().compile_model(model, "CPU", compile_config("exact")).create_infer_request()
    split, mapped = split_deep_matmuls(model, str(tmp_path))
    assert split == (chunks > 1)
    assert sum(op.get_type_name() == "MatMul" for op in model.get_ordered_ops()) == chunks
    widths = [op.get_output_partial_shape(0)[1].get_length() for op in model.get_ordered_ops()
              if op.get_type_name() == "Reshape" and op.get_output_partial_shape(0).rank.get_length() == 2]
    assert sum(widths) == depth and max(widths) <= (4096 if chunks > 1 else depth)
    got = core().compile_model(model, "CPU", compile_config("exact")).create_infer_request()
    x = np.random.default_rng(1).standard_normal((1, 5, depth)).astype(np.float32)
    a, b = want.infer([x])[0], got.infer([x])[0]
    assert np.abs(a).max() > 1 and np.allclose(a, b, rtol=1e-5, atol=1e-4 * np.abs(a).max())


def _layer_constants(folder: Path, first_layer: int) -> dict[tuple[int, str], tuple[ov.Type, np.ndarray]]:
    """Every compressed layer constant of a stage (codes, zero points, scales) by (global layer,
    name): the graph names a stage's layers from 0."""
    import re

    found = {}
    for op in core().read_model(str(folder / MODEL_XML)).get_ops():
        name = re.fullmatch(r"self\.layers\.(\d+)\.(.+)", op.get_friendly_name())
        if op.get_type_name() == "Constant" and name:
            found[first_layer + int(name[1]), name[2]] = (op.get_output_element_type(0), op.get_data().copy())
    return found


@pytest.mark.parametrize("asymmetric", [False, True])
def test_a_layer_compresses_to_the_same_int4_constants_whatever_the_split(tiny_models, tmp_path, monkeypatch,
                                                                          asymmetric):
    """Each layer's INT4 codes, zero points and scales are the same whichever stage it lands in (the
    2-stage and 1-stage exports of a model must decode alike).  The stages export in this process so
    that the symmetric/asymmetric switch reaches NNCF."""
    from engine.export import compress
    from engine.export.exporter import export_stage
    from engine.models.catalog import resolve_source

    monkeypatch.setattr(compress, "INT4_ASYMMETRIC", asymmetric)
    source = resolve_source(str(tiny_models["llama"]))
    layers = {}
    for label, ranges in (("one", [(0, 4)]), ("two", [(0, 1), (1, 4)])):
        layers[label] = {}
        for index, (start, end) in enumerate(ranges):
            folder = tmp_path / label / f"stage{index}"
            folder.parent.mkdir(exist_ok=True)
            job = dict(kind=source.kind, path=str(source.path), name="tiny", fingerprint=source.fingerprint,
                       start=start, end=end, index=index, count=len(ranges), weights="int4", folder=str(folder))
            export_stage(job, lambda progress: None)
            layers[label].update(_layer_constants(folder, start))
    one, two = layers["one"], layers["two"]
    assert one.keys() == two.keys()
    differ = [key for key in one if one[key][0] != two[key][0] or not np.array_equal(one[key][1], two[key][1])]
    assert not differ, f"constants that depend on the split: {differ}"
    kinds = {kind for kind, _ in one.values()}
    assert kinds == ({ov.Type.u4, ov.Type.f16} if asymmetric else {ov.Type.i4, ov.Type.f16})
    assert any(name.endswith("zero_point") for _, name in one) == asymmetric


@pytest.mark.skipif(sys.platform != "linux", reason="the glibc unload hazard engine.pinned avoids is Linux's")
def test_libraries_openvino_would_unload_stay_mapped(tiny_exports):
    """A tokenizer opened and closed and a shard read leave openvino-tokenizers' extension and the
    frontends mapped (engine/pinned.py says why)."""
    folder = tiny_exports["llama", "1"].folders[0]
    script = ("import gc, sys\n"
              "from engine.runtime.decode.tokenizer import ChatTokenizer\n"
              "from engine.runtime.stages.stage import core\n"
              "ChatTokenizer(sys.argv[1])\n"
              "core().read_model(sys.argv[1] + '/openvino_model.xml')\n"
              "gc.collect()\n"
              "maps = open('/proc/self/maps').read()\n"
              "print(*(name in maps for name in ('libopenvino_tokenizers.so', 'libopenvino_onnx_frontend.so')))\n")
    out = subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True"]
