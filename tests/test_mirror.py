"""Hot standbys kept warm: every frame that changes a stage's caches is copied to its standby, so a
switch to it keeps each stream's cache and the reply carries on from its next token, no prefill
again.  Over real sockets with in-process workers (a tiny model in three stages): the first remote
stage (mirrored by the coordinator) and the second (mirrored by the worker before it) lost mid-reply,
the reply token-identical to an uninterrupted one; copies that end without their hand-over leave
the standby holding nothing, and a worker serving an upstream ignores copies."""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest

from engine.config import FleetAccess, Scheduling
from engine.fleetkey import create_key, load_key
from engine.manifest import load_manifest
from engine.runtime.decode.service import ChatService
from engine.runtime.relay.mirror import Mirror
from engine.runtime.relay.remote import RemoteChain
from engine.runtime.relay.worker import Worker
from engine.runtime.stages.chain import LocalChain
from engine.transport import wire
from engine.transport.wire import Frame, Msg

MESSAGES = [{"role": "user", "content": "A fleet of laptops in an office answers questions about the weather, "
                                        "the trains, the lunch menu and the printer on the second floor, all day."}]
TOKENS = 16


@pytest.fixture(scope="module")
def key(tmp_path_factory):
    return load_key(create_key(tmp_path_factory.mktemp("keys") / "fleet.key"))


@contextlib.contextmanager
def _workers(folders, key):
    started = []
    try:
        for folder in folders:
            started.append(Worker(folder, "127.0.0.1:0", access=FleetAccess(key), log=lambda line: None).start())
        yield started
    finally:
        for worker in started:
            worker.stop()


def _until(condition, timeout=10.0):
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError("timed out")
        time.sleep(0.02)


@pytest.mark.parametrize("rewind", ["trim", "mask"])
@pytest.mark.parametrize("victim", [1, 2])
def test_a_lost_stage_hands_over_to_its_mirrored_standby_without_a_prefill(victim, rewind, tiny_exports, key):
    folders = tiny_exports["qwen2", "3"].folders
    reference = ChatService(LocalChain(folders), scheduling=Scheduling(streams=1), rewind=rewind)
    try:
        want = reference.submit(MESSAGES, TOKENS, ignore_eos=True).wait(60)
    finally:
        reference.close()
    with _workers(folders[1:] * 2, key) as (first, second, spare1, spare2):
        spares = {1: spare1, 2: spare2}
        chain = RemoteChain(folders[0], [first.address, second.address], access=FleetAccess(key), connect_timeout_s=10,
                            standbys=[spare1.address, spare2.address])
        victims = {1: first, 2: second}

        def recover(error):
            assert error.stage == victim
            chain.reroute(error.stage, spares[error.stage].address, timeout_s=10)
            return chain

        service = ChatService(chain, scheduling=Scheduling(streams=1), rewind=rewind, recover=recover)
        struck = threading.Event()

        def on_text(piece, count):
            if count >= 6 and not struck.is_set():
                struck.set()
                victims[victim].stop()

        try:
            reply = service.submit(MESSAGES, TOKENS, on_text=on_text, ignore_eos=True).wait(120)
            assert struck.is_set() and reply.error is None, reply.error
            assert reply.rerouted == 1 and reply.tokens == want.tokens
            assert service.failovers["kept"] == 1  # carried on from the caches the standby had mirrored
            # the standby computed what came after the switch, not the conversation again
            assert 0 < spares[victim].tokens < want.prompt_tokens
            assert chain.remotes[victim - 1] == spares[victim].address
            again = service.submit(MESSAGES, TOKENS, ignore_eos=True).wait(60)
            assert again.tokens == want.tokens and again.rerouted == 0
        finally:
            service.close()


def _copies(folder, key, spare, *, hand_over: bool):
    """A stream's RESET and prefill copied to ``spare`` (stage 1), then the copies handed over or cut."""
    manifest = load_manifest(folder)
    mirror = Mirror(spare.address, access=FleetAccess(key), manifest=manifest, mode="fast")
    x = np.random.default_rng(0).standard_normal((1, 5, spare.hidden)).astype(np.float32)
    mirror.send(Frame(Msg.RESET, 3))
    mirror.send(wire.forward_frame(3, 1, x, np.ones((1, 5), np.uint8), np.arange(5)[None], np.zeros(1, np.float32)))
    mirror.send(wire.control(Msg.PING, {"route": []}, 3, 2))  # not a cache change: not copied
    _until(lambda: spare.describe()["streams"].get("3") == 5)
    if hand_over:
        assert mirror.handover()
    else:
        mirror.close()
    _until(lambda: spare._mirror_done.is_set())
    return spare.describe()["streams"]


def test_copies_cut_without_their_hand_over_leave_nothing_behind(tiny_exports, key):
    folders = tiny_exports["qwen2", "3"].folders
    with _workers([folders[1]], key) as (spare,):
        assert _copies(folders[0], key, spare, hand_over=True) == {"3": 5}
    with _workers([folders[1]], key) as (spare,):
        assert _copies(folders[0], key, spare, hand_over=False) == {}  # a stream may lack a copy: none is kept
    assert spare.tokens == 0  # copies are not served tokens


def test_a_serving_worker_ignores_copies(tiny_exports, key):
    folders = tiny_exports["qwen2", "2"].folders
    want = LocalChain(folders)
    with _workers([folders[1]], key) as (worker,):
        chain = RemoteChain(folders[0], [worker.address], access=FleetAccess(key), connect_timeout_s=10)
        service = ChatService(chain, scheduling=Scheduling(streams=1))
        reference = ChatService(want, scheduling=Scheduling(streams=1))
        try:
            first = service.submit(MESSAGES, 8, ignore_eos=True).wait(60)
            held = dict(worker.describe()["streams"])
            # someone else's copies of a stream the worker serves: applied, they would corrupt its cache
            mirror = Mirror(worker.address, access=FleetAccess(key), manifest=load_manifest(folders[0]),
                            mode="fast")
            mirror.send(Frame(Msg.RESET, 0))
            time.sleep(0.5)
            mirror.close()
            assert worker.describe()["streams"] == held
            assert service.submit(MESSAGES, 8, ignore_eos=True).wait(60).tokens == first.tokens
            assert first.tokens == reference.submit(MESSAGES, 8, ignore_eos=True).wait(60).tokens
        finally:
            service.close()
            reference.close()


def test_a_standby_named_later_is_taken_up_at_the_next_reply(tiny_exports, key):
    """A PC back from sleep is named a stage's standby while the chain runs (``RemoteChain.stand_by``,
    from failover's watch thread): the next reply starts its stream anew rather than reuse the cache
    the standby lacks (the prefix cache), is mirrored, and the standby takes over without a prefill."""
    folders = tiny_exports["qwen2", "2"].folders
    reference = ChatService(LocalChain(folders), scheduling=Scheduling(streams=1))
    try:
        want = reference.submit(MESSAGES, TOKENS, ignore_eos=True).wait(60)
    finally:
        reference.close()
    with _workers([folders[1]] * 2, key) as (first, spare):
        chain = RemoteChain(folders[0], [first.address], access=FleetAccess(key), connect_timeout_s=10)
        service = ChatService(chain, scheduling=Scheduling(streams=1),
                              recover=lambda error: (chain.reroute(1, spare.address, timeout_s=10), chain)[1])
        try:
            assert service.submit(MESSAGES, 4, ignore_eos=True).wait(60).tokens == want.tokens[:4]
            assert spare.describe()["streams"] == {}  # not a standby yet
            chain.stand_by(1, spare.address)
            struck = threading.Event()

            def on_text(piece, count):
                if count >= 6 and not struck.is_set():
                    struck.set()
                    first.stop()

            reply = service.submit(MESSAGES, TOKENS, on_text=on_text, ignore_eos=True).wait(120)
            assert reply.error is None and reply.tokens == want.tokens and service.failovers["kept"] == 1
            assert 0 < spare.tokens < want.prompt_tokens
        finally:
            service.close()
