"""One PC, the whole fleet: node agents started on one machine (one home, so one machine id) are
each their own node, listed by `fleet nodes` under stable ids; a demo fleet of such agents with
simulated devices is profiled, deployed over and chatted on with the tiny Llama model, and a
demo node stopped mid-conversation has its layers moved to the spare one; `fleet up --demo` does
it in one command.  Everything speaks TLS, the fleet's default."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fleet_support import fleet_up, greedy, greedy_in_process

from engine.config import FleetAccess, Scheduling, Settings, ShardOptions
from engine.errors import FleetError
from engine.fleet.control import ControlClient
from engine.fleet.deploy import LOCAL
from engine.fleet.local_agent import start_local_agent, stop_local_agent
from engine.fleet.node import SimulatedDevice, agent_node_id, node_id
from engine.fleetkey import access_of, create_key, fleet_access, load_key, load_tls
from engine.runtime.stages.stage import core

core()  # before any test starts a thread: creating an OpenVINO Core forks a child that hangs if threads run


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """One machine: the agents this test starts share its home (config folder, machine id)."""
    monkeypatch.setenv("FLEETSHARD_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _status(address: str, key_path: Path | None = None) -> dict:
    """The agent's status, asked over TLS with the key at ``key_path`` (None: the default key)."""
    with ControlClient(address, FleetAccess(load_key(key_path), load_tls(True, key_path))) as agent:
        return agent.status()


def _fleet_nodes(key_path: Path) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "engine.cli", "nodes", "--json", "--seconds", "3",
                          "--fleet-key-file", str(key_path)], capture_output=True, text=True, timeout=120,
                         env=os.environ.copy())
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_agents_on_one_machine_are_each_a_node_listed_stably(home, tmp_path):
    key_path = create_key(tmp_path / "fleet.key")
    access = access_of(key_path, tls=True)
    started = {name: start_local_agent(access, name=name, mdns=True) for name in ("alpha", "beta")}
    try:
        ids = {name: _status(agent.address, key_path)["node"]["node_id"] for name, agent in started.items()}
        assert ids == {"alpha": agent_node_id("alpha"), "beta": agent_node_id("beta")}
        assert len(set(ids.values())) == 2 and node_id() not in ids.values()  # nor the machine's own
        for _ in range(2):  # the same two nodes at every listing
            heard = {n["name"]: n["node_id"] for n in _fleet_nodes(key_path) if n.get("source") == "mdns"}
            assert heard == ids, heard
        stop_local_agent(started.pop("beta"))  # started again, beta is the same node
        started["beta"] = start_local_agent(access, name="beta")
        assert _status(started["beta"].address, key_path)["node"]["node_id"] == ids["beta"]
    finally:
        for agent in started.values():
            stop_local_agent(agent)


def test_a_simulated_device_is_checked_and_says_so():
    device = SimulatedDevice("GPU", "integrated GPU", 3072, speed=2.0)
    assert SimulatedDevice.from_json(device.to_json()) == device
    assert device.device() == {"name": "GPU", "full_name": "simulated integrated GPU", "memory_mb": 3072}
    for bad, reason in (('{"name": "gpu", "full_name": "x", "memory_mb": 1}', "not a device name"),
                        ('{"name": "GPU", "full_name": "x", "memory_mb": 0}', "memory_mb must be"),
                        ('{"name": "GPU", "full_name": "x", "memory_mb": 1, "speed": 0}', "speed must be"),
                        ('{"name": "GPU", "memory_mb": 1}', "give a JSON object"),
                        ("GPU", "not JSON")):
        with pytest.raises(FleetError, match=reason):
            SimulatedDevice.from_json(bad)


def test_demo_fleet_profiles_deploys_chats_and_moves_a_stopped_nodes_layers(home, tiny_models):
    from engine.fleet.demo import DEMO_NODES, demo_up
    from engine.fleet.failover import Failover
    from engine.runtime.decode.service import ChatService

    model = str(tiny_models["llama"])
    events: list[str] = []
    access = fleet_access(Settings(tls=True), create=True)  # the default key, made here
    fleet, deployment, chain, doc = demo_up(model, 2, access=access, shard=ShardOptions(weights="f32"))
    try:
        key, tls = load_key(), load_tls(True)
        laptop, gpu = fleet.nodes
        assert [laptop.name, gpu.name] == [name for name, _ in DEMO_NODES[:2]]
        # each demo node is its own node, reporting its simulated device and memory, marked simulated
        for node in fleet.nodes:
            reported = _status(node.address)["node"]
            assert reported["simulated"] and reported["memory_mb"] == node.device.memory_mb
            assert [(d["name"], d["full_name"]) for d in reported["devices"]] == \
                [(node.device.name, f"simulated {node.device.full_name}")]
        ids = {info["name"]: n for n, info in doc["nodes"].items()}
        assert set(ids) == {"this PC", laptop.name, gpu.name} and len(set(ids.values())) == 3
        assert all(doc["nodes"][ids[n.name]].get("simulated") for n in fleet.nodes)
        profiled = {(d["node"], d["device"]): d for d in doc["fleet"]["devices"]}
        assert profiled[ids[gpu.name], "GPU"]["memory_bytes"] == gpu.device.memory_mb << 20
        assert (ids[laptop.name], "CPU") in profiled
        # the layers split evenly over this machine and the laptop; the GPU box is the spare
        assert [(s.node, s.device) for s in deployment.placement] == [(LOCAL, "CPU"), (laptop.address, "CPU")]
        want = greedy_in_process(deployment)
        assert greedy(chain) == want

        failover = Failover.of(deployment, access=FleetAccess(key, tls), on_event=events.append, chain=chain)
        service = ChatService(chain, scheduling=Scheduling(streams=1), recover=failover.recover)
        try:
            first = service.submit([{"role": "user", "content": "Paris is"}], 8, ignore_eos=True).wait(120)
            assert first.tokens and not first.error
            fleet.stop(laptop.name)  # that PC is switched off
            again = service.submit([{"role": "user", "content": "Paris is"}], 8, ignore_eos=True).wait(300)
        finally:
            service.close()
        assert again.tokens == first.tokens, (again.error, events)
        assert any(e.startswith(f"node {laptop.name} lost") for e in events), events
        moved = failover.deployment.placement
        assert [s.node for s in moved] == [LOCAL, gpu.address] and moved[1].device == "GPU", events
        assert [w["stage"] for w in _status(gpu.address)["workers"]] == [1]
        failover.deployment.stop(FleetAccess(key, tls))
    finally:
        fleet.close()
    assert not any(n.running for n in fleet.nodes)


def test_fleet_up_demo_brings_up_a_demo_fleet_and_stops_it(home, tiny_models, tmp_path):
    """`fleet up --demo 2 --no-chat`: two demo nodes, the model over this machine and the first, the
    chain it leaves up decodes as the model alone; ending it stops the workers and the demo nodes."""
    import re

    import psutil

    (home / "config").mkdir(parents=True)
    (home / "config" / "settings.json").write_text(json.dumps({"weights": "f32"}))
    log = tmp_path / "up.log"
    with fleet_up(["--model", str(tiny_models["llama"]), "--demo", "2", "--no-chat"], log) as (up, _, deployment):
        text = log.read_text()
        pids = [int(p) for p in re.findall(r"demo node demo-\S+ \(pid (\d+)\)", text)]
        assert len(pids) == 2 and "SIMULATED GPU (integrated GPU, 3 GB" in text, text
        assert re.search(r"part 1 on this PC CPU \(layers 0-1\); part 2 on demo-laptop CPU", text), text
        chain = deployment.chain(FleetAccess(load_key(), load_tls(True)))
        try:
            assert greedy(chain) == greedy_in_process(deployment)
        finally:
            chain.close()
        up.stdin.close()
        assert up.wait(timeout=60) == 0, log.read_text()[-2000:]
    def gone(pid):
        return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert all(gone(pid) for pid in pids)
