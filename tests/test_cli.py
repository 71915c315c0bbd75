"""The ``fleet`` command as a user runs it: real subprocesses, clear errors, no tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys


def fleet(*args, env=None):
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True,
                          timeout=600, env=env)


def test_generate_streams_text_and_reports_speed(tiny_exports, tmp_path):
    out = tmp_path / "gen.json"
    proc = fleet("generate", "--shards", *map(str, tiny_exports["qwen2", "3"].folders), "--prompt", "Paris is",
                 "--max-new-tokens", "12", "--ignore-eos", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "tok/s" in proc.stderr and "first token" in proc.stderr
    (result,) = json.loads(out.read_text())
    assert result["new_tokens"] == 12 and len(result["tokens"]) == 12
    assert result["stopped_by"] == "max_tokens"
    assert proc.stdout.strip() == result["text"].strip()


def test_generate_accepts_an_export_folder(tiny_exports):
    proc = fleet("generate", "--shards", str(tiny_exports["llama", "2"].out), "--prompt", "hi", "--max-new-tokens", "3")
    assert proc.returncode == 0, proc.stderr


def test_bad_sources_give_specific_errors(tmp_path):
    proc = fleet("export", "--model", "no-such-model", "--stages", "2", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2
    assert "error:" in proc.stderr and "smollm2-135m" in proc.stderr and "Traceback" not in proc.stderr
    proc = fleet("export", "--model", "gemma3-270m", "--stages", "2", "--out", str(tmp_path / "g"))
    assert proc.returncode == 2 and "unsupported architecture 'gemma3'; supported: llama, mistral, qwen2" in proc.stderr
    proc = fleet("generate", "--shards", str(tmp_path / "missing"), "--prompt", "hi")
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_bad_split_is_refused(tiny_models, tmp_path):
    proc = fleet("export", "--model", str(tiny_models["llama"]), "--split", "3,2", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2 and "not strictly increasing" in proc.stderr


def test_models_list_names_the_catalog():
    proc = fleet("models", "list")
    assert proc.returncode == 0
    for name in ("smollm2-135m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "gemma3-270m"):
        assert name in proc.stdout


def test_gui_placeholder_window_builds(qtbot):
    from fleetgui.app import build_window

    window = build_window()
    qtbot.addWidget(window)
    window.show()
    assert window.windowTitle() == "fleetshard"
