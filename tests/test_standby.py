"""Hot standbys: where the solver puts them (memory, the stage's own node, how often a node dropped
out), and, with real processes, a stage's worker killed mid-reply handing over to its standby: no
redeployment, the reply token-identical to an uninterrupted one (greedy, exact mode)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from pathlib import Path

import psutil
import pytest
from fleet_support import agent_process, eventually, fleet_profile

from engine.config import FleetAccess, Scheduling, ShardOptions
from engine.fleet import standby
from engine.fleet.deploy import LOCAL, Deployment, deploy
from engine.fleet.failover import Failover
from engine.fleet.placement import DeviceProfile, Fleet, ModelShape
from engine.fleet.span import StageSpan
from engine.fleetkey import create_key, load_key
from engine.runtime.decode.service import ChatService
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.stage import compile_config

GB = 1 << 30
SHAPE = ModelShape(name="m", num_layers=30, layer_bytes=GB // 10, embed_bytes=GB // 5, head_bytes=GB // 5,
                   kv_bytes_per_layer=0)


def _fleet(memory: dict[str, int]) -> Fleet:
    devices = [DeviceProfile(node, "CPU", bytes_, layer_ms=1.0, head_ms=1.0) for node, bytes_ in memory.items()]
    return Fleet(devices=devices, rtt_ms={}, coordinator="coordinator")


def test_standbys_go_where_there_is_room_and_never_on_their_own_node():
    stages = [StageSpan(LOCAL, "CPU", 0, 10), StageSpan("a", "CPU", 10, 20), StageSpan("b", "CPU", 20, 30)]
    fleet = _fleet({"coordinator": 8 * GB, "a": 8 * GB, "b": 8 * GB, "c": 8 * GB})
    where = standby.place(SHAPE, fleet, stages)
    assert set(where) == {1, 2}  # stage 0 runs here: this machine's loss ends the chat anyway
    assert all(where[i].node != stages[i].node and where[i].node != "coordinator" for i in where)
    assert [(where[i].start, where[i].end) for i in (1, 2)] == [(10, 20), (20, 30)]
    assert where[1].node == "c"  # the most room left

    tight = _fleet({"coordinator": 8 * GB, "a": 8 * GB, "b": 8 * GB, "c": int(1.2 * GB)})
    where = standby.place(SHAPE, tight, stages)
    assert where[1].node in ("b", "c") and where[2].node in ("a", "c")
    assert [w.node for w in where.values()].count("c") <= 1  # c holds one stage's shard, not two

    full = _fleet({"coordinator": 8 * GB, "a": int(1.3 * GB), "b": int(1.3 * GB)})
    assert standby.place(SHAPE, full, stages) == {}  # no room: the stages fail over by redeploying


def test_standbys_go_to_idle_nodes_first_since_they_compute_along(tmp_path):
    stages = [StageSpan(LOCAL, "CPU", 0, 10), StageSpan("a", "CPU", 10, 20), StageSpan("b", "CPU", 20, 30)]
    fleet = _fleet({"coordinator": 8 * GB, "a": 16 * GB, "b": 16 * GB, "c": 4 * GB})
    counts = tmp_path / "dropouts.json"
    standby.count_dropout("c", counts)
    where = standby.place(SHAPE, fleet, stages, standby.dropouts(counts))
    assert where[1].node == "c" and where[2].node == "c"  # less room, dropped out once, but idle


def test_standbys_prefer_the_nodes_that_drop_out_least(tmp_path):
    stages = [StageSpan(LOCAL, "CPU", 0, 15), StageSpan("a", "CPU", 15, 30)]
    fleet = _fleet({"coordinator": 8 * GB, "a": 8 * GB, "b": 4 * GB, "c": 8 * GB})
    assert standby.place(SHAPE, fleet, stages)[1].node == "c"  # the most room
    counts = tmp_path / "dropouts.json"
    standby.count_dropout("c", counts)
    standby.count_dropout("c", counts)
    assert standby.dropouts(counts) == {"c": 2}
    assert standby.place(SHAPE, fleet, stages, standby.dropouts(counts))[1].node == "b"
    counts.write_text("[not a count]")
    assert standby.dropouts(counts) == {}


MODEL = "smollm2-135m"
MESSAGES = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
TOKENS = 40


@contextlib.contextmanager
def _deployed(tmp_path, names: tuple[str, str]):
    """Two node agents named ``names``, the model's second half deployed on the first with a hot
    standby on the second, a failover of it, its chat service, and the reply an uninterrupted chain
    gives: (key, agents, deployment, failover, service, the reply's tokens, failover's events)."""
    key_file = create_key(tmp_path / "fleet.key")
    key = load_key(key_file)
    with contextlib.ExitStack() as stack:
        agents = {name: stack.enter_context(agent_process(key_file, tmp_path / name, name=name)) for name in names}
        profile = fleet_profile(MODEL, agents, key)
        profile_file = tmp_path / "profile.json"
        profile_file.write_text(json.dumps(profile))
        stages = [StageSpan(LOCAL, "CPU", 0, 15), StageSpan(agents[names[0]][1], "CPU", 15, 30)]
        deployment, chain = deploy(MODEL, stages, access=FleetAccess(key),
                                   shard=ShardOptions(weights="int4", mode="exact"), standbys=True,
                                   planned={"profile": str(profile_file)})
        events: list[str] = []
        failover = Failover(deployment, profile, access=FleetAccess(key), on_event=events.append, chain=chain)
        service = ChatService(chain, scheduling=Scheduling(streams=1), rewind="trim", recover=failover.recover)
        try:
            folders = sorted(Path(deployment.stage0).parent.glob("stage*[0-9]"))
            reference = ChatService(LocalChain(folders, config=compile_config("exact")),
                                    scheduling=Scheduling(streams=1), rewind="trim")
            try:
                want = reference.submit(MESSAGES, TOKENS, ignore_eos=True).wait(120).tokens
            finally:
                reference.close()
            assert len(set(want[8:])) > 5  # a reply that varies: carrying on and starting over would differ
            yield key, agents, deployment, failover, service, want, events
        finally:
            service.close()
            failover.close()
            failover.deployment.stop(FleetAccess(key))
            deployment.stop(FleetAccess(key))


def _at_token(n: int, action) -> tuple:
    """An ``on_text`` that runs ``action`` once ``n`` tokens have come, and the event it sets then."""
    fired = threading.Event()

    def on_text(piece, count):
        if count >= n and not fired.is_set():
            fired.set()
            action()

    return on_text, fired


@pytest.mark.real_model
def test_a_killed_worker_hands_over_to_its_standby(tmp_path):
    with _deployed(tmp_path, ("alpha", "beta")) as (key, agents, deployment, failover, service, want, events):
        alpha, beta = agents["alpha"][1], agents["beta"][1]
        chain = failover.chain
        spare = deployment.standby_for(1)
        assert spare is not None and spare.agent == beta
        assert Deployment.from_json(deployment.to_json()).standby_for(1) == spare  # recorded

        worker = psutil.Process(agents["alpha"][0].pid).children()[0]
        on_text, fired = _at_token(8, lambda: os.kill(worker.pid, signal.SIGKILL))
        reply = service.submit(MESSAGES, TOKENS, on_text=on_text, ignore_eos=True).wait(300)
        assert fired.is_set()
        assert reply.error is None and reply.rerouted == 1 and reply.tokens == want
        assert any("its standby on beta takes over" in e for e in events), events
        assert not any("starting its worker again" in e or "moving" in e for e in events), events
        assert failover.deployment.placement[1].node == beta and failover.deployment.standbys == []
        assert failover.deployment.remotes == [spare.address]
        assert failover.chain is chain  # re-routed: stage 0 not compiled again, every cache kept
        assert service.failovers["kept"] == 1  # carried on from the caches the standby mirrored
        again = service.submit(MESSAGES, TOKENS, ignore_eos=True).wait(120)
        assert again.tokens == want and again.rerouted == 0

        # the standby is spent: a second loss redeploys, and a standby starts again beside the reply
        worker = psutil.Process(agents["beta"][0].pid).children()[0]
        on_text, fired = _at_token(8, lambda: os.kill(worker.pid, signal.SIGKILL))
        reply = service.submit(MESSAGES, TOKENS, on_text=on_text, ignore_eos=True).wait(300)
        assert fired.is_set() and reply.error is None and reply.tokens == want, (reply.error, events)
        assert eventually(lambda: "part 2 has a standby again, on alpha" in events, 120), events
        assert failover.deployment.standby_for(1).agent == alpha


@pytest.mark.real_model
def test_a_laptop_back_from_sleep_stands_by_again(tmp_path):
    """The stage's PC sleeps mid-reply (SIGSTOP): its standby takes over.  It wakes: with no restart,
    it becomes the stage's standby, mirrors the next reply, and takes the stage back when the other
    PC is lost in turn, the reply carrying on from its caches both times, token-identical."""
    with _deployed(tmp_path, ("lid", "desk")) as (key, agents, deployment, failover, service, want, events):
        (lid_proc, lid), (desk_proc, desk) = agents["lid"], agents["desk"]
        failover.watch(0.5)
        asleep = [lid_proc.pid, psutil.Process(lid_proc.pid).children()[0].pid]

        def sleep():
            for pid in asleep:
                os.kill(pid, signal.SIGSTOP)

        try:
            reply = service.submit(MESSAGES, TOKENS, on_text=_at_token(8, sleep)[0], ignore_eos=True).wait(300)
            assert reply.error is None and reply.tokens == want, (reply.error, events)
            assert failover.deployment.placement[1].node == desk and service.failovers["kept"] == 1, events
            assert eventually(lambda: any(e.startswith("node lid lost") for e in events), 30), events
        finally:
            for pid in asleep:
                os.kill(pid, signal.SIGCONT)
        assert eventually(lambda: "node lid is back: it stands by for part 2" in events, 120), events
        assert failover.deployment.standby_for(1).agent == lid

        desk_worker = psutil.Process(desk_proc.pid).children()[0]
        on_text, _ = _at_token(8, lambda: os.kill(desk_worker.pid, signal.SIGKILL))
        reply = service.submit(MESSAGES, TOKENS, on_text=on_text, ignore_eos=True).wait(300)
        assert reply.error is None and reply.tokens == want, (reply.error, events)
        assert failover.deployment.placement[1].node == lid and service.failovers["kept"] == 2, events
