"""Shared fixtures: tiny random-weight Llama, Qwen2 and Gemma 3 checkpoints (with a real byte-level BPE
tokenizer) built in the test run, and session-cached exports of them."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

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


def pytest_addoption(parser):
    parser.addoption("--screenshots", metavar="DIR", default=None,
                     help="save the GUI tests' 1366x768 screenshots into DIR (`make screenshots`: docs/screenshots)")


def pytest_configure(config):
    import gui_support

    # Garbage is collected on the main thread only: between tests (below) and, in GUI tests, from the
    # app's timer (fleetgui.qtfix explains why a collection on an engine thread can crash Qt).
    gc.disable()

    folder = config.getoption("screenshots")
    gui_support.SCREENSHOTS = Path(folder).resolve() if folder else None


@pytest.fixture(autouse=True)
def _collect_garbage_between_tests():
    yield
    gc.collect()


@pytest.fixture(scope="session")
def qapp(qapp):
    from fleetgui import qtfix

    qtfix.collect_on_gui_thread(qapp)
    return qapp


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


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny(arch, root / arch) for arch in ("llama", "qwen2", "gemma3")}


@pytest.fixture(scope="session")
def tiny_exports(tiny_models, tmp_path_factory):
    """f32 exports of each tiny model as 1, 2 (even) and 3 (uneven 1/2/1) stages, made once."""
    from engine.export.exporter import export_model

    root = tmp_path_factory.mktemp("tiny-exports")
    out = {}
    for arch, folder in tiny_models.items():
        for label, kw in (("1", {"stages": 1}), ("2", {"stages": 2}), ("3", {"split": [1, 3]})):
            out[arch, label] = export_model(str(folder), weights="f32", out=root / f"{arch}-{label}", **kw)
    return out
