"""Export-time tokenizer work: the openvino-tokenizers IRs and the config files LLMPipeline reads.

Only the coordinator's shard (the first stage) carries them; workers never tokenize.
"""

from __future__ import annotations

import json
from pathlib import Path

import openvino as ov

from engine.errors import SourceError
from engine.pinned import pin_libraries

TOKENIZER_XML = "openvino_tokenizer.xml"
DETOKENIZER_XML = "openvino_detokenizer.xml"
# Tokens that end an assistant turn in the chat templates of the supported families.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|endoftext|>")


def load_hf_tokenizer(kind: str, path: Path):
    from transformers import AutoTokenizer

    try:
        if kind == "gguf":
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise SourceError(f"cannot read the tokenizer of {path}: {exc}") from exc


def stop_token_ids(tokenizer) -> list[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for token in END_OF_TURN:
        if token in vocab and token in tokenizer.all_special_tokens + list(tokenizer.added_tokens_encoder):
            ids.add(int(vocab[token]))
    return sorted(ids)


def write_tokenizer(tokenizer, folder: Path) -> None:
    pin_libraries()
    # openvino_tokenizers takes ~0.4 s to import and patches openvino.Core on import: only this step needs it
    from openvino_tokenizers import convert_tokenizer

    tok, detok = convert_tokenizer(tokenizer, with_detokenizer=True, skip_special_tokens=True)
    ov.save_model(tok, folder / TOKENIZER_XML)
    ov.save_model(detok, folder / DETOKENIZER_XML)


def write_hf_configs(tokenizer, spec, folder: Path, eos_ids: list[int]) -> None:
    """config.json and generation_config.json, as openvino_genai.LLMPipeline expects beside the IR."""
    config = {
        "model_type": {"gemma3": "gemma3_text"}.get(spec.arch, spec.arch),
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "mistral": "MistralForCausalLM", "gemma3": "Gemma3ForCausalLM"}.get(spec.arch, "CausalLM")],
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "rms_norm_eps": spec.rms_eps,
        "rope_theta": spec.rope_theta,
        "max_position_embeddings": spec.max_position,
        "tie_word_embeddings": spec.tie_embeddings,
        **({"sliding_window": spec.sliding_window,
            "layer_types": ["sliding_attention" if i in spec.sliding_layers else "full_attention"
                            for i in range(spec.num_layers)]} if spec.sliding_window else {}),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
    }
    generation = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos_ids, "do_sample": False}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
