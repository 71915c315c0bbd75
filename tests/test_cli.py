"""The ``fleet`` command as a user runs it: real subprocesses, clear errors, no tracebacks."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from engine.cli.args import reply_text


def fleet(*args):
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True, timeout=600)


def fleet_in(home, *args):
    """``fleet`` with its files under ``home`` (FLEETSHARD_HOME)."""
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "FLEETSHARD_HOME": str(home)})


def test_generate_streams_text_and_reports_speed(tiny_exports, tmp_path):
    out = tmp_path / "gen.json"
    proc = fleet("generate", "--shards", *map(str, tiny_exports["qwen2", "3"].folders), "--prompt", "Paris is",
                 "--max-new-tokens", "12", "--ignore-eos", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "tok/s" in proc.stderr and "first token" in proc.stderr
    (result,) = json.loads(out.read_text())
    assert result["new_tokens"] == 12 and len(result["tokens"]) == 12
    assert result["stopped_by"] == "max_tokens"
    assert proc.stdout.strip() == reply_text(result["text"]).strip()  # the JSON keeps the text as generated


def test_generate_accepts_an_export_folder(tiny_exports):
    proc = fleet("generate", "--shards", str(tiny_exports["llama", "2"].out), "--prompt", "hi", "--max-new-tokens", "3")
    assert proc.returncode == 0, proc.stderr


def test_bad_sources_give_specific_errors(tmp_path):
    proc = fleet("export", "--model", "no-such-model", "--stages", "2", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2
    assert "error:" in proc.stderr and "smollm2-135m" in proc.stderr and "Traceback" not in proc.stderr
    proc = fleet("generate", "--shards", str(tmp_path / "missing"), "--prompt", "hi")
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_bad_split_is_refused(tiny_models, tmp_path):
    proc = fleet("export", "--model", str(tiny_models["llama"]), "--split", "3,2", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2 and "not strictly increasing" in proc.stderr


def test_models_list_names_the_catalog():
    proc = fleet("models", "list")
    assert proc.returncode == 0
    for name in ("smollm2-135m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "gemma3-270m"):
        assert name in proc.stdout


def test_help_starts_where_a_new_user_starts():
    for args in (["--help"], []):  # a bare `fleet` shows the same help
        proc = fleet(*args)
        assert proc.returncode == 0, proc.stderr
        first = proc.stdout.splitlines()[0]
        assert first.startswith("Start here: fleet up (or fleet up --demo)"), proc.stdout[:300]
    up = fleet("up", "--help").stdout
    assert "--demo" in up and "--nodes" in up  # the options the first line names are real


def test_bare_models_lists_the_catalog_and_the_exported_models(tiny_exports, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(tiny_exports["llama", "2"].out, home / "cache" / "shards" / "tiny-llama-2")
    proc = fleet_in(home, "models")
    assert proc.returncode == 0, proc.stderr
    for name in ("smollm2-135m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "gemma3-270m"):
        assert name in proc.stdout
    (line,) = [x for x in proc.stdout.splitlines() if "tiny-llama-2" in x]
    assert "f32" in line and " 2 parts " in line, line
    assert proc.stdout == fleet_in(home, "models", "list").stdout  # `list` says the same


def test_gui_placeholder_window_builds(qtbot):
    from fleetgui.app import build_window

    window = build_window()
    qtbot.addWidget(window)
    window.show()
    assert window.windowTitle() == "fleetshard"


def test_runtime_path_needs_no_torch_transformers_or_nncf(tiny_exports):
    """A worker laptop serves shards with openvino, numpy and the tokenizer only."""
    code = (
        "import sys, numpy as np\n"
        "from engine.runtime.stages.chain import LocalChain\n"
        "from engine.runtime.decode.generate import Generator\n"
        "from engine.runtime.decode.tokenizer import ChatTokenizer\n"
        f"chain = LocalChain({[str(f) for f in tiny_exports['qwen2', '2'].folders]!r})\n"
        "ids = ChatTokenizer(chain.first_folder).prompt_ids('hello')\n"
        "Generator(chain, 64).generate(ids, 4, ignore_eos=True)\n"
        "print(sorted(m for m in ('torch', 'transformers', 'nncf', 'gguf', 'PySide6') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("args, wanted", [
    (("generate", "--max-new-tokens", "-3"), "a whole number of at least 1"),
    (("generate", "--streams", "0"), "a whole number of at least 1"),
    (("up", "--stages", "zero"), "a whole number of at least 1"),
    (("place", "--users", "0"), "a whole number of at least 1"),
    (("nodes", "--seconds", "-1"), "a number of 0 or more"),
    (("generate", "--delay-ms", "nan"), "a number of 0 or more"),
])
def test_counts_and_durations_are_checked_before_any_work(args, wanted):
    proc = fleet(*args)
    assert proc.returncode == 2 and f"argument {args[1]}: takes {wanted}, not '{args[2]}'" in proc.stderr, proc.stderr


def test_a_prompt_longer_than_the_context_is_refused_plainly(tiny_exports):
    proc = fleet("generate", "--shards", str(tiny_exports["llama", "2"].out), "--no-chat", "--prompt", "Paris " * 600)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert re.search(r"^error: the prompt \(\d+ tokens\) leaves no room in the context of 512$", proc.stderr, re.M)


def test_device_list_must_match_the_stages_and_this_machine(tiny_exports):
    proc = fleet("generate", "--shards", str(tiny_exports["llama", "2"].out), "--prompt", "hi",
                 "--device", "CPU,CPU,CPU")
    assert proc.returncode == 2 and "'CPU,CPU,CPU' names 3 devices for 2 stages" in proc.stderr
    proc = fleet("generate", "--shards", str(tiny_exports["llama", "2"].out), "--prompt", "hi", "--no-chat",
                 "--device", "CPU,XPU")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert re.search(r"^error: this PC has no OpenVINO device XPU: it has .*CPU", proc.stderr, re.M), proc.stderr


def test_local_workers_generate_the_in_process_tokens(tiny_exports, tmp_path):
    shards = str(tiny_exports["qwen2", "3"].out)
    args = ("generate", "--shards", shards, "--prompt", "Paris is", "--max-new-tokens", "10", "--ignore-eos",
            "--no-chat", "--fleet-key-file", str(tmp_path / "fleet.key"))
    proc = fleet("key", "init", "--fleet-key-file", str(tmp_path / "fleet.key"))
    assert proc.returncode == 0 and "fleet key written" in proc.stdout
    assert (tmp_path / "fleet.key").stat().st_mode & 0o077 == 0  # readable by its owner only
    local = fleet(*args, "--json", str(tmp_path / "local.json"))
    remote = fleet(*args, "--local-workers", "--json", str(tmp_path / "remote.json"))
    assert local.returncode == 0 and remote.returncode == 0, remote.stderr
    (a,), (b,) = (json.loads((tmp_path / f).read_text()) for f in ("local.json", "remote.json"))
    assert a["tokens"] == b["tokens"] and len(b["tokens"]) == 10
    assert len(b["breakdown"]["stage_compute_ms"]) == 3 and b["breakdown"]["network_ms"] > 0


def test_worker_errors_are_specific(tiny_exports, tmp_path):
    stage1 = str(tiny_exports["llama", "2"].folders[1])
    proc = fleet("worker", "--shard", stage1, "--listen", "127.0.0.1:0", "--fleet-key-file", str(tmp_path / "none"))
    assert proc.returncode == 2 and "no fleet key at" in proc.stderr and "fleet key init" in proc.stderr
    (tmp_path / "bad.key").write_text("not hex")
    proc = fleet("worker", "--shard", stage1, "--listen", "127.0.0.1:0", "--fleet-key-file", str(tmp_path / "bad.key"))
    assert proc.returncode == 2 and "does not hold hex digits" in proc.stderr
    proc = fleet("key", "init", "--fleet-key-file", str(tmp_path / "k"))
    proc = fleet("worker", "--shard", stage1, "--listen", "nonsense", "--fleet-key-file", str(tmp_path / "k"))
    assert proc.returncode == 2 and "'nonsense' is not HOST:PORT" in proc.stderr
    proc = fleet("generate", "--shards", stage1, "--remote", "127.0.0.1:1", "--fleet-key-file", str(tmp_path / "k"),
                 "--prompt", "hi")
    assert proc.returncode == 2 and "the coordinator runs stage 0" in proc.stderr
    proc = fleet("worker", "--shard", stage1, "--listen", "127.0.0.1:0", "--fleet-key-file", str(tmp_path / "k"),
                 "--cpus", "0-x")
    assert proc.returncode == 2 and "'0-x' is not a CPU list" in proc.stderr
    proc = fleet("worker", "--shard", stage1, "--listen", "127.0.0.1:0", "--fleet-key-file", str(tmp_path / "k"),
                 "--cpus", "4096")
    assert proc.returncode == 2 and "CPUs [4096] are not available here" in proc.stderr


def test_profiling_nodes_without_the_fleets_key_says_so_and_makes_none(tmp_path):
    """`fleet profile --nodes` needs the fleet's own key (its nodes refuse any other): a key file the
    settings name that does not exist is refused by name before any node is asked, and is not made;
    without a named file the default key is not made either (a new key would not be the fleet's)."""
    from engine.config import Settings

    home, missing = tmp_path / "home", tmp_path / "keys" / "fleet.key"
    Settings(fleet_key_file=str(missing)).save(home / "config" / "settings.json")
    proc = fleet_in(home, "profile", "--nodes", "127.0.0.1:9")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: profiling the fleet's nodes needs the fleet's key: "), proc.stderr
    assert f"no fleet key at {missing}, the key file the settings" in proc.stderr
    assert f"fleet key init --fleet-key-file {missing}" in proc.stderr and not missing.exists()
    bare = tmp_path / "bare"
    proc = fleet_in(bare, "profile", "--nodes", "127.0.0.1:9")
    assert proc.returncode == 2 and "needs the fleet's key: no fleet key at " in proc.stderr, proc.stderr
    assert not (bare / "config" / "fleet.key").exists()


def test_fleet_up_on_nodes_without_the_fleets_key_says_so_and_makes_none(tmp_path):
    """`fleet up --nodes` needs the fleet's own key too: without one it says so, and makes none."""
    bare = tmp_path / "bare"
    proc = fleet_in(bare, "up", "--nodes", "127.0.0.1:9")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    said = "error: placing the model on the fleet's nodes needs the fleet's key: no fleet key at "
    assert proc.stderr.startswith(said), proc.stderr
    assert not (bare / "config" / "fleet.key").exists()


def test_pinning_restricts_the_process_to_the_cpus(tiny_exports, tmp_path):
    """What ``fleet bench --cpus`` does for each stage.  (OpenVINO 2026.4 dies with SIGFPE when pinned
    to a single CPU on this 2-vCPU VM, so the pinned process here does not load OpenVINO.)"""
    from engine.config import FleetAccess
    from engine.runtime.relay.local_workers import LocalWorkers

    cpu = max(os.sched_getaffinity(0))
    probe = subprocess.run([sys.executable, "-c", "import os; from engine.runtime.relay.affinity import pin; "
                            f"pin('{cpu}'); print(sorted(os.sched_getaffinity(0)))"],
                           capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == f"[{cpu}]", probe.stderr
    access = FleetAccess(bytes(16), key_file=tmp_path / "k")
    local = LocalWorkers(tiny_exports["llama", "2"].folders[1:], access, log_dir=tmp_path, cpu_sets=["0-1"])
    assert local.arguments(0)[-2:] == ["--cpus", "0-1"]


def test_local_workers_hand_their_workers_the_shard_and_relay_options(tmp_path, monkeypatch):
    """A local fleet's worker processes are told its shard options, each worker its own device, and its
    relay's heartbeat; `fleet worker` reads back what it was given."""
    import argparse
    import dataclasses

    from engine.cli import worker
    from engine.cli.args import settings_of
    from engine.config import DEVICE, MODE, FleetAccess, RelayOptions, ShardOptions
    from engine.errors import ShardError
    from engine.runtime.relay.local_workers import LocalWorkers

    monkeypatch.setenv("FLEETSHARD_HOME", str(tmp_path / "home"))  # no saved settings: the defaults
    parser = argparse.ArgumentParser()
    worker.add_commands(parser.add_subparsers())
    access = FleetAccess(bytes(16), key_file=tmp_path / "k")
    folders = [tmp_path / "stage1", tmp_path / "stage2"]
    shard, relay = ShardOptions(mode="exact", precision="bf16", device="CPU,GPU.1"), RelayOptions(heartbeat_s=0.05)
    local = LocalWorkers(folders, access, shard=shard, relay=relay, log_dir=tmp_path)
    for i, device in enumerate(["CPU", "GPU.1"]):
        args = parser.parse_args(local.arguments(i))
        told = ShardOptions.of(settings_of(args), args.precision)
        assert dataclasses.replace(told, weights=shard.weights) == dataclasses.replace(shard, device=device)
        assert RelayOptions(heartbeat_s=args.heartbeat) == relay
    default = parser.parse_args(LocalWorkers(folders, access, log_dir=tmp_path).arguments(0))
    assert (default.device, default.mode, default.precision, default.heartbeat) == \
        (DEVICE, MODE, None, RelayOptions().heartbeat_s)
    with pytest.raises(ShardError, match="names 3 devices for 2 stages"):
        LocalWorkers(folders, access, shard=ShardOptions(device="CPU,GPU,NPU"), log_dir=tmp_path)
    with pytest.raises(SystemExit):
        parser.parse_args(["worker", "--shard", "s", "--listen", "127.0.0.1:0", "--heartbeat", "0"])


def test_a_nodes_name_with_terminal_escapes_prints_without_them(tmp_path):
    from engine.fleet.agent import Agent
    from engine.fleetkey import access_of, create_key

    name = "evil\x1b[2J\x1b]0;owned\x07node\x9b31m"  # clear the screen, retitle the terminal, a C1 CSI
    key_file = create_key(tmp_path / "fleet.key")
    node = Agent("127.0.0.1:0", access=access_of(key_file), name=name, store=tmp_path / "store", advertise=False,
                 log=lambda line: None).start()
    home = tmp_path / "home"
    (home / "config").mkdir(parents=True)
    (home / "config" / "settings.json").write_text(json.dumps({"nodes": [node.address], "tls": False}))
    try:
        proc = subprocess.run([sys.executable, "-m", "engine.cli", "nodes", "--seconds", "0", "--fleet-key-file",
                               str(key_file)], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "FLEETSHARD_HOME": str(home)})
    finally:
        node.stop()
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if node.address in line)
    assert row.startswith("evil[2J]0;ownednode31m ") and "idle" in row, proc.stdout
    assert not any(c in proc.stdout + proc.stderr for c in "\x1b\x07\x9b")


def test_generate_prints_a_clean_reply(capsys):
    """`fleet generate` shows the reply, not what would act on the terminal: an escape sequence, a bell
    and a carriage return in the model's text go, its line breaks and tabs stay (it used to print each
    piece as generated); and the reply's end held back for an incomplete character is printed too."""
    from types import SimpleNamespace

    from engine.cli.generate import _generator_reply

    pieces = {1: "Hi", 2: "\x1b]0;owned\x07\x1b[2J", 3: " there\tok\r\n", 4: "é"}

    class Tokenizer:
        def prompt_ids(self, prompt, system=None, chat=True):
            return [0]

        def decode(self, ids):
            text = "".join(pieces[i] for i in ids)
            return text[:-1] + "\ufffd" if ids and ids[-1] == 4 else text  # the last character incomplete

    class Gen:
        def generate(self, ids, max_new_tokens, *, on_token, **kw):
            for token in pieces:
                on_token(token)
            return SimpleNamespace(tokens=list(pieces), drafted=0, acceptance=0.0, decode_tok_s=1.0, ttft_s=0.1,
                                   stopped_by="max_tokens", to_json=dict)

    args = SimpleNamespace(system=None, no_chat=False, ignore_eos=False, sampling=None)
    reply = _generator_reply(args, SimpleNamespace(max_new_tokens=4), Tokenizer(), Gen(), None)
    reply("hello")
    assert capsys.readouterr().out == "Hi]0;owned[2J there\tok\n\ufffd\n"


def test_fleet_up_names_the_nodes_it_found_without_their_terminal_escapes(tmp_path, monkeypatch, capsys):
    """`fleet up` says which nodes of the fleet it found over mDNS: their names come off the network."""
    from types import SimpleNamespace

    import engine.cli.fleet as fleet_cli
    from engine.cli.main import main
    from engine.errors import FleetError

    name = "evil\x1b[2J\x1b]0;owned\x07node\x9b31m"  # clear the screen, retitle the terminal, a C1 CSI
    monkeypatch.setenv("FLEETSHARD_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(fleet_cli, "browse", lambda seconds, fleet: [SimpleNamespace(name=name)])

    def local_up(*args, **kwargs):
        raise FleetError("the local fleet is not needed here")

    monkeypatch.setattr(fleet_cli, "local_up", local_up)
    assert main(["up"]) == 2
    said = capsys.readouterr().err
    assert "found 1 node(s) of this fleet: evil[2J]0;ownednode31m. `fleet up` runs" in said, said
    assert not any(c in said for c in "\x1b\x07\x9b"), said
