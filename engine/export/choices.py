"""Faithful or fast: the two ways a GGUF model is exported, in a user's words, with what each was
measured to cost.

Faithful (``gguf``) keeps the GGUF's own quantized weights, so the model answers as it does in
llama.cpp; Fast (``int4``) quantizes them again to INT4: smaller and faster for one user, but it
answers worse.  ``auto`` exports a GGUF faithfully (``compress.best_weights``).  The figures are the
measured ones of docs/benchmarks.md; a model that was not measured shows Qwen2.5-Coder-1.5B's, and
says so.
"""

from __future__ import annotations

import dataclasses

from engine.config import AUTO_WEIGHTS


@dataclasses.dataclass(frozen=True)
class Measured:
    kl: float | None = None  # nats per token from the GGUF's own weights, at the stages' default precision
    humaneval: float | None = None  # pass@1 in %, greedy, the same prompt and API for every server
    same_outcome: int | None = None  # problems passed or failed as llama.cpp did on the same GGUF
    tok_s_1: float | None = None  # decode through the API, one user (``fleet bench serve``)
    tok_s_4: float | None = None  # the same, four users at once, all of them together


@dataclasses.dataclass(frozen=True)
class Choice:
    name: str
    weights: str
    what: str
    label: str  # the choice as the app offers it, in a user's words


FAITHFUL = Choice("Faithful", "gguf", "the GGUF's own weights: it answers as it does in llama.cpp",
                  "Same answers as the GGUF")
FAST = Choice("Fast", "int4", "quantized again to INT4: faster, but it no longer answers just as the GGUF does",
              "Faster, slightly different answers")
CHOICES = (FAITHFUL, FAST)
LLAMACPP = "llama.cpp"
REFERENCE = "qwen2.5-coder-1.5b"
PROBLEMS = 82  # HumanEval problems, evenly spread over its 164 (`fleet bench quality --cases 82`)

# The figures of docs/benchmarks.md: KL from "Quality" (`fleet bench quality`), HumanEval and tok/s
# from "Faithful by default" (`fleet bench quality --parts humaneval` and `fleet bench serve
# --llamacpp`, every server through the same client; llama.cpp's two runs averaged here).
MEASURED: dict[str, dict[str, Measured]] = {
    "qwen2.5-coder-1.5b": {
        "gguf": Measured(kl=0.0006, humaneval=68.3, same_outcome=79, tok_s_1=15.9, tok_s_4=40.8),
        "int4": Measured(kl=0.064, humaneval=69.5, same_outcome=75, tok_s_1=20.7, tok_s_4=61.8),
        LLAMACPP: Measured(humaneval=69.5, tok_s_1=23.3, tok_s_4=31.4),
    },
    "smollm2-135m": {"gguf": Measured(kl=0.002), "int4": Measured(kl=0.32)},
    "gemma3-270m": {"gguf": Measured(kl=0.003), "int4": Measured(kl=0.60)},
}


def choice_of(weights: str) -> Choice | None:
    """The choice a weight format is (``auto``: Faithful, what it gives a GGUF), or None."""
    if weights == AUTO_WEIGHTS:
        return FAITHFUL
    return next((c for c in CHOICES if c.weights == weights), None)


def other_than(choice: Choice) -> Choice:
    return next(c for c in CHOICES if c is not choice)


def measured_on(model: str | None) -> tuple[dict[str, Measured], str]:
    """The figures measured on ``model`` (a catalog name) and its name, or the reference model's
    where ``model`` was not measured."""
    if model in MEASURED:
        return MEASURED[model], model
    return MEASURED[REFERENCE], REFERENCE


def _figures(m: Measured, peer: Measured | None, kl: bool = True) -> list[str]:
    out = []
    if m.humaneval is not None:
        theirs = f" (llama.cpp on the same file {peer.humaneval:.1f}%)" if peer and peer.humaneval is not None else ""
        out.append(f"solves {m.humaneval:.1f}% of {PROBLEMS} HumanEval coding problems{theirs}")
    if m.same_outcome is not None:
        out.append(f"passes or fails {m.same_outcome} of them as llama.cpp does")
    if m.kl is not None and kl:
        out.append(f"next-word odds {'as' if m.kl < 0.01 else 'off'} the GGUF's (KL {m.kl:g} nats)")
    if m.tok_s_1 is not None and m.tok_s_4 is not None:
        theirs = (f" (llama.cpp {peer.tok_s_1:.0f} and {peer.tok_s_4:.0f})"
                  if peer and peer.tok_s_1 is not None and peer.tok_s_4 is not None else "")
        out.append(f"{m.tok_s_1:.0f} tok/s for one user, {m.tok_s_4:.0f} for four{theirs}")
    return out


def describe(choice: Choice, model: str | None = None, kl: bool = True) -> str:
    """What a choice is and costs, with the figures measured on ``model`` (a catalog name), or on
    Qwen2.5-Coder-1.5B where ``model`` was not measured; ``kl`` False leaves the KL out (the app
    keeps it for its details)."""
    measured, on = measured_on(model)
    figures = _figures(measured[choice.weights], measured.get(LLAMACPP), kl)
    text = f"{choice.what[0].upper()}{choice.what[1:]}."
    return text + (f" Measured on {on}: {'; '.join(figures)}." if figures else "")
