"""The generation loop: prefill, then greedy decode through a stage chain, with timings.

The loop only needs something with ``reset()`` and ``forward(ids, attention_mask, position_ids)``
returning an ``Output`` (top-1 tokens), so the in-process chain and the distributed pipeline share it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Protocol

import numpy as np

from engine.runtime.stage import Output
from engine.wire import Flag


class Chain(Protocol):
    def reset(self, stream: int = 0) -> None: ...

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                flags: Flag = Flag.NONE, stream: int = 0) -> Output: ...


class Breakdown:
    """Where a decode step's time goes, summed over steps: compute per stage, the network (waiting
    beyond the remote stages' compute) and the host (everything else: the loop, masks, framing)."""

    def __init__(self):
        self.steps = 0
        self.total_ms = 0.0
        self.stage_ms: list[float] = []
        self.network_ms = 0.0

    def add(self, wall_ms: float, out: Output) -> None:
        if not self.stage_ms:
            self.stage_ms = [0.0] * len(out.stage_ms)
        self.steps += 1
        self.total_ms += wall_ms
        self.stage_ms = [a + b for a, b in zip(self.stage_ms, out.stage_ms)]
        self.network_ms += out.network_ms

    def to_json(self) -> dict:
        n = max(self.steps, 1)
        stage = [s / n for s in self.stage_ms]
        network = self.network_ms / n
        total = self.total_ms / n
        return {
            "steps": self.steps,
            "token_ms": round(total, 3),
            "stage_compute_ms": [round(s, 3) for s in stage],
            "network_ms": round(network, 3),
            "host_ms": round(max(total - sum(stage) - network, 0.0), 3),
        }


@dataclasses.dataclass
class Generation:
    prompt_tokens: int
    tokens: list[int]
    ttft_s: float  # prompt in -> first new token out
    decode_s: float  # first token -> last token
    stopped_by: str  # "eos" | "max_tokens" | "cancelled"
    breakdown: Breakdown = dataclasses.field(default_factory=Breakdown)  # decode steps only

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
            "breakdown": self.breakdown.to_json(),
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
        breakdown = Breakdown()
        self.chain.reset()
        start = time.perf_counter()
        token = int(self.chain.forward(ids, self._mask[:, :n], self._positions[:, :n]).tokens[-1])
        first = step_start = time.perf_counter()
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
            out = self.chain.forward(self._token, self._mask[:, : pos + 1], self._positions[:, pos : pos + 1])
            token = int(out.tokens[-1])
            pos += 1
            tokens.append(token)
            if on_token:
                on_token(token)
            if token in eos:
                stopped = "eos"
            now = time.perf_counter()
            breakdown.add((now - step_start) * 1e3, out)
            step_start = now
        end = time.perf_counter()
        return Generation(n, tokens, first - start, end - first, stopped, breakdown)
