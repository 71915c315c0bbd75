"""How the next token is chosen: greedy, or sampled with temperature, top-p, top-k, a repetition
penalty and a seed.

``SamplingParams`` is what a request carries (the API server, the chat service and the CLI share
it); ``temperature == 0`` is greedy decoding, token-identical to the top-1 path.
"""

from __future__ import annotations

import dataclasses
import math

from engine.errors import FleetError


class SamplingError(FleetError):
    """A sampling parameter is out of range; ``field`` names it (the API answers 400 with it)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens (0: no limit beyond the candidates the stage returns)
    repetition_penalty: float = 1.0  # > 1 makes tokens already in the sequence less likely (CTRL's rule)
    seed: int | None = None  # the same seed, request and configuration give the same text

    def __post_init__(self):
        _check("temperature", self.temperature, 0.0, 2.0)
        _check("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError("top_k", f"must be a whole number of 0 or more, not {self.top_k!r}")
        _check("repetition_penalty", self.repetition_penalty, 0.0, 10.0, low_open=True)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise SamplingError("seed", f"must be a whole number, not {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0



def _check(field: str, value, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SamplingError(field, f"must be a number, not {value!r}")
    if value > high or value < low or (low_open and value == low):
        bound = f"more than {low:g}" if low_open else f"at least {low:g}"
        raise SamplingError(field, f"must be {bound} and at most {high:g}, not {value!r}")


GREEDY = SamplingParams()
