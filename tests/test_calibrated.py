"""Data-aware INT4 (``int4-awq``): the float model's activations on the calibration text reach every
stage, the shards load and generate, and they are no further from the float model than data-free
INT4 on text they were not calibrated on."""

from __future__ import annotations

import numpy as np
import pytest

from engine.bench.quality import compare, log_probs
from engine.export import calibration
from engine.export.exporter import export_model
from engine.manifest import load_manifest
from engine.runtime.decode.generate import Generator
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.stage import compile_config

# Token ids unlike the calibration text: random ones, the same every run.
TEXT_IDS = np.random.default_rng(5).integers(3, 320, size=160).astype(np.int64)


def _kl(reference_folders, folders, ids) -> float:
    exact = compile_config("exact")
    chain = LocalChain(reference_folders, config=exact)
    try:
        reference = np.concatenate([part for _, part in log_probs(chain, ids)])
    finally:
        chain.close()
    chain = LocalChain(folders, config=exact)
    try:
        return compare(reference, chain, ids)["kl_nats"]
    finally:
        chain.close()


def test_later_stage_calibration_inputs_are_the_float_models_hidden_states(tiny_models, tiny_exports):
    from engine.models.checkpoint import open_checkpoint
    from engine.runtime.stages.stage import StageRunner

    ckpt = open_checkpoint("hf", tiny_models["gemma3"])
    ids = np.array([[0, 5, 17, 42, 101, 7, 250, 33]], dtype=np.int64)
    hidden = calibration.stage_inputs(ckpt, 2, ids)
    first = StageRunner(tiny_exports["gemma3", "2"].folders[0], config=compile_config("exact"))
    want = first.forward(ids, np.ones(ids.shape, np.int64), np.arange(ids.shape[1])[None])
    assert hidden.shape == want.shape
    # the calibration runs the layers with f16-stored weights (as the compressed formats stage them)
    assert np.abs(hidden - want).max() < 1e-2 * np.abs(want).max()


@pytest.mark.parametrize("arch", ["qwen2"])  # where the tiny models differ most (int4 KL 2.7e-4, int4-awq 1.4e-4)
def test_calibrated_int4_exports_generates_and_is_closer_to_float_than_data_free(arch, tiny_models, tiny_exports,
                                                                                tmp_path):
    source = str(tiny_models[arch])
    plain = export_model(source, stages=2, weights="int4", out=tmp_path / "int4")
    aware = export_model(source, stages=2, weights="int4-awq", out=tmp_path / "awq")
    for folder in aware.folders:
        manifest = load_manifest(folder)
        assert manifest.weights == "int4-awq"
        assert manifest.export["calibration"]["sequences"] >= 2
    tokens = Generator(LocalChain(aware.folders), max_length=64).generate(TEXT_IDS[None, :8], 8, ignore_eos=True)
    assert len(tokens.tokens) == 8
    reference = tiny_exports[arch, "1"].folders
    kl_plain, kl_aware = _kl(reference, plain.folders, TEXT_IDS), _kl(reference, aware.folders, TEXT_IDS)
    assert 0 < kl_aware <= kl_plain, f"int4-awq KL {kl_aware} against data-free int4 {kl_plain}"


def test_a_calibrated_format_without_calibration_data_is_refused():
    import openvino as ov
    import openvino.opset13 as ops

    from engine.errors import ExportError
    from engine.export.compress import compress

    x = ops.parameter([1, 64], ov.Type.f32)
    model = ov.Model([ops.matmul(x, ops.constant(np.ones((64, 64), np.float32)), False, True)], [x])
    with pytest.raises(ExportError, match="int4-awq weight format needs calibration data"):
        compress(model, "int4-awq")


def test_auto_weights_are_gptq_for_small_float_checkpoints_and_int4_otherwise(tiny_models, tmp_path, capsys):
    """``auto``, the default, exports what measured best for the source: a float checkpoint under 1B
    parameters as int4-gptq; Qwen2.5-Coder-1.5B's size, or a GGUF with nothing to carry over, as
    int4.  `fleet export` says which it chose."""
    import dataclasses

    from engine.cli.main import main
    from engine.config import Settings
    from engine.export.compress import best_weights, parameters
    from engine.models.checkpoint import open_checkpoint

    assert Settings().weights == "auto"
    spec = open_checkpoint("hf", tiny_models["llama"]).spec
    assert (best_weights("hf", spec), best_weights("gguf", spec)) == ("int4-gptq", "int4")
    qwen = dataclasses.replace(spec, vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                               num_heads=12, num_kv_heads=2, head_dim=128, tie_embeddings=True)
    assert 1.5e9 < parameters(qwen) < 1.6e9 and best_weights("hf", qwen) == "int4"
    assert main(["export", "--model", str(tiny_models["llama"]), "--stages", "1", "--head", "int4",
                 "--out", str(tmp_path / "auto")]) == 0
    assert "weights: int4-gptq" in capsys.readouterr().out
    manifest = load_manifest(tmp_path / "auto" / "stage0")
    assert (manifest.weights, manifest.export["head"]) == ("int4-gptq", "int4")
