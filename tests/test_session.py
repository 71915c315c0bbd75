"""The one home of each flow: which chain the settings and a launch open (``engine.session``), how the
command line becomes settings (``engine.cli.args``), and the one settings file the CLI and app share."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
from pathlib import Path

import pytest

from engine.cli.args import chain_args, launch_of, settings_of
from engine.cli.main import GROUPS, build_parser
from engine.config import (PREFILL_CHUNK, SERVICE_SETTINGS, Scheduling, Settings, forget_nodes, known_nodes,
                           remember_nodes, service_changes)
from engine.errors import FleetError
from engine.fleet.deploy import Deployment
from engine.fleetkey import create_key, fleet_access
from engine.session import Launch, chain_kind, open_chain, open_service


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETSHARD_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_chain_kind_follows_the_settings_and_the_launch(tmp_path, tiny_exports):
    shards = tiny_exports["llama", "2"].out
    deployment = Deployment(model="m", stage0=str(shards), device="CPU", remotes=["127.0.0.1:1"], workers=[])
    model = Settings()  # a catalog model, 2 stages, local workers
    assert chain_kind(model, Launch()) == "local-fleet"
    assert chain_kind(Settings(stages=1), Launch()) == "in-process"
    assert chain_kind(Settings(local_workers=False), Launch()) == "in-process"
    assert chain_kind(Settings(device="CPU,CPU"), Launch()) == "workers"  # a device per stage: worker processes
    assert chain_kind(Settings(default_model=str(shards)), Launch()) == "workers"  # an exported shard set
    assert chain_kind(model, Launch(workers="none")) == "in-process"
    assert chain_kind(model, Launch(workers="processes")) == "workers"
    assert chain_kind(model, Launch(remote=["127.0.0.1:1"])) == "remote"
    assert chain_kind(model, Launch(deployment=deployment)) == "deployment"
    with pytest.raises(FleetError, match="exclude each other"):
        chain_kind(model, Launch(remote=["127.0.0.1:1"], workers="processes"))


def test_an_in_process_service_over_a_shard_set(tiny_exports):
    settings = Settings(default_model=str(tiny_exports["llama", "2"].out), draft="lookup", k="3", streams=3,
                        local_workers=False)
    service = open_service(settings)
    try:
        assert service.description.endswith("2 parts, in process")
        assert service.k == 3 and len(service.drafters) == 3  # one drafter per stream
    finally:
        service.close()
    cancel = argparse.Namespace(is_set=lambda: True)
    assert open_chain(settings, progress=lambda _: None, cancel=cancel) is None  # cancelled before compiling


def test_the_command_line_lays_its_options_over_the_settings():
    parser = argparse.ArgumentParser()
    chain_args(parser)
    saved = Settings(default_model="saved", stages=3, mode="exact", draft="lookup", k="auto")
    args = parser.parse_args(["--model", "other", "--draft", "hybrid:small", "--k", "5", "--tls"])
    got = settings_of(args, saved)
    assert (got.default_model, got.stages, got.mode, got.tls) == ("other", 3, "exact", True)
    assert (got.draft, got.draft_model, got.k) == ("hybrid", "small", "5")
    assert settings_of(parser.parse_args([]), saved).draft == "none"  # the CLI drafts only when told
    assert settings_of(parser.parse_args(["--draft", "lookup"]), saved).draft == "lookup"
    assert settings_of(parser.parse_args(["--draft", "tiny-draft"]), saved).draft_model == "tiny-draft"
    assert launch_of(parser.parse_args([]), in_process=True).workers == "none"
    assert launch_of(parser.parse_args([]), in_process=False).workers is None  # as the settings say
    assert launch_of(parser.parse_args(["--local-workers"]), in_process=True).workers == "processes"
    with pytest.raises(FleetError, match="exclude each other"):
        launch_of(parser.parse_args(["--local-workers", "--remote", "a:1", "--shards", "x"]), in_process=True)


def test_one_settings_file_typed_and_refused_by_name_when_damaged(home):
    Settings(default_model="qwen2.5-coder-1.5b", streams=3).save()
    path = home / "config" / "settings.json"
    raw = json.loads(path.read_text())
    raw.update(stages="three", extra="kept out")  # a hand edit: a wrong type and an unknown field
    path.write_text(json.dumps(raw))
    loaded = Settings.load()
    assert (loaded.default_model, loaded.streams, loaded.stages) == ("qwen2.5-coder-1.5b", 3, Settings().stages)
    assert remember_nodes(["10.0.0.5:7390"], by_hand=True) == ["10.0.0.5:7390"]
    assert known_nodes(by_hand=True) == ["10.0.0.5:7390"] and Settings.load().streams == 3
    assert forget_nodes(["10.0.0.5:7390"]) == []
    path.write_text("{not json")
    with pytest.raises(FleetError, match="settings.json"):
        Settings.load()
    assert Settings(k="40").validate() == "K must be between 0 and 32, or auto"
    assert "2 devices for 3 stages" in Settings(device="CPU,GPU", stages=3).validate()


def test_an_older_settings_file_keeps_its_nodes_added_by_hand_and_its_known_nodes(home):
    """Older files kept the nodes added by hand in ``nodes`` and those from join codes and scans in
    ``known_nodes`` (addresses); both load as the one list of known nodes, and save as it."""
    path = home / "config" / "settings.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"nodes": ["10.0.0.5:7390", "10.0.0.7:7390"], "streams": 3,
                                "known_nodes": ["10.0.0.6:7390", "10.0.0.7:7390", 42, {"address": 1}]}))
    loaded = Settings.load()
    assert known_nodes(loaded) == ["10.0.0.5:7390", "10.0.0.7:7390", "10.0.0.6:7390"] and loaded.streams == 3
    assert known_nodes(loaded, by_hand=True) == ["10.0.0.5:7390", "10.0.0.7:7390"]  # in both: added by hand
    assert known_nodes(loaded, by_hand=False) == ["10.0.0.6:7390"]
    loaded.save()
    raw = json.loads(path.read_text())
    assert "nodes" not in raw and Settings.load().known_nodes == loaded.known_nodes
    assert remember_nodes(["10.0.0.5:7390"]) == ["10.0.0.7:7390", "10.0.0.6:7390", "10.0.0.5:7390"]
    assert known_nodes(by_hand=True) == ["10.0.0.7:7390", "10.0.0.5:7390"]  # still added by hand


def test_every_command_group_is_registered_and_loads_alone():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == {c for commands in GROUPS.values() for c in commands}
    for commands in GROUPS.values():
        alone = build_parser(commands[0])
        (only,) = [a for a in alone._actions if isinstance(a, argparse._SubParsersAction)]
        assert set(only.choices) == set(commands)


def test_the_stage_runners_and_the_chains_implement_their_declared_interfaces():
    from engine.runtime.interfaces import Chain, PackingStage, Stage
    from engine.runtime.relay.remote import RemoteChain
    from engine.runtime.stages.chain import LocalChain
    from engine.runtime.stages.paged import PagedStage
    from engine.runtime.stages.stage import StageRunner
    from engine.runtime.stages.static import StaticStage

    for cls, interface in ((StageRunner, Stage), (PagedStage, PackingStage), (StaticStage, PackingStage),
                           (LocalChain, Chain), (RemoteChain, Chain)):
        assert interface in cls.__mro__  # declared, not just alike
        declared = {name: member for proto in interface.__mro__ if proto in (Stage, PackingStage, Chain)
                    for name, member in vars(proto).items() if not name.startswith("_") and callable(member)
                    or isinstance(member, property)}
        missing = [name for name, member in declared.items() if inspect.getattr_static(cls, name) is member]
        assert not missing, f"{cls.__name__} inherits {missing} from {interface.__name__} instead of implementing it"


def _settings_read(path: Path, function: str | None = None) -> set[str]:
    """The fields of ``settings`` a module (or the functions of it of one name) reads, from its source."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    trees = [tree] if function is None else \
        [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function]
    return {n.attr for t in trees for n in ast.walk(t)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "settings"}


def test_the_settings_a_service_is_built_from_are_those_whose_change_needs_a_new_one():
    engine = Path(__file__).resolve().parent.parent / "engine"
    read = _settings_read(engine / "session.py") | _settings_read(engine / "fleetkey.py", "fleet_access") | \
        _settings_read(engine / "config.py", "of")  # ShardOptions.of, Scheduling.of
    read = {"k" if name == "k_value" else name for name in read}  # K as a number: the ``k`` field
    assert read == set(SERVICE_SETTINGS)
    before = Settings()
    assert service_changes(before, dataclasses.replace(before, streams=3, k="4")) == ["streams", "k"]
    assert service_changes(before, dataclasses.replace(before, deadline_s=5.0)) == ["deadline_s"]
    # per request (the reply's length), the API's own, or the deployment's (standbys): the service carries on
    assert service_changes(before, dataclasses.replace(before, max_new_tokens=9, api_port=9000, standbys=False)) == []


def test_the_scheduling_is_built_from_the_settings_with_their_defaults():
    assert Scheduling.of(Settings()) == Scheduling()  # one set of defaults
    scheduling = Scheduling.of(Settings(streams=3, k="5", draft="none", speculate_ahead=True))
    assert scheduling == Scheduling(streams=3, k=5, draft="none", speculate_ahead=True, prefill_chunk=PREFILL_CHUNK)
    assert Scheduling.of(Settings(k="auto")).k == "auto"


def test_the_fleet_access_is_built_once_from_the_settings(home, tmp_path):
    key_path = create_key(tmp_path / "fleet.key")
    access = fleet_access(Settings(fleet_key_file=str(key_path), tls=False, deadline_s=3.5))
    assert access.key == bytes.fromhex(key_path.read_text().strip())
    assert (access.tls, access.uses_tls, access.deadline_s) == (None, False, 3.5)
    assert fleet_access(Settings(fleet_key_file=str(key_path))).uses_tls  # TLS unless the settings say not
    assert access.key.hex() not in repr(access)  # a log line never shows the key
    with pytest.raises(FleetError, match="no fleet key"):  # a key file the settings name is never made
        fleet_access(Settings(fleet_key_file=str(tmp_path / "missing.key"), tls=False), create=True)
