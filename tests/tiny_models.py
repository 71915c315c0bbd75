"""The tiny random-weight Llama, Qwen2 and Gemma 3 checkpoints (with a real byte-level BPE tokenizer)
the suite runs on, and their f32 exports as 1, 2 and 3 stages and as two tensor-parallel ranks,
kept between runs.

A set is built once and kept in the user's cache (tests/build_cache.py) under a key: a hash of
this file, of the source of every engine module the exporter imports, and of the versions of the
packages that build and export it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from build_cache import ROOT, cached, digest

ARCHITECTURES = ("llama", "qwen2", "gemma3")
# 3: uneven, 1/2/1 layers; ranks: two tensor-parallel ranks of the whole model
SPLITS = {"1": {"stages": 1}, "2": {"stages": 2}, "3": {"split": [1, 3]}, "ranks": {"ranks": 2}}
PACKAGES = ("torch", "transformers", "tokenizers", "openvino", "openvino-tokenizers", "numpy")

TINY_LAYERS = 4
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "A fleet of laptops can serve one language model together.",
    "def add(a, b):\n    return a + b\n",
] * 20


def _tokenizer(folder: Path):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=320, min_frequency=2,
                            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|im_end|>",
                                  bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return tok


def build_tiny(arch: str, folder: Path) -> Path:
    import torch
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    torch.manual_seed({"llama": 0, "qwen2": 1, "gemma3": 2}[arch])
    common = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=TINY_LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=2)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=True))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=False))
    else:
        # A 4-token window, so prompts and replies in the tests slide past it; head_dim and the
        # attention scale differ from hidden/heads, as in the real model's config they may.
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            **common, head_dim=32, query_pre_attn_scalar=24, sliding_window=4,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            pad_token_id=1))
    # Random init leaves biases and norms at 0/1; perturb them so the test sees them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    _tokenizer(folder)
    return folder


def _module_file(name: str) -> Path | None:
    path = ROOT.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def engine_closure(start: str) -> dict[str, Path]:
    """Every engine module ``start`` imports, directly or not, at the top or inside a function
    (read from the source, nothing imported), with its file."""
    found: dict[str, Path] = {}
    todo = [start]
    while todo:
        name = todo.pop()
        if name in found or (path := _module_file(name)) is None:
            continue
        found[name] = path
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # the packages' __init__ run too
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names if a.name.split(".")[0] == "engine"]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("engine"):
                todo += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]  # a name may be a module
    return found


def _export(folder: Path, arch: str, label: str):
    """The f32 export of ``arch`` as ``SPLITS[label]`` in the set ``folder`` (made, or reused)."""
    from engine.export.exporter import export_model

    return export_model(str(folder / "models" / arch), weights="f32", out=folder / "exports" / f"{arch}-{label}",
                        **SPLITS[label])


def _build(folder: Path) -> None:
    for arch in ARCHITECTURES:
        build_tiny(arch, folder / "models" / arch)
        for label in SPLITS:
            _export(folder, arch, label)


def tiny_set(root: Path | None = None):
    """(models, exports): {arch: checkpoint folder} and {(arch, "1"|"2"|"3"|"ranks"): ExportResult}, from
    the cache, made first if it has no intact set for today's code."""
    key = digest([Path(__file__), *engine_closure("engine.export.exporter").values()], PACKAGES)
    folder = cached("tiny-models", key, _build, root)
    models = {arch: folder / "models" / arch for arch in ARCHITECTURES}
    exports = {(arch, label): _export(folder, arch, label) for arch in ARCHITECTURES for label in SPLITS}
    assert all(result.cached for result in exports.values()), "a cached tiny export was not reused"
    return models, exports
