"""A traceable decoder stage in PyTorch: explicit KV tensors in and out, rotary from position ids.

Hugging Face's cache objects and rotary modules do not trace; this rewrite holds only the stage's
own layers (plus embeddings for the first stage, final norm and head for the last) and takes
everything that changes per step as a tensor input, so ``torch.jit.trace`` records one graph that
serves prefill and decode alike.

The attention mask covers the physical KV slots (past plus current).  The graph derives the causal
part from the physical cache length and ANDs it with ``attention_mask``, so a later forward can
hide rejected draft slots by zeroing their mask entries while ``position_ids`` follow the logical
sequence.  Sliding-window layers (Gemma 3) also hide every slot whose logical position (the count
of visible slots before it) lies a window or more behind the query's position id.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from engine.export.rankcut import MLP_UNIT, rank_cuts
from engine.models.architectures import ModelSpec
from engine.models.checkpoint import Checkpoint


def _param(array: np.ndarray, dtype=np.float32) -> nn.Parameter:
    return nn.Parameter(torch.from_numpy(np.ascontiguousarray(array, dtype=dtype)), requires_grad=False)


def _w(param: torch.Tensor) -> torch.Tensor:
    """A weight as f32 for the computation; a 16-bit weight traces as constant + Convert, the
    decompression pattern OpenVINO and NNCF expect, so the graph still computes in f32."""
    return param if param.dtype == torch.float32 else param.float()


class RMSNorm(nn.Module):
    def __init__(self, weight: np.ndarray, eps: float):
        super().__init__()
        self.weight = _param(weight)
        self.eps = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


MATRICES = ("q", "k", "v", "o", "gate", "up", "down")
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def _identity(x):
    return x


def rank_weights(spec: ModelSpec, weights: dict[str, np.ndarray], rank: int, ranks: int,
                 unit: int = MLP_UNIT) -> tuple[dict, int, int]:
    """A layer's matrices as tensor-parallel rank ``rank`` of ``ranks`` holds them (``rankcut``), with
    the rank's query and key/value head counts."""
    if ranks == 1:
        return weights, spec.num_heads, spec.num_kv_heads
    cuts, heads, kv_heads = rank_cuts(spec, rank, ranks, unit)
    sliced = {}
    for name, w in weights.items():
        if name in cuts:
            axis, kept = cuts[name]
            w = w[kept] if axis == 0 else w[:, kept]
        sliced[name] = np.ascontiguousarray(w)
    return sliced, heads, kv_heads


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, weights: dict[str, np.ndarray], dtype=np.float32,
                 activation: str = "silu", sliding: bool = False, rank: int = 0, ranks: int = 1,
                 unit: int = MLP_UNIT):
        super().__init__()
        self.spec = spec
        weights, self.heads, self.kv_heads = rank_weights(spec, weights, rank, ranks, unit)
        self.sliding = sliding
        self.act = ACTIVATIONS[activation]
        self.input_norm = RMSNorm(weights["input_norm"], spec.rms_eps)
        self.post_norm = RMSNorm(weights["post_norm"], spec.rms_eps)
        # Optional norms (Gemma 3); absent ones are the identity.
        for name in ("q_norm", "k_norm", "attn_out_norm", "ffn_out_norm"):
            setattr(self, name, RMSNorm(weights[name], spec.rms_eps) if name in weights else _identity)
        for name in MATRICES:
            setattr(self, name, _param(weights[name], dtype))
        for name in ("q_bias", "k_bias", "v_bias"):
            setattr(self, name, _param(weights[name]) if name in weights else None)

    def _project(self, x, heads, weight, bias):
        b, t, _ = x.shape
        y = F.linear(x, _w(weight), bias)
        return y.view(b, t, heads, self.spec.head_dim).transpose(1, 2)

    def forward(self, x, cos, sin, mask, past_k, past_v):
        spec = self.spec
        h = self.input_norm(x)
        q = self.q_norm(self._project(h, self.heads, self.q, self.q_bias))
        k = self.k_norm(self._project(h, self.kv_heads, self.k, self.k_bias))
        v = self._project(h, self.kv_heads, self.v, self.v_bias)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = torch.cat([past_k, k], dim=2)
        v = torch.cat([past_v, v], dim=2)
        groups = spec.num_heads // spec.num_kv_heads
        k_all, v_all = k, v
        if groups > 1:
            b, kvh, s, d = k.shape
            k_all = k[:, :, None, :, :].expand(b, kvh, groups, s, d).reshape(b, kvh * groups, s, d)
            v_all = v[:, :, None, :, :].expand(b, kvh, groups, s, d).reshape(b, kvh * groups, s, d)
        attn = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=spec.attention_scale)
        b, _, t, _ = attn.shape
        x = x + self.attn_out_norm(F.linear(attn.transpose(1, 2).reshape(b, t, self.heads * spec.head_dim), _w(self.o)))
        h = self.post_norm(x)
        x = x + self.ffn_out_norm(F.linear(self.act(F.linear(h, _w(self.gate))) * F.linear(h, _w(self.up)),
                                           _w(self.down)))
        return x, k, v


class DecoderStage(nn.Module):
    """Layers ``[start, end)`` of a decoder, plus the final norm when the stage is the last.

    forward(hidden, attention_mask, position_ids, *past) -> (hidden, *present) with ``past`` and
    ``present`` as (key, value) per layer, each ``[batch, kv_heads, seq, head_dim]``.  The vocabulary
    matrices (embedding, head) never enter torch: ``graph.attach_vocabulary`` adds them to the
    converted graph straight from the checkpoint, so the largest matrices of a model are neither
    traced nor held twice.
    """

    def __init__(self, ckpt: Checkpoint, start: int, end: int, weight_dtype=np.float32, rank: int = 0,
                 ranks: int = 1, unit: int = MLP_UNIT):
        """``weight_dtype=np.float16`` halves the memory of the matrices (exports to 16-bit or
        compressed formats lose nothing by it); norms, biases and the computation stay f32.
        ``rank`` of ``ranks``: the tensor-parallel part of each layer (``rank_weights``, its MLP cut
        in ``unit`` columns)."""
        super().__init__()
        spec = ckpt.spec
        self.spec, self.start, self.end = spec, start, end
        self.rank, self.ranks, self.unit = rank, ranks, unit
        self.first = start == 0
        self.last = end == spec.num_layers
        parts = ckpt.arch.layer_parts()
        self.layers = nn.ModuleList(
            DecoderLayer(
                spec,
                {p: ckpt.read(p, i, dtype=weight_dtype if p in MATRICES else np.float32)
                 for p in parts if ckpt.has(p, i)},
                weight_dtype,
                ckpt.arch.activation,
                sliding=i in spec.sliding_layers,
                rank=rank,
                ranks=ranks,
                unit=unit,
            )
            for i in range(start, end)
        )
        self.kv_heads = self.layers[0].kv_heads if len(self.layers) else spec.num_kv_heads
        self.final_norm = RMSNorm(ckpt.read("final_norm"), spec.rms_eps) if self.last else None
        self.register_buffer("inv_freq", self._inv_freq(spec.rope_theta), persistent=False)
        self.register_buffer("sliding_inv_freq", self._inv_freq(spec.sliding_rope_theta or spec.rope_theta),
                             persistent=False)

    def _inv_freq(self, theta: float) -> torch.Tensor:
        d = self.spec.head_dim
        return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))

    @staticmethod
    def _rotary(position_ids, inv_freq):
        freqs = position_ids[:, :, None].float() * inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:, None], emb.sin()[:, None]

    def forward(self, x, attention_mask, position_ids, *past):
        past_len = past[0].shape[2]
        kinds = {layer.sliding for layer in self.layers}
        rotary = {False: self._rotary(position_ids, self.inv_freq)} if False in kinds else {}
        masks = {False: self._mask(attention_mask, position_ids, x.shape[1], past_len)} if False in kinds else {}
        if True in kinds:
            rotary[True] = self._rotary(position_ids, self.sliding_inv_freq)
            masks[True] = self._mask(attention_mask, position_ids, x.shape[1], past_len, self.spec.sliding_window)
        present = []
        for n, layer in enumerate(self.layers):
            cos, sin = rotary[layer.sliding]
            x, k, v = layer(x, cos, sin, masks[layer.sliding], past[2 * n], past[2 * n + 1])
            present += [k, v]
        if self.last:
            x = self.final_norm(x)
        return (x, *present)

    @staticmethod
    def _mask(attention_mask, position_ids, query_len, past_len, window: int = 0):
        """Additive [batch, 1, query, kv] mask: causal over physical slots AND the given slot mask
        (AND, with a window, within ``window`` logical positions of the query)."""
        kv_len = past_len + query_len
        kv_pos = torch.arange(kv_len)
        q_pos = torch.arange(query_len) + past_len
        causal = kv_pos[None, :] <= q_pos[:, None]
        visible = attention_mask > 0
        allowed = causal[None, None, :, :] & visible[:, None, None, :]
        if window:
            logical = torch.cumsum(visible.to(torch.int64), dim=-1) - 1  # [batch, kv]
            near = logical[:, None, :] > position_ids[:, :, None] - window  # [batch, query, kv]
            allowed = allowed & near[:, None, :, :]
        zero = torch.zeros((), dtype=torch.float32)
        return torch.where(allowed, zero, torch.tensor(torch.finfo(torch.float32).min))
