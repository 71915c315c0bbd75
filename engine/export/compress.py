"""Weight formats of a shard: NNCF INT4 (symmetric, group 128) or INT8 compression, plain FP16, or
uncompressed F32 (the reference format the exactness tests use)."""

from __future__ import annotations

import logging

import openvino as ov

from engine.errors import ExportError

WEIGHT_FORMATS = ("int4", "int8", "fp16", "f32")
INT4_GROUP = 128
# Dimensions that 128 does not divide (SmolLM2's hidden 576) get the largest divisor >= this.
INT4_MIN_GROUP = 32


def compress(model: ov.Model, weights: str) -> ov.Model:
    """Compresses the model's weights; fp16 storage happens at save time (``save_fp16``)."""
    if weights not in WEIGHT_FORMATS:
        raise ExportError(f"unknown weight format {weights!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    if weights in ("fp16", "f32"):
        return model
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedCompressionParameters, GroupSizeFallbackMode

    logging.getLogger("nncf").setLevel(logging.WARNING)
    if weights == "int8":
        return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
    return nncf.compress_weights(
        model,
        mode=nncf.CompressWeightsMode.INT4_SYM,
        group_size=INT4_GROUP,
        ratio=1.0,
        advanced_parameters=AdvancedCompressionParameters(
            group_size_fallback_mode=GroupSizeFallbackMode.ADJUST,
            min_adjusted_group_size=INT4_MIN_GROUP,
        ),
    )


def save_fp16(weights: str) -> bool:
    """Whether ``ov.save_model`` should store the remaining float constants as fp16."""
    return weights != "f32"
