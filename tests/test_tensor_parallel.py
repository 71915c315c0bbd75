"""Tensor-parallel ranks: a tiny model split into two ranks over real loopback sockets gives the
logits of the whole model, and a missing, foreign or dead rank fails with a clear error."""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from engine.config import FleetAccess, Scheduling, ShardOptions
from engine.errors import ExportError, ShardError, StageError
from engine.export.exporter import export_model, rank_folder
from engine.export.rankcut import GGUF_UNIT, rank_cuts, ranks_problem
from engine.fleetkey import create_key, load_key, load_tls
from engine.manifest import load_manifest
from engine.models.architectures import ModelSpec
from engine.runtime.relay.ranks import RankChain
from engine.runtime.relay.worker import Worker
from engine.runtime.stages.chain import LocalChain
from engine.transport.mesh import Mesh, MeshError
from engine.runtime.stages.output import top_candidates
from engine.runtime.stages.stage import StageRunner, compile_config
from engine.transport.wire import CANDIDATE_COUNT, Flag, Frame, Msg

KEY = b"k" * 32
EXACT = compile_config("exact")


@pytest.fixture(scope="module")
def tp_exports(tiny_exports):
    """Each tiny model as two tensor-parallel ranks (f32)."""
    return {arch: tiny_exports[arch, "ranks"] for arch in ("llama", "qwen2", "gemma3")}


def _listening_rank(fingerprint: str, rank: int = 1, ranks: int = 2) -> tuple[Mesh, str]:
    """Rank ``rank`` of ``ranks``, listening for rank 0 on a loopback port; and that port's address."""
    listener = socket.create_server(("127.0.0.1", 0))
    mesh = Mesh(rank, ranks)
    mesh.listen(listener, KEY, fingerprint)
    return mesh, f"127.0.0.1:{listener.getsockname()[1]}"


def _mesh_pair(fingerprint: str) -> tuple[Mesh, Mesh]:
    rank1, address = _listening_rank(fingerprint)
    return Mesh.dial({1: address}, KEY, fingerprint, 2, timeout_s=10), rank1


def _at_once(*fns):
    """Runs the ranks' calls at once (as separate PCs would); returns their results in order."""
    out, errors = {}, []

    def run(i, fn):
        try:
            out[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return tuple(out[i] for i in range(len(fns)))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_two_ranks_give_the_whole_models_logits(arch, tp_exports, tiny_exports):
    """Rank 0 ends each forward with the whole model's logits: whole where its forward needs the
    logits or probabilities, else with rank 1's slice cut to each row's top-1 (greedy) or top
    candidates (sampling), which then are the whole model's.  Rank 1 keeps its own slice."""
    out = tp_exports[arch].out
    m0, m1 = load_manifest(rank_folder(out, 0)), load_manifest(rank_folder(out, 1))
    assert (m0.rank, m0.ranks, m1.rank, m1.ranks) == (0, 2, 1, 2)
    whole = StageRunner(tiny_exports[arch, "1"].folders[0], config=EXACT)
    mesh0, mesh1 = _mesh_pair(m0.fingerprint)
    half = m0.spec.vocab_size // 2
    try:
        rank0 = StageRunner(rank_folder(out, 0), config=EXACT, mesh=mesh0)
        rank1 = StageRunner(rank_folder(out, 1), config=EXACT, mesh=mesh1)
        ids = np.array([[5, 17, 42, 99, 7, 250, 31]], dtype=np.int64)
        tokens = []
        needs = [Flag.NONE, Flag.CANDIDATES, Flag.LOGITS, Flag.PROBS, Flag.NONE]  # the first: 7 rows
        for step, mesh0.needs in enumerate(needs):
            n = ids.shape[1] if step == 0 else 1
            x = ids if step == 0 else np.array([[tokens[-1]]], dtype=np.int64)
            total = ids.shape[1] + step
            mask = np.ones((1, total), dtype=np.int64)
            pos = np.arange(total - n, total, dtype=np.int64)[None]
            expected = whole.forward(x, mask, pos).copy()
            got0, got1 = _at_once(lambda: rank0.forward(x, mask, pos).copy(),
                                  lambda: rank1.forward(x, mask, pos).copy())
            assert got0.shape == got1.shape == expected.shape
            assert mesh1.needs == mesh0.needs  # told on rank 0's parts
            assert np.all(got1[..., :half] == -np.inf)
            np.testing.assert_allclose(got0[..., :half], expected[..., :half], atol=2e-4, rtol=1e-4)
            finite = np.isfinite(got0[..., half:]).sum(-1)
            if mesh0.needs & (Flag.LOGITS | Flag.PROBS):
                np.testing.assert_array_equal(got1[..., half:], got0[..., half:])
                np.testing.assert_allclose(got0, expected, atol=2e-4, rtol=1e-4)
            else:
                assert np.all(finite == (1 if not mesh0.needs else min(CANDIDATE_COUNT, half)))
                np.testing.assert_array_equal(got0[..., half:][np.isfinite(got0[..., half:])],
                                              got1[..., half:][np.isfinite(got0[..., half:])])
            assert np.array_equal(got0.argmax(-1), expected.argmax(-1))
            if mesh0.needs == Flag.CANDIDATES:
                ids0, logits0 = top_candidates(got0[0])
                _, logits_whole = top_candidates(expected[0])
                np.testing.assert_allclose(logits0, logits_whole, atol=2e-4, rtol=1e-4)
                # the whole model's candidates in its order, but for logits tied within the sums' rounding
                # (the ranks add their shares in another order: two such neighbours may swap)
                np.testing.assert_allclose(np.take_along_axis(expected[0], ids0, -1), logits_whole, atol=2e-4,
                                           rtol=1e-4)
            tokens.append(int(expected[0, -1].argmax()))
        assert mesh0.exchanges == mesh1.exchanges > 0
    finally:
        mesh0.close()
        mesh1.close()


def test_a_rank_needs_its_mesh(tp_exports):
    with pytest.raises(ShardError, match="tensor-parallel rank 1 of 2"):
        StageRunner(rank_folder(tp_exports["qwen2"].out, 1), config=EXACT)
    with pytest.raises(ShardError, match="rank 0 of 2: it runs in the coordinator"):
        Worker(rank_folder(tp_exports["qwen2"].out, 0), "127.0.0.1:0", access=FleetAccess(KEY))


def test_a_rank_0_without_the_fleet_key_is_refused_and_the_next_coordinator_is_taken(tp_exports):
    fingerprint = load_manifest(rank_folder(tp_exports["qwen2"].out, 0)).fingerprint
    rank1, address = _listening_rank(fingerprint)
    try:
        with pytest.raises(MeshError, match="rank 1 at .* refused the connection"):
            Mesh.dial({1: address}, b"x" * 32, fingerprint, 2, timeout_s=3)
        with pytest.raises(MeshError, match="rank 1 at .* refused the connection: .*fingerprint mismatch"):
            Mesh.dial({1: address}, KEY, "another model", 2, timeout_s=3)
        with pytest.raises(MeshError, match="serves tensor-parallel rank 1, not rank 2"):
            Mesh.dial({2: address}, KEY, fingerprint, 3, timeout_s=3)
        assert not rank1.links  # nobody got in
        x = np.arange(4, dtype=np.float32)[None]
        for session in range(2):  # each coordinator session replaces the last, counted from 0
            rank0 = Mesh.dial({1: address}, KEY, fingerprint, 2, timeout_s=3)
            sums = _at_once(lambda: _reduced(rank0, x), lambda: _reduced(rank1, 10 * x))
            assert np.array_equal(sums[0], 11 * x) and np.array_equal(sums[1], 11 * x)
            assert rank0.exchanges == rank1.exchanges == 1
            rank0.close()
    finally:
        rank1.close()


def _reduced(mesh: Mesh, x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    mesh.all_reduce(x, out)
    return out


def test_a_small_part_never_overtakes_a_large_one_still_being_sent():
    """A part too large to send from the caller goes through the mesh's sender thread; the next
    small part, sent at once after it, must still arrive behind it (it used to overtake it now and
    then: the peer then saw its parts out of step)."""
    rank0, rank1 = _mesh_pair("fp")
    try:
        large = np.ones((1, 1, 40_000), np.float32)  # 160 kB: over INLINE_BYTES
        small = np.ones((1, 1, 16), np.float32)

        def rounds(mesh):
            for _ in range(150):
                gathered = np.empty((1, 1, 80_000), np.float32)
                mesh.all_gather(large, gathered)
                _reduced(mesh, small)
            return gathered[np.isfinite(gathered)].sum()

        # rank 0 gathers both slices; rank 1, whose own comes back, sent its slice through the sender
        assert _at_once(lambda: rounds(rank0), lambda: rounds(rank1)) == (80_000, 40_000)
        assert rank0.exchanges == rank1.exchanges == 300
    finally:
        rank0.close()
        rank1.close()


def test_exchange_numbers_wrap_at_32_bits_on_both_ranks():
    """A frame numbers an exchange in 32 bits; a rank that has served long enough goes past that."""
    rank0, rank1 = _mesh_pair("fp")
    try:
        rank0.exchanges = rank1.exchanges = 0xFFFFFFFF - 1
        large = np.ones((1, 1, 40_000), np.float32)  # through the sender thread, as in the test above

        def rounds(mesh):
            gathered = np.empty((1, 1, 80_000), np.float32)
            for _ in range(2):
                mesh.all_gather(large, gathered)
                summed = _reduced(mesh, np.ones((1, 4), np.float32))
            return gathered[np.isfinite(gathered)].sum(), summed.sum()

        assert _at_once(lambda: rounds(rank0), lambda: rounds(rank1)) == ((80_000, 8.0), (40_000, 8.0))
        rank0.check()
        rank1.check()
    finally:
        rank0.close()
        rank1.close()


def test_three_ranks_sum_in_rank_order_on_every_rank_and_rank_0_gathers_the_slices():
    """With more than two ranks, rank 0 gathers the parts, sums them in rank order and sends the
    result back: every rank holds the very same sums, bit for bit.  A gather brings rank 0 every
    rank's slice; the others keep their own."""
    (rank1, address1), (rank2, address2) = (_listening_rank("fp", r, 3) for r in (1, 2))
    rank0 = Mesh.dial({1: address1, 2: address2}, KEY, "fp", 3, timeout_s=10)
    meshes = (rank0, rank1, rank2)
    parts = [np.random.default_rng(r).standard_normal((1, 2, 64)).astype(np.float32) * 10 ** r for r in range(3)]
    try:
        def rounds(mesh):
            sums, gathered = [], []
            for _ in range(20):
                sums.append(_reduced(mesh, parts[mesh.rank]))
                side_by_side = np.empty((1, 2, 192), np.float32)
                mesh.all_gather(parts[mesh.rank], side_by_side)
                gathered.append(side_by_side)
            return sums, gathered

        results = _at_once(*(lambda m=m: rounds(m) for m in meshes))
        want = (parts[0] + parts[1]) + parts[2]
        for rank, (sums, gathered) in enumerate(results):
            assert all(np.array_equal(s, want) for s in sums)
            own = [p if r == rank or rank == 0 else np.full_like(p, -np.inf) for r, p in enumerate(parts)]
            assert all(np.array_equal(g, np.concatenate(own, axis=-1)) for g in gathered)
        assert rank0.exchanges == rank1.exchanges == rank2.exchanges == 40
    finally:
        for mesh in meshes:
            mesh.close()


def test_a_top_1_outside_the_senders_vocabulary_slice_is_refused():
    rank0, rank1 = _mesh_pair("fp")
    try:
        rank0.needs = Flag.NONE  # a greedy forward: rank 1 sends (value, index) per row
        rank1._send(0, Frame(Msg.SHARE, 0, 0, [np.array([[[5.0, 8.0]]], np.float32)]))  # index 8 of 0-7
        with pytest.raises(MeshError, match="rank 1 sent vocabulary indices outside its slice"):
            rank0.all_gather(np.zeros((1, 1, 8), np.float32), np.empty((1, 1, 16), np.float32))
    finally:
        rank0.close()
        rank1.close()


def test_a_failed_exchange_fails_every_later_one_until_rank_0_connects_again():
    """OpenVINO does not always pass an exception from inside the graph on to ``infer``, so the
    mesh keeps the failure: ``check`` (after every forward) and every later exchange raise it."""
    listener = socket.create_server(("127.0.0.1", 0))
    rank1 = Mesh(1, 2)
    rank1.listen(listener, KEY, "fp")
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    x = np.ones((1, 4), np.float32)
    try:
        rank0 = Mesh.dial({1: address}, KEY, "fp", 2, timeout_s=3)
        _at_once(lambda: _reduced(rank0, x), lambda: _reduced(rank1, x))
        rank0.close()  # the coordinator goes away: rank 1's next exchange fails
        with pytest.raises(MeshError, match="rank 0 .* is gone") as failed:
            _reduced(rank1, x)
        with pytest.raises(MeshError) as again:
            rank1.check()
        assert again.value is failed.value
        with pytest.raises(MeshError) as later:
            _reduced(rank1, x)
        assert later.value is failed.value and rank1.exchanges == 2  # not tried again on a dead link
        rank0 = Mesh.dial({1: address}, KEY, "fp", 2, timeout_s=3)  # the next session starts clean
        rank1.check()
        assert np.array_equal(_at_once(lambda: _reduced(rank0, x), lambda: _reduced(rank1, x))[1], 2 * x)
        rank0.close()
    finally:
        rank1.close()


def test_a_dead_rank_ends_the_forward_with_an_error(tp_exports):
    out = tp_exports["qwen2"].out
    mesh0, mesh1 = _mesh_pair(load_manifest(rank_folder(out, 0)).fingerprint)
    try:
        rank0 = StageRunner(rank_folder(out, 0), config=EXACT, mesh=mesh0)
        mesh1.close()  # rank 1's PC goes away
        ids = np.array([[5, 17]], dtype=np.int64)
        with pytest.raises(Exception, match="rank 1 .* is gone"):
            rank0.forward(ids, np.ones((1, 2), np.int64), np.arange(2)[None])
    finally:
        mesh0.close()


def test_ranks_refuse_what_they_cannot_split(tiny_models, tmp_path):
    with pytest.raises(ExportError, match="without a split"):
        export_model(str(tiny_models["qwen2"]), weights="f32", ranks=2, stages=2, out=tmp_path / "a")
    with pytest.raises(ExportError, match="cannot be split into 4"):
        export_model(str(tiny_models["qwen2"]), weights="f32", ranks=4, out=tmp_path / "b")
    # a GGUF's own blocks are cut between blocks only: Qwen2.5-1.5B's heads and MLP are, SmolLM2's heads not
    qwen = ModelSpec(arch="qwen2", num_layers=28, hidden_size=1536, intermediate_size=8960, num_heads=12,
                     num_kv_heads=2, head_dim=128, vocab_size=151936, rms_eps=1e-6, rope_theta=1e6,
                     max_position=32768, tie_embeddings=True)
    smol = dataclasses.replace(qwen, hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64)
    assert ranks_problem(qwen, 2, "gguf") is None and ranks_problem(smol, 2, "int4") is None
    assert "do not split into 2 ranks" in ranks_problem(smol, 2, "gguf")
    cuts, heads, kv_heads = rank_cuts(qwen, 1, 2, GGUF_UNIT)
    assert (cuts["o"], cuts["down"], heads, kv_heads) == ((1, slice(768, 1536)), (1, slice(4352, 8960)), 6, 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_worker_process_serves_rank_1_for_the_coordinators_rank_0(tp_exports, tiny_exports, tmp_path):
    """Rank 1 in a `fleet worker` process, rank 0 here: greedy steps, a rewind and a reset give the
    tokens of the whole model; after that worker restarts, the next request but one does again
    (the chain reconnects to it, and the ranks' mesh with it)."""
    out = tp_exports["llama"].out
    key_file = create_key(tmp_path / "fleet.key")
    listen = f"127.0.0.1:{_free_port()}"

    def start_worker():
        return subprocess.Popen([sys.executable, "-m", "engine.cli", "worker", "--shard", str(rank_folder(out, 1)),
                                 "--listen", listen, "--fleet-key-file", str(key_file), "--mode", "exact"],
                                stderr=subprocess.DEVNULL)

    worker = start_worker()
    whole = LocalChain(tiny_exports["llama", "1"].folders, config=EXACT)
    chain = None
    try:
        access = FleetAccess(load_key(key_file), load_tls(True, key_file))  # as the worker: the default
        chain = RankChain(rank_folder(out, 0), [listen], access=access, shard=ShardOptions(mode="exact"),
                          connect_timeout_s=120)

        assert _greedy(chain, [5, 17, 42, 99], 6) == _greedy(whole, [5, 17, 42, 99], 6)
        assert _greedy(chain, [9, 8, 7], 4) == _greedy(whole, [9, 8, 7], 4)  # a reset between requests
        # a rewind: keep 5 slots of the cache, then go on from there on both
        for c in (chain, whole):
            c.keep(0, np.arange(5, dtype=np.int32))
        ids = np.array([[11]])
        mask, pos = np.ones((1, 6), np.int64), np.array([[5]])
        assert chain.forward(ids, mask, pos).tokens.tolist() == whole.forward(ids, mask, pos).tokens.tolist()
        worker.kill()
        worker.wait(30)
        worker = start_worker()
        failed = 0
        while True:
            try:
                got = _greedy(chain, [9, 8, 7], 4)
                break
            except StageError:  # the request that finds the old worker gone
                failed += 1
                assert failed == 1, "the chain did not recover"
        assert got == _greedy(whole, [9, 8, 7], 4)
        assert _greedy(chain, [5, 17, 42, 99], 6) == _greedy(whole, [5, 17, 42, 99], 6)
    finally:
        if chain is not None:
            chain.close()
        worker.terminate()
        worker.wait(30)


def test_fleet_generate_runs_rank_0_with_remote_ranks(tp_exports, tiny_exports, tmp_path):
    """`fleet generate --shards rank0 --remote W` against the whole model, greedy, exact mode, twice:
    the worker takes the second coordinator as it took the first."""
    out = tp_exports["qwen2"].out
    key_file = create_key(tmp_path / "fleet.key")
    listen = f"127.0.0.1:{_free_port()}"
    worker = subprocess.Popen([sys.executable, "-m", "engine.cli", "worker", "--shard", str(rank_folder(out, 1)),
                               "--listen", listen, "--fleet-key-file", str(key_file),
                               "--mode", "exact"], stderr=subprocess.DEVNULL)

    def generate(*shards_and_route, name):
        result = subprocess.run([sys.executable, "-m", "engine.cli", "generate", "--shards", *shards_and_route,
                                 "--prompt", "Paris is", "--max-new-tokens", "8", "--ignore-eos", "--mode", "exact",
                                 "--fleet-key-file", str(key_file), "--json", str(tmp_path / name)],
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr
        return json.loads((tmp_path / name).read_text())[0]["tokens"]

    try:
        whole = generate(str(tiny_exports["qwen2", "1"].folders[0]), name="whole.json")
        ranks = [generate(str(rank_folder(out, 0)), "--remote", listen, name=f"ranks{i}.json") for i in range(2)]
    finally:
        worker.terminate()
        worker.wait(30)
    assert ranks == [whole, whole] and len(whole) == 8


def test_ranks_deploy_through_an_agent_serve_coordinator_after_coordinator_and_a_lost_rank_is_named(
        tp_exports, tiny_models, tiny_exports, tmp_path, monkeypatch):
    """`deploy` exports the ranks, ships rank 1 to a node agent and starts its worker; the
    deployment's chain is a RankChain giving the whole model's tokens, a second coordinator session
    gets them again from the same worker, and a rank whose worker is stopped fails the next forward
    with a StageError naming it (what failover takes)."""
    from engine.fleet.control import ControlClient
    from engine.fleet.deploy import LOCAL, deploy
    from engine.fleet.span import StageSpan
    from tests.fleet_support import agent_process

    monkeypatch.setenv("FLEETSHARD_HOME", str(tmp_path / "coordinator"))
    key_file = create_key(tmp_path / "fleet.key")
    key = load_key(key_file)
    whole = LocalChain(tiny_exports["qwen2", "1"].folders, config=EXACT)
    layers = load_manifest(tiny_exports["qwen2", "1"].folders[0]).spec.num_layers
    with agent_process(key_file, tmp_path / "a", name="alpha") as (_, agent):
        stages = [StageSpan(LOCAL, "CPU", 0, layers, rank=0), StageSpan(agent, "CPU", 0, layers, rank=1)]
        deployment, chain = deploy(str(tiny_models["qwen2"]), stages, access=FleetAccess(key),
                                   shard=ShardOptions(weights="f32", mode="exact"))
        try:
            assert isinstance(chain, RankChain) and deployment.ranks == 2
            assert _greedy(chain) == _greedy(whole)
            chain.close()
            chain = deployment.chain(FleetAccess(key))  # the next coordinator session, the same worker
            assert _greedy(chain) == _greedy(whole)
            with ControlClient(agent, FleetAccess(key)) as client:
                client.stop_worker(deployment.workers[0]["worker"])
            with pytest.raises(StageError):
                _greedy(chain)
        finally:
            chain.close()
            deployment.stop(FleetAccess(key))


def _greedy(chain, prompt=(5, 17, 42, 99), n: int = 5) -> list[int]:
    ids, tokens = list(prompt), []
    chain.reset(0)
    out = chain.forward(np.array([ids]), np.ones((1, len(ids)), np.int64), np.arange(len(ids))[None])
    for _ in range(n):
        tokens.append(int(out.tokens.reshape(-1)[-1]))
        ids.append(tokens[-1])
        out = chain.forward(np.array([[ids[-1]]]), np.ones((1, len(ids)), np.int64), np.array([[len(ids) - 1]]))
    return tokens


def test_a_ranks_pc_killed_mid_reply_the_reply_carries_on_token_identical(tiny_models, tiny_exports, tmp_path,
                                                                         monkeypatch):
    """Rank 1 on a node agent's PC, rank 0 here, a chat reply in flight when that PC's agent and
    worker are killed (kill -9): failover re-plans from the fleet profile without the lost node and
    the reply carries on to the end, token-identical to the whole model in one process."""
    import os
    import signal

    import psutil

    from engine.fleet.control import ControlClient
    from engine.fleet.deploy import LOCAL, deploy
    from engine.fleet.span import StageSpan
    from engine.fleet.failover import Failover
    from engine.fleet.placement import DeviceProfile, Fleet, ModelShape
    from engine.fleet.profile import model_shape
    from engine.runtime.decode.service import ChatService
    from tests.fleet_support import agent_process

    monkeypatch.setenv("FLEETSHARD_HOME", str(tmp_path / "coordinator"))
    key_file = create_key(tmp_path / "fleet.key")
    key = load_key(key_file)
    whole = tiny_exports["qwen2", "1"].folders
    layers = load_manifest(whole[0]).spec.num_layers

    def reply(service, on_text=None):
        return service.submit([{"role": "user", "content": "Paris is"}], 24, chat=False, ignore_eos=True,
                              on_text=on_text).wait(300)

    alone = ChatService(LocalChain(whole, config=EXACT), scheduling=Scheduling(streams=1), rewind="trim")
    try:
        want = reply(alone).tokens
    finally:
        alone.close()
    with agent_process(key_file, tmp_path / "alpha", name="alpha") as (alpha_proc, alpha), \
            agent_process(key_file, tmp_path / "beta", name="beta") as (_, beta):
        nodes = {"coordinator": {"name": "this PC", "address": LOCAL}}
        for name, address in (("alpha", alpha), ("beta", beta)):
            with ControlClient(address, FleetAccess(key)) as client:
                nodes[client.status()["node"]["node_id"]] = {"name": name, "address": address}
        devices = [DeviceProfile(node, "CPU", 8 << 30, layer_ms=0.2, head_ms=1.0) for node in nodes]
        profile = {"model": ModelShape(**model_shape(load_manifest(whole[0]))).to_json(), "nodes": nodes,
                   "fleet": Fleet(devices=devices, rtt_ms={(a, b): 0.3 for a in nodes for b in nodes if a < b},
                                  coordinator="coordinator").to_json()}
        stages = [StageSpan(LOCAL, "CPU", 0, layers, rank=0), StageSpan(alpha, "CPU", 0, layers, rank=1)]
        deployment, chain = deploy(str(tiny_models["qwen2"]), stages, access=FleetAccess(key),
                                   shard=ShardOptions(weights="f32", mode="exact"))
        events: list[str] = []
        failover = Failover(deployment, profile, access=FleetAccess(key), on_event=events.append, chain=chain)
        service = ChatService(chain, scheduling=Scheduling(streams=1), rewind="trim", recover=failover.recover)
        try:
            assert isinstance(chain, RankChain)
            (worker,) = psutil.Process(alpha_proc.pid).children()
            killed = threading.Event()

            def kill_alpha(piece, tokens):
                if tokens >= 6 and not killed.is_set():
                    killed.set()
                    for proc in (worker, alpha_proc):
                        os.kill(proc.pid, signal.SIGKILL)

            got = reply(service, kill_alpha)
            assert killed.is_set() and got.error is None and got.rerouted == 1, (got.error, events)
            assert got.tokens == want
            assert any(e.startswith("node alpha lost") for e in events), events
            assert all(s.node != alpha for s in failover.deployment.placement)
            again = reply(service)  # the next request on the recovered chain
            assert again.tokens == want and again.rerouted == 0
        finally:
            service.close()
            failover.deployment.stop(FleetAccess(key))
