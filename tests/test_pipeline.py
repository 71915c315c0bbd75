"""The distributed pipeline on loopback with real workers: the same tokens as in-process, refusal of
strangers and foreign shards, a fuzzed worker that keeps serving, and dead, stalled or malformed workers
reported by stage and address within the deadline.  ``hosting``: most tests run their workers as threads of
this process (the fast tier) and as processes (the slow tier); a worker's death is a process's."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from engine.config import FleetAccess, RelayOptions, Scheduling, ShardOptions
from engine.errors import StageError
from engine.fleetkey import access_of, create_certificate, create_key, load_key, tls_file
from engine.manifest import load_manifest
from engine.runtime.decode.generate import Generator
from engine.runtime.relay.local_workers import LocalWorkers
from engine.runtime.relay.remote import RemoteChain
from engine.runtime.relay.worker import Worker
from engine.runtime.stages.chain import LocalChain
from engine.transport import wire
from engine.transport.link import Link, accept_loop, authenticate_peer, dial, successor_identity
from engine.transport.wire import Flag, Frame, Msg

IDS = np.array([[5, 17, 42, 101, 7, 250, 33, 64, 9]], dtype=np.int64)
TOKENS = 16


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    return create_key(tmp_path_factory.mktemp("keys") / "fleet.key")


@contextlib.contextmanager
def pipeline(folders, key_file, tmp_path, *, coordinator_key=None, depth=None, fed=False, relay=RelayOptions(),
             mode="fast", **fleet_args):
    """Stages 1.. as worker processes, stage 0 in this process (``fed``: every stage a worker, this
    process feeding the first its token ids); every stage runs in ``mode``, every relay with ``relay``."""
    tls = fleet_args.pop("tls", False)
    shard = ShardOptions(mode=mode)
    fleet = LocalWorkers(folders if fed else folders[1:], access_of(key_file, tls=tls), log_dir=tmp_path,
                         shard=shard, relay=relay, **fleet_args).start()
    chain = None
    try:
        access = FleetAccess(coordinator_key or load_key(key_file), _tls(key_file) if tls else None)
        chain = RemoteChain(folders[0], fleet.addresses, access=access, connect_timeout_s=30, shard=shard,
                            depth=depth, fed=fed, relay=relay)
        yield fleet, chain
    finally:
        if chain is not None:
            chain.close()
        fleet.close()


def _tls(key_file):
    from engine.fleetkey import TLS

    return TLS(tls_file(key_file))


def _greedy(chain, tokens=TOKENS, **kw):
    return Generator(chain, max_length=128).generate(IDS, tokens, ignore_eos=True, **kw).tokens


@pytest.mark.parametrize("arch, label, fed, stateful", [("llama", "2", False, False), ("qwen2", "3", False, False),
                                                       ("qwen2", "1", True, False), ("llama", "2", True, True)])
def test_loopback_pipeline_equals_in_process_chain(arch, label, fed, stateful, tiny_exports, key_file, tmp_path,
                                                   hosting):
    """``fed``: every stage on a worker, the model whole on one or split over two; this process
    only feeds token ids to the first (``stateful`` workers: one FORWARD per stream, no packing)."""
    folders = tiny_exports[arch, label].folders
    local = LocalChain(folders, paged=False if stateful else None)
    want = _greedy(local)
    n = IDS.shape[1]
    mask, pos = np.ones((1, n), np.int64), np.arange(n)[None]
    local.reset()
    want_out = local.forward(IDS, mask, pos, Flag.LOGITS | Flag.PROBS | Flag.ALL_POSITIONS)
    with pipeline(folders, key_file, tmp_path, fed=fed, isolate=stateful, hosting=hosting) as (fleet, chain):
        assert [s["stage"] for s in chain.stages] == list(range(0 if fed else 1, len(folders)))
        assert chain.packs != stateful
        assert _greedy(chain) == want
        assert _greedy(chain) == want  # a second request on the same connections starts clean
        chain.reset()
        got = chain.forward(IDS, mask, pos, Flag.LOGITS | Flag.PROBS | Flag.ALL_POSITIONS)
        # Same shards, same device: the relay must not change a single bit.
        assert np.array_equal(got.tokens, want_out.tokens) and got.tokens.shape == (n,)
        assert np.array_equal(got.logits, want_out.logits)
        assert np.array_equal(got.probs, want_out.probs)
        assert np.allclose(got.probs, 1 / np.exp(got.logits[0] - got.logits[0].max(-1, keepdims=True)).sum(-1))
        chain.reset()
        top1 = chain.forward(IDS, mask, pos)  # the default: top-1 of the last position only
        assert top1.logits is None and top1.probs is None and top1.tokens.tolist() == [want_out.tokens[-1]]
        assert len(top1.stage_ms) == len(folders) + fed and top1.network_ms >= 0  # fed: the feeder's 0 ms


@pytest.mark.parametrize("depth, fed", [(1, False), (3, False), (1, True)])
def test_streams_travel_packed_one_frame_per_round(depth, fed, tiny_exports, key_file, tmp_path, hosting):
    """Every stage paged: the active streams' rounds travel in PACKED frames down the chain, and
    each stream decodes (exact settings) what it decodes alone, while streams join and leave and
    spoiled drafts are cut back inside the packs.  ``depth`` 1: one frame carries every stream's
    round; 3: the streams form one group per stage, all in flight at once.  ``fed``: the token ids
    travel packed to a worker holding stage 0."""
    from engine.runtime.decode.generate import Decoding
    from engine.runtime.decode.kvsequence import KVSequence
    from engine.runtime.decode.speculative import PromptLookup
    from engine.runtime.stages.stage import MODES

    class WrongDrafts(PromptLookup):
        def propose(self, history, k):
            return [int(history[-1]) % 200 + 3] * k  # (almost) never right: every round rewinds

    folders = tiny_exports["qwen2", "3"].folders
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 200, size=n).tolist() for n in (5, 37, 1, 70)]
    lengths = [4, 10, 7, 10]  # stream 0 leaves early, stream 3 joins late
    alone = Generator(LocalChain(folders, config=MODES["exact"], paged=False), 256)
    want = [alone.generate(np.array([p]), n, ignore_eos=True).tokens for p, n in zip(prompts, lengths)]
    with pipeline(folders, key_file, tmp_path, mode="exact", depth=depth, fed=fed, hosting=hosting) as (fleet, chain):
        assert chain.packs and all(stage["packs"] for stage in chain.stages)
        assert chain.depth == depth
        sent, send = [], chain._send
        chain._send = lambda frame, keys=None, group=None: (sent.append(frame), send(frame, keys, group))[1]
        for drafter in (None, WrongDrafts):
            sent.clear()
            decodings = [Decoding(KVSequence(chain, 256, i), p, n, frozenset(), drafter=drafter and drafter(),
                                  k=2 if drafter else 0) for i, (p, n) in enumerate(zip(prompts, lengths))]
            active = decodings[:3]
            for d in active:
                d.start()
            rounds = 0
            while active:
                d = active.pop(chain.first_ready([d.ticket for d in active]))
                if d.advance():
                    active.append(d)
                rounds += 1
                if rounds == 6:
                    decodings[3].start()
                    active.append(decodings[3])
            assert [d.result.tokens for d in decodings] == want
            assert not [f for f in sent if f.type == Msg.FORWARD], "every round went packed"
            packs = [len(wire.unpack_packed(f)[1]) for f in sent if f.type == Msg.PACKED]
            # the prompt's forward and every round's: each stream's share of some frame
            assert sum(packs) == sum(d.result.breakdown.rounds + 1 for d in decodings)
            if depth == 1:
                assert max(packs) == 4, "stream 3 joined the others in flight"
                assert chain.most_in_flight == 1
            else:  # 4 streams over 3 stages: groups of at most 2, and every stage had one to compute
                # (the late stream's prompt went at once as a group of its own, beside the three)
                assert max(packs) == 2 and chain.most_in_flight >= 3, (packs, chain.most_in_flight)
            if drafter is None:  # one frame per round of a group in flight: fewer than one per stream
                assert len(packs) <= (max(lengths) + 3) * chain.depth
            else:
                assert sum(d.result.drafted for d in decodings) > sum(d.result.accepted for d in decodings)


def test_prompts_go_at_once_and_a_group_over_several_frames_counts_once(tiny_exports, key_file, tmp_path, hosting):
    """In a pipeline, each prompt goes at once as a group of its own (it fills a forward alone), so
    stage 1 starts on the first while stage 0 computes the next.  Packed into groups instead (as
    prompts under ``prompt_rows`` rows are), a group's rows may take several PACKED frames (at most
    PACK_ROWS rows a forward); it is still one group, so the next group goes before any reply comes
    back, and both PCs compute."""
    from engine.runtime.decode.generate import Decoding
    from engine.runtime.decode.kvsequence import KVSequence
    from engine.tuning import PACK_ROWS
    from engine.runtime.stages.stage import MODES

    folders = tiny_exports["qwen2", "2"].folders
    rng = np.random.default_rng(5)
    alone = Generator(LocalChain(folders, config=MODES["exact"], paged=False), 256)
    # alone: prompts of 40 rows (two would share a frame); packed: of PACK_ROWS / 2 + 10 rows
    for relay, size in ((RelayOptions(), 40), (RelayOptions(prompt_rows=10**6), PACK_ROWS // 2 + 10)):
        with pipeline(folders, key_file, tmp_path, mode="exact", depth=2, relay=relay,
                      hosting=hosting) as (fleet, chain):
            prompts = [rng.integers(3, 200, size=size).tolist() for _ in range(4)]
            want = [alone.generate(np.array([p]), 3, ignore_eos=True).tokens for p in prompts]
            events, send, receive = [], chain._send, chain._receive
            chain._send = lambda frame, keys=None, group=None: (events.append(frame), send(frame, keys, group))[1]
            chain._receive = lambda: (events.append("wait"), receive())[1]
            decodings = [Decoding(KVSequence(chain, 256, i), p, 3, frozenset()) for i, p in enumerate(prompts)]
            for d in decodings:
                d.start()
            active = list(decodings)
            while active:
                d = active.pop(chain.first_ready([d.ticket for d in active]))
                if d.advance():
                    active.append(d)
            chain._send, chain._receive = send, receive
            assert [d.result.tokens for d in decodings] == want
            # every prompt's frame went before the first wait for a reply: alone, one prompt a frame;
            # packed, two groups of two prompts, each group over PACK_ROWS rows (two frames)
            first = [f for f in events[:events.index("wait")] if f != "wait" and f.type == Msg.PACKED]
            assert [[h.stream for h in wire.unpack_packed(f)[1]] for f in first] == [[0], [1], [2], [3]], events[:8]


def test_groups_in_flight_follow_the_measured_trip():
    """How many groups of streams a chain keeps in flight: enough to keep its slowest stage busy."""
    from engine.runtime.relay.remote import _Trip

    def groups(rounds):
        trip = _Trip()
        for stage_ms, network_ms in rounds:
            trip.observe(stage_ms, network_ms)
        return trip.groups()

    assert groups([]) is None
    assert groups([([40.0, 40.0], 1.0)] * 5) == 2  # balanced stages: one group each
    assert groups([([3.0, 80.0], 1.0)] * 5) == 1  # stage 0 only feeds the PC that holds the rest
    assert groups([([40.0, 40.0], 200.0)] * 5) == 7  # a slow link: more groups hide its time
    # a round that queued behind another group does not count as network time
    assert groups([([40.0, 40.0], 1.0), ([40.0, 40.0], 120.0)]) == 2
    assert groups([([1.0, 1.0], 500.0)]) == RelayOptions().max_groups
    # stages that take one computer's turns never compute at once: they are one stage of the pipeline
    trip = _Trip()
    trip.observe([40.0, 40.0, 40.0], 1.0)
    assert trip.groups() == 3 and trip.groups([None, None, None]) == 3
    assert trip.groups(["here", "here", None]) == 2 and trip.groups(["here", "here", "here"]) == 1


def test_the_chat_service_packs_concurrent_users_over_the_relay(tiny_exports, key_file, tmp_path, hosting):
    """What the app and `fleet serve` run: the chat service over a worker process.  Four users at once
    travel in shared PACKED frames, in as many groups as the measured rounds ask for (several: the
    hop's injected 10 ms each way outweighs the tiny stages, where bare loopback hops only sometimes
    did on a busy host), and each gets the reply it gets alone (exact settings)."""
    from engine.runtime.decode.service import ChatService
    from engine.runtime.stages.stage import MODES

    folders = tiny_exports["llama", "2"].folders
    asks = [[{"role": "user", "content": text}] for text in ("The quick brown fox", "Hello there",
                                                            "Count to ten, slowly please", "Why?")]
    alone = ChatService(LocalChain(folders, config=MODES["exact"], paged=False), scheduling=Scheduling(streams=1))
    try:
        want = [alone.submit(ask, 12, ignore_eos=True).wait(60).text for ask in asks]
    finally:
        alone.close()
    with pipeline(folders, key_file, tmp_path, mode="exact", delay_ms=10, hosting=hosting) as (fleet, chain):
        sent, send = [], chain._send
        chain._send = lambda frame, keys=None, group=None: (sent.append(frame), send(frame, keys, group))[1]
        service = ChatService(chain, scheduling=Scheduling(streams=4))
        try:
            handles = [service.submit(ask, 12, ignore_eos=True) for ask in asks]
            got = [h.wait(60).text for h in handles]
        finally:
            service.close()
    assert got == want
    packs = [len(wire.unpack_packed(f)[1]) for f in sent if f.type == Msg.PACKED]
    assert packs and not [f for f in sent if f.type == Msg.FORWARD]
    assert chain.depth == chain._trip.groups() > 1 and chain.most_in_flight > 1


def test_a_round_a_worker_refuses_gives_up_the_others_in_flight(tiny_exports, key_file, tmp_path, hosting):
    """A worker answers one round with ERROR (here: a stream whose cache it never held, as after a
    restart) while another stream's round travels.  The caller gives up every round; so does the
    chain, or their groups would count against the depth for as long as the link lives."""
    folders = tiny_exports["qwen2", "3"].folders
    want = _greedy(LocalChain(folders))
    with pipeline(folders, key_file, tmp_path, depth=2, fed=True, hosting=hosting) as (fleet, chain):
        for stream in (0, 1):
            chain.reset(stream)
        travelling = chain.submit(IDS, np.ones(IDS.shape, np.int64), np.arange(IDS.shape[1])[None], stream=0)
        chain._flush()  # a group of its own
        chain.local.keep(1, np.arange(5))  # the coordinator believes stream 1 holds 5 positions
        refused = chain.submit(IDS[:, :1], np.ones((1, 6), np.int64), np.array([[5]]), stream=1)
        with pytest.raises(StageError, match="stream 1 holds 0 positions"):
            chain.collect(refused)
        assert chain.groups_in_flight == 0
        with pytest.raises(StageError, match="given up"):
            chain.collect(travelling)
        assert _greedy(chain) == want and chain.groups_in_flight == 0 and not chain._early


def test_breakdown_and_injected_delay(tiny_exports, key_file, tmp_path, hosting):
    folders = tiny_exports["llama", "2"].folders
    want = _greedy(LocalChain(folders), 6)
    with pipeline(folders, key_file, tmp_path, delay_ms=20, hosting=hosting) as (fleet, chain):
        gen = Generator(chain, max_length=128).generate(IDS, 6, ignore_eos=True)
    assert gen.tokens == want
    bd = gen.breakdown.to_json()
    assert bd["steps"] == 5 and len(bd["stage_compute_ms"]) == 2
    # 20 ms on the way in and 20 ms on the way out of the worker, every token.
    assert bd["network_ms"] >= 40 and bd["token_ms"] >= 40


def test_wrong_key_is_refused_on_both_sides(tiny_exports, key_file, tmp_path, hosting):
    folders = tiny_exports["llama", "2"].folders
    other = load_key(create_key(tmp_path / "other.key"))
    with LocalWorkers(folders[1:], access_of(key_file), log_dir=tmp_path, hosting=hosting) as fleet:
        with pytest.raises(StageError, match="stage 1 at 127.0.0.1:\\d+: handshake failed: .*fleet key"):
            RemoteChain(folders[0], fleet.addresses, access=FleetAccess(other), connect_timeout_s=10)
        assert _wait_for_log(fleet.logs[0], "refused connection from 127.0.0.1")
    assert "fleet key" in fleet.logs[0].read_text()


def _wait_for_log(path, text, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if text in path.read_text():
            return True
        time.sleep(0.05)
    return False


def test_foreign_shards_are_refused(tiny_exports, key_file, tmp_path, hosting):
    llama, qwen = tiny_exports["llama", "2"].folders, tiny_exports["qwen2", "2"].folders
    fleet = LocalWorkers(qwen[1:], access_of(key_file), log_dir=tmp_path, hosting=hosting).start()
    try:
        with pytest.raises(StageError, match="fingerprint mismatch"):
            RemoteChain(llama[0], fleet.addresses, access=FleetAccess(load_key(key_file)), connect_timeout_s=10)
        # Same model, but the worker's stage of the 3-stage split starts at layer 1, not at layer 2.
        three = tiny_exports["llama", "3"].folders
        fleet2 = LocalWorkers(three[1:2], access_of(key_file), log_dir=tmp_path, hosting=hosting).start()
        try:
            with pytest.raises(StageError, match="first_layer mismatch"):
                RemoteChain(llama[0], fleet2.addresses, access=FleetAccess(load_key(key_file)), connect_timeout_s=10)
        finally:
            fleet2.close()
    finally:
        fleet.close()


def _garbage(rng, good: bytes) -> bytes:
    kind = rng.integers(6)
    if kind == 0:
        return rng.bytes(int(rng.integers(1, 200)))
    if kind == 1:
        return good[: int(rng.integers(1, len(good)))]  # truncated
    if kind == 2:  # a header announcing a huge payload
        return wire.HEADER.pack(wire.MAGIC, wire.VERSION, int(Msg.FORWARD), 0, 1, 1, 0, 1 << 40)
    data = bytearray(good)
    for _ in range(int(rng.integers(1, 4))):
        data[int(rng.integers(len(data)))] = int(rng.integers(256))
    return bytes(data)


def _bad_forwards(rng, hidden: int):
    """Well-framed FORWARDs that no stage can serve."""
    f32 = np.float32
    good = [rng.standard_normal((1, 3, hidden)).astype(f32), np.ones((1, 3), np.uint8),
            np.arange(3)[None], np.zeros(1, f32)]
    variants = [
        good[:3],
        [good[0].astype(np.float16), *good[1:]],
        [good[0][:, :, :-1], *good[1:]],
        [good[0], np.ones((1, 2), np.uint8), *good[2:]],
        [good[0], good[1], np.arange(4)[None], good[3]],
        [good[0], good[1], np.array([[0, 1, 99999]]), good[3]],
        [good[0], good[1].astype(np.int64), *good[2:]],
        [good[0], good[1], good[2], np.zeros((2, 2), f32)],
        [np.zeros((1, 0, hidden), f32), np.ones((1, 0), np.uint8), np.zeros((1, 0), np.int64), good[3]],
    ]
    frames = [Frame(Msg.FORWARD, int(rng.integers(4)), i, variants[i % len(variants)]) for i in range(300)]
    # PACKED frames: consistent tables this stage still cannot serve, and tables that contradict their rows
    rows = [rng.standard_normal((3, hidden)).astype(f32), np.arange(3), np.zeros(1, f32)]

    def packed(i, x=rows[0], table=((0, 3),), positions=rows[1], timings=rows[2], start=0):
        heads = np.array([[stream, i, start, q, 0] for stream, q in table], np.int64)
        return Frame(Msg.PACKED, int(heads[0, 0]) if len(heads) else 0, i,
                     [x, heads.reshape(-1, 5), positions, timings])

    packed_variants = [
        lambda i: packed(i, x=rows[0].astype(np.float16)),
        lambda i: packed(i, x=rows[0][:, :-1]),
        lambda i: packed(i, x=np.arange(3)),  # token ids to a stage that takes hidden states
        lambda i: packed(i, positions=np.array([0, 1, 99999])),
        lambda i: packed(i, start=5),  # a stream continuing from positions it never held
        lambda i: packed(i, table=((0, 2),)),  # the table and the rows disagree
        lambda i: packed(i, table=((0, 1), (0, 2))),  # one stream twice
        lambda i: packed(i, table=()),
        lambda i: packed(i, timings=np.zeros((2, 2), f32)),
    ]
    return frames + [packed_variants[i % len(packed_variants)](300 + i) for i in range(90)]


def test_fuzzed_worker_keeps_serving(tiny_exports, key_file, tmp_path):
    folders = tiny_exports["llama", "2"].folders
    want = _greedy(LocalChain(folders))
    manifest = LocalChain(folders).manifest
    identity = {"fingerprint": manifest.fingerprint, "stage": 1, "first_layer": 2}
    key = load_key(key_file)
    rng = np.random.default_rng(7)
    hidden = manifest.spec.hidden_size
    good = wire.encode(Frame(Msg.FORWARD, 0, 1, [np.ones((1, 1, hidden), np.float32), np.ones((1, 1), np.uint8),
                                                  np.zeros((1, 1), np.int64), np.zeros(1, np.float32)]))
    fleet = LocalWorkers(folders[1:], access_of(key_file), log_dir=tmp_path).start()
    address = fleet.addresses[0]
    sent = 0
    try:
        for i in range(400):  # strangers: garbage before (or instead of) a handshake
            with contextlib.closing(dial(address)) as s:
                s.sendall(_garbage(rng, good) if i % 2 else wire.encode(
                    wire.control(Msg.HELLO, {"version": 1, "nonce": "zz"})))
            sent += 1
        for _ in range(350):  # authenticated peers sending broken frames: each costs its connection
            with contextlib.closing(dial(address)) as s:
                s.settimeout(5)
                wire.client_handshake(s, key, identity)
                s.sendall(_garbage(rng, good))
            sent += 1
        with contextlib.closing(dial(address)) as s:  # well-framed nonsense: answered with ERROR each
            s.settimeout(5)
            _, seal = wire.client_handshake(s, key, identity)
            for frame in _bad_forwards(rng, hidden):
                wire.send_frame(s, frame, seal)
                reply = wire.recv_frame(s, seal=seal)
                while reply.type == Msg.ALIVE:
                    reply = wire.recv_frame(s, seal=seal)
                assert reply.type == Msg.ERROR and reply.seq == frame.seq, reply
                assert reply.json()["stage"] == 1 and reply.json()["reason"]
                sent += 1
        assert sent >= 1000
        assert fleet.procs[0].poll() is None, "the worker died"
        chain = RemoteChain(folders[0], fleet.addresses, access=FleetAccess(key), connect_timeout_s=10)
        try:
            assert _greedy(chain) == want
        finally:
            chain.close()
    finally:
        fleet.close()
    log = fleet.logs[0].read_text()
    assert "refused connection" in log and "closing upstream" in log


def _fail_at(n, action):
    calls = []

    def on_token(_):
        calls.append(1)
        if len(calls) == n:
            action()

    return on_token


@pytest.mark.parametrize("victim, how", [(2, "kill"), (1, "kill"), (2, "stop"), (1, "stop")])
def test_dead_or_stalled_worker_is_reported_within_the_deadline(victim, how, tiny_exports, key_file, tmp_path):
    folders = tiny_exports["qwen2", "3"].folders
    want = _greedy(LocalChain(folders), 24)
    with pipeline(folders, key_file, tmp_path) as (fleet, chain):
        proc = fleet.procs[victim - 1]

        def strike():
            os.kill(proc.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)

        with pytest.raises(StageError) as info:
            _greedy(chain, 24, on_token=_fail_at(4, strike))
        err = info.value
        assert (err.stage, err.address) == (victim, fleet.addresses[victim - 1]), str(err)
        # what reported it: the lost connection at once, or a stall the silence deadline found (the
        # chain's own, or the worker before the victim's), not the operating system's TCP timeout
        assert re.search(r"no reply for [\d.]+ s \(stalled\)" if how == "stop" else "connection lost", err.reason), err
        # Bring the stage back; the next request is served and correct.
        if how == "stop":
            os.kill(proc.pid, signal.SIGCONT)
        else:
            proc.wait()
            fleet.start_worker(victim - 1)
            fleet.wait_ready(victim - 1)
        assert _greedy(chain, 24) == want


@pytest.mark.parametrize("pong", [
    lambda ping: wire.control(Msg.PONG, {"stages": 5}, ping.stream, ping.seq),
    lambda ping: Frame(Msg.PONG, ping.stream, ping.seq, [np.zeros(3, np.float32)]),
], ids=["stages not a list", "no JSON"])
def test_a_malformed_pong_from_the_next_stage_fails_the_request_instead_of_hanging(pong, tiny_exports, key_file):
    """The next stage proves the key, then answers PING with a malformed PONG (issue 82): the worker
    takes it as a lost link, so the coordinator hears an error naming that stage within its deadline,
    not heartbeats for ever."""
    folders = tiny_exports["qwen2", "3"].folders
    key = load_key(key_file)
    identity = {"role": "stage", "delay_ms": 0.0, **successor_identity(load_manifest(folders[1]), "fast")}

    def session(conn, seal, peer: str) -> None:
        link = Link(conn, peer, seal)
        try:
            while (frame := link.recv()).type != Msg.BYE:
                if frame.type == Msg.PING:
                    link.send(pong(frame))
        except (ConnectionError, wire.ProtocolError):
            pass
        finally:
            link.close()

    listener = socket.create_server(("127.0.0.1", 0))
    last = "127.0.0.1:%d" % listener.getsockname()[1]
    access = FleetAccess(key, deadline_s=1.0)
    worker = Worker(folders[1], "127.0.0.1:0", last, access=access, log=lambda line: None)  # before threads
    stop = threading.Event()
    threading.Thread(target=accept_loop, daemon=True,
                     args=(listener, stop, lambda conn: authenticate_peer(conn, key, identity), session, "stage 2",
                           lambda line: None)).start()
    worker.start()
    outcome: dict = {}

    def connect() -> None:
        try:
            RemoteChain(folders[0], [worker.address, last], access=access, connect_timeout_s=2.0).close()
        except StageError as exc:
            outcome["error"] = exc

    coordinator = threading.Thread(target=connect, daemon=True)
    try:
        coordinator.start()
        coordinator.join(10)
        assert not coordinator.is_alive(), "the coordinator still waits for its PONG"
    finally:
        worker.stop()
        stop.set()
        listener.close()
    err = outcome.get("error")
    assert err is not None and (err.stage, err.address) == (2, last) and "malformed" in err.reason, err


def test_coordinator_routes_workers_started_without_next(tiny_exports, key_file, tmp_path, hosting):
    """``fleet generate --remote A,B``: the workers learn their successor from the coordinator."""
    folders = tiny_exports["qwen2", "3"].folders
    fleet = LocalWorkers(folders[1:], access_of(key_file), log_dir=tmp_path, hosting=hosting,
                         link_workers=False).start()
    try:
        out = tmp_path / "gen.json"
        proc = subprocess.run(
            [sys.executable, "-m", "engine.cli", "generate", "--shards", str(folders[0]),
             "--remote", ",".join(fleet.addresses), "--fleet-key-file", str(key_file), "--no-tls", "--no-chat",
             "--prompt", "Paris is", "--max-new-tokens", "8", "--ignore-eos", "--json", str(out)],
            capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
    finally:
        fleet.close()
    assert "next stage set to" in fleet.logs[0].read_text()
    (result,) = json.loads(out.read_text())
    assert result["new_tokens"] == 8 and "breakdown" in result


def test_tls_fleet_serves_and_refuses_plain_peers(tiny_exports, tmp_path, hosting):
    folders = tiny_exports["llama", "2"].folders
    key_file = create_key(tmp_path / "tls" / "fleet.key")
    create_certificate(tls_file(key_file))
    want = _greedy(LocalChain(folders), 8)
    with pipeline(folders, key_file, tmp_path, tls=True, hosting=hosting) as (fleet, chain):
        assert _greedy(chain, 8) == want
        with pytest.raises(StageError, match="handshake failed"):
            RemoteChain(folders[0], fleet.addresses, access=FleetAccess(load_key(key_file)), connect_timeout_s=5)


def test_worker_reports_a_port_in_use(tiny_exports, key_file, tmp_path, hosting):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        fleet = LocalWorkers(tiny_exports["llama", "2"].folders[1:], access_of(key_file), log_dir=tmp_path,
                             hosting=hosting)
        fleet.addresses = ["127.0.0.1:%d" % busy.getsockname()[1]]
        with pytest.raises(Exception, match="did not start(.|\n)*Address already in use"):
            fleet.start()
