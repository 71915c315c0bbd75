"""Supported decoder architectures as data: config keys and checkpoint tensor names per stage part.

Adding a Llama-like architecture (Mistral, Phi-3 with split projections, ...) is a table entry: the
HF config keys, the Hugging Face and GGUF tensor names of every part, and whether the GGUF
converter permuted the rotary halves of q/k (llama.cpp does that for the ``llama`` family only).
"""

from __future__ import annotations

import dataclasses

from engine.errors import SourceError

# Parts of one decoder layer, in the order the decoder module consumes them.
LAYER_PARTS = (
    "input_norm", "q", "k", "v", "q_bias", "k_bias", "v_bias", "o",
    "post_norm", "gate", "up", "down",
)
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

    def layer_parts(self) -> tuple[str, ...]:
        if self.attention_bias:
            return LAYER_PARTS
        return tuple(p for p in LAYER_PARTS if not p.endswith("_bias"))


ARCHITECTURES = {
    a.name: a
    for a in (
        Architecture("llama", ("llama",), attention_bias=False, gguf_permuted_qk=True,
                     default_tie_embeddings=False),
        Architecture("mistral", ("mistral",), attention_bias=False, gguf_permuted_qk=True,
                     default_tie_embeddings=False),
        Architecture("qwen2", ("qwen2",), attention_bias=True, gguf_permuted_qk=False,
                     default_tie_embeddings=False),
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

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: dict) -> "ModelSpec":
        return cls(**{f.name: raw[f.name] for f in dataclasses.fields(cls)})


def spec_from_values(arch: Architecture, values: dict) -> ModelSpec:
    """Completes the derived fields (head_dim, kv heads, tying) and validates the rest."""
    values = dict(values)
    values.setdefault("num_kv_heads", values.get("num_heads"))
    if values.get("head_dim") is None and values.get("num_heads"):
        values["head_dim"] = values["hidden_size"] // values["num_heads"]
    values.setdefault("tie_embeddings", arch.default_tie_embeddings)
    values.setdefault("rope_theta", 10000.0)
    values.setdefault("max_position", 4096)
    missing = [f.name for f in dataclasses.fields(ModelSpec) if f.name != "arch" and values.get(f.name) is None]
    if missing:
        raise SourceError(f"the model's configuration lacks {', '.join(missing)}")
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
    )


def hf_config_values(config: dict) -> dict:
    return {field: config[key] for key, field in _HF_CONFIG.items() if config.get(key) is not None}


def gguf_config_values(arch_name: str, metadata: dict) -> dict:
    prefix = arch_name + "."
    return {
        field: metadata[prefix + key] for key, field in _GGUF_CONFIG.items() if prefix + key in metadata
    }
