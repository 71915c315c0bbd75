"""The second architecture end to end: the real Gemma 3 270M (sliding-window layers, q/k norms,
head_dim 256, scaled embeddings) exported as 1, 2 and 3 stages greedily decodes the very tokens of
transformers' own model of the same GGUF, on eight prompts, one of them longer than the window, on
stateful and on paged stages."""

from __future__ import annotations

import json

import pytest
import torch
from build_cache import cached, digest

from engine.export.exporter import export_model
from engine.manifest import load_manifest
from engine.models.catalog import CATALOG, pull
from engine.runtime.stages.chain import LocalChain
from engine.runtime.decode.generate import Generator
from engine.runtime.decode.tokenizer import ChatTokenizer

pytestmark = pytest.mark.real_model
MODEL = "gemma3-270m"
NEW_TOKENS = 16
F32 = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "The three primary colors are",
    "import numpy as np\n",
    "Water boils at",
    "In 1969, the first person to walk on the moon was",
    # about 850 tokens: well past the 512-token window of the sliding layers
    " ".join(f"item {i}:" for i in range(160)),
]


@pytest.fixture(scope="module")
def gemma_exports():
    # f32 weights: the comparison is against transformers' float model of the same GGUF.
    return {n: export_model(MODEL, stages=n, weights="f32") for n in (1, 2, 3)}


@pytest.fixture(scope="module")
def gemma_reference():
    """Each prompt's token ids and the NEW_TOKENS greedy tokens of transformers' float model of the
    same GGUF, kept between runs (loading the GGUF into transformers takes over a minute here)."""
    key = f"{CATALOG[MODEL].sha256[:12]}-{digest([__file__], ('transformers', 'torch', 'gguf'))}"
    return json.loads((cached("gemma3-reference", key, _reference) / "tokens.json").read_text())


def _reference(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = pull(CATALOG[MODEL])
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokens = {}
    for prompt in PROMPTS:
        ids = hf_tok(prompt).input_ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False)
        tokens[prompt] = {"ids": ids, "greedy": out[0, len(ids):].tolist()}
    (folder / "tokens.json").write_text(json.dumps(tokens))


def test_the_manifest_carries_the_sliding_layers(gemma_exports):
    spec = load_manifest(gemma_exports[1].folders[0]).spec
    assert spec.arch == "gemma3" and spec.head_dim == 256 and spec.sliding_window == 512
    assert spec.sliding_layers == tuple(i for i in range(18) if i not in (5, 11, 17))
    assert spec.tie_embeddings


def test_one_two_three_stateful_or_paged_stages_decode_transformers_greedy_tokens(gemma_exports, gemma_reference):
    tok = ChatTokenizer(gemma_exports[1].folders[0])
    chains = {(n, kind): LocalChain(gemma_exports[n].folders, config=F32, paged=kind == "paged")
              for n in (1, 2, 3) for kind in ("stateful", "paged")}
    long_prompt_seen = False
    for prompt in PROMPTS:
        ids = tok.prompt_ids(prompt, chat=False)
        reference = gemma_reference[prompt]
        assert ids.reshape(-1).tolist() == reference["ids"], f"tokenizer differs on {prompt[:30]!r}"
        long_prompt_seen |= ids.size > 512
        want = reference["greedy"]
        for (n, kind), chain in chains.items():
            got = Generator(chain, max_length=2048).generate(ids.reshape(-1), NEW_TOKENS, ignore_eos=True).tokens
            assert got == want, f"{n}-stage {kind} chain on {prompt[:30]!r}"
    assert long_prompt_seen
