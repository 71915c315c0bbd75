"""The fleet on a simulated office (``engine.fleet.sim.office``): PCs that are network namespaces on a
bridge, each with its own address, node agent, memory cap and CPU set.  Discovery across the bridge
finds every PC at its own address and no further (a PC on the routed subnet is reached by address);
a PC whose cable is cut mid-reply (link down: packets vanish, no reset) has its layers moved and the
reply carries on token-identical; its link back, it is offered to the fleet again; a PC whose lid
closes mid-reply (its processes stopped) is left out over TLS, and once awake, with no restart, takes
the work back when the other PC is lost; shards cross a
bandwidth-capped link and a cut transfer resumes; a PC given a link delay holds the rounds through
it and no other PC's; a model no single PC's memory cap holds is placed over several PCs; two PCs of
a split compute at the same time, several users' streams in flight, each reply token-identical; two
PCs as tensor-parallel ranks decode what the whole model does.  Needs root (CI runs as root);
nothing made is left behind."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import psutil
import pytest
from fleet_support import IDS, deployed_equals_in_process, eventually, fleet_profile, simulated_office

from engine.config import FleetAccess, Scheduling, ShardOptions
from engine.fleet.sim import netns
from engine.fleet.control import AgentError, ControlClient
from engine.fleet.deploy import LOCAL, deploy
from engine.fleet.span import StageSpan
from engine.fleet.discovery import Browser
from engine.fleet.failover import Failover
from engine.fleet.placement import Fleet, ModelShape
from engine.fleet.profile import model_shape
from engine.fleet.shardstore import content_hash
from engine.fleet.sim.office import PREFIX, NodeSpec, clean_leftovers
from engine.fleetkey import create_key, fleet_id, load_key
from engine.manifest import load_manifest
from engine.runtime.decode.generate import Generator
from engine.runtime.decode.service import ChatService
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.stage import compile_config, core

core()  # before any thread starts: creating an OpenVINO Core forks a child that hangs if threads run
pytestmark = pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0,
                                reason="a simulated office needs root (network namespaces, cgroups)")

MESSAGES = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. Paris is"}]
TOKENS = 32
RATE_MBIT = 40
SPECS = [NodeSpec("pc1", memory_mb=1536, cpus="0"), NodeSpec("pc2", memory_mb=1536, cpus="1"),
         NodeSpec("pc3", memory_mb=1536, cpus="0", rate_mbit=RATE_MBIT), NodeSpec("far", memory_mb=1536, remote=True)]


@pytest.fixture(scope="module")
def office(tmp_path_factory):
    root = tmp_path_factory.mktemp("office")
    key_file = create_key(root / "fleet.key")
    with simulated_office(SPECS, key_file, root) as office:
        yield office


def _key(office) -> bytes:
    return load_key(office.key_file)


def _reply_alone(deployment) -> list[int]:
    """The deployment's reply to MESSAGES from its shards in this process, uninterrupted, in exact mode:
    what a reply carried on over a failover must equal.  It varies, so carrying on and starting over
    would differ."""
    folders = sorted(Path(deployment.stage0).parent.glob("stage*[0-9]"))
    alone = ChatService(LocalChain(folders, config=compile_config("exact")), scheduling=Scheduling(streams=1))
    try:
        want = alone.submit(MESSAGES, TOKENS, ignore_eos=True).wait(120).tokens
    finally:
        alone.close()
    assert len(set(want[4:])) > 3
    return want


def _status(agent: str, key: bytes | FleetAccess) -> dict:
    with ControlClient(agent, key if isinstance(key, FleetAccess) else FleetAccess(key)) as client:
        return client.status()


def test_every_pc_is_found_across_the_bridge_at_its_own_address(office):
    key = _key(office)
    ids = {name: _status(node.agent, key)["node"]["node_id"] for name, node in office.nodes.items()}
    assert len(set(ids.values())) == len(ids)  # each PC its own node
    with Browser(fleet_id(key), addresses=[office.coordinator_ip]) as browser:
        deadline = time.monotonic() + 20
        while len(browser.nodes()) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2)  # time enough for the routed PC to be heard, were mDNS to cross the router
        heard = browser.nodes()
    assert {i.name for i in heard.values()} == {"pc1", "pc2", "pc3"}, browser.rejected()
    for info in heard.values():
        node = office.nodes[info.name]
        assert info.node_id == ids[info.name] and info.port == node.port
        assert info.addresses[0] == node.ip and not node.ip.startswith("127.")
    # the PC on the other subnet: not heard over mDNS, reached by its address through the router
    far = office.nodes["far"]
    assert far.ip.rsplit(".", 1)[0] != office.coordinator_ip.rsplit(".", 1)[0]
    assert _status(far.agent, key)["node"]["name"] == "far"
    # each agent (and what it starts) runs inside its PC's cgroups: its CPU set, its memory cap
    for node in office.nodes.values():
        agent = psutil.Process(node.proc.pid)
        if node.spec.cpus:
            assert agent.cpu_affinity() == [int(node.spec.cpus)]
        memory = node.cgroup[0]  # v1: the memory controller's folder first; v2: the one folder
        limit = (memory / ("memory.max" if netns.cgroup_v2() else "memory.limit_in_bytes")).read_text()
        assert int(limit) == node.spec.memory_mb << 20
        assert str(agent.pid) in (memory / "cgroup.procs").read_text().split()


def test_a_routed_pc_serves_a_stage(office, tiny_models):
    key = _key(office)
    far = office.nodes["far"].agent
    deployment, chain = deploy(str(tiny_models["llama"]), [StageSpan(LOCAL, "CPU", 0, 2),
                                                           StageSpan(far, "CPU", 2, 4)],
                               access=FleetAccess(key), shard=ShardOptions(weights="f32", mode="exact"))
    try:
        got = ChatService(chain, scheduling=Scheduling(streams=1)).submit(MESSAGES, 8, ignore_eos=True).wait(120)
        assert got.error is None and len(got.tokens) == 8
        assert deployment.remotes[0].startswith(office.nodes["far"].ip + ":")
    finally:
        chain.close()
        deployment.stop(FleetAccess(key))


DELAY_MS = 40.0


def test_a_pcs_link_delay_holds_the_rounds_through_it_and_no_other_pc(office, tiny_models):
    """pc2's link delayed (its agent started with --link-delay-ms): its worker holds every frame it
    takes and sends, so each round of a chain through pc1 and pc2 waits on the wire at least twice
    the delay; pc1's worker holds nothing."""
    key = _key(office)
    office.set_delay("pc2", DELAY_MS)
    try:
        assert _status(office.nodes["pc2"].agent, key)["link_delay_ms"] == DELAY_MS
        assert _status(office.nodes["pc1"].agent, key)["link_delay_ms"] == 0
        deployment, chain = deploy(str(tiny_models["llama"]), [StageSpan(LOCAL, "CPU", 0, 2),
                                                               StageSpan(office.nodes["pc1"].agent, "CPU", 2, 3),
                                                               StageSpan(office.nodes["pc2"].agent, "CPU", 3, 4)],
                                   access=FleetAccess(key), shard=ShardOptions(weights="f32", mode="exact"))
        try:
            held = {name: [w["delay_ms"] for w in _status(office.nodes[name].agent, key)["workers"]]
                    for name in ("pc1", "pc2")}
            assert held == {"pc1": [0.0], "pc2": [DELAY_MS]}, held
            got = Generator(chain, max_length=64).generate(IDS, 6, ignore_eos=True)
            rounds = got.breakdown.rounds
            assert len(got.tokens) == 6 and rounds >= 5
            # a delay only adds time: pc2's frame in and its reply out are each held DELAY_MS
            assert got.breakdown.network_ms >= rounds * 2 * DELAY_MS, (got.breakdown.network_ms, rounds)
        finally:
            chain.close()
            deployment.stop(FleetAccess(key))
    finally:
        office.set_delay("pc2", None)
    assert _status(office.nodes["pc2"].agent, key)["link_delay_ms"] == 0


def test_a_pc_cut_off_mid_reply_is_routed_around_and_offered_again_when_back(office, tiny_models):
    key = _key(office)
    source = str(tiny_models["gemma3"])  # its greedy reply varies (the tiny Llama's repeats one token)
    agents = {name: (None, office.nodes[name].agent) for name in ("pc1", "pc2", "pc3")}
    profile = fleet_profile(source, agents, key, weights="f32", memory=4 << 30)
    stages = [StageSpan(LOCAL, "CPU", 0, 2), StageSpan(office.nodes["pc1"].agent, "CPU", 2, 4)]
    deployment, chain = deploy(source, stages, access=FleetAccess(key), shard=ShardOptions(weights="f32", mode="exact"))
    want = _reply_alone(deployment)
    events: list[str] = []
    failover = Failover(deployment, profile, access=FleetAccess(key), on_event=events.append, chain=chain)
    service = ChatService(chain, scheduling=Scheduling(streams=1), recover=failover.recover)
    cut = threading.Event()
    try:
        def on_text(piece, tokens):
            if tokens >= 4 and not cut.is_set():
                cut.set()
                office.partition("pc1")  # the cable is pulled: no FIN, no RST, the packets vanish

        reply = service.submit(MESSAGES, TOKENS, on_text=on_text, ignore_eos=True).wait(300)
        assert cut.is_set() and reply.error is None, (reply.error, events)
        assert reply.rerouted == 1 and reply.tokens == want, events
        assert any(e.startswith("node pc1 lost") for e in events), events
        moved = failover.deployment.placement[1].node
        assert moved in (office.nodes["pc2"].agent, office.nodes["pc3"].agent), events
        with pytest.raises(AgentError, match="not reachable"):  # still cut off
            ControlClient(office.nodes["pc1"].agent, FleetAccess(key), timeout_s=2)
        assert failover.returned() == []
        office.reconnect("pc1")
        deadline = time.monotonic() + 30
        back: list[str] = []
        while not back and time.monotonic() < deadline:
            back = failover.returned()
        assert back == ["pc1"] and any(e.startswith("node pc1 is back") for e in events), events
        again = service.submit(MESSAGES, TOKENS, ignore_eos=True).wait(120)
        assert again.tokens == want and again.rerouted == 0  # not pulled into the conversation
        assert all(s.node != office.nodes["pc1"].agent for s in failover.deployment.placement)
    finally:
        office.reconnect("pc1")
        service.close()
        failover.deployment.stop(FleetAccess(key))
        deployment.stop(FleetAccess(key))


def test_a_pc_whose_lid_closes_mid_reply_is_left_out_and_takes_the_work_back_when_it_wakes(tmp_path, tiny_models):
    """An office of two PCs speaking the fleet's default TLS.  pc1's lid closes mid-reply (every process
    on it stopped, SIGSTOP; its link up): the reply carries on over pc2, token-identical, and pc1 counts
    as having dropped out.  While the lid stays shut failover's watch keeps it out; the lid opens
    (SIGCONT): with no restart of its agent it is counted back in, the worker it ran stopped; when
    pc2's cable is then cut mid-reply, pc1 takes the work back."""
    from engine.fleet import standby

    key_file = create_key(tmp_path / "fleet.key")
    specs = [NodeSpec("pc1", memory_mb=1536, cpus="0"), NodeSpec("pc2", memory_mb=1536, cpus="1")]
    with simulated_office(specs, key_file, tmp_path / "office", tls=True) as office:
        access = office.access
        assert access.uses_tls
        pc1, pc2 = office.nodes["pc1"], office.nodes["pc2"]
        source = str(tiny_models["gemma3"])  # its greedy reply varies
        profile = fleet_profile(source, {n.name: (None, n.agent) for n in (pc1, pc2)}, access.key, weights="f32",
                                memory=4 << 30, access=access)
        pc1_id = next(node for node, info in profile["nodes"].items() if info["name"] == "pc1")
        dropped = standby.dropouts().get(pc1_id, 0)
        stages = [StageSpan(LOCAL, "CPU", 0, 2), StageSpan(pc1.agent, "CPU", 2, 4)]
        deployment, chain = deploy(source, stages, access=access, shard=ShardOptions(weights="f32", mode="exact"))
        want = _reply_alone(deployment)
        events: list[str] = []
        failover = Failover(deployment, profile, access=access, on_event=events.append, chain=chain).watch(0.5)
        service = ChatService(chain, scheduling=Scheduling(streams=1), recover=failover.recover)
        agent_pid = pc1.proc.pid

        def at_token(action):
            fired = threading.Event()

            def on_text(piece, tokens):
                if tokens >= 4 and not fired.is_set():
                    fired.set()
                    action()
            return on_text, fired

        try:
            on_text, fired = at_token(lambda: office.sleep("pc1"))
            try:
                reply = service.submit(MESSAGES, TOKENS, on_text=on_text, ignore_eos=True).wait(300)
                assert fired.is_set() and reply.error is None, (reply.error, events)
                assert reply.rerouted == 1 and reply.tokens == want, events
                assert any(e.startswith("node pc1 lost") for e in events), events
                assert [s.node for s in failover.deployment.placement] == [LOCAL, pc2.agent], events
                assert standby.dropouts().get(pc1_id, 0) == dropped + 1  # the placement of standbys weighs it
                time.sleep(10 * failover.access.deadline_s)  # the lid stays shut: the watch asks it all along
                assert "pc1" in [failover.name(a) for a in failover.lost.values()], events
            finally:
                office.wake("pc1")
            assert eventually(lambda: any(e.startswith("node pc1 is back") for e in events), 120), events
            assert not failover.lost
            assert pc1.proc.pid == agent_pid and pc1.proc.poll() is None  # the same agent, never restarted
            status = _status(pc1.agent, access)
            assert status["workers"] == [] and status["state"] == "idle", status  # its stale worker stopped

            # pc2's cable is cut mid-reply: the woken PC takes the work back
            on_text, fired = at_token(lambda: office.partition("pc2"))
            reply = service.submit(MESSAGES, TOKENS, on_text=on_text, ignore_eos=True).wait(300)
            assert fired.is_set() and reply.error is None, (reply.error, events)
            assert reply.rerouted == 1 and reply.tokens == want, events
            assert [s.node for s in failover.deployment.placement] == [LOCAL, pc1.agent], events
        finally:
            office.wake("pc1")
            office.reconnect("pc2")
            service.close()
            failover.close()
            failover.deployment.stop(access)
            deployment.stop(access)


@pytest.fixture(scope="module")
def wide_model(tiny_models, tmp_path_factory) -> Path:
    """A 4-layer Llama of about 60 MB (f32) a layer, with the tiny models' tokenizer: layers large
    enough that a PC's memory cap decides how many of them it takes."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("wide") / "llama"
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=384, hidden_size=256, intermediate_size=19200, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=2, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(folder)
    for part in tiny_models["llama"].iterdir():
        if part.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(part, folder)
    return folder


def test_a_model_no_pc_can_hold_is_placed_over_several_and_chats(office, wide_model):
    """Each PC's memory cap leaves room for two of the model's layers but not three: with stage 0
    (layer 0) on this machine, layers 1-3 go to both PCs (one on the routed subnet), and the chain
    gives the in-process tokens.  The PCs measure their own headroom under the cap (the survey); the
    workers run under it."""
    from engine.fleet.placement import Pin, solve, stage_memory
    from engine.fleet.plans import placement_stages
    from engine.fleet.profile import export_profile_shards
    from engine.fleet.survey import survey

    key = _key(office)
    source, names = str(wide_model), ["pc1", "far"]
    shards = export_profile_shards(source, "f32")
    memory = stage_memory(ModelShape(**model_shape(load_manifest(shards[0]))))
    whole, part = memory.at(3, False, True), memory.at(2, False, True)  # layers 1-3; two of them
    try:
        for name in names:  # the survey's shards first (receiving them grows an agent some 20 MB)
            with ControlClient(office.nodes[name].agent, FleetAccess(key)) as agent:
                for folder in shards:
                    agent.send_shard(folder)
            office.set_memory(name, (office.memory_used(name) + (whole + part) // 2) >> 20)  # 2.5 layers' room
        doc = survey(source, [office.nodes[n].agent for n in names], access=FleetAccess(key), local_node="coordinator",
                     weights="f32")
        held = {doc["nodes"][d["node"]]["name"]: d["memory_bytes"] for d in doc["fleet"]["devices"]}
        assert all(part < held[n] < whole for n in names), (held, part, whole)  # the caps, as measured
        plan = solve(ModelShape.from_json(doc["model"]), Fleet.from_json(doc["fleet"]),
                     pins=[Pin("coordinator", 0, 1)])
        stages = placement_stages({"plan": plan.to_json(), "nodes": doc["nodes"]})
        assert stages[0].node == LOCAL and (stages[0].start, stages[0].end) == (0, 1)
        assert len({s.node for s in stages[1:]}) >= 2, plan.explain()
        deployed_equals_in_process(source, stages, key)
    finally:
        for name in names:
            office.set_memory(name, office.specs[[s.name for s in office.specs].index(name)].memory_mb)


def _qdisc_stats(office, name: str) -> dict:
    """Bytes sent and overlimits (packets held for tokens) of the tbf towards PC ``name``."""
    import re

    text = netns.run("tc", "-s", "qdisc", "show", "dev", office.nodes[name].link).stdout
    sent, over = re.search(r"Sent (\d+) bytes \d+ pkt \(dropped \d+, overlimits (\d+)", text).groups()
    return {"sent": int(sent), "overlimits": int(over)}


def test_shards_cross_a_capped_link_and_a_cut_transfer_resumes(office, tiny_exports):
    key = _key(office)
    folder = tiny_exports["qwen2", "2"].folders[1]
    size = sum(p.stat().st_size for p in folder.iterdir())
    before = _qdisc_stats(office, "pc3")
    with ControlClient(office.nodes["pc3"].agent, FleetAccess(key), timeout_s=30) as agent:
        cancel, seen = threading.Event(), []

        def cut_after_three(progress):
            seen.append(progress.bytes_done)
            if len(seen) >= 3:
                cancel.set()

        with pytest.raises(AgentError, match="cancelled"):
            agent.send_shard(folder, progress=cut_after_three, cancel=cancel, chunk_bytes=64 << 10)
        resumed = []
        started = time.monotonic()
        _, sent = agent.send_shard(folder, progress=lambda p: resumed.append(p.bytes_done), chunk_bytes=64 << 10)
        seconds = time.monotonic() - started
        assert sent and resumed[0] == seen[-1] > 0  # picked up where the bytes on the PC ended
        assert agent.call("has_shard", hash=content_hash(folder))["present"]
    after = _qdisc_stats(office, "pc3")
    assert after["sent"] - before["sent"] >= size  # every byte went through the capped link
    assert after["overlimits"] > before["overlimits"]  # and the token bucket held packets back
    print(f"resumed {(size - seen[-1]) / 2**20:.1f} MB over a {RATE_MBIT} Mbit/s link in {seconds:.2f} s")


def test_leftovers_of_a_dead_office_are_removed(tmp_path):
    """What a crashed run left (a namespace, a bridge, a cgroup, named for an owner that is gone) is
    found and removed; a live owner's things are not touched."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    live = f"{PREFIX}{os.getpid()}-keep"
    names = [f"{PREFIX}{dead}-pc1", f"{PREFIX}{dead}a", f"{PREFIX}{dead}-cg"]
    try:
        netns.make_namespace(names[0])
        netns.make_namespace(live)
        netns.make_bridge(names[1])
        netns.make_cgroup(names[2], 256, None)
        removed = clean_leftovers()
        assert set(names) <= set(removed) and live not in removed
        assert names[0] not in netns.namespaces() and names[1] not in netns.links()
        assert names[2] not in netns.cgroups(PREFIX) and live in netns.namespaces()
    finally:
        for name in (names[0], live):
            netns.delete_namespace(name)
        netns.delete_link(names[1])
        with contextlib.suppress(KeyError):
            netns.delete_cgroup(netns.cgroups(PREFIX)[names[2]])


def test_fleet_sim_brings_up_an_office_and_a_crashed_ones_leftovers_are_cleaned(tmp_path):
    """`fleet sim`: the PCs it lists are heard by `fleet nodes` at their addresses; killed (-9), it
    leaves its namespaces behind, and `fleet sim --clean` removes them."""
    import json
    import signal
    import subprocess
    import sys

    env = {**os.environ, "FLEETSHARD_HOME": str(tmp_path / "home")}
    log = tmp_path / "sim.log"
    with open(log, "w") as err:
        sim = subprocess.Popen([sys.executable, "-m", "engine.cli", "sim", "--pcs", "2", "--routed", "1",
                                "--memory", "1024", "--cpus", "0;1", "--lifeline"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    tag = f"{PREFIX}{sim.pid}a"  # its first office
    try:
        lines = []
        while not (lines and lines[-1].startswith("ready ")):
            line = sim.stdout.readline()
            assert line, f"fleet sim ended early: {log.read_text()[-2000:]}"
            lines.append(line)
        table = {row.split()[0]: row.split()[1] for row in lines[1:-1]}
        assert set(table) == {"pc1", "pc2", "far1"}, lines
        out = subprocess.run([sys.executable, "-m", "engine.cli", "nodes", "--json", "--seconds", "4"],
                             capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        heard = {n["name"]: f"{n['addresses'][0]}:{n['port']}" for n in json.loads(out.stdout)
                 if n.get("source") == "mdns"}
        assert heard == {"pc1": table["pc1"], "pc2": table["pc2"]}, heard
        assert {f"{tag}-pc1", f"{tag}-pc2", f"{tag}-far1", f"{tag}-router"} <= set(netns.namespaces())
        sim.send_signal(signal.SIGKILL)  # a crash: no cleanup runs (its agents follow it, by their lifeline)
        sim.wait(timeout=10)
        assert f"{tag}-pc1" in netns.namespaces() and f"{tag}-pc1" in netns.cgroups(PREFIX)
        clean = subprocess.run([sys.executable, "-m", "engine.cli", "sim", "--clean"], capture_output=True,
                               text=True, env=env, timeout=120)
        assert clean.returncode == 0 and f"{tag}-pc1" in clean.stderr, clean.stderr
        assert not [n for n in netns.namespaces() + netns.links() + list(netns.cgroups(PREFIX)) if n.startswith(tag)]
    finally:
        if sim.poll() is None:
            sim.kill()
            sim.wait()
        sim.stdin.close()
        sim.stdout.close()
        clean_leftovers()


def test_a_worker_started_by_a_pinned_process_takes_its_own_cpus():
    """`fleet bench microbatch --stages 2 --cpus "0;1"`: stage 0's process pins itself to CPU 0 first,
    and the worker it starts inherits that; the worker still takes CPU 1.  CPUs the machine lacks
    are refused, naming them, and the affinity is left as it was."""
    import subprocess
    import sys

    if len(os.sched_getaffinity(0)) < 2:
        pytest.fail("this test needs two CPUs")
    one, other = sorted(os.sched_getaffinity(0))[:2]
    code = ("import os; from engine.runtime.relay.affinity import pin; pin(os.environ['WANT']); "
            "print(sorted(os.sched_getaffinity(0)))")
    pinned = subprocess.run(["taskset", "-c", str(one), sys.executable, "-c", code], capture_output=True,
                            text=True, env={**os.environ, "WANT": str(other)})
    assert pinned.returncode == 0 and pinned.stdout.strip() == f"[{other}]", pinned.stderr
    missing = os.cpu_count() + 3
    refusing = ("import os; from engine.runtime.relay.affinity import pin\ntry: pin(os.environ['WANT'])\n"
                "except Exception as exc: print(exc, sorted(os.sched_getaffinity(0)))")
    refused = subprocess.run(["taskset", "-c", str(one), sys.executable, "-c", refusing], capture_output=True,
                             text=True, env={**os.environ, "WANT": f"{other},{missing}"})
    assert refused.stdout.startswith(f"CPUs [{missing}] are not available here"), refused
    assert refused.stdout.strip().endswith(f"[{one}]")  # as it was


def test_without_root_it_says_so(monkeypatch, capsys):
    from engine.cli.main import main

    before = netns.namespaces()
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["sim", "--pcs", "2"]) != 0
    assert "fleet sim needs root (network namespaces, a bridge, veth pairs and cgroups): run it with sudo" in \
        capsys.readouterr().err
    assert netns.namespaces() == before  # nothing made


def test_a_delay_for_a_pc_the_office_lacks_or_not_a_number_is_refused(capsys):
    from engine.cli.main import main

    before = netns.namespaces()
    assert main(["sim", "--pcs", "2", "--delay-ms", "pc1=20,pc7=5"]) != 0
    assert "--delay-ms names pc7, not PCs of this office (pc1, pc2)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sim", "--pcs", "2", "--delay-ms", "pc1=slow"])
    assert "takes a number of 0 or more, not 'slow'" in capsys.readouterr().err
    assert netns.namespaces() == before  # nothing made


def test_two_pcs_compute_at_once_and_streams_in_flight_decode_what_each_does_alone(office, wide_model):
    """A 3-stage split, two layers of about 60 MB on pc1 (CPU 0), one on pc2 (CPU 1), one here: six
    users' rounds travel in groups, so while pc2 computes one group pc1 computes the next: several
    groups are in flight at once, where a chain held to one group has one at a time, and every reply
    is what it is alone (exact mode).  What the overlap gains is `fleet bench sim`'s to measure."""
    key = _key(office)
    source = str(wide_model)
    # long prompts: their prefill makes the PCs' compute, not this process's bookkeeping, the work
    asks = [[{"role": "user", "content": f"Count from {n}, one number a line."}] for n in range(6)]
    alone = ChatService(LocalChain(_folders(source, [1, 3]), config=compile_config("exact")),
                        scheduling=Scheduling(streams=1))
    try:
        want = [alone.submit(ask, 24, ignore_eos=True).wait(300).tokens for ask in asks]
    finally:
        alone.close()
    stages = [StageSpan(LOCAL, "CPU", 0, 1), StageSpan(office.nodes["pc1"].agent, "CPU", 1, 3),
              StageSpan(office.nodes["pc2"].agent, "CPU", 3, 4)]
    deployment, chain = deploy(source, stages, access=FleetAccess(key), shard=ShardOptions(weights="f32", mode="exact"))
    service = ChatService(chain, scheduling=Scheduling(streams=len(asks)), prefix_cache=False)
    in_flight = {1: set(), None: set()}  # the most groups in flight of each run, by depth
    try:
        assert chain.packs and chain.depth == 3
        service.submit(asks[0], 4, ignore_eos=True).wait(120)  # warm: the first forwards compile
        for depth in (1, None, 1, None):  # one group in flight (the PCs take turns) against as many
            chain._depth = depth          # as the measured trip asks (None)
            chain.most_in_flight = 0
            replies = [h.wait(300) for h in [service.submit(ask, 24, ignore_eos=True) for ask in asks]]
            assert [r.tokens for r in replies] == want
            in_flight[depth].add(chain.most_in_flight)
    finally:
        service.close()
        deployment.stop(FleetAccess(key))
    assert in_flight[1] == {1} and min(in_flight[None]) >= 2, in_flight


def test_two_pcs_as_tensor_parallel_ranks_decode_what_the_whole_model_does(office, tiny_models, tmp_path):
    """Rank 0 here, rank 1 a `fleet worker` on pc2: every layer of every token is computed
    by both (two exchanges a layer, one for the logits), and greedy replies are the whole model's."""
    from engine.export.exporter import export_model, rank_folder
    from engine.launch import fleet_command
    from engine.runtime.relay.ranks import RankChain

    source = str(tiny_models["qwen2"])
    ranks = export_model(source, weights="f32", ranks=2, out=tmp_path / "ranks").out
    pc2 = office.nodes["pc2"]
    worker = office.spawn("pc2", fleet_command("worker", "--shard", str(rank_folder(ranks, 1)), "--listen",
                                               "0.0.0.0:7420", "--mode", "exact", "--no-tls",
                                               "--fleet-key-file", str(office.key_file)), tmp_path / "rank1.log")
    asks = (MESSAGES, [{"role": "user", "content": "Count to ten."}])
    whole = export_model(source, stages=1, weights="f32").folders
    alone = ChatService(LocalChain(whole, config=compile_config("exact")), scheduling=Scheduling(streams=1))
    chain = None
    try:
        want = [alone.submit(ask, 12, ignore_eos=True).wait(120).tokens for ask in asks]
        chain = RankChain(rank_folder(ranks, 0), [f"{pc2.ip}:7420"], access=FleetAccess(_key(office)),
                          shard=ShardOptions(mode="exact"), connect_timeout_s=120)
        service = ChatService(chain, scheduling=Scheduling(streams=1), prefix_cache=False)
        try:
            got = [service.submit(ask, 12, ignore_eos=True).wait(120).tokens for ask in asks]
        finally:
            service.close()
        layers = load_manifest(rank_folder(ranks, 0)).spec.num_layers
        forwards = chain.mesh.exchanges // (2 * layers + 1)
        assert chain.mesh.exchanges == forwards * (2 * layers + 1) and forwards >= 24
    finally:
        alone.close()
        if chain is not None:
            chain.close()
        worker.terminate()
    assert got == want


def _folders(source: str, split: list[int]) -> list[Path]:
    from engine.export.exporter import export_model

    return export_model(source, split=split, weights="f32").folders


BUSY = """
import os, time
start = time.monotonic()
while time.monotonic() - start < 2.0:
    pass
times = os.times()
print(times.user + times.system, flush=True)
"""


def test_a_pcs_cpu_quota_holds_what_runs_on_it(tmp_path):
    """A PC given half a core (a cgroup CPU quota, so that three PCs fit two cores): a program that
    spins for 2 s of wall time on it gets about 1 s of CPU; the quota is what was asked for."""
    import sys

    key_file = create_key(tmp_path / "fleet.key")
    with simulated_office([NodeSpec("half", cpus="1", cpu_quota=0.5)], key_file, tmp_path / "office") as office:
        node = office.nodes["half"]
        assert netns.cpu_quota(node.cgroup) == 0.5
        assert "0.5" in office.table()[1].split()
        log = tmp_path / "busy.log"
        proc = office.spawn("half", [sys.executable, "-c", BUSY], log)
        assert proc.wait(30) == 0, log.read_text()
        cpu = float(log.read_text().split()[-1])
    assert 0.6 < cpu < 1.4, cpu


def test_bench_sim_refuses_user_counts_its_layout_does_not_serve(capsys):
    from engine.cli.main import main

    assert main(["bench", "sim", "--model", "smollm2-135m", "--parts", "layout", "--users", "5,7"]) != 0
    assert "fleet bench sim's layout serves 1, 2, 3, 4, 6, 8 users, none of 5, 7" in capsys.readouterr().err
