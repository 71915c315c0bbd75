"""The engine's chat service the app drives (no Qt): incremental text equal to decoding everything,
queued requests, cancels, conversations that outgrow the context, and a failing chain."""

from __future__ import annotations

import random
import threading

import pytest

from engine.config import Scheduling
from engine.errors import StageError
from engine.runtime.decode.service import ChatService
from engine.runtime.decode.speculative import stream_drafters
from engine.runtime.decode.tokenizer import ChatTokenizer, TextStream
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.stage import compile_config


@pytest.fixture(scope="module")
def chain(tiny_exports):
    # exact mode: a request that reuses a stream's cached prefix gives the very tokens of a cold one
    return LocalChain(tiny_exports["qwen2", "2"].folders, config=compile_config("exact"))


def test_text_stream_pieces_add_up_to_the_full_decode(chain):
    tok = ChatTokenizer(chain.first_folder)
    rng = random.Random(0)
    alphabet = list("abc fox the \n日本語éüñ€😀,.")
    cases = [tok._tok.encode("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))),
                             add_special_tokens=False).input_ids.data.tolist()[0] for _ in range(100)]
    cases += [[rng.randrange(384) for _ in range(24)] for _ in range(100)]  # broken byte sequences too
    split_chars = 0
    for ids in cases:
        stream = TextStream(tok)
        pieces = [stream.push(i) for i in ids]
        assert "".join(pieces) + stream.flush() == tok.decode(ids)
        split_chars += pieces.count("")
    assert split_chars > 0  # some characters did span tokens and were held back


def test_streams_run_concurrently_and_match_running_alone(chain):
    # drafting in every round, beside another stream too
    service = ChatService(chain, scheduling=Scheduling(streams=2, k=3), drafters=lambda n: stream_drafters("lookup", n),
                          rewind="trim", draft_alone=False)
    try:
        prompts = [[{"role": "user", "content": p}] for p in ("The quick brown fox", "def add(a, b):", "Paris")]
        alone = [service.submit(m, 24, ignore_eos=True).wait(60) for m in prompts]
        texts = {i: [] for i in range(3)}
        handles = [service.submit(m, 24, on_text=lambda piece, n, i=i: texts[i].append(piece), ignore_eos=True)
                   for i, m in enumerate(prompts)]
        together = [h.wait(60) for h in handles]
        for a, b, i in zip(alone, together, range(3)):
            assert b.tokens == a.tokens and b.text == a.text == "".join(texts[i])
            assert b.stopped_by == "max_tokens" and b.acceptance is not None and b.ttft_ms > 0
        assert {r.stream for r in together} <= {0, 1}  # three requests on two streams: one waited
        assert len({r.stream for r in together[:2]}) == 2
    finally:
        service.close()


def test_cancel_stops_running_and_queued_requests(chain):
    service = ChatService(chain, scheduling=Scheduling(streams=1))
    try:
        started = threading.Event()
        running = service.submit([{"role": "user", "content": "A fleet"}], 400, ignore_eos=True,
                                 on_text=lambda piece, n: started.set())
        queued = service.submit([{"role": "user", "content": "of laptops"}], 400, ignore_eos=True)
        queued.cancel()
        assert started.wait(60)
        running.cancel()
        first, second = running.wait(60), queued.wait(60)
        assert first.stopped_by == "cancelled" and 0 < len(first.tokens) < 400
        assert second.stopped_by == "cancelled" and second.tokens == []
        after = service.submit([{"role": "user", "content": "A fleet"}], 8, ignore_eos=True).wait(60)
        assert after.stopped_by == "max_tokens" and len(after.tokens) == 8  # the stream is usable again
    finally:
        service.close()


def test_a_long_conversation_drops_its_oldest_turns_to_fit(chain):
    service = ChatService(chain, scheduling=Scheduling(streams=1))
    try:
        long = "the quick brown fox " * 60
        messages = [{"role": "system", "content": "Be brief."}]
        for i in range(6):
            messages += [{"role": "user", "content": f"{i} {long}"}, {"role": "assistant", "content": long}]
        messages.append({"role": "user", "content": "and now?"})
        reply = service.submit(messages, 32, ignore_eos=True).wait(60)
        assert reply.stopped_by == "max_tokens" and reply.dropped > 0
        assert reply.prompt_tokens + 32 <= chain.spec.max_position
        too_long = service.submit([{"role": "user", "content": long * 3}], 32).wait(60)
        assert too_long.stopped_by == "error" and "leaves no room in the context" in too_long.error
    finally:
        service.close()


class Breaking:
    """A chain whose stages die after a few forwards."""

    def __init__(self, chain, after: int):
        self.chain, self.left = chain, after
        self.manifest, self.spec, self.first_folder = chain.manifest, chain.spec, chain.first_folder

    def reset(self, stream=0):
        self.chain.reset(stream)

    def keep(self, stream, slots):
        self.chain.keep(stream, slots)

    def submit(self, ids, mask, pos, flags=0, stream=0):
        self.left -= 1
        if self.left < 0:
            raise StageError(1, "127.0.0.1:5001", "connection lost")
        return self.chain.submit(ids, mask, pos, flags, stream)

    def collect(self, ticket):
        return self.chain.collect(ticket)

    def first_ready(self, tickets):
        return self.chain.first_ready(tickets)

    def close(self):
        pass


def test_a_failing_chain_ends_every_stream_with_the_error(chain):
    service = ChatService(Breaking(chain, 10), scheduling=Scheduling(streams=2))
    try:
        handles = [service.submit([{"role": "user", "content": p}], 100, ignore_eos=True) for p in ("a", "b")]
        replies = [h.wait(60) for h in handles]
        assert all(r.stopped_by == "error" and r.error == "stage 1 at 127.0.0.1:5001: connection lost" for r in replies)
        assert all(len(r.tokens) < 100 for r in replies)
    finally:
        service.close()
