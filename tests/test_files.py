"""Shared files are saved whole and one writer at a time (``engine.files``); secrets, the settings (with
their MCP servers' tokens) and the chat history are private to their owner."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from engine.config import Settings
from engine.errors import FleetError
from engine.fleet.deploy import Deployment
from engine.fleetkey import api_key_file, create_key, load_api_key, load_key

posix_only = pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")

SAVER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from engine.config import Settings
    path, tag = Path(sys.argv[1]), sys.argv[2]
    for i in range(300):
        Settings(default_model=tag * (1 + i % 200), stages=1 + i % 7).save(path)
""")


def test_racing_saves_from_two_processes_always_leave_a_whole_settings_file(tmp_path):
    path = tmp_path / "settings.json"
    Settings().save(path)
    savers = [subprocess.Popen([sys.executable, "-c", SAVER, str(path), tag]) for tag in "ab"]
    reads = 0
    while any(p.poll() is None for p in savers):
        loaded = Settings.load(path)  # a half-written or empty file raises FleetError
        assert loaded.default_model == "smollm2-135m" or set(loaded.default_model) in ({"a"}, {"b"})
        reads += 1
    assert [p.wait() for p in savers] == [0, 0] and reads > 0
    assert set(Settings.load(path).default_model) in ({"a"}, {"b"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["settings.json", "settings.json.lock"]


@pytest.mark.parametrize("save", ["settings", "deployment"])
def test_a_crash_mid_save_leaves_the_old_file_intact(tmp_path, monkeypatch, save):
    path = tmp_path / f"{save}.json"
    if save == "settings":
        old, new = Settings(stages=3), Settings(stages=5)
    else:
        old = Deployment(model="m", stage0="s", device="CPU", remotes=["127.0.0.1:1"], workers=[])
        new = Deployment(model="other", stage0="s", device="CPU", remotes=[], workers=[])
    old.save(path)
    before = path.read_bytes()

    def crash(*args):
        raise OSError("power cut")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="power cut"):
        new.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []  # no temporary left behind


@posix_only
def test_a_key_file_others_can_read_is_refused_with_the_chmod_that_fixes_it(tmp_path):
    path = create_key(tmp_path / "fleet.key")
    assert len(load_key(path)) == 32
    for mode in (0o644, 0o640, 0o604):
        path.chmod(mode)
        with pytest.raises(FleetError, match=f"chmod 600 {path}"):
            load_key(path)
    path.chmod(0o600)
    assert len(load_key(path)) == 32


@posix_only
def test_an_api_key_file_others_can_read_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETSHARD_HOME", str(tmp_path))
    key = load_api_key(create=True)
    api_key_file().chmod(0o644)
    with pytest.raises(FleetError, match=f"chmod 600 {api_key_file()}"):
        load_api_key()
    api_key_file().chmod(0o600)
    assert load_api_key() == key


@posix_only
def test_the_chat_history_and_its_journal_are_private(tmp_path):
    from fleetgui.history import HistoryStore, Message

    store = HistoryStore(tmp_path / "history.sqlite")
    store.append(store.create("hello"), Message("user", "a private question"))
    files = [p for p in tmp_path.iterdir() if p.name.startswith("history.sqlite")]
    assert {p.name for p in files} >= {"history.sqlite", "history.sqlite-wal"}
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {p.name: "0o600" for p in files}
    store.close()
    # A history an older version left readable by others is made private when opened.
    (tmp_path / "history.sqlite").chmod(0o644)
    HistoryStore(tmp_path / "history.sqlite").close()
    assert (tmp_path / "history.sqlite").stat().st_mode & 0o777 == 0o600



@posix_only
def test_the_settings_with_mcp_tokens_are_private(tmp_path):
    folder = tmp_path / "config"
    folder.mkdir(mode=0o755)
    path = folder / "settings.json"
    path.write_text("{}")
    path.chmod(0o644)  # as an older version left them
    server = {"name": "tickets", "command": "tickets-mcp", "args": [], "env": {"TOKEN": "s3cret"}, "enabled": True}
    Settings(mcp_servers=[server]).save(path)
    assert Settings.load(path).mcp_servers[0]["env"] == {"TOKEN": "s3cret"}
    assert (oct(path.stat().st_mode & 0o777), oct(folder.stat().st_mode & 0o777)) == ("0o600", "0o700")
    path.unlink()
    Settings().save(path)  # a new file too
    assert oct(path.stat().st_mode & 0o777) == "0o600"
