"""Drafting on another PC: a draft server over real sockets drafts ahead for a target here.  Exact
mode stays token-identical to plain greedy decoding with several streams in flight; the server's
rewind by mask leaves its cache as a fresh one fed the same text; a draft server that dies
mid-reply, a foreign tokenizer, a peer without the fleet key and hostile frames cost nothing."""

from __future__ import annotations

import socket
import threading
import time
from argparse import Namespace

import numpy as np
import pytest

from engine.cli.args import settings_of
from engine.config import FleetAccess, Scheduling, Settings
from engine.errors import FleetError, ShardError
from engine.fleetkey import create_key, fleet_access, load_key
from engine.runtime.decode.draftserver import MAX_LEAD, DraftServer, DraftText, draft_identity
from engine.runtime.decode.generate import Generator, generate_streams
from engine.runtime.decode.remotedraft import DraftLink, RemoteDraft
from engine.runtime.decode.speculative import open_draft_chain
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.stage import MODES
from engine.transport import wire
from engine.transport.link import dial

EXACT = MODES["exact"]
PROMPT = [5, 17, 42, 101, 7, 250, 33, 64, 9, 17, 42, 101]


@pytest.fixture
def key(tmp_path):
    return load_key(create_key(tmp_path / "fleet.key"))


@pytest.fixture
def target(tiny_exports):
    return LocalChain(tiny_exports["qwen2", "3"].folders, config=EXACT)


def _greedy(target, tokens: int, prompt=PROMPT) -> list[int]:
    return Generator(target, 128).generate(prompt, tokens, ignore_eos=True).tokens


@pytest.fixture
def server(tiny_exports, key):
    # compiled as the target is: a tiny random model's argmax differs between bf16 and f32, so a draft
    # compiled with a draft's own settings would rarely be right
    drafts = DraftServer(tiny_exports["qwen2", "1"].folders, "127.0.0.1:0", access=FleetAccess(key),
                         log=lambda m: None, config=EXACT).start()
    yield drafts
    drafts.stop()


def test_exact_mode_is_token_identical_with_drafts_from_another_process_of_streams(target, server, key):
    prompts = [PROMPT, PROMPT[::-1], [3, 1, 4, 1, 5, 9, 2, 6]]
    want = [_greedy(target, 40, p) for p in prompts]
    link = DraftLink(server.address, FleetAccess(key), target.manifest)

    def steep(drafter):  # as on an AVX2 core, where a padded verify costs more than a plain one
        drafter.plain_s, drafter.padded_s = 1e-4, 1.0
        return drafter

    try:
        for k, costs in (("auto", None), (3, None), ("auto", steep)):
            drafters = [link.drafter(i) for i in range(len(prompts))]
            gens, _ = generate_streams(target, [np.array(p) for p in prompts], 40, max_length=128, ignore_eos=True,
                                       drafters=[costs(d) for d in drafters] if costs else drafters,
                                       scheduling=Scheduling(k=k))
            assert [g.tokens for g in gens] == want
            assert all(g.accepted > 0 for g in gens), (k, [(g.accepted, g.drafted) for g in gens], server.drafted)
            if costs:
                assert all(sum(d._plain) > 0 for d in drafters)  # some rounds went plain
    finally:
        link.close()
    assert server.drafted > 0


def test_the_servers_rewind_leaves_its_cache_as_a_fresh_one_fed_the_same_text(tiny_exports):
    chain = LocalChain(tiny_exports["qwen2", "1"].folders, config=EXACT)
    text = DraftText(chain, 0)
    text.seq.reset()
    text.sync(1, 0, 6, False, PROMPT)
    while text.wants_step():
        text.step()
    drafted = text.tokens[len(PROMPT):]
    assert len(drafted) >= 6
    # the target kept two drafts, then chose another token: the server rewinds to there
    settled = PROMPT + drafted[:2] + [(drafted[2] + 1) % 256]
    assert text.sync(2, len(PROMPT), 4, False, settled[len(PROMPT):]) == []
    assert text.tokens == settled
    text.step()
    fresh = DraftText(chain, 1)
    fresh.seq.reset()
    fresh.sync(1, 0, 1, False, settled)
    fresh.step()
    assert text.tokens[-1] == fresh.tokens[-1]
    assert text.seq.logical == fresh.seq.logical
    # a text that the drafts already extend keeps them, and they are sent again
    assert text.sync(3, len(settled), 4, False, []) == text.tokens[len(settled):]


def test_a_streams_new_drafter_ignores_the_drafts_still_on_their_way_to_the_one_before(target, server, key):
    link = DraftLink(server.address, FleetAccess(key), target.manifest)
    try:
        link.drafter(0).prime(PROMPT)
        fresh = link.drafter(0)  # as the next request on stream 0 does, before it primes
        deadline = time.monotonic() + 10
        while server.drafted < RemoteDraft.LEAD and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.drafted >= RemoteDraft.LEAD
        time.sleep(0.2)  # the DRAFTS for the first drafter's text reach the new one's mirror
        assert link.error is None
        fresh.prime(PROMPT[::-1])
        want = _greedy(target, 3, PROMPT[::-1])
        assert link.ahead(0, PROMPT[::-1], 3, 10.0)[:3] == want
        with pytest.raises(FleetError, match="64 streams at most"):  # the server would drop the link
            link.drafter(64)
    finally:
        link.close()


def test_a_text_outgrowing_the_drafts_context_goes_plain_and_keeps_the_link(target, server, key):
    want = _greedy(target, 40)
    link = DraftLink(server.address, FleetAccess(key), target.manifest)
    assert link.context == server.chain.spec.max_position
    link.context = len(PROMPT) + 20  # as a draft model of a shorter context than the target's would say
    try:
        gen = Generator(target, 128).generate(PROMPT, 40, ignore_eos=True, drafter=link.drafter(0), k=3)
        assert gen.tokens == want and gen.drafted > 0 and link.error is None
        assert len(link._mirrors[0].told) + 2 < link.context  # the server was never told a longer text
    finally:
        link.close()


def test_a_draft_server_that_dies_mid_reply_leaves_plain_rounds(target, server, key):
    want = _greedy(target, 40)
    link = DraftLink(server.address, FleetAccess(key), target.manifest)
    drafter = link.drafter(0)
    seen = []

    def on_token(token):
        seen.append(token)
        if len(seen) == 10:
            server.stop()

    gen = Generator(target, 128).generate(PROMPT, 40, ignore_eos=True, drafter=drafter, k="auto", on_token=on_token)
    link.close()
    assert gen.tokens == want
    deadline = time.monotonic() + 5
    while link.error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert link.error is not None


def test_a_send_that_fails_before_the_reader_hears_leaves_plain_rounds(target, server, key):
    want = _greedy(target, 20)
    link = DraftLink(server.address, FleetAccess(key), target.manifest)
    drafter = link.drafter(0)
    link.link.close()  # every send fails now, whatever the reader has heard yet
    gen = Generator(target, 128).generate(PROMPT, 20, ignore_eos=True, drafter=drafter, k=3)
    assert gen.tokens == want and gen.drafted == 0 and link.error


def test_a_foreign_tokenizer_and_a_wrong_key_are_refused(tiny_exports, server, key):
    llama = LocalChain(tiny_exports["llama", "1"].folders)
    with pytest.raises(ShardError, match="does not share the target .*tokenizer"):
        DraftLink(server.address, FleetAccess(key), llama.manifest)
    with pytest.raises(FleetError, match="refused"):
        DraftLink(server.address, FleetAccess(b"x" * 32))


def test_a_draft_server_speaks_the_fleets_default_tls_and_refuses_a_coordinator_without_it(tiny_exports, target,
                                                                                          tmp_path):
    """TLS is on by default on every fleet connection, the draft server's too: with the access the
    default settings give (as ``fleet worker --role draft`` and ``--draft remote:`` build it), drafts
    come over TLS and exact mode stays token-identical; a coordinator holding the key but speaking
    plain text is refused."""
    key_file = create_key(tmp_path / "fleet.key")
    access = fleet_access(Settings(fleet_key_file=str(key_file)))
    assert access.uses_tls
    drafts = DraftServer(tiny_exports["qwen2", "1"].folders, "127.0.0.1:0", access=access, log=lambda m: None,
                         config=EXACT).start()
    try:
        want = _greedy(target, 24)
        link = DraftLink(drafts.address, access, target.manifest)
        try:
            gen = Generator(target, 128).generate(PROMPT, 24, ignore_eos=True, drafter=link.drafter(0), k=3)
        finally:
            link.close()
        assert gen.tokens == want and gen.accepted > 0, (gen.accepted, gen.drafted)
        with pytest.raises(FleetError, match=f"draft server at {drafts.address}"):
            DraftLink(drafts.address, FleetAccess(access.key), target.manifest)
    finally:
        drafts.stop()


@pytest.mark.parametrize("frame", [
    wire.sync_frame(0, 1, 5, 4, False, [1, 2]),  # keeps tokens of a text it never told
    wire.sync_frame(0, 1, 0, 4, False, [1 << 40]),  # a token outside the vocabulary
    wire.Frame(wire.Msg.SYNC, 0, 1, [np.zeros(3, np.float32), np.zeros(1, np.int64)]),
    wire.Frame(wire.Msg.FORWARD, 0, 1, []),
])
def test_a_hostile_frame_costs_its_sender_the_connection_only(tiny_exports, server, key, frame):
    sock = dial(server.address)
    sock.settimeout(5)
    _, seal = wire.client_handshake(sock, key, {"role": "draft"})
    wire.send_frame(sock, frame, seal)
    with pytest.raises((wire.ProtocolError, OSError)):
        wire.recv_frame(sock, seal=seal)
    sock.close()
    target = LocalChain(tiny_exports["qwen2", "1"].folders)  # the server still serves the next coordinator
    link = DraftLink(server.address, FleetAccess(key), target.manifest)
    try:
        drafter = link.drafter(0)
        drafter.prime(PROMPT)
        assert link.ahead(0, PROMPT, 1, 10.0)
    finally:
        link.close()


@pytest.mark.parametrize("kind", ["beyond its lead", "outside the vocabulary"])
def test_a_draft_server_with_the_key_cannot_grow_the_coordinator_or_propose_foreign_ids(target, key, kind):
    """The security review's case: a draft server holding the fleet key sent DRAFTS on and on (the
    coordinator's mirror of its text grew without bound) and token ids the target has not.  Here a
    real connection, from a server that answers the first SYNC so: the link breaks, saying why, and
    nothing of it is proposed."""
    vocab = target.spec.vocab_size
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve():
        conn, _ = listener.accept()
        try:
            _, seal = wire.server_handshake(conn, key, draft_identity(target.manifest))
            sync = wire.recv_frame(conn, seal=seal)
            told = len(wire.unpack_tokens(sync, 3, 1 << 16)[1])
            if kind == "outside the vocabulary":
                frames = [wire.drafts_frame(0, sync.seq, told, [5, vocab + 7])]
            else:  # a lead's worth at a time (each frame within bounds alone), on and on
                frames = [wire.drafts_frame(0, sync.seq, told + i * MAX_LEAD, [5] * MAX_LEAD) for i in range(1000)]
            for frame in frames:
                wire.send_frame(conn, frame, seal)
        except OSError:
            pass  # the coordinator hung up
        done.wait(10)
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    link = DraftLink(f"127.0.0.1:{listener.getsockname()[1]}", FleetAccess(key), target.manifest)
    try:
        link.drafter(0).prime(PROMPT)
        deadline = time.monotonic() + 5
        while link.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert link.error is not None and ("vocabulary" if kind == "outside the vocabulary" else "ahead") in link.error
        assert len(link._mirrors[0].tokens) <= len(PROMPT) + MAX_LEAD + 1
        assert all(0 <= t < vocab for t in link.ahead(0, PROMPT, 2, 0.1))
    finally:
        done.set()
        link.close()
        listener.close()
        thread.join(5)


def test_a_stage_worker_is_not_taken_for_a_draft_server(tiny_exports, key):
    from engine.runtime.relay.worker import Worker

    worker = Worker(tiny_exports["qwen2", "2"].folders[1], "127.0.0.1:0", access=FleetAccess(key),
                    log=lambda m: None).start()
    try:
        with pytest.raises(FleetError, match="role mismatch"):
            DraftLink(worker.address, FleetAccess(key))
    finally:
        worker.stop()


def test_the_command_line_names_a_remote_draft():
    settings = settings_of(Namespace(draft="remote:10.0.0.7:7311"), Settings())
    assert (settings.draft, settings.draft_at) == ("remote", "10.0.0.7:7311")
    assert settings.validate() is None
    assert "HOST:PORT" in Settings(draft="remote", draft_at="10.0.0.7").validate()


def test_the_handshake_names_the_drafts_tokenizer(tiny_exports):
    chain = open_draft_chain(tiny_exports["qwen2", "1"].folders)
    identity = draft_identity(chain.manifest)
    assert identity["role"] == "draft"
    assert all(identity["tokenizer"].values())


def test_a_stream_drafts_only_while_it_is_alone(target, server, key):
    # with several streams the verify's extra rows cost more than drafts give (``draft_alone``)
    from engine.runtime.decode.service import ChatService

    link = DraftLink(server.address, FleetAccess(key), target.manifest)
    service = ChatService(target, scheduling=Scheduling(streams=2, k="auto"),
                          drafters=lambda n: [link.drafter(i) for i in range(n)], prefix_cache=False, owned=[link])
    try:
        long, short = ([{"role": "user", "content": text}] for text in ("a long reply", "a short one"))
        alone = service.submit(long, 40, ignore_eos=True).wait(120)
        both = [service.submit(long, 40, ignore_eos=True), service.submit(short, 6, ignore_eos=True)]
        together, brief = (h.wait(120) for h in both)
    finally:
        service.close()
    assert together.tokens == alone.tokens  # exact mode: drafts or none, the same reply
    assert alone.drafted > 0
    assert brief.drafted == 0  # its every round had the other stream beside it
    assert 0 < together.drafted < alone.drafted  # it drafted once the short reply was done


def test_a_round_goes_plain_where_padded_rounds_with_as_many_guesses_did_not_pay():
    from engine.runtime.decode.remotedraft import RemoteDraft

    drafter = RemoteDraft(Namespace(), 0)
    drafter.pick_k = True
    assert drafter._goes_plain(0) and not drafter._goes_plain(1)  # no plain verify timed: a bare round times one
    drafter.feedback(0, 0, 381.0, 0.0)
    drafter._class = 2
    drafter.feedback(3, 2, 731.0, 0.0)
    assert (drafter.plain_s, drafter.padded_s) == (0.381, 0.731)
    assert drafter.gain[2] == pytest.approx(0.8 + 0.4)
    drafter.gain = [0.1, 0.5, 1.2, 2.0]  # an AVX2 core: a padded round pays with more than 0.92 extra tokens
    assert not drafter._goes_plain(3) and not drafter._goes_plain(2)
    went = [drafter._goes_plain(0) for _ in range(4 * RemoteDraft.RETRY)]
    assert went.count(False) == 4  # padded now and then, to hear whether it still does not pay
    # with int8 dot products a plain verify after padded ones costs about what they do (and its new width more)
    drafter.plain_s, drafter.padded_s = 0.080, 0.067
    assert not any(drafter._goes_plain(g) for g in range(RemoteDraft.WIDTH + 1))
