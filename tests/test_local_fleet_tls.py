"""Mutual TLS is on by default, with the certificate the fleet key gives (or the fleet's own
``fleet.pem``), and the local fleet speaks TLS as the caller's settings say, not as the saved
settings file does: with ``tls=True`` (the file saying ``tls: false``) its agent and workers speak
TLS and the chat and failover reach them with it; with ``tls=False`` (the file saying ``tls: true``)
everything stays plaintext; ``fleet bench tls`` runs both side by side.  Real agent and worker
processes, the tiny models."""

from __future__ import annotations

import dataclasses
import json
import socket
import ssl

import pytest
from fleet_support import fleet_up, greedy

from engine.config import FleetAccess, Settings
from engine.errors import FleetError
from engine.fleet.control import AgentError, ControlClient
from engine.fleet.demo import start_demo_fleet
from engine.fleet.agent import Agent
from engine.fleetkey import (TLS, access_of, create_certificate, create_key, key_certificate, load_key, load_tls,
                             tls_file)
from engine.runtime.stages.stage import core
from engine.session import Launch, open_chain

core()  # before any test starts a thread: creating an OpenVINO Core forks a child that hangs if threads run


@pytest.fixture
def fleet_home(tmp_path, monkeypatch):
    """A home with a fleet key (no certificate file: the key gives it); returns (home, key file)."""
    home = tmp_path / "home"
    monkeypatch.setenv("FLEETSHARD_HOME", str(home))
    return home, create_key(home / "config" / "fleet.key")


def _saved(home, **fields) -> None:
    (home / "config" / "settings.json").write_text(json.dumps(fields))


def _tls_handshake(address: str, key_path) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        try:
            with load_tls(True, key_path).client.wrap_socket(raw, server_hostname=host):
                return True
        except (ssl.SSLError, OSError):
            return False


def _agent_answers(address: str, key: bytes, tls) -> bool:
    try:
        with ControlClient(address, FleetAccess(key, tls), timeout_s=10) as agent:
            return bool(agent.status()["node"])
    except AgentError:
        return False


def _local_fleet(settings: Settings):
    opened = open_chain(settings, Launch())
    assert opened.kind == "local-fleet" and len(opened.deployment.placement) == 2
    return opened


@pytest.mark.parametrize("tls", [True, False])
def test_the_local_fleet_speaks_tls_as_the_callers_settings_say(fleet_home, tiny_models, tls):
    home, key_path = fleet_home
    _saved(home, tls=not tls)  # the saved file says the opposite; the settings object in hand decides
    settings = dataclasses.replace(Settings.load(), default_model=str(tiny_models["llama"]), stages=2,
                                   weights="f32", fleet_key_file=str(key_path), tls=tls)
    key, contexts = load_key(key_path), load_tls(tls, key_path)
    opened = _local_fleet(settings)
    try:
        tokens = greedy(opened.chain, 4)
        assert len(tokens) == 4
        agent = opened.deployment.placement[1].node
        assert _tls_handshake(agent, key_path) is tls
        assert _agent_answers(agent, key, contexts)  # as failover probes it
        assert not _agent_answers(agent, key, load_tls(not tls, key_path))
        # the worker too: the chat reopens the deployment with the same setting, and decodes the same
        again = opened.deployment.chain(FleetAccess(key, contexts), connect_timeout_s=30)
        try:
            assert greedy(again, 4) == tokens
        finally:
            again.close()
    finally:
        opened.close()


@pytest.mark.parametrize("tls", [True, False])
def test_demo_nodes_speak_tls_as_the_callers_settings_say(fleet_home, tls):
    home, key_path = fleet_home
    _saved(home, tls=not tls)
    with start_demo_fleet(access_of(key_path, tls=tls), 1) as fleet:
        (address,) = fleet.addresses
        assert _tls_handshake(address, key_path) is tls
        assert _agent_answers(address, load_key(key_path), load_tls(tls, key_path))


def test_fleet_up_tls_brings_the_local_fleet_up_over_tls(fleet_home, tiny_models, tmp_path):
    """`fleet up --tls --no-chat` with the saved settings saying no TLS: the deployment it leaves up
    answers over TLS (as its chat, given --tls, reaches it) and not in plaintext."""
    home, key_path = fleet_home
    _saved(home, tls=False, weights="f32")
    log = tmp_path / "up.log"
    with fleet_up(["--model", str(tiny_models["llama"]), "--local", "--no-chat", "--tls"], log) as (up, _, deployment):
        key = load_key(key_path)
        assert _tls_handshake(deployment.placement[1].node, key_path)
        chain = deployment.chain(FleetAccess(key, load_tls(True, key_path)), connect_timeout_s=30)
        try:
            assert len(greedy(chain, 4)) == 4
        finally:
            chain.close()
        with pytest.raises(FleetError):  # nor in plaintext
            deployment.chain(FleetAccess(key), connect_timeout_s=5).close()
        up.stdin.close()
        assert up.wait(timeout=60) == 0, log.read_text()[-2000:]


def test_the_saved_settings_saying_nothing_the_local_fleet_speaks_tls(fleet_home, tiny_models):
    """Secure by default: a settings file without ``tls`` (and no certificate file) gives a local
    fleet whose agent and workers answer over TLS only."""
    home, key_path = fleet_home
    _saved(home, default_model=str(tiny_models["llama"]), stages=2, weights="f32")
    settings = Settings.load()
    assert settings.tls
    opened = _local_fleet(settings)
    try:
        assert len(greedy(opened.chain, 4)) == 4
        agent = opened.deployment.placement[1].node
        assert _tls_handshake(agent, key_path)
        assert not _agent_answers(agent, load_key(key_path), None)  # nor in plaintext
    finally:
        opened.close()


def _agent(key_path, store, tls) -> Agent:
    return Agent("127.0.0.1:0", access=FleetAccess(load_key(key_path), tls, key_file=key_path), store=store,
                 advertise=False).start()


def test_every_copy_of_the_key_gives_the_same_certificate(tmp_path):
    """A machine holding a copy of the key (nothing else copied) reaches an agent over mutual TLS; a
    certificate from another key is refused in the TLS handshake, before the fleet key's proof."""
    here = create_key(tmp_path / "here" / "fleet.key")
    there = tmp_path / "there" / "fleet.key"
    there.parent.mkdir()
    there.write_bytes(here.read_bytes())
    there.chmod(0o600)
    other = create_key(tmp_path / "other" / "fleet.key")
    assert key_certificate(load_key(here)) == key_certificate(load_key(there))
    assert key_certificate(load_key(here)) != key_certificate(load_key(other))
    node = _agent(here, tmp_path / "store", load_tls(True, here))
    address = f"127.0.0.1:{node.port}"
    try:
        assert _agent_answers(address, load_key(there), load_tls(True, there))
        assert _tls_handshake(address, there)
        assert not _tls_handshake(address, other)  # the TLS layer itself refuses another fleet's certificate
        assert not _agent_answers(address, load_key(here), TLS.of_key(load_key(other)))
    finally:
        node.stop()


def test_a_certificate_file_of_the_fleets_own_takes_the_keys_place(fleet_home, tmp_path):
    """`fleet key init --tls`'s ``fleet.pem`` beside the key is the certificate in force: a peer using
    the one the key gives is refused."""
    _, key_path = fleet_home
    derived = TLS.of_key(load_key(key_path))
    create_certificate(tls_file(key_path))
    node = _agent(key_path, tmp_path / "store", load_tls(True, key_path))
    address = f"127.0.0.1:{node.port}"
    try:
        assert _agent_answers(address, load_key(key_path), load_tls(True, key_path))
        assert not _agent_answers(address, load_key(key_path), derived)
    finally:
        node.stop()


def test_the_tls_bench_runs_the_fleet_with_tls_and_without_side_by_side(tiny_exports, tmp_path):
    """``fleet bench tls`` (what TLS costs, on the benchmarks page) at its smallest: the fleet over TLS
    and the same fleet without it decode the same tokens, and the report holds the ratios the page
    quotes (their values are the bench's to measure on a quiet machine, not a test's)."""
    from engine.bench.tls import run_tls

    out = tmp_path / "tls.json"
    report = run_tls("tiny qwen2", shards=tiny_exports["qwen2", "2"].folders, tokens=8, prompt=32, warmup=0, runs=2,
                     out=out, log=lambda m: None)
    assert [(r["config"], r["tls"]) for r in report["rows"]] == [("TLS", True), ("plain", False)]
    assert all(r["same_tokens"] and len(r["decode_runs"]) == 2 for r in report["rows"]), report["rows"]
    ratios = report["ratios"]
    assert {"decode_tls_vs_plain", "prefill_tls_vs_plain", "cpu_per_token_tls_vs_plain"} <= set(ratios), ratios
    assert all(v > 0 for name, v in ratios.items() if "_vs_plain" in name), ratios
    assert json.loads(out.read_text())["ratios"] == ratios
