"""Worker mode (``fleetgui --worker``) in its window fallback (offscreen has no system tray): the
in-process agent is found over real mDNS, Pause shows as paused in the agent's own status and in its
advertisement, Remove unused shards frees the store, "Start with the session" writes and removes the
autostart entry, and Quit makes the browser report the node removed (a clean departure: goodbye
sent, control port closed)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from gui_support import screenshot

from engine.config import FleetAccess
from engine.runtime.stages.stage import core

core()  # before any test starts a thread: creating an OpenVINO Core forks a child that hangs if threads run


@pytest.fixture
def key_file(gui_home):
    from engine.fleetkey import create_key

    return create_key(gui_home / "keys" / "fleet.key")


def test_worker_window_serves_pauses_and_leaves_cleanly(qtbot, gui_home, key_file, tmp_path, monkeypatch,
                                                         tiny_exports):
    from PySide6.QtWidgets import QSystemTrayIcon

    from engine.fleet.control import AgentError, ControlClient
    from engine.fleet.discovery import Browser
    from engine.fleetkey import fleet_id, load_key
    from fleetgui import autostart, theme
    from fleetgui.tray import WorkerWindow, build_worker

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    key = load_key(key_file)
    assert not QSystemTrayIcon.isSystemTrayAvailable()  # offscreen: the window stands in for the tray
    events, lock = [], threading.Lock()

    def seen(kind, info):
        with lock:
            events.append((kind, info.name, info.status))

    def kinds():
        with lock:
            return [(k, s) for k, n, s in events if n == "tray-node"]

    with Browser(fleet_id(key), on_event=seen):
        controller, window = build_worker(key_file, listen="127.0.0.1:0", name="tray-node",
                                          store=gui_home / "store", poll_ms=200)
        qtbot.addWidget(window)
        assert isinstance(window, WorkerWindow) and window.isVisible()
        assert controller.running, window.banner.message
        address = controller.agent.address
        qtbot.waitUntil(lambda: ("added", "idle") in kinds(), timeout=30000)
        assert window.status.text().startswith("idle") and "tray-node" in window.identity.text()

        window.pause_button.click()
        qtbot.waitUntil(lambda: window.pause_button.text() == "Resume serving", timeout=10000)
        with ControlClient(address, FleetAccess(key)) as agent:
            status = agent.status()
        assert status["paused"] is True and status["state"] == "paused"
        assert window.status.text().startswith("paused") and "paused" in window.activity.toPlainText()
        qtbot.waitUntil(lambda: ("updated", "paused") in kinds(), timeout=15000)  # the advertisement follows
        with ControlClient(address, FleetAccess(key)) as agent, pytest.raises(AgentError, match="paused"):
            agent.start_worker("0" * 64)
        theme.apply("light")
        screenshot(window, "tray")

        entry = autostart.desktop_entry_path()
        assert entry == tmp_path / "xdg" / "autostart" / "fleetshard-worker.desktop" and not entry.exists()
        window.autostart.setChecked(True)
        text = entry.read_text()
        assert "[Desktop Entry]" in text and "--worker" in text.split("Exec=", 1)[1].splitlines()[0]
        window.autostart.setChecked(False)
        assert not entry.exists()

        window.pause_button.click()  # resume
        qtbot.waitUntil(lambda: window.pause_button.text() == "Pause serving", timeout=10000)
        with ControlClient(address, FleetAccess(key)) as agent:
            assert agent.status()["paused"] is False

        # Remove unused shards: a shard sent but not served goes, and the window says so
        assert not window.prune_button.isEnabled()  # nothing to remove
        with ControlClient(address, FleetAccess(key)) as agent:
            agent.send_shard(tiny_exports["llama", "2"].folders[1])
        qtbot.waitUntil(lambda: window.prune_button.isEnabled() and "layers 2-3" in window.shards.text(),
                        timeout=10000)
        window.prune_button.click()
        qtbot.waitUntil(lambda: window.shards.text() == "none", timeout=10000)
        assert "removed 1 shard(s) not in use" in window.activity.toPlainText()
        with ControlClient(address, FleetAccess(key)) as agent:
            assert agent.status()["shards"] == []

        with qtbot.waitSignal(controller.stopped, timeout=30000):
            window.quit_button.click()
        qtbot.waitUntil(lambda: kinds() and kinds()[-1][0] == "removed", timeout=15000)
        assert not window.isVisible()
        with pytest.raises(AgentError, match="not reachable"):
            ControlClient(address, FleetAccess(key), timeout_s=2)


def test_worker_without_a_key_says_so_and_starts_once_given_one(qtbot, gui_home, key_file):
    from fleetgui.tray import build_worker

    controller, window = build_worker(gui_home / "missing.key", listen="127.0.0.1:0", name="keyless",
                                      advertise=False)
    qtbot.addWidget(window)
    assert controller.agent is None
    assert "no fleet key" in window.banner.message and "missing.key" in window.banner.message
    assert window.key_button.isVisible() and not window.pause_button.isEnabled()
    window.choose_key(key_file)
    assert controller.running and "idle" in window.status.text()
    with qtbot.waitSignal(controller.stopped, timeout=30000):
        window.close()  # closing the window quits cleanly too
    assert controller.agent is None


def test_desktop_entry_quotes_its_command():
    from fleetgui.autostart import desktop_entry, desktop_exec

    assert desktop_exec(["/usr/bin/fleetgui", "--worker"]) == "/usr/bin/fleetgui --worker"
    assert desktop_exec(["my env/py", "-m", "fleetgui.app"]) == '"my env/py" -m fleetgui.app'
    assert desktop_exec(['/x/$"q"', "50%"]) == r'"/x/\\$\\"q\\"" 50%%'
    assert "Exec=/opt/fleetgui --worker" in desktop_entry(["/opt/fleetgui", "--worker"])


def test_autostart_starts_the_worker_of_this_installation(monkeypatch, tmp_path):
    """The installed `fleetgui` script beside this Python, or a bundled app's own executable."""
    import sys

    from fleetgui import autostart

    command = autostart.worker_command()
    assert command[-1] == "--worker"
    assert "fleetgui" in command[0] or command[1:] == ["-m", "fleetgui.app", "--worker"], command
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "fleetshard"))
    assert autostart.worker_command() == [str(tmp_path / "fleetshard"), "--worker"]


def test_tray_menu_and_live_activity(qtbot, gui_home, key_file, tiny_exports):
    """The tray icon's menu (built and driven for real; offscreen shows no icon) and the window's
    Activity: control connections, a stage started and its worker's own log lines appear live, with
    their tally, in both front ends."""
    from engine.fleet.control import ControlClient
    from engine.fleetkey import load_key
    from engine.runtime.relay.remote import RemoteChain
    from fleetgui.tray import WorkerController, WorkerTray, WorkerWindow

    controller = WorkerController(key_file, listen="127.0.0.1:0", name="tray-menu", advertise=False,
                                  store=gui_home / "store", poll_ms=200)
    tray = WorkerTray(controller)
    window = WorkerWindow(controller)
    qtbot.addWidget(window)
    assert controller.start()
    menu = [a.text() for a in tray.menu.actions() if not a.isSeparator()]
    assert menu[0].startswith("Status: idle") and "Pause serving" in menu and "Quit" in menu
    assert tray.tally_action.text() == "Activity: 0 connections · 0 parts started · 0 tokens served · 0 errors"

    key = load_key(key_file)
    with ControlClient(controller.agent.address, FleetAccess(key)) as agent:
        digest, _ = agent.send_shard(tiny_exports["llama", "2"].folders[1])
        worker = agent.start_worker(digest)
    qtbot.waitUntil(lambda: "part 2 of 2: stage 1 of 2" in window.activity.toPlainText(), timeout=60000)
    assert "started worker" in window.activity.toPlainText()
    qtbot.waitUntil(lambda: "1 part started" in tray.tally_action.text(), timeout=10000)
    chain = RemoteChain(tiny_exports["llama", "2"].folders[0], [worker["address"]],
                        access=FleetAccess(key))  # a coordinator
    try:
        qtbot.waitUntil(lambda: "part 2 of 2: serving upstream" in window.activity.toPlainText(), timeout=30000)
        chain.forward(np.array([[3, 5, 7, 9, 11]]), np.ones((1, 5), np.int64), np.arange(5)[None])  # a prompt
        chain.forward(np.array([[13]]), np.ones((1, 6), np.int64), np.array([[5]]))  # and one decode step
    finally:
        chain.close()
    # counted while serving and as the chain leaves: the five prompt positions and the one step forwarded
    qtbot.waitUntil(lambda: controller.counts["tokens"] == 6, timeout=10000)
    qtbot.waitUntil(lambda: "6 tokens served" in tray.tally_action.text(), timeout=10000)
    qtbot.waitUntil(lambda: controller.counts["connections"] >= 1 and "0 connections" not in tray.tally_action.text(),
                    timeout=10000)
    assert window.tally.text() == controller.tally()
    assert controller.counts["errors"] == 0  # the coordinator leaving ("upstream … left") is no error
    # a client that drops its connection without a goodbye has left too; a refused handshake or a
    # next stage lost is an error
    controller._log("stage 1: upstream 127.0.0.1:5 gone: 127.0.0.1:5 closed the connection")
    controller._log("control connection from 127.0.0.1:6 ended: 127.0.0.1:6 closed the connection")
    assert controller.counts["errors"] == 0
    controller._log("stage 1: refused connection from 127.0.0.1:7: the peer's proof does not match the fleet key")
    controller._log("stage 1: next stage 127.0.0.1:8: connection lost")
    assert controller.counts["errors"] == 2 and "2 errors" in controller.tally()
    assert tray.stage_action.isVisible() and "part 2 of 2" in tray.stage_action.text()

    tray.pause_action.trigger()  # the menu drives the agent
    qtbot.waitUntil(lambda: tray.pause_action.text() == "Resume serving", timeout=20000)
    assert tray.status_action.text().startswith("Status: paused")
    qtbot.waitUntil(lambda: "part 2 of 2: worker" in window.activity.toPlainText() and
                    "stopped" in window.activity.toPlainText(), timeout=10000)  # pausing stopped its worker
    with qtbot.waitSignal(controller.stopped, timeout=30000):
        tray.quit_action.trigger()
    assert controller.agent is None


def test_a_stage_exported_twice_is_one_shard_on_the_worker(qtbot, gui_home, key_file, tiny_models, tmp_path):
    """A profile exports a split's last stage alone, a deployment of that split exports the whole
    split: the same stage both times, so the same shard, held and listed once (it used to differ by
    the export's own timing in its manifest, and the worker listed it twice)."""
    from engine.export.exporter import export_model
    from engine.fleet.control import ControlClient
    from engine.fleet.shardstore import content_hash
    from engine.fleetkey import load_key
    from fleetgui.tray import WorkerController, WorkerWindow

    out = tmp_path / "export"
    alone = export_model(str(tiny_models["qwen2"]), split=[3], only=[1], weights="f32", out=out).folders[0]
    first = content_hash(alone)
    sent = []
    controller = WorkerController(key_file, listen="127.0.0.1:0", name="twice", advertise=False,
                                  store=gui_home / "store", poll_ms=200)
    window = WorkerWindow(controller)
    qtbot.addWidget(window)
    assert controller.start()
    with ControlClient(controller.agent.address, FleetAccess(load_key(key_file))) as agent:
        sent.append(agent.send_shard(alone)[0])
        whole = export_model(str(tiny_models["qwen2"]), split=[3], weights="f32", out=out)  # stage 0 is new
        assert content_hash(whole.folders[1]) == first
        sent.append(agent.send_shard(whole.folders[1])[0])
    assert sent == [first, first]
    window.refresh()
    assert len(controller.shards()) == 1 and window.shards.text().count("qwen2 part 2 of 2") == 1, window.shards.text()
    with qtbot.waitSignal(controller.stopped, timeout=30000):
        controller.quit()
