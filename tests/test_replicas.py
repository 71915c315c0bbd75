"""Replicas (``engine.runtime.decode.replicas``): users spread over copies of the model, each reply the
one a single copy gives, and a conversation's next turn goes to the copy that holds its cache."""

from __future__ import annotations

from types import SimpleNamespace

from engine.config import Scheduling
from engine.runtime.decode.replicas import Replicas
from engine.runtime.decode.service import ChatService
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.stage import MODES

ASKS = [[{"role": "user", "content": text}] for text in ("The quick brown fox", "Hello there",
                                                          "Count to ten, slowly please", "Why?")]


def test_users_spread_over_the_copies_and_a_next_turn_finds_its_cache(tiny_exports):
    whole, split = tiny_exports["llama", "1"].folders, tiny_exports["llama", "2"].folders
    alone = ChatService(LocalChain(whole, config=MODES["exact"]), scheduling=Scheduling(streams=1))
    try:
        want = [alone.submit(ask, 10, ignore_eos=True).wait(60).text for ask in ASKS]
    finally:
        alone.close()
    replicas = Replicas([ChatService(LocalChain(whole, config=MODES["exact"]), scheduling=Scheduling(streams=2)),
                         ChatService(LocalChain(split, config=MODES["exact"]), scheduling=Scheduling(streams=2))])
    try:
        assert replicas.streams == 4 and replicas.max_length == replicas.services[0].max_length
        handles = [replicas.submit(ask, 10, ignore_eos=True) for ask in ASKS]
        assert replicas.routed == [2, 2]  # each copy took two of the four users at once
        replies = [h.wait(60) for h in handles]
        assert [r.text for r in replies] == want
        # each conversation's next turn goes back to the copy that holds it, and reuses its cache
        for i in (1, 0):
            routed = list(replicas.routed)
            turn = ASKS[i] + [{"role": "assistant", "content": replies[i].text},
                              {"role": "user", "content": "And then?"}]
            again = replicas.submit(turn, 4, ignore_eos=True).wait(60)
            held_by = next(n for n, s in enumerate(replicas.services) if handles[i] in _handles(s, handles))
            assert [b - a for a, b in zip(routed, replicas.routed)] == [int(n == held_by) for n in range(2)]
            assert again.error is None and again.cached_tokens > 0
        assert replicas.busy == 0 and replicas.queued == 0
    finally:
        replicas.close()


def _handles(service: ChatService, handles) -> list:
    return [h for h in handles if h._service is service]


def test_the_description_counts_copies():
    """The status bar shows the service's description: the copies in the app's word, not "replicas"."""
    def copy():
        return SimpleNamespace(tokenizer=None, chain=None, max_length=64, streams=1, description="qwen2, 1 part")

    assert Replicas([copy(), copy()]).description == "qwen2, 1 part, 2 copies"
    assert Replicas([copy()]).description == "qwen2, 1 part, 1 copy"
