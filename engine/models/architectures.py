"""Supported decoder architectures as data: config keys and checkpoint tensor names per stage part.

Adding a Llama-like architecture (Mistral, Phi-3 with split projections, ...) is a table entry: the
HF config keys, the Hugging Face and GGUF tensor names of every part, and whether the GGUF
converter permuted the rotary halves of q/k (llama.cpp does that for the ``llama`` family only).
Gemma 3 adds the optional pieces the decoder knows: per-head q/k norms, norms after attention and
after the MLP, a GELU MLP, embeddings scaled by sqrt(hidden) and sliding-window layers with their
own rotary base.
"""

from __future__ import annotations

import dataclasses

from engine.errors import SourceError

# Parts of one decoder layer, in the order the decoder module consumes them.
LAYER_PARTS = (
    "input_norm", "q", "k", "v", "q_bias", "k_bias", "v_bias", "o",
    "post_norm", "gate", "up", "down",
)
# Optional layer parts (Gemma 3): per-head q/k norms, norms of the attention and MLP outputs.
EXTRA_PARTS = ("q_norm", "k_norm", "attn_out_norm", "ffn_out_norm")
# Parts that are RMSNorm weights: Hugging Face's Gemma keeps them as ``w`` for a ``1 + w`` scale.
NORM_PARTS = ("input_norm", "post_norm", "final_norm") + EXTRA_PARTS
# Parts outside the layers: embeddings (first stage), final norm and head (last stage).
GLOBAL_PARTS = ("embed", "final_norm", "lm_head")

_HF_LAYER = {
    "input_norm": "model.layers.{i}.input_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj.weight",
    "k": "model.layers.{i}.self_attn.k_proj.weight",
    "v": "model.layers.{i}.self_attn.v_proj.weight",
    "q_bias": "model.layers.{i}.self_attn.q_proj.bias",
    "k_bias": "model.layers.{i}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{i}.self_attn.v_proj.bias",
    "o": "model.layers.{i}.self_attn.o_proj.weight",
    "post_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
}
_HF_GLOBAL = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}
_GGUF_LAYER = {
    "input_norm": "blk.{i}.attn_norm.weight",
    "q": "blk.{i}.attn_q.weight",
    "k": "blk.{i}.attn_k.weight",
    "v": "blk.{i}.attn_v.weight",
    "q_bias": "blk.{i}.attn_q.bias",
    "k_bias": "blk.{i}.attn_k.bias",
    "v_bias": "blk.{i}.attn_v.bias",
    "o": "blk.{i}.attn_output.weight",
    "post_norm": "blk.{i}.ffn_norm.weight",
    "gate": "blk.{i}.ffn_gate.weight",
    "up": "blk.{i}.ffn_up.weight",
    "down": "blk.{i}.ffn_down.weight",
}
_GGUF_GLOBAL = {
    "embed": "token_embd.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
}
# GGUF metadata key (after the "<arch>." prefix) -> ModelSpec field.
_GGUF_CONFIG = {
    "block_count": "num_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_heads",
    "attention.head_count_kv": "num_kv_heads",
    "attention.layer_norm_rms_epsilon": "rms_eps",
    "rope.freq_base": "rope_theta",
    "context_length": "max_position",
    "vocab_size": "vocab_size",
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
}
# HF config.json key -> ModelSpec field.
_HF_CONFIG = {
    "num_hidden_layers": "num_layers",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "rms_norm_eps": "rms_eps",
    "rope_theta": "rope_theta",
    "max_position_embeddings": "max_position",
    "vocab_size": "vocab_size",
    "head_dim": "head_dim",
    "tie_word_embeddings": "tie_embeddings",
    "sliding_window": "sliding_window",
    "query_pre_attn_scalar": "query_pre_attn_scalar",
}


@dataclasses.dataclass(frozen=True)
class Architecture:
    name: str
    hf_model_types: tuple[str, ...]
    attention_bias: bool
    gguf_permuted_qk: bool
    default_tie_embeddings: bool
    hf_layer: dict = dataclasses.field(default_factory=lambda: dict(_HF_LAYER))
    hf_global: dict = dataclasses.field(default_factory=lambda: dict(_HF_GLOBAL))
    gguf_layer: dict = dataclasses.field(default_factory=lambda: dict(_GGUF_LAYER))
    gguf_global: dict = dataclasses.field(default_factory=lambda: dict(_GGUF_GLOBAL))
    extra_parts: tuple[str, ...] = ()
    activation: str = "silu"  # or "gelu_tanh"
    scaled_embeddings: bool = False  # embeddings times sqrt(hidden_size)
    hf_norm_offset: float = 0.0  # added to Hugging Face norm weights (GGUF stores the sum)
    # Sliding-window layers when the checkpoint does not list them: every layer but each Nth.
    sliding_pattern: int = 0
    sliding_rope_theta: float = 0.0  # the rotary base of sliding-window layers (GGUF does not store it)

    def layer_parts(self) -> tuple[str, ...]:
        parts = LAYER_PARTS if self.attention_bias else tuple(p for p in LAYER_PARTS if not p.endswith("_bias"))
        return parts + self.extra_parts

    def sliding_layers(self, num_layers: int) -> tuple[int, ...]:
        if not self.sliding_pattern:
            return ()
        return tuple(i for i in range(num_layers) if (i + 1) % self.sliding_pattern)


ARCHITECTURES = {
    a.name: a
    for a in (
        Architecture("llama", ("llama",), attention_bias=False, gguf_permuted_qk=True,
                     default_tie_embeddings=False),
        Architecture("mistral", ("mistral",), attention_bias=False, gguf_permuted_qk=True,
                     default_tie_embeddings=False),
        Architecture("qwen2", ("qwen2",), attention_bias=True, gguf_permuted_qk=False,
                     default_tie_embeddings=False),
        Architecture(
            "gemma3", ("gemma3_text", "gemma3"), attention_bias=False, gguf_permuted_qk=False,
            default_tie_embeddings=True,
            hf_layer={**_HF_LAYER,
                      "post_norm": "model.layers.{i}.pre_feedforward_layernorm.weight",
                      "attn_out_norm": "model.layers.{i}.post_attention_layernorm.weight",
                      "ffn_out_norm": "model.layers.{i}.post_feedforward_layernorm.weight",
                      "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
                      "k_norm": "model.layers.{i}.self_attn.k_norm.weight"},
            gguf_layer={**_GGUF_LAYER,
                        "attn_out_norm": "blk.{i}.post_attention_norm.weight",
                        "ffn_out_norm": "blk.{i}.post_ffw_norm.weight",
                        "q_norm": "blk.{i}.attn_q_norm.weight",
                        "k_norm": "blk.{i}.attn_k_norm.weight"},
            extra_parts=EXTRA_PARTS, activation="gelu_tanh", scaled_embeddings=True, hf_norm_offset=1.0,
            sliding_pattern=6, sliding_rope_theta=10000.0,
        ),
    )
}


def architecture(name: str) -> Architecture:
    for arch in ARCHITECTURES.values():
        if name == arch.name or name in arch.hf_model_types:
            return arch
    raise SourceError(
        f"unsupported architecture {name!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
    )


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The shape facts of a decoder the exporter and runtime need, whatever the source format."""

    arch: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_eps: float
    rope_theta: float
    max_position: int
    tie_embeddings: bool
    sliding_window: int = 0  # tokens a sliding-window layer sees (itself included); 0: none
    sliding_layers: tuple[int, ...] = ()
    sliding_rope_theta: float = 0.0
    query_pre_attn_scalar: float = 0.0  # attention scale is its -1/2 power; 0: head_dim

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: dict) -> "ModelSpec":
        """Fields with a default may be absent (manifests written before they existed)."""
        values = {f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name in raw}
        if "sliding_layers" in values:
            values["sliding_layers"] = tuple(values["sliding_layers"])
        return cls(**values)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5


def spec_from_values(arch: Architecture, values: dict) -> ModelSpec:
    """Completes the derived fields (head_dim, kv heads, tying) and validates the rest."""
    values = dict(values)
    values.setdefault("num_kv_heads", values.get("num_heads"))
    if values.get("head_dim") is None and values.get("num_heads"):
        values["head_dim"] = values["hidden_size"] // values["num_heads"]
    values.setdefault("tie_embeddings", arch.default_tie_embeddings)
    values.setdefault("rope_theta", 10000.0)
    values.setdefault("max_position", 4096)
    missing = [f.name for f in dataclasses.fields(ModelSpec)
               if f.name != "arch" and f.default is dataclasses.MISSING and values.get(f.name) is None]
    if missing:
        raise SourceError(f"the model's configuration lacks {', '.join(missing)}")
    sliding = values.get("sliding_layers")
    if sliding is None:
        sliding = arch.sliding_layers(int(values["num_layers"]))
    window = int(values.get("sliding_window") or 0) if sliding else 0
    return ModelSpec(
        arch=arch.name,
        num_layers=int(values["num_layers"]),
        hidden_size=int(values["hidden_size"]),
        intermediate_size=int(values["intermediate_size"]),
        num_heads=int(values["num_heads"]),
        num_kv_heads=int(values["num_kv_heads"]),
        head_dim=int(values["head_dim"]),
        vocab_size=int(values["vocab_size"]),
        rms_eps=float(values["rms_eps"]),
        rope_theta=float(values["rope_theta"]),
        max_position=int(values["max_position"]),
        tie_embeddings=bool(values["tie_embeddings"]),
        sliding_window=window,
        sliding_layers=tuple(sorted(int(i) for i in sliding)) if window else (),
        sliding_rope_theta=float(values.get("sliding_rope_theta") or arch.sliding_rope_theta or values["rope_theta"]),
        query_pre_attn_scalar=float(values.get("query_pre_attn_scalar") or 0.0),
    )


def hf_config_values(config: dict) -> dict:
    values = {field: config[key] for key, field in _HF_CONFIG.items() if config.get(key) is not None}
    if config.get("layer_types"):
        values["sliding_layers"] = [i for i, kind in enumerate(config["layer_types"]) if kind == "sliding_attention"]
    # transformers 5 keeps per-layer-type rotary bases in "rope_parameters"; older configs a key.
    rope = config.get("rope_parameters") or {}
    sliding_rope = rope.get("sliding_attention") if isinstance(rope.get("sliding_attention"), dict) else {}
    full_rope = rope.get("full_attention") if isinstance(rope.get("full_attention"), dict) else rope
    if "rope_theta" in sliding_rope or "rope_local_base_freq" in config:
        values["sliding_rope_theta"] = sliding_rope.get("rope_theta", config.get("rope_local_base_freq"))
    if "rope_theta" not in values and "rope_theta" in full_rope:
        values["rope_theta"] = full_rope["rope_theta"]
    return values


def gguf_config_values(arch_name: str, metadata: dict) -> dict:
    prefix = arch_name + "."
    return {
        field: metadata[prefix + key] for key, field in _GGUF_CONFIG.items() if prefix + key in metadata
    }
