"""Calibration data for the data-aware INT4 formats: what each stage's float graph sees on real text.

The text is ``calibration.txt`` (shipped beside this module, different from what ``fleet bench
quality`` measures on): public-domain prose (the Gettysburg Address, the opening of the Declaration
of Independence) and passages, dialogues and code written for this project and given to the public
domain.  It is cut into sequences of ``SEQUENCE`` tokens, each led by the tokens the tokenizer puts
before any text (Gemma's and Llama's BOS).  A first stage is given the token ids; a later stage the
hidden states the float model has at its first layer, computed here in torch one layer at a time (so
the extra memory is one layer's, whatever the stage's position).  Every sequence is one prefill of
a fresh KV state: NNCF resets a stateful model's state before each item it infers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.errors import ExportError
from engine.manifest import BEAM_IDX

TEXT = Path(__file__).with_name("calibration.txt")
SEQUENCE = 128  # tokens per calibration sequence
MAX_SEQUENCES = 32


def token_sequences(hf_tokenizer, text: str | None = None) -> np.ndarray:
    """The calibration text as [sequences, SEQUENCE] token ids, each row starting with the
    tokenizer's own leading special tokens."""
    text = TEXT.read_text(encoding="utf-8") if text is None else text
    lead = list(hf_tokenizer("")["input_ids"])  # what the tokenizer puts before any text (BOS or nothing)
    body = list(hf_tokenizer(text, add_special_tokens=False)["input_ids"])
    step = SEQUENCE - len(lead)
    rows = [lead + body[i:i + step] for i in range(0, len(body) - step + 1, step)][:MAX_SEQUENCES]
    if not rows:
        raise ExportError(f"the calibration text holds {len(body)} tokens, fewer than one sequence of {SEQUENCE}")
    return np.array(rows, dtype=np.int64)


def stage_inputs(ckpt, start: int, ids: np.ndarray) -> np.ndarray:
    """What the stage starting at layer ``start`` receives for ``ids`` [sequences, tokens]: the ids
    themselves for a first stage, else the float model's hidden states before layer ``start``."""
    if start == 0:
        return ids
    import torch  # the export process has it; the runtime never imports this module

    from engine.export.decoder import DecoderStage  # torch, as above

    table = ckpt.read("embed", dtype=np.float16)
    hidden = torch.from_numpy(table[ids].astype(np.float32))
    del table
    if ckpt.arch.scaled_embeddings:
        hidden = hidden * np.float32(ckpt.spec.hidden_size ** 0.5)
    spec = ckpt.spec
    mask = torch.ones(ids.shape, dtype=torch.int64)
    positions = torch.arange(ids.shape[1], dtype=torch.int64)[None].expand(ids.shape[0], -1)
    empty = torch.zeros(ids.shape[0], spec.num_kv_heads, 0, spec.head_dim)
    with torch.no_grad():
        for layer in range(start):
            block = DecoderStage(ckpt, layer, layer + 1, weight_dtype=np.float16).eval()
            hidden = block(hidden, mask, positions, empty, empty)[0]
            del block
    return hidden.numpy()


def dataset(first_inputs: np.ndarray, input_name: str, beam_idx: bool):
    """An ``nncf.Dataset`` of one full-sequence prefill per row of ``first_inputs``, keyed by the
    stateful stage graph's input names."""
    import nncf

    def item(row: np.ndarray) -> dict:
        tokens = row.shape[0]
        feed = {input_name: row[None], "attention_mask": np.ones((1, tokens), dtype=np.int64),
                "position_ids": np.arange(tokens, dtype=np.int64)[None]}
        if beam_idx:
            feed[BEAM_IDX] = np.zeros(1, dtype=np.int32)
        return feed

    return nncf.Dataset([item(row) for row in first_inputs])
