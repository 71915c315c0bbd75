"""Tensor-parallel ranks: a tiny model split into two ranks over real loopback sockets gives the
logits of the whole model, and a missing, foreign or dead rank fails with a clear error."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from engine.errors import ExportError, ShardError
from engine.export.exporter import export_model, rank_folder
from engine.fleetkey import create_key, load_key
from engine.manifest import load_manifest
from engine.runtime.relay.ranks import RankChain
from engine.runtime.stages.chain import LocalChain
from engine.transport.mesh import Mesh, MeshError
from engine.runtime.stages.stage import StageRunner, compile_config

KEY = b"k" * 32
EXACT = compile_config("exact")


@pytest.fixture(scope="module")
def tp_exports(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {arch: export_model(str(tiny_models[arch]), weights="f32", ranks=2, out=root / arch)
            for arch in ("llama", "qwen2", "gemma3")}


def _mesh_pair(fingerprint: str, key: bytes = KEY) -> tuple[Mesh, Mesh]:
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    got = {}
    server = threading.Thread(target=lambda: got.update(m=Mesh.serve(listener, KEY, fingerprint, 2, timeout_s=10)))
    server.start()
    try:
        joined = Mesh.join(address, key, fingerprint, 1, 2, timeout_s=10)
    finally:
        server.join()
        listener.close()
    return got["m"], joined


def _both(fn0, fn1):
    """Runs the two ranks' calls at once (as two PCs would); returns rank 0's result."""
    out, errors = {}, []

    def run(i, fn):
        try:
            out[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in ((0, fn0), (1, fn1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out[0], out[1]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_two_ranks_give_the_whole_models_logits(arch, tp_exports, tiny_exports):
    out = tp_exports[arch].out
    m0, m1 = load_manifest(rank_folder(out, 0)), load_manifest(rank_folder(out, 1))
    assert (m0.rank, m0.ranks, m1.rank, m1.ranks) == (0, 2, 1, 2)
    whole = StageRunner(tiny_exports[arch, "1"].folders[0], config=EXACT)
    mesh0, mesh1 = _mesh_pair(m0.fingerprint)
    try:
        rank0 = StageRunner(rank_folder(out, 0), config=EXACT, mesh=mesh0)
        rank1 = StageRunner(rank_folder(out, 1), config=EXACT, mesh=mesh1)
        ids = np.array([[5, 17, 42, 99, 7, 250, 31]], dtype=np.int64)
        tokens = []
        for step in range(4):
            n = ids.shape[1] if step == 0 else 1
            x = ids if step == 0 else np.array([[tokens[-1]]], dtype=np.int64)
            total = ids.shape[1] + step
            mask = np.ones((1, total), dtype=np.int64)
            pos = np.arange(total - n, total, dtype=np.int64)[None]
            expected = whole.forward(x, mask, pos).copy()
            got0, got1 = _both(lambda: rank0.forward(x, mask, pos).copy(), lambda: rank1.forward(x, mask, pos).copy())
            assert got0.shape == expected.shape
            np.testing.assert_allclose(got0, expected, atol=2e-4, rtol=1e-4)
            np.testing.assert_array_equal(got0, got1)  # sums in rank order: both ranks hold the same
            tokens.append(int(expected[0, -1].argmax()))
        assert mesh0.exchanges == mesh1.exchanges > 0
    finally:
        mesh0.close()
        mesh1.close()


def test_a_rank_needs_its_mesh(tp_exports):
    with pytest.raises(ShardError, match="tensor-parallel rank 1 of 2"):
        StageRunner(rank_folder(tp_exports["qwen2"].out, 1), config=EXACT)


def test_a_rank_without_the_fleet_key_is_refused(tp_exports):
    fingerprint = load_manifest(rank_folder(tp_exports["qwen2"].out, 0)).fingerprint
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    result = {}

    def serve():
        try:
            Mesh.serve(listener, KEY, fingerprint, 2, timeout_s=3)
        except MeshError as exc:
            result["error"] = str(exc)

    server = threading.Thread(target=serve)
    server.start()
    with pytest.raises(MeshError, match="refused rank 1"):
        Mesh.join(address, b"x" * 32, fingerprint, 1, 2, timeout_s=3)
    server.join()
    listener.close()
    assert "did not connect" in result["error"]


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_worker_process_serves_rank_1_for_the_coordinators_rank_0(tp_exports, tiny_exports, tmp_path):
    """Rank 1 in a `fleet worker --mesh` process, rank 0 here: greedy steps, a rewind and a reset
    give the tokens of the whole model."""
    out = tp_exports["llama"].out
    key_file = create_key(tmp_path / "fleet.key")
    mesh, listen = f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"
    worker = subprocess.Popen([sys.executable, "-m", "engine.cli", "worker", "--shard", str(rank_folder(out, 1)),
                               "--listen", listen, "--mesh", mesh, "--fleet-key-file", str(key_file),
                               "--mode", "exact"], stderr=subprocess.PIPE, text=True)
    whole = LocalChain(tiny_exports["llama", "1"].folders, config=EXACT)
    chain = None
    try:
        chain = RankChain(rank_folder(out, 0), mesh, [listen], key=load_key(key_file), mode="exact",
                          connect_timeout_s=120)

        def steps(c, prompt, n):
            ids, tokens = list(prompt), []
            c.reset(0)
            out_ = c.forward(np.array([ids]), np.ones((1, len(ids)), np.int64), np.arange(len(ids))[None])
            for _ in range(n):
                tokens.append(int(out_.tokens.reshape(-1)[-1]))
                ids.append(tokens[-1])
                out_ = c.forward(np.array([[ids[-1]]]), np.ones((1, len(ids)), np.int64),
                                 np.array([[len(ids) - 1]]))
            return tokens

        assert steps(chain, [5, 17, 42, 99], 6) == steps(whole, [5, 17, 42, 99], 6)
        assert steps(chain, [9, 8, 7], 4) == steps(whole, [9, 8, 7], 4)  # a reset between requests
        # a rewind: keep 5 slots of the cache, then go on from there on both
        for c in (chain, whole):
            c.keep(0, np.arange(5, dtype=np.int32))
        ids = np.array([[11]])
        mask, pos = np.ones((1, 6), np.int64), np.array([[5]])
        assert chain.forward(ids, mask, pos).tokens.tolist() == whole.forward(ids, mask, pos).tokens.tolist()
    finally:
        if chain is not None:
            chain.close()
        worker.terminate()
        worker.wait(30)


def test_fleet_generate_runs_rank_0_with_remote_ranks(tp_exports, tiny_exports, tmp_path):
    """`fleet generate --shards rank0 --remote W --mesh M` against the whole model, greedy, exact mode."""
    out = tp_exports["qwen2"].out
    key_file = create_key(tmp_path / "fleet.key")
    mesh, listen = f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"
    worker = subprocess.Popen([sys.executable, "-m", "engine.cli", "worker", "--shard", str(rank_folder(out, 1)),
                               "--listen", listen, "--mesh", mesh, "--fleet-key-file", str(key_file),
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
        ranks = generate(str(rank_folder(out, 0)), "--remote", listen, "--mesh", mesh, name="ranks.json")
    finally:
        worker.terminate()
        worker.wait(30)
    assert ranks == whole and len(whole) == 8
