"""The prefix cache and chunked prefill: a conversation's next turn reuses the KV its stream kept and
prefills only the new suffix, token-identical to a cold start in exact mode (in process and over a worker process,
with and without speculation); requests go to the stream holding their longest prefix; a long prompt
is prefilled in chunks with the other streams' rounds between them, to the same reply."""

from __future__ import annotations

import pytest

from engine.config import FleetAccess, Scheduling, ShardOptions
from engine.fleetkey import access_of, create_key, load_key
from engine.runtime.decode.service import ChatService
from engine.runtime.decode.speculative import stream_drafters
from engine.runtime.relay.local_workers import LocalWorkers
from engine.runtime.relay.remote import RemoteChain
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.stage import compile_config

TURNS = ["The quick brown fox", "Paris is the capital of France.", "def add(a, b):", "A fleet of laptops"]


def _conversation(service, turns, tokens=12):
    """Every turn of a conversation through ``service``: the replies, each on the conversation so far."""
    messages, replies = [], []
    for text in turns:
        messages.append({"role": "user", "content": text})
        reply = service.submit(messages, tokens, ignore_eos=True).wait(120)
        assert reply.error is None, reply.error
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply.text})
    return replies


def _service(chain, drafts: bool, prefix_cache: bool = True, streams: int = 1, speculate_ahead: bool = False):
    return ChatService(chain, scheduling=Scheduling(streams=streams, k=3, speculate_ahead=speculate_ahead),
                       rewind="trim", prefix_cache=prefix_cache,
                       drafters=(lambda n: stream_drafters("lookup", n)) if drafts else None)


def _warm_equals_cold(chain, drafts):
    warm, cold = _service(chain, drafts), _service(chain, drafts, prefix_cache=False)
    try:
        got, want = _conversation(warm, TURNS), _conversation(cold, TURNS)
    finally:
        warm.chain = cold.chain = _Kept()
        warm.close()
        cold.close()
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert got[0].cached_tokens == 0 and all(r.cached_tokens > 0 for r in got[1:])
    # every later turn reused at least the earlier turn's prompt (the reply's tokens too where its text
    # encodes back to them: a random model's gibberish often does not)
    assert all(later.cached_tokens >= earlier.prompt_tokens for earlier, later in zip(got, got[1:]))
    assert all(r.cached_tokens == 0 for r in want)


class _Kept:
    """Stands in for a chain the test still needs after the service closes."""

    def close(self) -> None:
        pass


@pytest.mark.parametrize("drafts", [False, True])
def test_next_turns_reuse_the_cache_and_equal_a_cold_start_in_process(tiny_exports, drafts):
    _warm_equals_cold(LocalChain(tiny_exports["qwen2", "2"].folders, config=compile_config("exact")), drafts)


def test_next_turns_reuse_the_cache_over_a_worker_process(tiny_exports, tmp_path):
    folders = tiny_exports["llama", "2"].folders
    key = create_key(tmp_path / "fleet.key")
    exact = ShardOptions(mode="exact")
    with LocalWorkers(folders[1:], access_of(key), shard=exact, log_dir=tmp_path) as fleet:
        chain = RemoteChain(folders[0], fleet.addresses, access=FleetAccess(load_key(key)), shard=exact)
        try:
            _warm_equals_cold(chain, drafts=True)
        finally:
            chain.close()


def test_speculating_ahead_keeps_a_conversation_and_its_cache(tiny_exports, monkeypatch):
    # Each reply ends with a round sent ahead in flight (or discarded): the stream's cache must hold
    # the conversation and nothing of it, for the next turn to reuse.
    from engine.runtime.decode.generate import Decoding

    sent, send = [], Decoding._send_ahead
    monkeypatch.setattr(Decoding, "_send_ahead", lambda self, room: (sent.append(room), send(self, room))[1])
    chain = LocalChain(tiny_exports["qwen2", "2"].folders, config=compile_config("exact"))
    ahead, plain = _service(chain, True, speculate_ahead=True), _service(chain, True)
    try:
        got = _conversation(ahead, TURNS, tokens=24)
        want = _conversation(plain, TURNS, tokens=24)
    finally:
        ahead.chain = plain.chain = _Kept()
        ahead.close()
        plain.close()
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert [r.cached_tokens for r in got] == [r.cached_tokens for r in want] and got[-1].cached_tokens > 0
    assert sent  # the service sent rounds ahead


def test_requests_go_to_the_stream_holding_their_prefix(tiny_exports):
    service = _service(LocalChain(tiny_exports["qwen2", "1"].folders, config=compile_config("exact")), False,
                       streams=2)
    try:
        a = [{"role": "user", "content": TURNS[0]}]
        b = [{"role": "user", "content": TURNS[2]}]
        first_a, first_b = (service.submit(m, 8, ignore_eos=True).wait(60) for m in (a, b))
        assert first_a.stream != first_b.stream
        for _ in range(2):  # each conversation's next turn lands where its first turn is cached
            for messages, first in ((b, first_b), (a, first_a)):
                messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "More."}]
                reply = service.submit(messages, 8, ignore_eos=True).wait(60)
                assert reply.stream == first.stream and reply.cached_tokens >= first.prompt_tokens
                first.text = reply.text
    finally:
        service.close()


class Recording:
    """A chain that notes every forward's stream and length (a proxy, so the scheduler sees the real one)."""

    def __init__(self, chain):
        self._chain, self.calls = chain, []

    def __getattr__(self, name):
        return getattr(self._chain, name)

    def submit(self, input_ids, *args, **kwargs):
        self.calls.append((kwargs.get("stream", args[3] if len(args) > 3 else 0), input_ids.shape[1]))
        return self._chain.submit(input_ids, *args, **kwargs)


def test_a_long_prompt_is_prefilled_in_chunks_between_other_streams_rounds(tiny_exports):
    chain = Recording(LocalChain(tiny_exports["qwen2", "2"].folders, config=compile_config("exact")))
    long_paste = [{"role": "user", "content": " ".join(TURNS * 6)}]
    short = [{"role": "user", "content": TURNS[1]}]
    whole = ChatService(chain, scheduling=Scheduling(streams=1, prefill_chunk=4096), rewind="trim", prefix_cache=False)
    want = whole.submit(long_paste, 8, ignore_eos=True).wait(60)
    whole.chain = _Kept()
    whole.close()
    assert want.prompt_tokens > 200
    chain.calls.clear()
    service = ChatService(chain, scheduling=Scheduling(streams=2, prefill_chunk=48), rewind="trim", prefix_cache=False)
    try:
        chatting = service.submit(short, 60, ignore_eos=True)  # decoding when the paste arrives
        got = service.submit(long_paste, 8, ignore_eos=True).wait(60)
        chatting.wait(60)
    finally:
        service.chain = _Kept()
        service.close()
    assert got.tokens == want.tokens  # chunked, the same reply (exact mode)
    paste = [i for i, (stream, q) in enumerate(chain.calls) if stream == got.stream]
    chunks = [chain.calls[i][1] for i in paste[: -len(got.tokens) + 1]]
    assert sum(chunks) == want.prompt_tokens and max(chunks) == 48 and len(chunks) >= 5
    # between two chunks of the paste the other stream ran its round (it waited one chunk at most)
    firsts = paste[: len(chunks)]
    assert all(any(chain.calls[j][0] != got.stream for j in range(a + 1, b)) for a, b in zip(firsts, firsts[1:]))
