"""The terminal chat ``fleet up`` hands over to (``fleet generate --deployment``) survives a worker killed
mid-reply, as the API server and the app do: a local node agent runs stage 1 of the tiny Llama over a slow
link, its worker is killed (kill -9) once the reply has begun to print, and the reply carries on over a
new worker to the end, token-identical to the model in one process; the saved record then names the
new worker, so stopping the deployment stops it.  Everything speaks TLS, the fleet's default."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from engine.config import FleetAccess, Scheduling, ShardOptions
from engine.cli.args import reply_text
from engine.fleet.deploy import LOCAL, Deployment, deploy
from engine.fleet.local_agent import start_local_agent, stop_local_agent
from engine.fleet.span import StageSpan
from engine.fleetkey import create_key, load_key, load_tls
from engine.runtime.decode.service import ChatService
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.stage import compile_config, core

core()  # before any test starts a thread: creating an OpenVINO Core forks a child that hangs if threads run

PROMPT = "Paris is"
TOKENS = 60


def _in_process(deployment) -> list[int]:
    folders = sorted(Path(deployment.stage0).parent.glob("stage*[0-9]"))
    service = ChatService(LocalChain(folders, config=compile_config("exact")), scheduling=Scheduling(streams=1),
                          rewind="trim")
    try:
        return service.submit([{"role": "user", "content": PROMPT}], TOKENS, chat=False,
                              ignore_eos=True).wait(120).tokens
    finally:
        service.close()


def test_the_terminal_chat_carries_on_over_a_worker_killed_mid_reply(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETSHARD_HOME", str(tmp_path / "home"))
    key_path = create_key(tmp_path / "fleet.key")
    key, tls = load_key(key_path), load_tls(True, key_path)
    # a reply of a few seconds
    agent = start_local_agent(FleetAccess(key, tls, key_file=key_path), options=("--link-delay-ms", "10"))
    chat = None
    try:
        stages = [StageSpan(LOCAL, "CPU", 0, 2), StageSpan(agent.address, "CPU", 2, 4)]
        deployment, chain = deploy(str(tiny_models["llama"]), stages, access=FleetAccess(key, tls),
                                   shard=ShardOptions(weights="f32", mode="exact"))
        chain.close()
        record = deployment.save(tmp_path / "deployment.json")
        want = _in_process(deployment)
        (worker,) = psutil.Process(agent.pid).children()
        out, log = tmp_path / "chat.json", tmp_path / "chat.log"
        with open(log, "w") as err:
            chat = subprocess.Popen(
                [sys.executable, "-m", "engine.cli", "generate", "--deployment", str(record), "--fleet-key-file",
                 str(key_path), "--mode", "exact", "--no-chat", "--prompt", PROMPT, "--ignore-eos",
                 "--max-new-tokens", str(TOKENS), "--json", str(out)],
                stdout=subprocess.PIPE, stderr=err, env=os.environ.copy())
        first = os.read(chat.stdout.fileno(), 256)  # the reply has begun
        assert first, log.read_text()[-3000:]
        os.kill(worker.pid, signal.SIGKILL)
        rest = chat.stdout.read()
        assert chat.wait(timeout=300) == 0, log.read_text()[-3000:]
        text = log.read_text()
        (result,) = json.loads(out.read_text())
        assert result["rerouted"] == 1, text  # the worker died under the reply
        assert result["tokens"] == want and result["stopped_by"] == "max_tokens"
        assert (first + rest).decode().strip() == reply_text(result["text"]).strip()  # the terminal's, clean
        assert "fleet: part 2 stopped answering" in text and "starting its worker again" in text, text
        assert "carried on over a new chain 1x" in text
        assert [p.pid for p in psutil.Process(agent.pid).children()] != [worker.pid]  # a new worker serves
        # the record names the worker that runs now, so stopping the deployment stops it
        saved = Deployment.load(record)
        assert saved.id == deployment.id and saved.workers != deployment.workers
        assert saved.stop(FleetAccess(key, tls)) == []
        assert psutil.Process(agent.pid).children() == []
    finally:
        if chat is not None and chat.poll() is None:
            chat.kill()
            chat.wait()
        stop_local_agent(agent)

