"""The coordinator's tokenizer: the openvino-tokenizers IRs of the first shard, via openvino_genai."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.errors import ShardError


class ChatTokenizer:
    def __init__(self, folder: Path):
        import openvino_genai

        folder = Path(folder)
        if not (folder / "openvino_tokenizer.xml").exists():
            raise ShardError(f"{folder} holds no tokenizer: give the first stage's shard to the coordinator")
        self._tok = openvino_genai.Tokenizer(str(folder))
        self.has_chat_template = bool(self._tok.chat_template)

    def prompt_ids(self, prompt: str, system: str | None = None, chat: bool = True) -> np.ndarray:
        """Token ids [1, n] of a user prompt, wrapped in the model's chat template when it has one."""
        if chat and self.has_chat_template:
            history = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            text = self._tok.apply_chat_template(history, add_generation_prompt=True)
            ids = self._tok.encode(text, add_special_tokens=False).input_ids
        else:
            ids = self._tok.encode(prompt).input_ids
        return np.array(ids.data, dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


class TextStream:
    """Turns a growing list of token ids into text increments, holding back incomplete characters."""

    def __init__(self, tokenizer: ChatTokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._text = ""

    def push(self, token: int) -> str:
        self._ids.append(int(token))
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):  # a multi-byte character split across tokens: wait for the rest
            return ""
        new, self._text = text[len(self._text):], text
        return new
