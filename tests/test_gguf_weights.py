"""GGUF quantized matrices carried into a shard as they are (``engine.export.gguf_weights``): every
block type decomposes to the GGUF's own float values, and the shard's constants, no larger than the
GGUF's blocks where the plugin runs the type's own bits, decode to them inside the CPU plugin's
compressed MatMul."""

from __future__ import annotations

import gguf
import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

from engine.export.gguf_weights import carried_values, carry_matmul, lookup_table, stored
from engine.models.quantized import BLOCKS, NAMES, Q4_0, Q5_0, Q6_K, Q8_0, decompose

ROWS, COLUMNS = 64, 512
EXACT = frozenset({Q4_0, Q5_0, Q8_0, Q6_K})  # the types without a minimum
EXACT_CONFIG = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}


def raw_blocks(qtype: int, rng) -> np.ndarray:
    """Random blocks of a type: quantized by the gguf package where it can, else random bytes with
    finite f16 scales (the K-quants), which any decoder must read the same way."""
    kind = gguf.GGMLQuantizationType(qtype)
    data = rng.standard_normal((ROWS, COLUMNS)).astype(np.float32) * 0.05
    try:
        return np.ascontiguousarray(gguf.quants.quantize(data, kind)).view(np.uint8).reshape(ROWS, -1)
    except NotImplementedError:
        size, nbytes = BLOCKS[qtype]
        raw = rng.integers(0, 256, (ROWS, COLUMNS // size, nbytes), dtype=np.uint8)
        scales = (rng.uniform(1e-4, 1e-2, (ROWS, COLUMNS // size, 2))).astype(np.float16).view(np.uint8)
        if qtype == 14:  # Q6_K: d is the last two bytes
            raw[..., 208:210] = scales[..., :2]
        else:  # Q4_K, Q5_K: d and dmin first
            raw[..., 0:4] = scales.reshape(ROWS, COLUMNS // size, 4)
        return raw.reshape(ROWS, -1)


def reference(qtype: int, raw: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)).reshape(ROWS, COLUMNS).astype(np.float32)


@pytest.mark.parametrize("qtype", sorted(BLOCKS), ids=lambda t: NAMES[t])
def test_each_block_type_decomposes_to_the_gguf_values(qtype):
    raw = raw_blocks(qtype, np.random.default_rng(qtype))
    want = reference(qtype, raw)
    q = decompose(qtype, raw, ROWS, COLUMNS)
    assert q.exact == (qtype in EXACT)
    assert np.array_equal(q.values(), want)


def assert_near_gguf(got, want, exact):
    """Without a minimum each weight is the GGUF's; with one, a float zero point and its scale are
    held to f16's 11 bits (``stored``), within 2^-9 of the largest weight."""
    if exact:
        assert np.array_equal(got, want)
    else:
        assert np.abs(got - want).max() <= 2**-9 * np.abs(want).max()
    assert not np.array_equal(got, np.zeros_like(got))


def test_scales_are_stored_as_f16_where_it_holds_them_to_11_bits():
    d = np.float16(0.01234).astype(np.float32)
    scales = d * np.arange(1, 64, dtype=np.float32)  # a K-quant's d * six-bit scale: up to 17 bits
    kept = stored(scales)
    assert kept.dtype == np.float16 and not np.array_equal(kept.astype(np.float32), scales)
    assert np.all(np.abs(kept.astype(np.float32) - scales) <= scales * 2**-11)
    tiny = np.array([1e-6, 0.5], dtype=np.float32)  # f16 keeps 1e-6 only as a subnormal, to 6%
    assert stored(tiny).dtype == np.float32 and np.array_equal(stored(tiny), tiny)


@pytest.mark.parametrize("offsets", [False, True], ids=["float zero point", "offsets added"])
@pytest.mark.parametrize("qtype", sorted(BLOCKS), ids=lambda t: NAMES[t])
def test_the_shard_constant_decodes_to_the_gguf_values_in_a_compressed_matmul(qtype, offsets):
    raw = raw_blocks(qtype, np.random.default_rng(100 + qtype))
    want = reference(qtype, raw)
    q = decompose(qtype, raw, ROWS, COLUMNS)
    x = ops.parameter([1, -1, COLUMNS], ov.Type.f32, name="x")
    matmul = ops.matmul(x, ops.constant(np.zeros((ROWS, COLUMNS), np.float32)), False, True)
    model = ov.Model([ops.result(matmul)], [x])
    limit = 0 if offsets else 10**9
    carry_matmul(matmul, q, offsets_from=limit)
    stored_bytes = sum(op.get_byte_size() for op in model.get_ops()
                       if op.get_type_name() == "Constant" and len(op.get_output_shape(0)) >= 2)
    own_bits = q.bits in (4, 6, 8) and (q.exact or offsets)  # else five-bit codes as six, or a float zero point
    assert stored_bytes <= raw.nbytes * (1.0 if own_bits else 1.3)
    compiled = ov.Core().compile_model(model, "CPU", EXACT_CONFIG)
    got = compiled(np.eye(COLUMNS, dtype=np.float32)[None])[0][0].T  # identity in: the weights out
    assert np.array_equal(got, carried_values(q, limit))
    assert_near_gguf(got, want, q.exact)
    # the decompression runs inside the MatMul: the weights stay as their codes, not a float matrix
    kinds = []
    for op in compiled.get_runtime_model().get_ordered_ops():
        if op.get_rt_info()["layerType"].astype(str) == "FullyConnected":
            kinds.append(op.input_value(1).get_node().get_rt_info()["outputPrecisions"].astype(str))
    assert kinds[0] in ("i4", "i8", "u4", "u8") and len(kinds) == (2 if offsets and not q.exact else 1)  # 2: offsets


@pytest.mark.parametrize("qtype", sorted(BLOCKS), ids=lambda t: NAMES[t])
def test_an_embedding_keeps_its_gguf_codes_in_a_compressed_gather(qtype):
    """The embedding of a ``gguf`` export is the GGUF's codes, which the CPU plugin's Gather decodes
    row by row: each looked-up row is the GGUF's (its scales held to 11 bits), and no float table
    is built."""
    raw = raw_blocks(qtype, np.random.default_rng(200 + qtype))
    want = reference(qtype, raw)

    class Checkpoint:
        def read_blocks(self, part, layer=None):
            assert part == "embed"
            return qtype, raw

    ids = ops.parameter([1, -1], ov.Type.i64, name="ids")
    model = ov.Model([ops.gather(lookup_table(Checkpoint()), ids, ops.constant(np.int64(0)))], [ids])
    compiled = ov.Core().compile_model(model, "CPU", EXACT_CONFIG)
    got = compiled(np.arange(ROWS, dtype=np.int64)[::-1][None])[0][0][::-1]
    assert_near_gguf(got, want, qtype in EXACT)
    gather = next(op for op in compiled.get_runtime_model().get_ordered_ops()
                  if op.get_rt_info()["layerType"].astype(str) == "Gather")
    assert gather.input_value(0).get_element_type().get_type_name() in ("i4", "i8", "u4", "u8")


def test_a_float_source_has_no_gguf_weights_to_carry(tiny_models, tmp_path):
    from engine.errors import ExportError
    from engine.export.exporter import export_model

    with pytest.raises(ExportError, match="is not a GGUF model"):
        export_model(str(tiny_models["llama"]), stages=1, weights="gguf", out=tmp_path / "x")


@pytest.mark.real_model
def test_smollm2_carried_over_is_as_good_as_its_gguf_and_loads_in_llmpipeline():
    """The default model's Q4_1 layers carried over (2 stages) against its own weights in float: KL
    at most 0.01 nats per token at the f32 hint; the re-quantized INT4 export is far off."""
    import openvino_genai

    from engine.bench.quality import bench_text, compare, log_probs
    from engine.export.exporter import export_model
    from engine.manifest import load_manifest
    from engine.runtime.decode.tokenizer import ChatTokenizer
    from engine.runtime.stages.chain import LocalChain
    from engine.runtime.stages.stage import compile_config

    reference = export_model("smollm2-135m", stages=1, weights="f32")
    carried = export_model("smollm2-135m", stages=2, weights="gguf")
    report = load_manifest(carried.folders[0]).export["gguf_weights"]
    assert report["carried"] == {"Q4_1": 15 * 7} and report["kept_float"] == []
    ids = ChatTokenizer(reference.folders[0]).prompt_ids(bench_text(), chat=False)[0, :384]
    exact = compile_config("exact")
    chain = LocalChain(reference.folders, config=exact)
    want = np.concatenate([part for _, part in log_probs(chain, ids)])
    chain.close()
    ours = compare(want, LocalChain(carried.folders, config=exact), ids)
    assert ours["kl_nats"] <= 0.01 and ours["top1_agreement"] >= 0.95
    requantized = compare(want, LocalChain(export_model("smollm2-135m", stages=2, weights="int4").folders,
                                           config=exact), ids)
    assert requantized["kl_nats"] > 10 * ours["kl_nats"]  # what carrying the codes over is for
    one = export_model("smollm2-135m", stages=1, weights="gguf").folders[0]
    pipe = openvino_genai.LLMPipeline(str(one), "CPU")
    config = pipe.get_generation_config()
    config.max_new_tokens = 16
    assert "Paris" in str(pipe.generate("What is the capital of France?", config))


def test_the_quality_bench_ranks_formats_against_the_float_reference(tiny_models, tmp_path, monkeypatch):
    """`fleet bench quality` on a tiny float model: f32 shards split in 2 agree with the 1-stage
    reference (KL ~0, every top-1 the same); INT4 does not."""
    import json

    from engine.bench.quality import run_quality

    monkeypatch.setenv("FLEETSHARD_HOME", str(tmp_path / "home"))
    out = tmp_path / "quality.json"
    report = run_quality(str(tiny_models["llama"]), weights=("f32", "int4"), stages=(2,), tokens=96, out=out,
                         log=lambda _: None)
    assert json.loads(out.read_text())["bench"] == "quality"
    rows = {(r["weights"], r["precision"]): r for r in report["rows"]}
    assert rows["f32 (reference)", "f32"]["kl_nats"] == 0.0
    assert rows["f32", "f32"]["kl_nats"] < 1e-4 and rows["f32", "f32"]["top1_agreement"] == 1.0
    assert rows["int4", "f32"]["kl_nats"] > 100 * max(rows["f32", "f32"]["kl_nats"], 1e-7)
    assert len(report["ratios"]) == len(report["rows"]) - 1


def write_matrices(path, types: list[int]) -> None:
    """A GGUF holding one 64 x 512 matrix of each GGML type (and a float norm vector)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for i, qtype in enumerate(types):
        if qtype in (0, 1):
            writer.add_tensor(f"blk.{i}.w", np.zeros((ROWS, COLUMNS), dtype=np.float32 if qtype == 0 else np.float16))
            continue
        size, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
        raw = np.zeros((ROWS, COLUMNS // size * nbytes), dtype=np.uint8)
        writer.add_tensor(f"blk.{i}.w", raw, raw_dtype=gguf.GGMLQuantizationType(qtype))
    writer.add_tensor("norm", np.ones(COLUMNS, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("types, carried", [
    ([12, 12, 14, 1], True),  # Q4_K_M-like, a float embedding
    ([3, 3, 8], True),
    ([1, 1, 1], False),  # a float GGUF: nothing to carry
    ([12, 11, 14], False),  # a Q3_K matrix cannot be carried
], ids=["Q4_K_M", "Q4_1", "F16", "Q3_K"])
def test_auto_keeps_a_ggufs_own_weights_where_every_matrix_carries_over(tmp_path, types, carried):
    """``auto`` exports a GGUF faithfully (``gguf``) when all its quantized matrices are of the types
    carried over, else as int4; a float checkpoint keeps its data-aware choice."""
    from engine.export.compress import best_weights
    from engine.export.gguf_weights import carries
    from engine.models.architectures import ModelSpec

    path = tmp_path / "m.gguf"
    write_matrices(path, types)
    assert carries(path) is carried
    spec = ModelSpec(arch="llama", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                     head_dim=16, vocab_size=1000, rms_eps=1e-5, rope_theta=1e4, max_position=2048,
                     tie_embeddings=True)
    assert best_weights("gguf", spec, path) == ("gguf" if carried else "int4")
    assert best_weights("hf", spec) == "int4-gptq"


@pytest.mark.parametrize("qtype", sorted(BLOCKS), ids=lambda t: NAMES[t])
def test_a_tensor_parallel_ranks_cut_keeps_the_gguf_values_of_its_rows_and_columns(qtype):
    """A rank's rows, or its columns in whole blocks, of a GGUF matrix decode to the same slice of
    the whole matrix's values; a cut through a block is refused."""
    from engine.errors import ExportError
    from engine.export.gguf_weights import _cut

    raw = raw_blocks(qtype, np.random.default_rng(qtype))
    whole = decompose(qtype, raw, ROWS, COLUMNS).values()
    rows = slice(16, 48)
    assert np.array_equal(decompose(qtype, _cut(raw, qtype, 0, rows), 32, COLUMNS).values(), whole[rows])
    columns = slice(256, 512)
    assert np.array_equal(decompose(qtype, _cut(raw, qtype, 1, columns), ROWS, 256).values(), whole[:, columns])
    if BLOCKS[qtype][0] > 16:
        with pytest.raises(ExportError, match="cut .* blocks"):
            _cut(raw, qtype, 1, slice(16, 512))


@pytest.mark.parametrize("tied", [False, True], ids=["own head", "tied"])
def test_a_head_of_its_own_is_carried_with_its_gguf_codes(tied):
    """A model whose head is its own GGUF tensor (not the embedding) gets the GGUF's codes in the
    last stage's head MatMul, a rank its rows of the vocabulary; a tied head is left to the
    embedding's table."""
    from types import SimpleNamespace

    from engine.export.gguf_weights import carry_head, own_head

    raw = raw_blocks(Q6_K, np.random.default_rng(7))

    class Checkpoint:
        spec = SimpleNamespace(tie_embeddings=tied)

        def has(self, part, layer=None):
            return part == "lm_head"

        def read_blocks(self, part, layer=None):
            assert part == "lm_head"
            return Q6_K, raw

    blocks = own_head(Checkpoint())
    if tied:
        assert blocks is None
        return
    rows = slice(16, 48)
    hidden = ops.parameter([1, -1, COLUMNS], ov.Type.f32, name="hidden")
    stand_in = ops.broadcast(ops.constant(np.float32(0)), ops.constant(np.array([32, COLUMNS])))
    model = ov.Model([ops.result(ops.matmul(hidden, stand_in, False, True))], [hidden])
    assert carry_head(model, blocks, rows) == "Q6_K"
    x = np.random.default_rng(8).standard_normal((1, 3, COLUMNS)).astype(np.float32)
    got = ov.Core().compile_model(model, "CPU", EXACT_CONFIG)(x)[0]
    want = x @ reference(Q6_K, raw)[rows].T
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
