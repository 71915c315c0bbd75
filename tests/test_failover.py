"""Surviving a lost laptop, with real processes: three node agents on loopback, the real SmolLM2 as
a 2-stage deployment, and a chat reply in flight when a node's agent and worker are killed
(kill -9), when a worker hangs (SIGSTOP), and when the survivors cannot take the lost layers.  The
reply carries on over the new chain token-identical to an uninterrupted one (greedy, exact mode); a
lost node that comes back is offered to the next placement, not pulled into the conversation."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading

import psutil
import pytest
from fleet_support import agent_process, fleet_profile

from engine.config import FleetAccess, Scheduling, ShardOptions
from engine.fleet.deploy import LOCAL, deploy
from engine.fleet.span import StageSpan
from engine.fleet.failover import Failover
from engine.fleet.placement import Fleet
from engine.fleetkey import create_key, load_key
from engine.runtime.decode.service import ChatService
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.stage import compile_config

MODEL = "smollm2-135m"
MESSAGES = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
TOKENS = 40
pytestmark = pytest.mark.real_model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Three agents (alpha on a fixed port, so it can come back there), the fleet's profile, and the
    fleet key."""
    root = tmp_path_factory.mktemp("failover")
    key_file = create_key(root / "fleet.key")
    key = load_key(key_file)
    port = _free_port()
    with contextlib.ExitStack() as stack:
        agents = {name: stack.enter_context(agent_process(key_file, root / name, name=name,
                                                          listen=f"127.0.0.1:{port}" if name == "alpha" else
                                                          "127.0.0.1:0"))
                  for name in ("alpha", "beta", "gamma")}
        yield {"key": key, "key_file": key_file, "source": MODEL, "agents": agents,
               "profile": fleet_profile(MODEL, agents, key), "root": root}


def _reference(deployment) -> list[int]:
    from pathlib import Path

    folders = sorted(Path(deployment.stage0).parent.glob("stage*[0-9]"))
    service = ChatService(LocalChain(folders, config=compile_config("exact")), scheduling=Scheduling(streams=1),
                          rewind="trim")
    try:
        return service.submit(MESSAGES, TOKENS, ignore_eos=True).wait(120).tokens
    finally:
        service.close()


def _deployed(fleet, on="alpha"):
    address = fleet["agents"][on][1]
    stages = [StageSpan(LOCAL, "CPU", 0, 15), StageSpan(address, "CPU", 15, 30)]
    return deploy(fleet["source"], stages, access=FleetAccess(fleet["key"]),
                  shard=ShardOptions(weights="int4", mode="exact"))


def _worker_of(agent_proc) -> psutil.Process:
    children = psutil.Process(agent_proc.pid).children()
    assert len(children) == 1, children
    return children[0]


def _chat_with(service, after_tokens: int, action):
    """Submits the reply and runs ``action`` once ``after_tokens`` tokens have arrived."""
    fired = threading.Event()

    def on_text(piece, tokens):
        if tokens >= after_tokens and not fired.is_set():
            fired.set()
            action()

    reply = service.submit(MESSAGES, TOKENS, on_text=on_text, ignore_eos=True).wait(300)
    assert fired.is_set()
    return reply


def test_a_node_killed_mid_reply_and_a_hung_worker(fleet):
    events: list[str] = []
    deployment, chain = _deployed(fleet)
    want = _reference(deployment)
    assert len(set(want[8:])) > 5  # a reply that varies: carrying on and starting over would differ
    failover = Failover(deployment, fleet["profile"], access=FleetAccess(fleet["key"]), on_event=events.append,
                        chain=chain)
    service = ChatService(chain, scheduling=Scheduling(streams=1), rewind="trim", recover=failover.recover)
    try:
        alpha_proc, _ = fleet["agents"]["alpha"]
        worker = _worker_of(alpha_proc)

        def kill_alpha():
            for proc in (worker, alpha_proc):
                os.kill(proc.pid, signal.SIGKILL)

        reply = _chat_with(service, 8, kill_alpha)
        assert reply.error is None and reply.rerouted == 1
        assert reply.tokens == want
        assert any(e.startswith("node alpha lost") for e in events), events
        moved = [e for e in events if e.startswith("moving layers 15-29 to node")]
        assert moved and moved[0].split()[-1].rstrip("…") in ("beta", "gamma"), events
        survivor = moved[0].split()[-1].rstrip("…")
        assert failover.deployment.placement[1].node == fleet["agents"][survivor][1]
        assert failover.chain is not chain and failover.chain.local is chain.local  # stage 0 not compiled again

        # a worker that hangs rather than dies: its node still answers, so the stage starts again there
        events.clear()
        hung = _worker_of(fleet["agents"][survivor][0])
        reply = _chat_with(service, 8, lambda: os.kill(hung.pid, signal.SIGSTOP))
        assert reply.error is None and reply.rerouted == 1 and reply.tokens == want
        assert any("starting its worker again" in e for e in events), events
        assert not hung.is_running() or hung.status() == psutil.STATUS_ZOMBIE  # the hung worker was ended
        assert _worker_of(fleet["agents"][survivor][0]).pid != hung.pid

        # alpha comes back (same address): offered to the next placement, not pulled into the chat
        with agent_process(fleet["key_file"], fleet["root"] / "alpha", name="alpha",
                           listen=fleet["agents"]["alpha"][1]):
            assert failover.returned() == ["alpha"]
            assert any(e.startswith("node alpha is back") for e in events)
            again = service.submit(MESSAGES, TOKENS, ignore_eos=True).wait(120)
            assert again.tokens == want and again.rerouted == 0
            assert all(s.node != fleet["agents"]["alpha"][1] for s in failover.deployment.placement)
    finally:
        service.close()
        failover.deployment.stop(FleetAccess(fleet["key"]))


def test_survivors_that_cannot_take_the_layers_say_so(fleet):
    deployment, chain = _deployed(fleet, on="beta")
    profile = dict(fleet["profile"])
    tiny_memory = [{**d, "memory_bytes": 1 if d["node"] != "coordinator" else d["memory_bytes"]}
                   for d in profile["fleet"]["devices"]]
    profile["fleet"] = {**profile["fleet"], "devices": tiny_memory}
    assert Fleet.from_json(profile["fleet"]).devices
    events: list[str] = []
    failover = Failover(deployment, profile, access=FleetAccess(fleet["key"]), on_event=events.append)
    service = ChatService(chain, scheduling=Scheduling(streams=1), rewind="trim", recover=failover.recover)
    try:
        beta_proc, _ = fleet["agents"]["beta"]
        worker = _worker_of(beta_proc)
        # beta's agent stops answering (SIGSTOP), its worker dies
        reply = _chat_with(service, 4, lambda: (os.kill(beta_proc.pid, signal.SIGSTOP),
                                                os.kill(worker.pid, signal.SIGKILL)))
        assert reply.stopped_by == "error"
        assert "node beta lost, and the surviving nodes cannot take its layers 15-29" in reply.error, reply.error
        assert "tray worker" in reply.error and any(e.startswith("node beta lost") for e in events)
    finally:
        os.kill(beta_proc.pid, signal.SIGCONT)
        service.close()
        deployment.stop(FleetAccess(fleet["key"]))


def test_a_laptop_that_sleeps_is_left_out_and_rejoins_when_it_wakes(fleet, tmp_path):
    """A laptop's lid closes mid-reply (its agent and worker stopped, SIGSTOP) for as long as 30 of the
    settings' deadlines (60 s at the default): the reply carries on over the other laptop, token-identical.
    The lid opens (SIGCONT): with no restart of its agent, failover's watch counts it back in and stops
    the worker it no longer uses; when the other laptop is then lost, the woken one takes the work back."""
    import time

    from fleet_support import eventually

    from engine.config import Settings
    from engine.fleet.control import ControlClient

    settings = Settings()  # the deadline and the rejoin watch's pace, as the app and `fleet serve` run them
    key = fleet["key"]
    with agent_process(fleet["key_file"], tmp_path / "lid", name="lid") as (lid_proc, lid), \
            agent_process(fleet["key_file"], tmp_path / "desk", name="desk") as (desk_proc, desk):
        agents = {"lid": (lid_proc, lid), "desk": (desk_proc, desk)}
        stages = [StageSpan(LOCAL, "CPU", 0, 15), StageSpan(lid, "CPU", 15, 30)]
        access = FleetAccess(key, deadline_s=settings.deadline_s)
        deployment, chain = deploy(fleet["source"], stages, access=access,
                                   shard=ShardOptions(weights="int4", mode="exact"))
        want = _reference(deployment)
        events: list[str] = []
        failover = Failover(deployment, fleet_profile(MODEL, agents, key), access=access, on_event=events.append,
                            chain=chain).watch(settings.rejoin_check_s)
        service = ChatService(chain, scheduling=Scheduling(streams=1), rewind="trim", recover=failover.recover)
        asleep = [lid_proc.pid, _worker_of(lid_proc).pid]
        try:
            closed_at = []

            def close_lid():
                closed_at.append(time.monotonic())
                for pid in asleep:
                    os.kill(pid, signal.SIGSTOP)

            reply = _chat_with(service, 8, close_lid)
            assert reply.error is None and reply.rerouted == 1 and reply.tokens == want, (reply.error, events)
            assert any(e.startswith("node lid lost") for e in events), events
            assert [s.node for s in failover.deployment.placement] == [LOCAL, desk]
            time.sleep(max(0.0, closed_at[0] + 30 * settings.deadline_s - time.monotonic()))  # the lid stays shut
            assert "lid" in [failover.name(a) for a in failover.lost.values()]  # asked while asleep: still out
        finally:
            for pid in asleep:
                os.kill(pid, signal.SIGCONT)
        try:
            assert eventually(lambda: any(e.startswith("node lid is back") for e in events), 120), events
            assert not failover.lost
            assert psutil.Process(lid_proc.pid).is_running() and lid_proc.poll() is None  # the same agent process
            with ControlClient(lid, FleetAccess(key)) as agent:
                status = agent.status()
            assert status["workers"] == [] and status["state"] == "idle"  # the stale worker stopped

            # the other laptop is lost: the woken one takes the work back
            events.clear()
            desk_worker = _worker_of(desk_proc)

            def lose_desk():
                for proc in (desk_worker, desk_proc):
                    os.kill(proc.pid, signal.SIGKILL)

            reply = _chat_with(service, 8, lose_desk)
            assert reply.error is None and reply.rerouted == 1 and reply.tokens == want, (reply.error, events)
            assert [s.node for s in failover.deployment.placement] == [LOCAL, lid], events
        finally:
            service.close()
            failover.close()
            failover.deployment.stop(FleetAccess(key))
