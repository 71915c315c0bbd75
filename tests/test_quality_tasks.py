"""The task-level quality measure of `fleet bench quality`: HumanEval answers run in the sandbox (passing
and failing programs, the time limit, no network, no secrets of ours), the code taken from typical chat
replies, and the whole part through the real API on a tiny model and on llama.cpp."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.bench import sandbox
from engine.bench.tasks import extract_code, humaneval, problems, program
from engine.errors import FleetError

FIRST = problems(1)[0]  # HumanEval/0, has_close_elements
WHOLE = FIRST["prompt"] + FIRST["canonical_solution"]
BODY = FIRST["canonical_solution"]


def test_a_right_answer_passes_and_a_wrong_one_fails():
    assert FIRST["task_id"] == "HumanEval/0"
    assert sandbox.run_program(program(FIRST, BODY)) == sandbox.Outcome(True, "passed")
    wrong = sandbox.run_program(program(FIRST, "    return True\n"))
    assert not wrong.passed and wrong.status == "failed: AssertionError"
    broken = sandbox.run_program(program(FIRST, "def has_close_elements(numbers, threshold):\n    return (\n"))
    assert not broken.passed and "SyntaxError" in broken.status


def test_an_endless_answer_is_stopped_with_what_it_forked(tmp_path):
    pid_file = tmp_path / "child.pid"
    source = (f"import os\npid = os.fork()\nif pid:\n    open({str(pid_file)!r}, 'w').write(str(pid))\n"
              "while True:\n    pass\n")
    assert sandbox.run_program(source, timeout_s=2) == sandbox.Outcome(False, "timed out")
    child = int(pid_file.read_text())
    for _ in range(100):  # the kill is sent; wait (bounded) until the kernel has ended the child
        if _ended(child):
            break
        time.sleep(0.05)
    assert _ended(child), f"the answer's forked child {child} is still running"


def _ended(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def test_an_answer_cannot_reach_the_network(tmp_path):
    if sandbox.isolation() != "network namespace":
        pytest.skip("no network namespace can be made here: the sandbox runs with resource limits only")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0)
        port = listener.getsockname()[1]
        source = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=5).close()\n"
        # the same program outside the sandbox does reach the listener
        (tmp_path / "connect.py").write_text(source)
        assert subprocess.run([sys.executable, str(tmp_path / "connect.py")], timeout=30).returncode == 0
        listener.accept()[0].close()
        outcome = sandbox.run_program(source)
        assert not outcome.passed and "Network is unreachable" in outcome.status, outcome
        with pytest.raises(BlockingIOError):  # no second connection arrived
            listener.accept()


def test_no_secret_of_ours_reaches_the_answer(monkeypatch):
    monkeypatch.setenv("FLEETSHARD_TEST_SECRET", "hunter2-token")
    source = ("import os\nassert not any('hunter2' in v for v in os.environ.values()), sorted(os.environ)\n"
              "assert sorted(os.listdir('.')) == ['answer.py', 'stderr.txt'], os.listdir('.')\n")
    assert sandbox.run_program(source) == sandbox.Outcome(True, "passed")


REPLIES = {
    "prose around a python block": f"Here is the function:\n\n```python\n{WHOLE}```\n\nIt compares every pair.",
    "a usage block first": f"```python\nprint(has_close_elements([1.0], 0.5))\n```\nThe function:\n```py\n{WHOLE}```",
    "cut off by the token limit": f"Sure.\n```python\n{WHOLE}\n\n# Example usage:\nif __name__ == '__main__':\n    pr",
    "no fence at all": WHOLE,
    "a bare body in an unnamed block": f"```\n{BODY}```",
    "a body at the margin": "```python\n" + "\n".join(line[4:] for line in BODY.splitlines()) + "\n```",
}


@pytest.mark.parametrize("kind", list(REPLIES))
def test_the_code_of_a_typical_reply_is_found_and_passes(kind):
    code = extract_code(REPLIES[kind], FIRST["entry_point"])
    assert "print(has_close_elements([1.0], 0.5))" not in code
    assert sandbox.run_program(program(FIRST, code)).passed, (kind, code)


def test_the_subset_is_fixed_and_spread_over_the_set():
    every = problems()
    assert len(every) == 164 and len({p["task_id"] for p in every}) == 164
    four = [p["task_id"] for p in problems(4)]
    assert four == ["HumanEval/0", "HumanEval/41", "HumanEval/82", "HumanEval/123"]
    assert [p["task_id"] for p in problems(4)] == four and len(problems(500)) == 164
    with pytest.raises(FleetError, match="at least 1"):
        problems(0)


def _long_context_tiny(tiny_models, tmp_path) -> Path:
    """The tiny Llama with room for a HumanEval prompt and a 512-token reply."""
    folder = tmp_path / "tiny-llama-2k"
    shutil.copytree(tiny_models["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    return folder


def test_the_quality_bench_scores_each_format_through_the_api(tiny_models, tmp_path, monkeypatch):
    """Two problems asked of the tiny model behind `fleet serve`'s API: one row for the format, its
    pass@1 beside its KL, every problem's outcome; llama.cpp asked for on a non-GGUF source is skipped."""
    from engine.bench.quality import run_quality

    monkeypatch.setenv("FLEETSHARD_HOME", str(tmp_path / "home"))
    out = tmp_path / "quality.json"
    report = run_quality(str(_long_context_tiny(tiny_models, tmp_path)), weights=("f32",), stages=(1,), tokens=64,
                         parts=("kl", "humaneval"), cases=2, llamacpp=True, out=out, log=lambda _: None)
    assert json.loads(out.read_text())["bench"] == "quality"
    task = [r for r in report["rows"] if r.get("part") == "humaneval"]
    kl = [r for r in report["rows"] if r["weights"] == "f32" and r.get("precision") == "fast" and "part" not in r]
    assert len(task) == 1 and len(kl) == 1
    row = task[0]
    assert (row["server"], row["weights"], row["stages"], row["cases"]) == ("fleet serve", "f32", 1, 2)
    assert row["kl_nats"] == kl[0]["kl_nats"]
    assert list(row["results"]) == ["HumanEval/0", "HumanEval/82"]
    assert row["passed"] == sum(s == "passed" for s in row["results"].values())
    assert row["pass_at_1"] == row["passed"] / 2 and row["reply_tokens"] > 0
    assert report["ratios"]["HumanEval pass@1 (%), fleet serve f32"] == round(100 * row["pass_at_1"], 1)
    settings = report["settings"]["humaneval"]
    assert settings["llamacpp"].startswith("skipped: llama.cpp runs GGUF files")
    assert settings["sandbox"] == sandbox.isolation()
    with pytest.raises(FleetError, match="unknown parts nope"):
        run_quality("smollm2-135m", parts=("nope",))


@pytest.mark.real_model
def test_llamacpp_answers_through_the_same_client():
    from engine.bench import llamacpp
    from engine.bench.parity import llamacpp_gguf

    if not (llamacpp.build_folder() / "bin" / "llama-server").is_file():
        pytest.skip("llama-server is not built here (`fleet bench parity --llamacpp` builds it once)")
    with llamacpp.LlamaServer(llamacpp_gguf("smollm2-135m"), log=lambda _m: None) as server:
        score = humaneval(server.url, "smollm2-135m", cases=1, log=lambda _m: None)
    assert score["cases"] == 1 and list(score["results"]) == ["HumanEval/0"] and score["reply_tokens"] > 0
    assert score["results"]["HumanEval/0"] == "passed" or score["results"]["HumanEval/0"].startswith("failed")
