"""The coordinator's tokenizer: the openvino-tokenizers IRs of the first shard, via openvino_genai."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.errors import ShardError
from engine.pinned import pin_libraries
from engine.runtime.decode.grammar import Constraint, GrammarTokenizer

REPLACEMENT = "\ufffd"


class ChatTokenizer:
    def __init__(self, folder: Path):
        pin_libraries()
        # workers import this module too but never tokenize: only the coordinator loads openvino_genai
        import openvino_genai

        folder = Path(folder)
        if not (folder / "openvino_tokenizer.xml").exists():
            raise ShardError(f"{folder} holds no tokenizer: give the first stage's shard to the coordinator")
        self.folder = folder
        self._tok = openvino_genai.Tokenizer(str(folder))
        self.has_chat_template = bool(self._tok.chat_template)
        self._grammar: GrammarTokenizer | None = None

    def prompt_ids(self, prompt: str, system: str | None = None, chat: bool = True) -> np.ndarray:
        """Token ids [1, n] of a user prompt, wrapped in the model's chat template when it has one."""
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return self.chat_ids(messages, chat)

    @property
    def template(self) -> str:
        """The model's chat template (Jinja), empty if it has none."""
        return self._tok.chat_template or ""

    def chat_ids(self, messages: list[dict], chat: bool = True, tools: list[dict] | None = None) -> np.ndarray:
        """Token ids [1, n] of a conversation (``{"role", "content"}`` dicts, oldest first, with an
        assistant's ``tool_calls`` and a tool's ``tool_call_id`` where the template renders them)
        ready for the assistant's next reply; ``tools`` (OpenAI's function tools) are given to the
        template.  Without a chat template (or ``chat=False``) the messages' texts are joined by
        blank lines and encoded as plain text."""
        if chat and self.has_chat_template:
            text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools or None)
            ids = self._tok.encode(text, add_special_tokens=False).input_ids
        else:
            ids = self._tok.encode("\n\n".join(m["content"] or "" for m in messages)).input_ids
        return np.array(ids.data, dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text (no special tokens added)."""
        return [int(i) for i in np.asarray(self._tok.encode(text, add_special_tokens=False).input_ids.data).reshape(-1)]

    def constraint(self, grammar: str, eos) -> Constraint:
        """A reply's constraint by ``grammar`` (``grammar.compile_grammar``) over this vocabulary;
        ``eos`` ends a reply once the grammar is complete."""
        if self._grammar is None:  # indexes the vocabulary once (~0.15 s for 49152 tokens)
            self._grammar = GrammarTokenizer(self.folder, frozenset(eos), self.encode)
        return Constraint(grammar, self._grammar)


class TextStream:
    """Turns a growing list of token ids into text increments, holding back incomplete characters.

    Only a small window is decoded per token: the ids of the last emitted piece (as context, so
    that tokenizers which drop a leading space at the start of a decode still give it back) and the
    ids not emitted yet.  A piece is emitted once the window decodes without a trailing replacement
    character, i.e. once a character split across tokens is complete."""

    MAX_PENDING = 8  # ids that still decode to a broken character after this many are emitted as is

    def __init__(self, tokenizer: ChatTokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # ids before this are emitted

    def push(self, token: int) -> str:
        self._ids.append(int(token))
        pending = len(self._ids) - self._read
        context = self._tok.decode(self._ids[self._prefix : self._read]) if self._read > self._prefix else ""
        text = self._tok.decode(self._ids[self._prefix :])
        if (text.endswith(REPLACEMENT) or len(text) <= len(context)) and pending < self.MAX_PENDING:
            return ""  # a character split across tokens, or nothing printable yet (a special token)
        return self._emit(context, text)

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        if self._read >= len(self._ids):
            return ""
        context = self._tok.decode(self._ids[self._prefix : self._read]) if self._read > self._prefix else ""
        return self._emit(context, self._tok.decode(self._ids[self._prefix :]))

    def _emit(self, context: str, text: str) -> str:
        # the context normally decodes the same inside the window; if not, decode the new ids alone
        new = text[len(context):] if text.startswith(context) else self._tok.decode(self._ids[self._read :])
        self._prefix, self._read = self._read, len(self._ids)
        return new
