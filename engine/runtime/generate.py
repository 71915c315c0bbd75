"""The generation loop: prefill, then greedy decode through a stage chain, with timings.

The loop only needs something with ``reset()`` and ``forward(ids, attention_mask, position_ids)``
returning logits, so the in-process chain and (later) the distributed pipeline share it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Protocol

import numpy as np


class Chain(Protocol):
    def reset(self) -> None: ...

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray: ...


@dataclasses.dataclass
class Generation:
    prompt_tokens: int
    tokens: list[int]
    ttft_s: float  # prompt in -> first new token out
    decode_s: float  # first token -> last token
    stopped_by: str  # "eos" | "max_tokens" | "cancelled"

    @property
    def decode_tok_s(self) -> float:
        """Decode throughput: tokens after the first over the time they took."""
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    def to_json(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": len(self.tokens),
            "ttft_ms": round(self.ttft_s * 1e3, 2),
            "decode_tok_s": round(self.decode_tok_s, 2),
            "stopped_by": self.stopped_by,
        }


class Generator:
    """Greedy generation over a chain, with preallocated mask and position buffers."""

    def __init__(self, chain: Chain, max_length: int, eos_ids: list[int] | tuple[int, ...] = ()):
        self.chain = chain
        self.max_length = max_length
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self._mask = np.ones((1, max_length), dtype=np.int64)
        self._positions = np.arange(max_length, dtype=np.int64)[None, :]
        self._token = np.zeros((1, 1), dtype=np.int64)

    def generate(
        self,
        input_ids: np.ndarray,
        max_new_tokens: int,
        *,
        ignore_eos: bool = False,
        on_token: Callable[[int], None] | None = None,
        cancel=None,
    ) -> Generation:
        ids = np.ascontiguousarray(input_ids, dtype=np.int64).reshape(1, -1)
        n = ids.shape[1]
        max_new_tokens = min(max_new_tokens, self.max_length - n)
        if max_new_tokens <= 0:
            raise ValueError(f"the prompt ({n} tokens) leaves no room in the context of {self.max_length}")
        eos = frozenset() if ignore_eos else self.eos_ids
        self.chain.reset()
        start = time.perf_counter()
        logits = self.chain.forward(ids, self._mask[:, :n], self._positions[:, :n])
        token = int(logits[0, -1].argmax())
        first = time.perf_counter()
        tokens = [token]
        if on_token:
            on_token(token)
        stopped = "eos" if token in eos else "max_tokens"
        pos = n
        while stopped == "max_tokens" and len(tokens) < max_new_tokens:
            if cancel is not None and cancel.is_set():
                stopped = "cancelled"
                break
            self._token[0, 0] = token
            logits = self.chain.forward(self._token, self._mask[:, : pos + 1], self._positions[:, pos : pos + 1])
            token = int(logits[0, -1].argmax())
            pos += 1
            tokens.append(token)
            if on_token:
                on_token(token)
            if token in eos:
                stopped = "eos"
        end = time.perf_counter()
        return Generation(n, tokens, first - start, end - first, stopped)
