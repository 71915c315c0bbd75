"""Fleet operations with real agent processes on loopback: the control API refuses strangers,
shards arrive verified (resuming, refusing corruption, skipped when present), deployment to two
agents gives the in-process chain's tokens, a node lost mid-deployment leaves nothing running,
stages take their own computer's compute turns, agents are discovered over real mDNS and noticed
leaving, the survey feeds the solver, and `fleet up --nodes` does all of it in one command."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from fleet_support import (agent_process, deployed_equals_in_process, fleet_up, greedy, greedy_in_process, turn_held,
                           waits_for_turn)

from engine.config import FleetAccess, Scheduling, ShardOptions
from engine.errors import FleetError
from engine.fleet.control import AgentError, ControlClient
from engine.fleet.deploy import LOCAL, deploy, deploy_draft
from engine.fleet.span import StageSpan
from engine.fleet.shardstore import content_hash
from engine.fleetkey import create_key, fleet_id, load_key
from engine.runtime.stages.chain import LocalChain

@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    return create_key(tmp_path_factory.mktemp("keys") / "fleet.key")


@pytest.fixture
def two_agents(key_file, tmp_path):
    with agent_process(key_file, tmp_path / "a", name="alpha") as a, \
            agent_process(key_file, tmp_path / "b", name="beta") as b:
        yield a, b


def test_agent_refuses_without_the_fleet_key(two_agents, key_file, tmp_path):
    (_, address), _ = two_agents
    stranger = create_key(tmp_path / "other.key")
    with pytest.raises(AgentError, match="fleet key"):
        ControlClient(address, FleetAccess(load_key(stranger)))
    with ControlClient(address, FleetAccess(load_key(key_file))) as agent:  # the agent kept serving
        status = agent.status()
    assert status["node"]["name"] == "alpha" and status["node"]["fleet_id"] == fleet_id(load_key(key_file))
    assert "key" not in str(status["node"]).lower().replace("fleet_id", "")


def test_agent_answers_bad_requests_with_errors(two_agents, key_file):
    (_, address), _ = two_agents
    with ControlClient(address, FleetAccess(load_key(key_file))) as agent:
        with pytest.raises(AgentError, match="unknown operation"):
            agent.call("format_disk")
        with pytest.raises(AgentError, match="not a shard content hash"):
            agent.call("has_shard", hash="../../etc/passwd")
        with pytest.raises(AgentError, match="send it first"):
            agent.start_worker("0" * 64)
        assert agent.call("ping") == {}


def test_transfer_resumes_skips_and_refuses_corruption(two_agents, key_file, tiny_exports, tmp_path):
    (_, address), _ = two_agents
    folder = tiny_exports["llama", "2"].folders[1]
    digest = content_hash(folder)
    key = load_key(key_file)
    with ControlClient(address, FleetAccess(key)) as agent:
        cancel, seen = threading.Event(), []

        def stop_after_two(progress):
            seen.append(progress.bytes_done)
            if len(seen) >= 3:
                cancel.set()

        with pytest.raises(AgentError, match="cancelled"):
            agent.send_shard(folder, progress=stop_after_two, cancel=cancel, chunk_bytes=64 << 10)
        assert not agent.call("has_shard", hash=digest)["present"]
        interrupted_at = seen[-1]
        resumed = []
        _, sent = agent.send_shard(folder, progress=lambda p: resumed.append((p.bytes_done, p.bytes_total)),
                                   chunk_bytes=64 << 10)
        assert sent and resumed[0][0] == interrupted_at > 0  # picked up where the bytes on the node ended
        assert resumed[-1][0] == resumed[-1][1]
        assert agent.call("has_shard", hash=digest)["present"]
        assert agent.send_shard(folder)[1] is False  # already there: nothing sent
        assert [s["hash"] for s in agent.status()["shards"]] == [digest]

    corrupt = tiny_exports["llama", "3"].folders[1]
    cdigest = content_hash(corrupt)
    with ControlClient(address, FleetAccess(key)) as agent:
        names = sorted(p.name for p in corrupt.iterdir() if p.name != "manifest.json")
        sizes = {n: (corrupt / n).stat().st_size for n in names}
        agent.call("put_begin", (corrupt / "manifest.json").read_bytes(), hash=cdigest, sizes=sizes)
        for n in names:
            data = bytearray((corrupt / n).read_bytes())
            if n == "openvino_model.bin":
                data[len(data) // 2] ^= 0xFF
            agent.call("put_chunk", bytes(data), hash=cdigest, file=n, offset=0)
        with pytest.raises(AgentError, match="openvino_model.bin.*corrupted"):
            agent.call("put_end", hash=cdigest)
        assert not agent.call("has_shard", hash=cdigest)["present"]
        with pytest.raises(AgentError, match="not a plain file name"):
            agent.call("put_chunk", b"x", hash=cdigest, file="../escape", offset=0)
        with pytest.raises(AgentError, match="does not match the announced content hash"):
            agent.call("put_begin", b"{}", hash=cdigest, sizes={})
        # a shard larger than the node's free disk is refused before a byte is sent
        manifest = (corrupt / "manifest.json").read_bytes()
        with pytest.raises(AgentError, match=r"^node alpha: not enough disk space for shard \w{12}: "
                                             r"it needs [\d.]+ GB more, and .* has [\d.]+ [kMG]B free\. Free up"):
            agent.call("put_begin", manifest, hash=cdigest, sizes={n: 1 << 50 for n in names})
        # a disk that fills up during the transfer: the error reaches the sender, the connection stays
        agent.call("put_begin", manifest, hash=cdigest, sizes=sizes)
        part = next((tmp_path / "a").rglob("incoming")) / cdigest / "openvino_model.bin"
        part.unlink(missing_ok=True)
        part.symlink_to("/dev/full")
        with pytest.raises(AgentError, match="^node alpha: not enough disk space for shard .* the partly received "
                                             "files were removed"):
            agent.call("put_chunk", b"x", hash=cdigest, file="openvino_model.bin", offset=0)
        assert not part.parent.exists()
        assert agent.call("has_shard", hash=cdigest)["present"] is False


def test_deploy_to_two_agents_equals_in_process_chain(two_agents, key_file, tiny_models, tmp_path):
    (_, a), (_, b) = two_agents
    key = load_key(key_file)
    stages = [StageSpan(LOCAL, "CPU", 0, 1), StageSpan(a, "CPU", 1, 3), StageSpan(b, "CPU", 3, 4)]
    phases = []
    deployment, chain = deploy(str(tiny_models["qwen2"]), stages, access=FleetAccess(key),
                               shard=ShardOptions(weights="f32"),
                               progress=lambda p: phases.append((p.stage, p.step)))
    try:
        got = greedy(chain)
        assert [s["stage"] for s in chain.stages] == [1, 2]
    finally:
        chain.close()
    folders = sorted(Path(deployment.stage0).parent.glob("stage*[0-9]"))
    assert greedy(LocalChain(folders)) == got
    assert {(1, "send"), (2, "send"), (1, "start"), (2, "start"), (0, "connect")} <= set(phases)
    for address, stage in ((a, 1), (b, 2)):
        with ControlClient(address, FleetAccess(key)) as agent:
            status = agent.status()
            assert [w["stage"] for w in status["workers"]] == [stage]
            assert status["state"] == f"serving part {stage + 1} of 3"
    # a second deployment of the same plan sends nothing: the nodes hold those shards
    assert deployment.stop(FleetAccess(key)) == []
    again, chain = deploy(str(tiny_models["qwen2"]), stages, access=FleetAccess(key), shard=ShardOptions(weights="f32"),
                          progress=lambda p: phases.append((p.stage, p.step, p.fraction)))
    chain.close()
    # `fleet nodes prune`: alpha keeps the shard its worker serves and gives up another, and a
    # transfer left unfinished (one too recent to count as left stays)
    with ControlClient(a, FleetAccess(key)) as agent:
        agent.send_shard(folders[2])
        served = [s["hash"] for s in agent.status()["shards"] if s["stage"] == 1]
        for folder in folders[:2]:  # two transfers begun: stage 0's is left for an hour below
            agent.call("put_begin", (folder / "manifest.json").read_bytes(), hash=content_hash(folder),
                       sizes={p.name: p.stat().st_size for p in folder.iterdir() if p.name != "manifest.json"})
    left, busy = (next((tmp_path / "a").rglob("incoming")) / content_hash(f) for f in (folders[0], folders[1]))
    for part in left.iterdir():
        os.utime(part, (time.time() - 3600,) * 2)
    prune = [sys.executable, "-m", "engine.cli", "nodes", "prune", a, "--fleet-key-file", str(key_file),
             "--no-tls"]  # as the agents (agent_process)
    out = subprocess.run(prune, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and re.search(rf"^removed 1 shard\(s\) and 1 unfinished transfer\(s\), [0-9.]+ MB, "
                                             rf"from {a}; 1 served shard\(s\) kept$", out.stderr, re.M), out.stderr
    assert not left.exists() and busy.exists()
    with ControlClient(a, FleetAccess(key)) as agent:
        assert [s["hash"] for s in agent.status()["shards"]] == served
    again.stop(FleetAccess(key))
    with ControlClient(a, FleetAccess(key)) as agent:
        assert agent.status()["workers"] == []
        assert len(agent.call("prune")["dropped"]) == 1 and agent.status()["shards"] == []


def test_a_deployment_drafts_on_another_node(two_agents, key_file, tiny_models):
    from engine.config import Settings
    from engine.runtime.decode.generate import Generator
    from engine.session import open_draft_link

    (_, a), (_, b) = two_agents
    key = load_key(key_file)
    model = str(tiny_models["qwen2"])
    stages = [StageSpan(LOCAL, "CPU", 0, 2), StageSpan(a, "CPU", 2, 4)]
    deployment, chain = deploy(model, stages, access=FleetAccess(key), shard=ShardOptions(weights="f32", mode="exact"))
    try:
        deployment.draft = deploy_draft(model, b, access=FleetAccess(key), weights="f32")
        with ControlClient(b, FleetAccess(key)) as agent:
            assert [w["role"] for w in agent.status()["workers"]] == ["draft"]
        link = open_draft_link(Settings(draft="remote", fleet_key_file=str(key_file), tls=False), chain, deployment)
        try:
            prompt = [5, 17, 42, 101, 7, 250, 33, 64]
            want = Generator(chain, 64).generate(prompt, 24, ignore_eos=True).tokens
            got = Generator(chain, 64).generate(prompt, 24, ignore_eos=True, drafter=link.drafter(0), k="auto")
        finally:
            link.close()
    finally:
        chain.close()
        assert deployment.stop(FleetAccess(key)) == []
    assert got.tokens == want and got.drafted > 0  # exact mode: the same tokens, however many drafts held
    with ControlClient(b, FleetAccess(key)) as agent:
        assert agent.status()["workers"] == []


def test_a_deployments_copies_share_its_draft_server(two_agents, key_file, tiny_models, tmp_path):
    """A draft server serves one coordinator at a time: the copies of a deployment draft over one
    connection, each copy's streams numbered after the copy's before."""
    from engine.config import Settings
    from engine.fleet.deploy import Deployment, deploy_layout
    from engine.runtime.decode.replicas import Replicas
    from engine.session import Launch, open_service

    (_, a), (_, b) = two_agents
    key = load_key(key_file)
    model = str(tiny_models["qwen2"])
    deployment, chains = deploy_layout(model, [[StageSpan(LOCAL, "CPU", 0, 4)], [StageSpan(a, "CPU", 0, 4)]],
                                       access=FleetAccess(key), shard=ShardOptions(weights="f32", mode="exact"))
    for chain in chains:
        chain.close()
    try:
        deployment.draft = deploy_draft(model, b, access=FleetAccess(key), weights="f32")
        record = Deployment.load(deployment.save(tmp_path / "deployment.json"))
        settings = Settings(fleet_key_file=str(key_file), mode="exact", streams=2, draft="remote", k="3", tls=False)
        service = open_service(settings, Launch(deployment=record))
        try:
            assert isinstance(service, Replicas)
            questions = [[{"role": "user", "content": f"question number {i}"}] for i in range(2)]  # one a copy:
            got = [h.wait(120) for h in [service.submit(q, 24, ignore_eos=True) for q in questions]]  # drafts
            routed = list(service.routed)
        finally:
            service.close()
    finally:
        assert deployment.stop(FleetAccess(key)) == []
    assert routed == [1, 1] and all(r.error is None for r in got)
    assert all(r.drafted > 0 for r in got), [(r.drafted, r.accepted) for r in got]


def test_replicas_deploy_each_serve_users_of_their_own_and_stop_together(two_agents, key_file, tiny_models,
                                                                          tmp_path):
    """Three copies (whole here; a layer here feeding alpha; whole on beta, fed from here): the
    record holds them all, the chat service spreads users over them with the tokens of one chain
    in exact mode, each copy's failover restarts its own worker, and stopping the record stops
    every copy's workers."""
    from engine.config import Settings
    from engine.fleet.deploy import Deployment, deploy_layout
    from engine.runtime.decode.replicas import Replicas
    from engine.runtime.decode.service import ChatService
    from engine.runtime.stages.stage import compile_config
    from engine.session import Launch, open_service

    (_, a), (_, b) = two_agents
    key = load_key(key_file)
    model = str(tiny_models["qwen2"])
    copies = [[StageSpan(LOCAL, "CPU", 0, 4)],
              [StageSpan(LOCAL, "CPU", 0, 1), StageSpan(a, "CPU", 1, 4)],
              [StageSpan(b, "CPU", 0, 4)]]
    deployment, chains = deploy_layout(model, copies, access=FleetAccess(key),
                                       shard=ShardOptions(weights="f32", mode="exact"))
    for chain in chains:
        chain.close()
    record = Deployment.load(deployment.save(tmp_path / "deployment.json"))
    assert [c.remotes == [] for c in record.copies] == [True, False, False]
    assert [c.fed for c in record.copies] == [False, False, True]
    settings = Settings(fleet_key_file=str(key_file), mode="exact", streams=2, draft="none", k="0", tls=False)
    questions = [[{"role": "user", "content": f"question number {i}"}] for i in range(6)]
    service = open_service(settings, Launch(deployment=record))
    try:
        assert isinstance(service, Replicas) and service.streams == 6 and "3 copies" in service.description
        handles = [service.submit(q, 10, ignore_eos=True) for q in questions]
        got = [h.wait(120) for h in handles]
        routed = list(service.routed)
        # alpha's and beta's workers die: each copy's failover starts its own again
        for agent, _ in two_agents:
            (worker,) = psutil.Process(agent.pid).children()
            worker.kill()
        again = [h.wait(120) for h in [service.submit(q, 10, ignore_eos=True) for q in questions]]
    finally:
        service.close()
    assert sum(routed) == 6 and min(routed) >= 1  # users arriving together go to idle copies first
    assert [r.tokens for r in again] == [r.tokens for r in got] and all(r.error is None for r in again)
    assert sum(r.rerouted for r in again) >= 2  # the ones on alpha's and beta's copies went through failover
    whole = ChatService(LocalChain([record.stage0], config=compile_config("exact")), scheduling=Scheduling(streams=1))
    try:
        want = [whole.submit(q, 10, ignore_eos=True).wait(120) for q in questions]
    finally:
        whole.close()
    assert [r.tokens for r in got] == [r.tokens for r in want] and all(len(r.tokens) == 10 for r in got)
    # the record names the first workers; the ones the failovers started are the only ones left
    assert [p for p in record.stop(FleetAccess(key)) if "no worker" not in p] == []
    for address in (a, b):
        with ControlClient(address, FleetAccess(key)) as agent:
            (restarted,) = agent.status()["workers"]
            agent.stop_worker(restarted["id"])
    for address in (a, b):
        with ControlClient(address, FleetAccess(key)) as agent:
            assert agent.status()["workers"] == []


def test_stages_take_the_compute_turns_of_the_computer_they_run_on(two_agents, key_file, tiny_models, tmp_path,
                                                                   monkeypatch):
    """A worker a node agent starts, and the coordinator's stage 0, wait for their own computer's
    compute turn (the file in its data folder: each test agent's home is its computer)."""
    from engine.runtime.stages.turns import machine_turns_file

    (_, a), _ = two_agents
    key = load_key(key_file)
    stages = [StageSpan(LOCAL, "CPU", 0, 2), StageSpan(a, "CPU", 2, 4)]
    deployment, chain = deploy(str(tiny_models["llama"]), stages, access=FleetAccess(key),
                               shard=ShardOptions(weights="f32"))
    chain.close()

    def blocked_until_released(chain, turns_file) -> None:
        done = threading.Event()
        with turn_held(turns_file) as holder:
            threading.Thread(target=lambda: (greedy(chain, 2), done.set()), daemon=True).start()
            assert waits_for_turn(turns_file), f"no stage came to wait for {turns_file}"
            assert not done.is_set(), f"a forward finished while {turns_file} was held elsewhere"
            holder.stdin.close()
            assert done.wait(30), "the forward did not finish once the turn was let go"

    try:
        worker_only = deployment.chain(FleetAccess(key), turns=None)  # only alpha's worker may wait
        greedy(worker_only, 2)  # compiled and warm
        blocked_until_released(worker_only, tmp_path / "a" / "data" / "compute.turns")
        worker_only.close()
        monkeypatch.setenv("FLEETSHARD_HOME", str(tmp_path / "coordinator"))
        coordinator = deployment.chain(FleetAccess(key))
        greedy(coordinator, 2)
        blocked_until_released(coordinator, machine_turns_file())
        coordinator.close()
    finally:
        deployment.stop(FleetAccess(key))


# What a worker laptop does not install: refused at import in every process started with it.
REFUSE_IMPORTS = """
import sys

class _NotOnAWorkerLaptop:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {"torch", "transformers", "nncf", "gguf", "PySide6"}:
            raise ImportError(f"{name} is not installed on a worker laptop")

sys.meta_path.insert(0, _NotOnAWorkerLaptop())
"""


def test_a_worker_laptop_serves_with_openvino_numpy_and_the_tokenizer_only(key_file, tiny_models, tmp_path):
    """An agent (and the stage workers it starts) with torch, transformers, nncf, gguf and PySide6
    refused at import is profiled, takes a shard and serves its stage."""
    from engine.fleet.survey import survey

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(REFUSE_IMPORTS)
    env = {"PYTHONPATH": str(site)}
    refused = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True,
                             env={**os.environ, **env})
    assert "torch is not installed on a worker laptop" in refused.stderr  # the refusal works
    key = load_key(key_file)
    source = str(tiny_models["llama"])
    with agent_process(key_file, tmp_path / "laptop", name="laptop", env=env) as (_, laptop):
        doc = survey(source, [laptop], access=FleetAccess(key), local_node="coordinator", weights="f32")
        assert {d["node"] for d in doc["fleet"]["devices"]} == {"coordinator", *doc["taken"]["agents"].values()}
        deployed_equals_in_process(source, [StageSpan(LOCAL, "CPU", 0, 2), StageSpan(laptop, "CPU", 2, 4)],
                                    key)


def test_node_lost_during_deployment_leaves_no_chain(two_agents, key_file, tiny_models):
    (_, a), (proc_b, b) = two_agents
    key = load_key(key_file)
    stages = [StageSpan(LOCAL, "CPU", 0, 2), StageSpan(a, "CPU", 2, 3), StageSpan(b, "CPU", 3, 4)]

    def lose_b(progress):
        if (progress.stage, progress.step, progress.fraction) == (2, "start", 0.0):  # stage 1's worker is already up
            proc_b.kill()
            proc_b.wait()

    with pytest.raises(FleetError, match=r"starting part 3 of 3: node agent at .* (lost|not reachable)"):
        deploy(str(tiny_models["llama"]), stages, access=FleetAccess(key),
               shard=ShardOptions(weights="f32"), progress=lose_b)
    with ControlClient(a, FleetAccess(key)) as agent:
        assert agent.status()["workers"] == []  # stage 1's worker was stopped again
    # a node already gone is found before anything is exported
    phases = []
    with pytest.raises(FleetError, match=r"^deployment not started: node agent at .* not reachable"):
        deploy(str(tiny_models["llama"]), stages, access=FleetAccess(key),
               shard=ShardOptions(weights="f32"), progress=phases.append)
    assert phases == []


def test_agents_are_discovered_over_mdns_and_seen_leaving(key_file, tmp_path):
    from engine.fleet.discovery import Browser

    events = []
    with Browser(fleet_id(load_key(key_file)), on_event=lambda kind, info: events.append((kind, info))) as browser:
        with agent_process(key_file, tmp_path / "m", mdns=True, name="mdns-node") as (proc, address):
            deadline = time.monotonic() + 20
            while not any(i.name == "mdns-node" for i in browser.nodes().values()) and time.monotonic() < deadline:
                time.sleep(0.2)
            found = [i for i in browser.nodes().values() if i.name == "mdns-node"]
            assert found, f"agent not discovered; rejected: {browser.rejected()}"
            assert found[0].port == int(address.rpartition(":")[2]) and "127.0.0.1" in found[0].addresses
            proc.terminate()  # a clean stop says goodbye over mDNS
            proc.wait(timeout=15)
            deadline = time.monotonic() + 20
            while any(i.name == "mdns-node" for i in browser.nodes().values()) and time.monotonic() < deadline:
                time.sleep(0.2)
        assert [k for k, i in events if i.name == "mdns-node"][-1] == "removed"
        assert not any(i.name == "mdns-node" for i in browser.nodes().values())


def test_survey_solve_and_deploy(two_agents, key_file, tiny_models, tmp_path, monkeypatch):
    import json

    from engine.fleet.plans import placement_stages
    from engine.fleet.placement import Pin, solve
    from engine.fleet.survey import load_survey, recent_survey, survey

    monkeypatch.setenv("FLEETSHARD_HOME", str(tmp_path / "coordinator"))
    (_, a), (_, b) = two_agents
    key = load_key(key_file)
    source = str(tiny_models["llama"])
    # an agent that does not answer fails the survey before anything is exported or profiled
    said = []
    with pytest.raises(FleetError, match="survey of the node at 127.0.0.1:9 failed: .*not reachable"):
        survey(source, [a, "127.0.0.1:9"], access=FleetAccess(key), local_node="coordinator", weights="f32",
               progress=said.append)
    assert said == []
    # a node under two addresses is profiled once
    doc = survey(source, [a, b, a], access=FleetAccess(key), local_node="coordinator", weights="f32")
    names = {n: info["name"] for n, info in doc["nodes"].items()}
    assert set(names.values()) == {"this PC", "alpha", "beta"}
    devices = doc["fleet"]["devices"]
    # a tiny model's layer costs microseconds, so only the sum is sure to be above the noise
    assert len(devices) == 3 and all(d["call_ms"] + d["layer_ms"] > 0 and min(d["layer_ms"], d["head_ms"]) >= 0
                                     and d["supported"] for d in devices)
    assert len(doc["fleet"]["rtt"]) == 3  # coordinator-alpha, coordinator-beta, alpha-beta
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    asked = dict(access=FleetAccess(key), local_node="coordinator", weights="f32")
    assert recent_survey(path, source, [b, a], **asked)["nodes"] == doc["nodes"]  # what `fleet up` reuses
    assert recent_survey(path, source, [a], **asked) is None  # other agents
    assert recent_survey(path, source, [a, b], **asked, streams=2) is None  # planned for other users
    assert recent_survey(path, source, [a, b], **asked, max_age_s=0) is None  # too old
    assert recent_survey(path, source, [a, b], local_node="another", access=FleetAccess(key), weights="f32") is None
    swapped = {a: doc["taken"]["agents"][b], b: doc["taken"]["agents"][a]}  # the addresses changed hands
    path.write_text(json.dumps({**doc, "taken": {**doc["taken"], "agents": swapped}}))
    assert recent_survey(path, source, [a, b], **asked) is None
    shape, nodes, fleet = load_survey(path)
    with pytest.raises(FleetError, match="^no fleet profile at .*: make one with `fleet profile"):
        load_survey(tmp_path / "none.json")
    beta = next(n for n, name in names.items() if name == "beta")
    plan = solve(shape, fleet, objective="throughput", users=2, pins=[Pin(beta, 3, 4)])
    assert plan.stages[0].node == "coordinator" and (plan.stages[-1].node, plan.stages[-1].start) == (beta, 3)
    deployed_equals_in_process(source, placement_stages({"plan": plan.to_json(), "nodes": nodes}), key)


def test_all_nodes_leaves_out_added_nodes_that_do_not_answer(two_agents, key_file, tmp_path, monkeypatch, capsys):
    """`--nodes all` (fleet profile, fleet up): a node added by address that is switched off is left
    out, and said so, instead of failing the survey."""
    import argparse
    import json

    from engine.cli.fleet import _agent_addresses

    (_, a), _ = two_agents
    home = tmp_path / "coordinator"
    (home / "config").mkdir(parents=True)
    (home / "config" / "settings.json").write_text(json.dumps({"nodes": [a, "127.0.0.1:9"]}))
    monkeypatch.setenv("FLEETSHARD_HOME", str(home))
    agents = _agent_addresses(argparse.Namespace(nodes="all", seconds=0.5), FleetAccess(load_key(key_file)))
    assert a in agents and "127.0.0.1:9" not in agents
    assert "left out 127.0.0.1:9 (added by address): node agent at 127.0.0.1:9 is not reachable" in \
        capsys.readouterr().err


def test_fleet_up_on_nodes_profiles_places_deploys_and_stops(two_agents, key_file, tiny_models, tmp_path):
    """`fleet up --nodes`: the survey, the solver (here with a pin) and the deployment in one command;
    the chain it leaves up gives the in-process chain's tokens, and ending `fleet up` stops the
    workers, whether it is ended by a signal or by its parent closing its stdin (--lifeline).  A second
    `fleet up` of the same fleet reuses the profile.  A plan that keeps every layer on this machine
    deploys nothing and says why."""
    import json

    (_, a), _ = two_agents
    key = load_key(key_file)
    home = tmp_path / "coordinator"
    (home / "config").mkdir(parents=True)
    (home / "config" / "settings.json").write_text(json.dumps({"weights": "f32", "tls": False}))  # as the agents
    env = {**os.environ, "FLEETSHARD_HOME": str(home)}
    up_args = ["--model", str(tiny_models["llama"]), "--nodes", a, "--fleet-key-file", str(key_file), "--no-chat"]
    log = tmp_path / "up.log"
    for ending in ("SIGTERM", "stdin closed"):  # the user's Ctrl-C or a service stop; the app going away
        with fleet_up([*up_args, "--pin", "alpha:3"], log, env) as (up, lines, deployment):
            _up_serves_then_stops(up, lines, deployment, ending, log, a, key)
        # the first run profiles the fleet, the next ones reuse its profile
        assert ("using the fleet profile" in log.read_text()) == (ending != "SIGTERM"), log.read_text()
    local = subprocess.run([sys.executable, "-m", "engine.cli", "up", *up_args, "--pin", "this PC:0-3"],
                           capture_output=True, text=True, env=env, timeout=300)
    assert local.returncode == 0, local.stderr
    assert "1 part(s)" in local.stdout and "keeps every layer" in local.stderr
    assert "using the fleet profile" in local.stderr
    assert re.search(r"^alpha +CPU +layer [0-9.]+ ms", local.stdout, re.M), local.stdout  # the profile, shown
    with ControlClient(a, FleetAccess(key)) as agent:
        assert agent.status()["workers"] == []


def _up_serves_then_stops(up, lines, deployment, ending: str, log: Path, a: str, key: bytes) -> None:
    assert any(": alpha CPU, layer 3," in line for line in lines), lines  # the plan, explained, by node name
    assert [w["agent"] for w in deployment.workers] == [a]
    chain = deployment.chain(FleetAccess(key))
    try:
        got = greedy(chain)
    finally:
        chain.close()
    assert got == greedy_in_process(deployment)
    with ControlClient(a, FleetAccess(key)) as agent:
        assert [w["stage"] for w in agent.status()["workers"]] == [1]
    if ending == "SIGTERM":
        up.terminate()
    else:
        up.stdin.close()
    assert up.wait(timeout=60) == 0, log.read_text()[-2000:]
    with ControlClient(a, FleetAccess(key)) as agent:
        assert agent.status()["workers"] == [], ending


def test_fleet_nodes_lists_discovered_and_added_nodes(key_file, tmp_path):
    """`fleet nodes --json`: an agent heard over mDNS, one added by address (its agent does not
    advertise), and an added address nobody answers on, reported unreachable; `fleet nodes`, a table."""
    import json

    home = tmp_path / "cli"
    env = {**os.environ, "FLEETSHARD_HOME": str(home)}

    def fleet(*args):
        out = subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True,
                             env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout

    with agent_process(key_file, tmp_path / "heard", mdns=True, name="heard") as (_, heard), \
            agent_process(key_file, tmp_path / "added", name="added") as (_, added):
        fleet("nodes", "add", added)
        fleet("nodes", "add", "127.0.0.1:9")
        plain = ("--no-tls", "--fleet-key-file", str(key_file))  # as the agents (agent_process)
        nodes = json.loads(fleet("nodes", "--json", "--seconds", "4", *plain))
        table = fleet("nodes", "--seconds", "1", *plain).splitlines()
    assert table[0].split() == ["name", "agent", "status", "OS", "devices", "kernels", "memory"], table
    assert any(line.split()[:3] == ["added", added, "idle"] for line in table[1:]), table
    by_name = {n.get("name", n.get("address")): n for n in nodes}
    assert by_name["heard"]["source"] == "mdns" and by_name["heard"]["port"] == int(heard.rpartition(":")[2])
    assert by_name["added"]["source"] == "address" and by_name["added"]["status"] == "idle"
    assert by_name["127.0.0.1:9"]["status"] == "unreachable" and "not reachable" in by_name["127.0.0.1:9"]["error"]
    fleet("nodes", "remove", "127.0.0.1:9")
    assert [e["address"] for e in json.loads((home / "config" / "settings.json").read_text())["known_nodes"]] == [added]


def test_an_agent_back_from_sleep_announces_its_node_again(tmp_path, monkeypatch):
    """A PC that slept (the agent's clocks jumped past ``WAKE_GAP_S`` between two of its ticks) says so
    and announces its node over mDNS again, so that browsers that dropped it list it again; the agent
    itself runs on, never restarted."""
    from engine.fleet import agent as agent_module
    from engine.fleet.agent import Agent
    from engine.fleetkey import access_of

    class Clocks:  # the agent's clocks, which a sleep moves on at once
        slept = 0.0

        def monotonic(self):
            return time.monotonic() + self.slept

        def time(self):
            return time.time() + self.slept

    clocks = Clocks()
    monkeypatch.setattr(agent_module, "time", clocks)
    monkeypatch.setattr(agent_module, "WAKE_TICK_S", 0.05)
    lines: list[str] = []
    node = Agent("127.0.0.1:0", access=access_of(create_key(tmp_path / "fleet.key")), name="lid",
                 store=tmp_path / "store", advertise=False, log=lines.append)
    announced = threading.Event()
    monkeypatch.setattr(node, "_changed", announced.set)
    node.start()
    try:
        assert not announced.wait(0.5), lines  # its ticks on time: nothing to announce
        clocks.slept = agent_module.WAKE_GAP_S + 30
        assert announced.wait(10), lines
        slept = [float(m[1]) for m in map(re.compile(r"awake again after about (\d+) s asleep: announcing node lid "
                                                     r"again$").match, lines) if m]
        assert slept and slept[0] >= agent_module.WAKE_GAP_S + 30, lines
    finally:
        node.stop()
