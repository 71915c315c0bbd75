"""Exact mode on our kernels (``engine.kernels``, the activations in float): the real models' own GGUF
weights give the very tokens of plain greedy decoding under speculation, in process, over loopback
workers and over two tensor-parallel ranks, and the same reply on each."""

from __future__ import annotations

import pytest

from engine import kernels
from engine.config import FleetAccess, ShardOptions
from engine.export.exporter import export_model, rank_folder
from engine.fleetkey import access_of, create_key, load_key
from engine.runtime.decode.generate import Generator
from engine.runtime.decode.speculative import PromptLookup
from engine.runtime.decode.tokenizer import ChatTokenizer
from engine.runtime.relay.local_workers import LocalWorkers
from engine.runtime.relay.ranks import RankChain
from engine.runtime.relay.remote import RemoteChain
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.stage import MODES, read_for

pytestmark = pytest.mark.real_model
EXACT = MODES["exact"]
PROMPT = "List the planets of the solar system with one fact each."


@pytest.fixture(autouse=True)
def our_kernels():
    if not kernels.tile_width():
        pytest.skip(f"our kernels do not run here: {kernels.unavailable() or 'this CPU has no AVX2'}")


def exact_replies(chain, folder, tokens: int = 32) -> list[int]:
    """A greedy reply in exact mode, checked against speculation (prompt lookup) on the same chain."""
    gen = Generator(chain, max_length=2048)
    ids = ChatTokenizer(folder).prompt_ids(PROMPT)
    greedy = gen.generate(ids, tokens, ignore_eos=True).tokens
    drafted = gen.generate(ids, tokens, ignore_eos=True, drafter=PromptLookup(), k=3)
    assert drafted.tokens == greedy
    return greedy


def in_process(folders) -> list[int]:
    local = LocalChain(folders, config=EXACT)
    try:
        return exact_replies(local, folders[0])
    finally:
        local.close()


def test_smollm2_over_loopback_workers(smollm2_gguf, tmp_path):
    """Stage 0 here, stage 1 in a worker: every carried matrix runs our kernels with x in float, and
    the reply is the in-process chain's."""
    stages = export_model("smollm2-135m", stages=2, weights="gguf")
    model, _ = read_for(stages.folders[0], "CPU", EXACT)
    ops = [op for op in model.get_ops() if op.get_type_name() == kernels.OP]
    assert ops and all(op.get_attributes()["float_x"] == 1 for op in ops)
    want = in_process(stages.folders)
    key = create_key(tmp_path / "fleet.key")
    exact = ShardOptions(mode="exact")
    with LocalWorkers(stages.folders[1:], access_of(key), shard=exact, hosting="threads", log_dir=tmp_path) as fleet:
        chain = RemoteChain(stages.folders[0], fleet.addresses, access=FleetAccess(load_key(key)), shard=exact)
        try:
            assert exact_replies(chain, stages.folders[0]) == want
        finally:
            chain.close()


def test_qwen_over_two_tensor_parallel_ranks(qwen15_gguf, tmp_path):
    """Rank 1 in a worker, rank 0 here: the whole model's reply (the exchanges sum the ranks' parts in
    rank order)."""
    ranks = export_model("qwen2.5-coder-1.5b", ranks=2, weights="gguf")
    key = create_key(tmp_path / "fleet.key")
    exact = ShardOptions(mode="exact")
    with LocalWorkers([rank_folder(ranks.out, 1)], access_of(key), shard=exact, hosting="threads",
                      log_dir=tmp_path) as fleet:
        chain = RankChain(rank_folder(ranks.out, 0), fleet.addresses, access=FleetAccess(load_key(key)), shard=exact)
        try:
            got = exact_replies(chain, rank_folder(ranks.out, 0))
        finally:
            chain.close()
    assert got == in_process(export_model("qwen2.5-coder-1.5b", stages=1, weights="gguf").folders)
