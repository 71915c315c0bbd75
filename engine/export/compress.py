"""Weight formats of a shard: INT4 (asymmetric, group 128) or INT8 layer weights via NNCF with the
vocabulary matrices in asymmetric INT8, INT4 fitted to the activations of calibration text
(``CALIBRATED``: NNCF's data-aware algorithms, ``engine.export.calibration``), a GGUF's own
quantized layer weights carried over as they are (``gguf``: ``engine.export.gguf_weights``;
vocabulary in asymmetric INT8), plain FP16, or uncompressed F32 (the reference the exactness tests
use).

The embedding and output head are quantized here (``vocab_table``) rather than by NNCF, a block of rows at a time:
NNCF materialises several float32 copies of the matrix it works on, which for a 150k-token
vocabulary is gigabytes that a stage's peak memory would otherwise carry whatever its layer count.
Every layer matrix goes through NNCF with the same settings, so a layer compresses identically
whichever stage it lands in.
"""

from __future__ import annotations

import logging

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from engine.config import AUTO_WEIGHTS
from engine.errors import ExportError
from engine.export.gguf_weights import carries
from engine.manifest import INT4_GROUP
from engine.models.quantized import ROW_BLOCK, int8_rows
from engine.tuning import CALIBRATE_BELOW, HEAD_SHRINK

# Data-aware INT4: the same symmetric INT4 group-128 codes as ``int4``, with
# scales (and for AWQ a per-channel smoothing folded into the preceding weights) chosen to fit what
# calibration text's activations see.  Measured in docs/benchmarks.md ("Data-aware INT4").
CALIBRATED = {
    "int4-awq": {"awq": True, "scale_estimation": True},
    "int4-se": {"scale_estimation": True},
    "int4-gptq": {"gptq": True, "scale_estimation": True},
}
WEIGHT_FORMATS = (AUTO_WEIGHTS, "int4", *CALIBRATED, "int8", "gguf", "fp16", "f32")
# What each format is for, in a user's words (figures: docs/benchmarks.md, Qwen2.5-Coder-1.5B)
WEIGHT_NOTES = {
    AUTO_WEIGHTS: "The measured best for the source: for a GGUF file its own weights (Faithful, gguf); "
                  "for a float checkpoint under 1B parameters INT4 fitted to sample text (GPTQ), which it "
                  "brings much closer to the original (the export takes minutes); INT4 for larger ones.",
    "int4": "INT4 (Fast for a GGUF): smallest and fastest for one user. From a GGUF it quantizes the "
            "GGUF's weights again, so it answers worse than the GGUF (Qwen 1.5B: KL 0.064).",
    "int4-awq": "INT4 fitted to sample text (AWQ): int4's size and speed, closer to the original; the "
                "export takes many times longer.",
    "int4-se": "INT4 fitted to sample text (scale estimation): int4's size and speed, closer to the "
               "original; the export takes many times longer.",
    "int4-gptq": "INT4 fitted to sample text (GPTQ): int4's size and speed, the closest INT4; the export "
                 "takes many times longer.",
    "int8": "INT8: twice int4's size, close to the original.",
    "gguf": "A GGUF's own quantized weights, carried over as they are (Faithful): it answers as the "
            "GGUF does in llama.cpp; for one user slower than int4. GGUF sources only.",
    "fp16": "16-bit floats: exact to the source's float weights, large and slow.",
    "f32": "32-bit floats: the reference; the largest and slowest.",
}
# Dimensions that 128 does not divide (SmolLM2's hidden 576) get the largest divisor >= this.
INT4_MIN_GROUP = 32
# Data-free ``int4`` codes: asymmetric (INT4_ASYM, a u4 zero point per group beside the f16 scale:
# closer to the source than symmetric INT4_SYM for a few more bytes, docs/benchmarks.md "Asymmetric
# int4").  Switching re-exports every cached int4 shard: bump EXPORTER_VERSION with it.
INT4_ASYMMETRIC = True


def parameters(spec) -> int:
    """A decoder's weight count from its spec: vocabulary table(s) and each layer's matrices."""
    attention = spec.hidden_size * spec.head_dim * 2 * (spec.num_heads + spec.num_kv_heads)
    layer = attention + 3 * spec.hidden_size * spec.intermediate_size
    return spec.vocab_size * spec.hidden_size * (1 if spec.tie_embeddings else 2) + spec.num_layers * layer


def best_weights(kind: str, spec, path=None) -> str:
    """What ``auto`` exports for a source of ``kind`` ("gguf" or "hf") with this spec: a GGUF whose
    matrices can all be carried over (at ``path``) keeps them (``gguf``, the faithful format); a float
    checkpoint below ``CALIBRATE_BELOW`` parameters takes int4-gptq, whose data-aware scales pay for
    their export time on a small model, a larger one int4."""
    if kind == "gguf":
        return "gguf" if path is not None and carries(path) else "int4"
    return "int4-gptq" if parameters(spec) < CALIBRATE_BELOW else "int4"


def compress(model: ov.Model, weights: str, dataset=None) -> ov.Model:
    """Compresses the layer weights with NNCF (the vocabulary tables were built in their final
    format by ``vocab_table``, a GGUF's layers by ``gguf_weights.carry``); fp16 storage happens at save
    time (``save_fp16``).  A ``CALIBRATED`` format needs ``dataset``, an ``nncf.Dataset`` of the
    stage's inputs (``calibration.dataset``)."""
    if weights not in WEIGHT_FORMATS:
        raise ExportError(f"unknown weight format {weights!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    if weights in ("gguf", "fp16", "f32"):
        return model
    if weights in CALIBRATED and dataset is None:
        raise ExportError(f"the {weights} weight format needs calibration data")
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedCompressionParameters, GroupSizeFallbackMode

    logging.getLogger("nncf").setLevel(logging.WARNING)
    if weights == "int8":
        return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)  # per channel, every layer
    data_aware = {}
    if weights in CALIBRATED:
        data_aware = dict(CALIBRATED[weights], dataset=dataset, subset_size=dataset.get_length())
    asymmetric = weights == "int4" and INT4_ASYMMETRIC  # the calibrated formats keep symmetric codes
    return nncf.compress_weights(
        model,
        mode=nncf.CompressWeightsMode.INT4_ASYM if asymmetric else nncf.CompressWeightsMode.INT4_SYM,
        group_size=INT4_GROUP,
        ratio=1.0,
        all_layers=True,
        advanced_parameters=AdvancedCompressionParameters(
            group_size_fallback_mode=GroupSizeFallbackMode.ADJUST,
            min_adjusted_group_size=INT4_MIN_GROUP,
        ),
        **data_aware,
    )


def vocab_table(table: np.ndarray, weights: str) -> ov.Output:
    """A [vocab, hidden] matrix as an f32-valued graph output in the shard's weight format: for
    int4/int8/gguf INT8 rows (``int8_rows``)."""
    if weights == "f32":
        return ops.constant(np.ascontiguousarray(table, dtype=np.float32)).output(0)
    if weights == "fp16":
        return ops.convert(ops.constant(np.ascontiguousarray(table, dtype=np.float16)), ov.Type.f32).output(0)
    return int8_rows(table)


HEAD_FORMATS = ("int8", "int4")
HEAD_GROUP = 128
# The LM head's formats in a user's words (figures: docs/benchmarks.md, Qwen2.5-Coder-1.5B)
HEAD_NOTES = {
    "int8": "INT8 head: the vocabulary as accurate as the layers allow (the default).",
    "int4": "INT4 head: about a tenth faster decoding on a 1.5B model, somewhat less accurate "
            "(perplexity +2%); for INT4 layers only.",
}



def int4_head_codes(table: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric INT4 codes of ``table`` [rows, columns] in groups of ``group`` columns: (codes
    u8 0..15 [rows, groups, group], zero points u8 [rows, groups, 1], f16 scales [rows, groups, 1]),
    decoding as ``(codes - zero) * scale``."""
    rows_total, hidden = table.shape
    groups = hidden // group
    codes = np.empty((rows_total, groups, group), dtype=np.uint8)
    zero = np.empty((rows_total, groups, 1), dtype=np.uint8)
    scale = np.empty((rows_total, groups, 1), dtype=np.float16)
    for start in range(0, rows_total, ROW_BLOCK):
        x = table[start:start + ROW_BLOCK].astype(np.float32).reshape(-1, groups, group)
        lo, hi = np.minimum(x.min(axis=2, keepdims=True), 0.0), np.maximum(x.max(axis=2, keepdims=True), 0.0)
        best = None
        for shrink in HEAD_SHRINK:
            s = (np.maximum(hi - lo, 1e-8) * shrink / 15.0).astype(np.float16)
            s32 = s.astype(np.float32)
            z = np.clip(np.rint(-lo * shrink / s32), 0, 15)
            q = np.clip(np.rint(x / s32) + z, 0, 15)
            err = (((q - z) * s32 - x) ** 2).sum(axis=2, keepdims=True)
            if best is None:
                best, bq, bz, bs = err, q, z, s
            else:
                better = err < best
                best = np.where(better, err, best)
                bq, bz, bs = np.where(better, q, bq), np.where(better, z, bz), np.where(better, s, bs)
        codes[start:start + ROW_BLOCK], zero[start:start + ROW_BLOCK] = bq, bz
        scale[start:start + ROW_BLOCK] = bs
    return codes, zero, scale


def head_table_int4(table: np.ndarray, group: int = HEAD_GROUP) -> ov.Output:
    """The LM head as asymmetric INT4 (``int4_head_codes``) in the pattern the CPU plugin runs as a
    compressed MatMul (Constant u4 [vocab, groups, group] -> Convert -> Subtract(u4 zero point) ->
    Multiply(f16 scale) -> Reshape).  It halves the head's bytes, which are a larger share of a small
    draft model's step than of a large model's."""
    rows_total, hidden = table.shape
    group = next((g for g in (group, 64, 32) if hidden % g == 0), 0)  # as NNCF's group-size fallback
    if not group:
        raise ExportError(f"an INT4 head needs a hidden size divisible by 32, not {hidden}")
    codes, zero, scale = int4_head_codes(table, group)
    centered = ops.subtract(ops.convert(ops.constant(codes, dtype=ov.Type.u4), ov.Type.f16),
                            ops.convert(ops.constant(zero, dtype=ov.Type.u4), ov.Type.f16))
    flat = ops.reshape(ops.multiply(centered, ops.constant(scale)),
                       ops.constant(np.array([rows_total, hidden], dtype=np.int64)), False)
    return ops.convert(flat, ov.Type.f32).output(0)


def staging_dtype(weights: str):
    """The dtype matrices are held in before compression: f32 only for the f32 reference format."""
    return np.float32 if weights == "f32" else np.float16


def save_fp16(weights: str) -> bool:
    """Whether ``ov.save_model`` should store the remaining float constants as fp16."""
    return weights != "f32"
