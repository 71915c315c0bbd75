"""Paged-attention and static-shape stages: many streams' tokens in one forward, each stream's output
the same as decoded alone on the stateful path (``exact`` settings), streams joining, leaving and
rewinding; the static stage's ring with attention sinks beyond its window."""

from __future__ import annotations

import numpy as np
import pytest

from engine.errors import ShardError
from engine.export.exporter import export_model
from engine.manifest import load_manifest
from engine.runtime.stages.chain import LocalChain
from engine.runtime.decode.generate import Generator
from engine.runtime.stages.paged import PagedStage
from engine.runtime.stages.packing import Part
from engine.runtime.stages.factory import stage_kind
from engine.runtime.stages.stage import MODES
from engine.runtime.stages.static import StaticStage
from engine.transport.wire import Flag
from engine.tuning import FIXED_ROWS_AFTER
from engine.runtime.decode.tokenizer import ChatTokenizer

EXACT = MODES["exact"]


def _chain_forward(stages: list[PagedStage], parts: list[Part]) -> list[np.ndarray]:
    for stage in stages:
        outs = stage.forward_parts(parts)
        parts = [Part(p.stream, out, p.start, p.keep) for p, out in zip(parts, outs)]
    return outs


def _staggered_greedy(stages: list[PagedStage], prompts: list[np.ndarray], new_tokens: int) -> list[list[int]]:
    """Greedy decoding of every prompt, packed: stream k joins at round 2k and leaves (its blocks
    freed) as soon as it has its tokens, so the batch grows and shrinks mid-flight."""
    got: dict[int, list[int]] = {k: [] for k in range(len(prompts))}
    pending: dict[int, np.ndarray] = {}
    held: dict[int, int] = {}
    for rnd in range(2 * len(prompts) + new_tokens + 1):
        for k, ids in enumerate(prompts):
            if rnd == 2 * k:
                pending[k], held[k] = ids, 0
        parts = [Part(k, pending[k], held[k]) for k in pending if len(got[k]) < new_tokens]
        if not parts:
            break
        for part, logits in zip(parts, _chain_forward(stages, parts)):
            token = int(logits[-1].argmax())
            got[part.stream].append(token)
            held[part.stream] += len(part.x)
            pending[part.stream] = np.array([token])
            if len(got[part.stream]) == new_tokens:
                for stage in stages:
                    stage.reset(part.stream)
    return [got[k] for k in range(len(prompts))]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("split", ["1", "2", "3"])
def test_packed_streams_decode_what_each_decodes_alone(tiny_exports, arch, split):
    """Gemma 3's tiny model has a 4-token window on three of its four layers: the paged stages give
    those layers' attention ops the window, or these prompts would decode other tokens."""
    folders = tiny_exports[arch, split].folders
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 200, size=n) for n in (5, 37, 1, 70, 12, 3, 50, 20)]
    alone = Generator(LocalChain(folders, config=EXACT, paged=False), 256)
    want = [alone.generate(ids.reshape(1, -1), 16, ignore_eos=True).tokens for ids in prompts]
    # the pools start at one block, so they grow (cached blocks copied over) several times mid-flight;
    # 16 tokens each, so all eight streams are in flight together before the first leaves
    stages = [PagedStage(f, config=EXACT, kv_positions=1) for f in folders]
    assert _staggered_greedy(stages, prompts, 16) == want
    assert all(stage.pool.capacity >= 8 for stage in stages)
    assert all(stage.pool.free_blocks == stage.pool.capacity for stage in stages), "every block came back"


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_fixed_row_graphs_run_with_the_numbers_of_the_dynamic_one(tiny_exports, mode):
    """A forward of one row in all runs the one-row graph (static shapes) from the start; a count of
    rows that recurs gets a graph of its own, compiled in the background, which any streams' rows of
    that count then run.  All over the same caches, with the same logits as the stage without them,
    and the caches both fill are the same for what follows; other counts run the dynamic graph."""
    folders = tiny_exports["qwen2", "2"].folders
    config = MODES[mode]
    fixed, dynamic = ([PagedStage(f, config=config, kv_positions=16, fixed_rows=on) for f in folders]
                      for on in (True, False))
    assert all(s.fixed_rows == [1] for s in fixed) and all(s.fixed_rows == [] for s in dynamic)
    rng = np.random.default_rng(5)
    prompts = {1: rng.integers(3, 200, size=20), 2: rng.integers(3, 200, size=9)}
    got = {}
    for name, stages in (("fixed", fixed), ("dynamic", dynamic)):
        logits = [_chain_forward(stages, [Part(1, prompts[1], 0)])[0][-1]]
        assert all(s.last_request is s._request for s in stages), "a prompt runs the dynamic graph"
        at = len(prompts[1])
        for _ in range(24):  # past the pools' first blocks: they grow, and every graph sees the new caches
            logits.append(_chain_forward(stages, [Part(1, np.array([int(logits[-1].argmax())]), at)])[0][-1])
            at += 1
            if name == "fixed":
                assert all(s.last_request is s._fixed[1] for s in stages)
        for step in range(FIXED_ROWS_AFTER + 2):  # two rows a forward: a speculative round's
            if name == "fixed" and step == FIXED_ROWS_AFTER:
                assert all(2 in s._compiling for s in stages), "its compile started at the last count"
                for s in stages:
                    s.fix_rows(2)  # waits for the background compile
                assert all(s.fixed_rows == [1, 2] for s in stages)
            two = _chain_forward(stages, [Part(1, np.array([int(logits[-1].argmax()), 9]), at, keep=2)])[0]
            logits += list(two)
            at += 2
            ran = [s.last_request is s._fixed.get(2) for s in stages]
            assert all(ran) if name == "fixed" and step >= FIXED_ROWS_AFTER else not any(ran)
        other = _chain_forward(stages, [Part(2, prompts[2], 0)])[0][-1]  # 9 rows: the dynamic graph
        assert all(s.last_request is s._request for s in stages)
        pair = _chain_forward(stages, [Part(1, np.array([int(logits[-1].argmax())]), at),
                                       Part(2, np.array([int(other.argmax())]), len(prompts[2]))])
        if name == "fixed":  # two streams' one row each: the graph of two rows too
            assert all(s.last_request is s._fixed[2] for s in stages)
        got[name] = np.stack(logits + [other] + [rows[-1] for rows in pair])
    np.testing.assert_array_equal(got["fixed"].argmax(-1), got["dynamic"].argmax(-1))
    np.testing.assert_allclose(got["fixed"], got["dynamic"], rtol=0, atol=1e-5)


def test_a_recurring_count_waits_for_memory_to_spare(tiny_exports, monkeypatch):
    """Short of ``FIXED_HEADROOM_MB`` of memory, a recurring count of rows keeps the dynamic graph, and
    is asked again after as many forwards: with memory to spare, its graph is compiled then."""
    from engine.runtime.stages import paged
    from engine.tuning import FIXED_HEADROOM_MB

    spare = {"bytes": (FIXED_HEADROOM_MB << 20) - 1}
    monkeypatch.setattr(paged, "process_memory", lambda: (8 << 30, spare["bytes"]))
    stage = PagedStage(tiny_exports["qwen2", "1"].folders[0], config=EXACT, kv_positions=64, fixed_rows=True)
    at = 0
    for forward in range(2 * FIXED_ROWS_AFTER):
        if forward == FIXED_ROWS_AFTER:
            assert stage.fixed_rows == [1] and not stage._compiling, "no compile without memory to spare"
            spare["bytes"] += 1
        stage.forward_parts([Part(1, np.array([5, 6]), at)])
        at += 2
    stage.fix_rows(2)  # waits for the compile the second count started
    assert stage.fixed_rows == [1, 2]


def test_a_rewind_is_a_shorter_start(tiny_exports):
    """Continuing from an earlier position drops what followed: the same logits as a stream that
    never saw the dropped tokens."""
    stages = [PagedStage(f, config=EXACT, kv_positions=256) for f in tiny_exports["qwen2", "2"].folders]
    rng = np.random.default_rng(3)
    prompt, junk, suffix = (rng.integers(3, 200, size=n) for n in (40, 9, 6))
    _chain_forward(stages, [Part(1, prompt, 0)])
    _chain_forward(stages, [Part(1, junk, len(prompt), keep=len(junk))])
    rewound = _chain_forward(stages, [Part(1, suffix, len(prompt), keep=len(suffix))])[0]
    cold = _chain_forward(stages, [Part(2, np.concatenate([prompt, suffix]), 0, keep=len(suffix))])[0]
    assert rewound.shape == (len(suffix), cold.shape[1])
    np.testing.assert_array_equal(rewound.argmax(-1), cold.argmax(-1))
    np.testing.assert_allclose(rewound, cold, rtol=0, atol=1e-4)
    assert stages[0].length(1) == len(prompt) + len(suffix)


def test_bad_parts_and_a_full_pool_are_refused_and_change_nothing(tiny_exports):
    stage = PagedStage(tiny_exports["llama", "1"].folders[0], config=EXACT, kv_positions=64, max_kv_positions=64)
    size = stage.pool.block_size
    ids = np.arange(3, 3 + size, dtype=np.int64)
    stage.forward_parts([Part(1, ids, 0)])
    with pytest.raises(ShardError, match="holds 32 positions, it cannot continue from 40"):
        stage.forward_parts([Part(1, ids, 40)])
    with pytest.raises(ShardError, match="the KV pool is full"):
        stage.forward_parts([Part(2, ids, 0), Part(3, ids, 0)])
    with pytest.raises(ShardError, match="at most once"):
        stage.forward_parts([Part(1, ids[:1], size), Part(1, ids[:1], size)])
    assert stage.streams == [1] and stage.length(1) == size
    stage.forward_parts([Part(2, ids, 0)])  # the refused forwards took no blocks
    assert stage.pool.free_blocks == stage.pool.capacity - 2


def test_a_chain_packs_at_most_pack_rows_a_forward(tiny_exports):
    """Rounds queued together (a failover's re-prefills) go in forwards of at most PACK_ROWS rows, a
    longer one alone, in submission order; each stream's logits are what it gets alone."""
    from engine.tuning import PACK_ROWS

    folders = tiny_exports["llama", "2"].folders
    rng = np.random.default_rng(4)
    sizes = [PACK_ROWS // 2, PACK_ROWS // 2 + 1, 3, PACK_ROWS + 40, 5]
    prompts = [rng.integers(3, 200, size=n) for n in sizes]
    alone = LocalChain(folders, config=EXACT, paged=True)
    want = [alone.forward(ids[None], np.ones((1, len(ids)), np.int64), np.arange(len(ids))[None], Flag.LOGITS,
                          stream=i).logits for i, ids in enumerate(prompts)]
    chain = LocalChain(folders, config=EXACT, paged=True)
    forwards, run = [], chain.stages[0].forward_parts
    chain.stages[0].forward_parts = lambda parts: (forwards.append([len(p.x) for p in parts]), run(parts))[1]
    tickets = [chain.submit(ids[None], np.ones((1, len(ids)), np.int64), np.arange(len(ids))[None], Flag.LOGITS, i)
               for i, ids in enumerate(prompts)]
    got = [chain.collect(t).logits for t in tickets]
    assert forwards == [[sizes[0]], [sizes[1], 3], [sizes[3]], [5]]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("split", ["1", "3"])
def test_static_stages_decode_what_each_stream_decodes_alone(tiny_exports, arch, split):
    """Fixed shapes (8 rows a forward, so the long prompts go in several), five streams joining and
    leaving with two slots to start with (they double twice): within its window every stream gives
    the stateful path's tokens."""
    folders = tiny_exports[arch, split].folders
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 200, size=n) for n in (5, 37, 1, 70, 12)]
    alone = Generator(LocalChain(folders, config=EXACT, paged=False), 256)
    want = [alone.generate(ids.reshape(1, -1), 10, ignore_eos=True).tokens for ids in prompts]
    stages = [StaticStage(f, "CPU", EXACT, rows=8, slots=2, window=96) for f in folders]
    assert _staggered_greedy(stages, prompts, 10) == want
    assert all(not port.get_partial_shape().is_dynamic for stage in stages for port in stage.compiled.inputs)
    assert [(stage.slots, stage.compiles) for stage in stages] == [(8, 3)] * len(stages)
    assert all(stage.streams == [] for stage in stages), "every window came back"


def test_beyond_its_window_a_static_stream_keeps_its_sinks_and_the_latest_tokens(tiny_exports):
    """A 3-position window of sinks plus the 9 latest: the logits of every step equal the stateful
    path's when its mask shows exactly those positions, one token a forward."""
    folders = tiny_exports["qwen2", "2"].folders
    sinks, window = 3, 12
    stateful = LocalChain(folders, config=EXACT, paged=False)
    stages = [StaticStage(f, "CPU", EXACT, rows=4, slots=2, window=window, sinks=sinks) for f in folders]
    ids = np.random.default_rng(9).integers(3, 200, size=30)
    stateful.reset(0)
    for p, token in enumerate(ids):
        visible = [o < sinks or p - o < window - sinks for o in range(p + 1)]
        want = stateful.forward(np.array([[token]]), np.array([visible], np.int64), np.array([[p]]), Flag.LOGITS).logits
        got = _chain_forward(stages, [Part(0, np.array([token]), p)])[0]
        np.testing.assert_allclose(got, want[0, -1:], rtol=0, atol=1e-4, err_msg=f"position {p}")
    held = sorted(stages[0]._held[0].tolist())
    assert held == [0, 1, 2] + list(range(30 - (window - sinks), 30)) and stages[0].length(0) == 30


def test_the_static_stage_refuses_what_does_not_fit_and_npus_pick_it(tiny_exports):
    folder = tiny_exports["llama", "1"].folders[0]
    stage = StaticStage(folder, "CPU", EXACT, rows=4, slots=1, window=32, max_slots=2)
    ids = np.arange(3, 13, dtype=np.int64)
    stage.forward_parts([Part(1, ids, 0)])
    with pytest.raises(ShardError, match="holds 10 positions, it cannot continue from 12"):
        stage.forward_parts([Part(1, ids, 12)])
    with pytest.raises(ShardError, match="2 streams join 1 and a static stage holds at most 2"):
        stage.forward_parts([Part(2, ids, 0), Part(3, ids, 0)])
    assert stage.streams == [1] and stage.length(1) == 10 and stage.compiles == 1
    with pytest.raises(ShardError, match="1 ≤ slots ≤ max_slots"):
        StaticStage(folder, "CPU", slots=3, max_slots=2)
    with pytest.raises(ShardError, match="must hold the model's 4-token sliding window"):
        StaticStage(tiny_exports["gemma3", "1"].folders[0], "CPU", window=6, sinks=3)
    manifest = stage.manifest
    assert stage_kind(manifest, "NPU") == "static" and stage_kind(manifest, "npu.0") == "static"
    assert stage_kind(manifest, "CPU") == stage_kind(manifest, "GPU.1") == "paged"
    assert (stage_kind(manifest, "NPU", static=False) == "stateful"
            and stage_kind(manifest, "CPU", static=True) == "static")
    assert stage_kind(manifest, "CPU", isolate=True) == "stateful"
    gemma = load_manifest(tiny_exports["gemma3", "1"].folders[0])
    assert stage_kind(gemma, "NPU") == "static" and stage_kind(gemma, "CPU") == "paged"


def test_smollm2_packed_chat_streams_match_the_stateful_path():
    """The real model, 2 stages: four chat prompts of different lengths joining one after another."""
    folders = export_model("smollm2-135m", stages=2, weights="int4").folders
    tokenizer = ChatTokenizer(folders[0])
    prompts = [tokenizer.prompt_ids(p).reshape(-1) for p in (
        "What is the capital of France?", "Write a haiku about rust.",
        "Explain TCP in one sentence, with an example.", "Count to ten.")]
    alone = Generator(LocalChain(folders, config=EXACT, paged=False), 512)
    want = [alone.generate(ids.reshape(1, -1), 16, ignore_eos=True).tokens for ids in prompts]
    stages = [PagedStage(f, config=EXACT, kv_positions=1024) for f in folders]
    assert _staggered_greedy(stages, prompts, 16) == want


@pytest.mark.parametrize("kind", ["paged", "static"])
@pytest.mark.parametrize("split", ["1", "2"])
def test_the_generation_loop_runs_on_paged_stages_with_speculation_and_a_cached_prefix(tiny_exports, split, kind):
    """A paged chain behind the usual loop: plain greedy, prompt-lookup speculation (rejected drafts
    cut by a shorter length) and a second turn that keeps the first one's prefix give the stateful
    chain's tokens."""
    from engine.runtime.decode.speculative import PromptLookup

    class LastDraftWrong(PromptLookup):
        """The lookup's drafts with the last one spoiled: every round rewinds."""

        def propose(self, history, k):
            drafts = super().propose(history, k)
            return drafts[:-1] + [drafts[-1] + 1] if drafts else drafts

    folders = tiny_exports["qwen2", split].folders
    rng = np.random.default_rng(11)
    motif = rng.integers(3, 200, size=6)
    prompt = np.concatenate([rng.integers(3, 200, size=20), motif, rng.integers(3, 200, size=5), motif])
    stateful = Generator(LocalChain(folders, config=EXACT, paged=False), 256, rewind="trim")
    paged = Generator(LocalChain(folders, config=EXACT, paged=True, static=kind == "static"), 256)
    assert paged.chain.packs
    assert paged.seq.rewind == "trim"
    for drafter in (None, LastDraftWrong()):
        want = stateful.generate(prompt, 24, ignore_eos=True, drafter=drafter, k=3)
        got = paged.generate(prompt, 24, ignore_eos=True, drafter=drafter and LastDraftWrong(), k=3)
        assert got.tokens == want.tokens
    if drafter:
        assert got.drafted > got.accepted > 0, "some drafts were rejected and rewound"
    # the next turn keeps the conversation so far (all but the last token, never fed) and prefills the rest
    from engine.runtime.decode.generate import Decoding

    turn = [int(t) for t in np.concatenate([prompt, got.tokens, rng.integers(3, 200, size=7)])]
    cached = len(prompt) + len(got.tokens) - 1
    assert paged.chain.stages[-1].length(0) == cached
    results = []
    for gen in (stateful, paged):
        decoding = Decoding(gen.seq, turn, 8, frozenset(), cached=cached)
        decoding.start()
        while decoding.advance():
            pass
        results.append(decoding.result.tokens)
    assert results[0] == results[1]
    assert paged.chain.stages[0].length(0) == len(turn) + 7


def test_the_batch_benchmark_reports_every_way(tiny_models, tmp_path):
    """`fleet bench batch` in miniature: every way and stream count measured, its ratios and KV rows."""
    import json

    from engine.bench.batch import run_batch

    report = run_batch(str(tiny_models["llama"]), stage_counts=(1, 2), streams=(1, 2), tokens=8, runs=1,
                       weights="f32", out=tmp_path / "batch.json", log=lambda _: None)
    assert json.loads((tmp_path / "batch.json").read_text())["bench"] == "batch"
    speeds = {(r["way"], r["streams"]): r["tok_s"] for r in report["rows"] if "tok_s" in r}
    # a tiny model's extra tokens take about as long as the machine's jitter: speeds, not their sign
    assert len(speeds) == 6 * 2 and all(np.isfinite(v) and v != 0 for v in speeds.values()), speeds
    assert {"packed 1-stage / ContinuousBatchingPipeline, 2 streams", "packed / per-stream, 2-stage, 2 streams",
            "packed 2-stage over the relay / in process, 2 streams"} <= set(report["ratios"])
    assert all(r["paged_mb"] > 0 and r["stateful_mb"] > 0 for r in report["rows"] if r["way"].startswith("KV per"))
    pools = [r for r in report["rows"] if r["way"].startswith("KV pool")]
    assert len(pools) == 2 and all(r["grow_ms"] > 0 and r["reuse_us"] > 0 for r in pools)
