"""The Fleet view over real agent processes on loopback: an agent advertised over real mDNS is
listed, one added by address (through the validating dialog) shows its status, pausing and losing a
node show as such, round trips are measured into the matrix, a node that leaves drops out, and the
fleet key can be made and chosen (private to its owner)."""

from __future__ import annotations

import os
import stat

import pytest
from fleet_support import agent_process
from gui_support import open_window, settings_store, tiny_settings

from engine.hostcpu import int8_dot
from engine.runtime.stages.stage import core

core()  # before any test starts a thread: creating an OpenVINO Core forks a child that hangs if threads run


@pytest.fixture
def key_file(gui_home):
    from engine.fleetkey import create_key

    return create_key(gui_home / "keys" / "fleet.key")


def test_discovered_and_added_nodes_with_status_and_round_trips(qtbot, gui_home, key_file, tmp_path):
    from PySide6.QtWidgets import QDialogButtonBox

    from engine.config import FleetAccess
    from engine.fleet.control import ControlClient
    from engine.fleetkey import load_key, load_tls
    from fleetgui.fleet_view import added_nodes

    key, tls = load_key(key_file), load_tls(True, key_file)  # the agents speak TLS, the app's default
    with agent_process(key_file, tmp_path / "m", mdns=True, name="mdns-node", tls=True) as (mdns_proc, mdns_address), \
            agent_process(key_file, tmp_path / "s", name="static-node", tls=True) as (static_proc, static_address):
        window = open_window(qtbot, tiny_settings(tmp_path / "none", fleet_key_file=str(key_file)),
                             settings_store(tmp_path / "s.ini"))
        view = window.show_view("Fleet")
        view.timer.setInterval(500)
        assert view.key.fleet_id and str(key_file) in view.key_label.text()

        qtbot.waitUntil(lambda: view.model.row("mdns-node") is not None, timeout=30000)
        found = view.model.row("mdns-node")
        assert found.mdns and not found.added and found.address == mdns_address
        assert view.model.row("static-node") is None  # not advertised, not added yet
        view.add_node(mdns_address)  # found both ways: one row
        assert len(view.model.node_rows()) == 1 and view.model.row("mdns-node").found_by == "mDNS + by hand"
        view.remove_node(mdns_address)
        assert len(view.model.node_rows()) == 1 and view.model.row("mdns-node").found_by == "mDNS"

        dialog = view._ask_add_node()
        ok = dialog.buttons.button(QDialogButtonBox.StandardButton.Ok)
        for bad, why in (("static-node", "HOST:PORT"), ("127.0.0.1:99999", "port"), ("bad host!:7390", "host")):
            dialog.address.setText(bad)
            assert not ok.isEnabled() and why in dialog.hint.text(), bad
        dialog.address.setText(static_address)
        assert ok.isEnabled()
        ok.click()
        assert added_nodes() == [static_address]  # the engine settings' list, shared with `fleet nodes add`

        def status(name):
            row = view.model.row(name)
            return row.status if row else None

        qtbot.waitUntil(lambda: status("static-node") == "idle" and status("mdns-node") == "idle", timeout=20000)
        static = view.model.row("static-node")
        assert static.added and not static.mdns and static.os and "CPU" in static.devices and static.memory_mb > 0
        assert static.int8_dot == int8_dot()  # from the agent's status
        index = view.model.index(view.model.rows.index(static), 5)
        assert view.model.data(index) == "idle"
        assert view.agent_addresses() == [mdns_address, static_address]

        view.measure_round_trips()
        qtbot.waitUntil(lambda: view.rtt_table.rowCount() == 3, timeout=60000)
        for a, b in (("this PC", "mdns-node"), ("this PC", "static-node"), ("mdns-node", "static-node"),
                     ("static-node", "mdns-node")):
            assert 0 < float(view.rtt_table.value(a, b)) < 1000, (a, b)

        with ControlClient(static_address, FleetAccess(key, tls)) as agent:
            agent.call("pause", paused=True)
        qtbot.waitUntil(lambda: status("static-node") == "paused", timeout=10000)

        static_proc.terminate()
        static_proc.wait(timeout=15)
        qtbot.waitUntil(lambda: status("static-node") == "unreachable", timeout=10000)
        row = view.model.rows.index(view.model.row("static-node"))
        assert "not reachable" in view.model.data(view.model.index(row, 5), 3)  # the tooltip says why

        mdns_proc.terminate()  # a clean stop says goodbye over mDNS: the node leaves the list
        mdns_proc.wait(timeout=15)
        qtbot.waitUntil(lambda: view.model.row("mdns-node") is None, timeout=20000)

        view.remove_node(static_address)
        assert added_nodes() == [] and view.model.node_rows() == []
        assert [r.found_by for r in view.model.rows] == ["this PC"]  # always listed


def test_forget_this_pc_drops_a_known_pc_from_the_view_and_the_settings(qtbot, gui_home, key_file, tmp_path):
    """A PC known from a join code or a scan is dialled into the view; its row's menu forgets it, after a
    confirm: the saved known nodes lose its address and the row leaves the list."""
    from PySide6.QtWidgets import QMessageBox

    from engine.config import known_nodes, remember_nodes

    with agent_process(key_file, tmp_path / "k", name="known-pc", tls=True) as (_, address):
        remember_nodes([address])  # as a join code or a scan leaves it
        window = open_window(qtbot, tiny_settings(tmp_path / "none", fleet_key_file=str(key_file)),
                             settings_store(tmp_path / "s.ini"))
        view = window.show_view("Fleet")
        qtbot.waitUntil(lambda: view.model.row("known-pc") is not None, timeout=30000)
        row = view.model.row("known-pc")
        assert not row.added
        this = view.row_menu(view.model.rows[0]).actions()[0]  # this PC, always first
        assert this.text() == "Forget this PC…" and not this.isEnabled()  # nothing of it is known by address
        forget = view.row_menu(row).actions()[0]
        assert forget.text() == "Forget this PC…" and forget.isEnabled()
        forget.trigger()
        box = view.findChild(QMessageBox)
        assert "known-pc" in box.text() and address in box.text()
        box.button(QMessageBox.StandardButton.Cancel).click()
        assert known_nodes() == [address]
        view.row_menu(row).actions()[0].trigger()
        next(b for b in view.findChildren(QMessageBox) if b.isVisible()).button(QMessageBox.StandardButton.Ok).click()
        assert known_nodes() == []  # saved: `fleet nodes` and the next start no longer know it
        qtbot.waitUntil(lambda: view.model.row("known-pc") is None, timeout=20000)


def test_a_cpu_without_int8_dot_products_is_marked_and_its_tooltip_says_why(qtbot):
    """Marked where OpenVINO's own kernels run its matrices, not where ours do; the tooltip names the
    kernels a node runs."""
    from PySide6.QtCore import Qt

    from engine.hostcpu import NONE
    from engine.kernels import GGML, STOCK
    from fleetgui.fleet_view import COLUMNS, NodeRow, NodesModel

    model = NodesModel()
    for name, dot, kernels in (("old-pc", NONE, STOCK), ("old-pc-ours", NONE, GGML), ("ai-pc", "AVX-VNNI", STOCK),
                               ("older-agent", "", "")):
        model._append(row := NodeRow(key=name))
        row.take_node({"name": name, "node_id": "ab" * 8, "cpu": "Some CPU", "devices": [{"name": "CPU"}],
                       "int8_dot": dot, "kernels": kernels})
    column = COLUMNS.index("Devices")

    def cell(name, role):
        return model.data(model.index(model.rows.index(model.row(name)), column), role)

    assert not cell("old-pc", Qt.ItemDataRole.DecorationRole).isNull()
    assert "no int8 dot-product instructions" in cell("old-pc", Qt.ItemDataRole.ToolTipRole)
    assert "matrices: OpenVINO's own" in cell("old-pc", Qt.ItemDataRole.ToolTipRole)
    assert "matrices: our CPU kernels" in cell("old-pc-ours", Qt.ItemDataRole.ToolTipRole)
    for name in ("old-pc-ours", "ai-pc", "older-agent"):  # ours run it, one that has them, one that does not say
        assert cell(name, Qt.ItemDataRole.DecorationRole) is None
        assert "int8" not in cell(name, Qt.ItemDataRole.ToolTipRole)


def test_a_record_cannot_move_a_node_the_view_knows(qtbot, gui_home, key_file, tmp_path, caplog):
    """Anyone on the LAN can announce a record naming a known node's id at their own address: the
    view dials it first, and one where nothing answers is skipped with a warning, the node staying
    where it is."""
    import dataclasses
    import secrets
    import socket

    from zeroconf import IPVersion, ServiceInfo, Zeroconf

    from engine.fleet.discovery import SERVICE

    caplog.set_level("WARNING", logger="engine.fleet.discovery")
    with socket.socket() as sock:  # a loopback port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    zc = Zeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    try:
        with agent_process(key_file, tmp_path / "m", mdns=True, name="mdns-node", tls=True) as (_, address):
            window = open_window(qtbot, tiny_settings(tmp_path / "none", fleet_key_file=str(key_file)),
                                 settings_store(tmp_path / "s.ini"))
            view = window.show_view("Fleet")
            qtbot.waitUntil(lambda: view.model.row("mdns-node") is not None, timeout=30000)
            node = view.discovery.browser.nodes()[view.model.row("mdns-node").node_id]
            bogus = dataclasses.replace(node, port=closed)
            name = f"mdns-node ({secrets.token_hex(3)}).{SERVICE}"
            zc.register_service(ServiceInfo(SERVICE, name, port=closed, properties=bogus.to_txt(),
                                            server="elsewhere.local.", parsed_addresses=["127.0.0.1"]))
            qtbot.waitUntil(lambda: name in view.discovery.browser.rejected(), timeout=20000)
            qtbot.wait(200)  # an event the browser had sent would be delivered by now
            assert view.model.row("mdns-node").address == address
            assert view.discovery.browser.nodes()[node.node_id].port == node.port
            assert name in caplog.text and "not reachable" in caplog.text
    finally:
        zc.close()


def test_fleet_key_is_made_and_chosen_private(qtbot, gui_home, tmp_path):
    from fleetgui import keystore
    from fleetgui.settings import GuiSettings

    path = tmp_path / "s.ini"
    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(path))
    view = window.show_view("Fleet")
    assert not view.key.usable and "No fleet key yet" in view.key_label.text()
    assert view.discovery.browser is None  # no key, no fleet to look for

    made = gui_home / "config" / "fleet.key"
    view.create_key(made)
    assert view.key.usable and stat.S_IMODE(made.stat().st_mode) == 0o600
    assert "readable only by you" in view.key_note.text()
    assert view.discovery.browser is not None and view.discovery.browser.fleet_id == view.key.fleet_id
    assert keystore.key_path(GuiSettings.load(settings_store(path))) == made  # the app keeps using it

    shared = tmp_path / "from-the-admin.key"
    shared.write_text("ab" * 32 + "\n")
    os.chmod(shared, 0o644)
    before = view.key.fleet_id
    view.choose_key(shared)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o600 and "now readable only by you" in view.banner.message
    assert view.key.fleet_id != before and window.settings.fleet_key_file == str(shared)

    bad = tmp_path / "bad.key"
    bad.write_text("not hex")
    view.choose_key(bad)
    assert "does not hold hex digits" in view.banner.message and window.settings.fleet_key_file == str(shared)


def test_with_an_os_keyring_the_key_is_kept_there_and_written_back(qtbot, gui_home, tmp_path, monkeypatch):
    """The keyring package is optional (not installed here): a stand-in module with its API."""
    import sys
    import types

    stored = {}
    fail = types.ModuleType("keyring.backends.fail")
    fail.Keyring = type("Keyring", (), {})
    backend = type("SecretService", (), {"priority": 5})()
    keyring = types.ModuleType("keyring")
    keyring.get_keyring = lambda: backend
    keyring.set_password = lambda service, user, secret: stored.__setitem__((service, user), secret)
    keyring.get_password = lambda service, user: stored.get((service, user))
    backends = types.ModuleType("keyring.backends")
    backends.fail = fail
    for name, module in (("keyring", keyring), ("keyring.backends", backends), ("keyring.backends.fail", fail)):
        monkeypatch.setitem(sys.modules, name, module)

    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    view = window.show_view("Fleet")
    default = gui_home / "config" / "fleet.key"
    view.create_key(default)
    assert stored[("fleetshard", "fleet-key")] == default.read_text().strip()
    assert "Kept in the OS keyring (SecretService)" in view.key_note.text()
    assert window.settings.fleet_key_file == ""  # the default key file stays the default

    fleet = view.key.fleet_id
    default.unlink()  # the file is only the engine's working copy: the keyring gives it back
    view.reload_key()
    assert view.key.fleet_id == fleet and stat.S_IMODE(default.stat().st_mode) == 0o600


def test_counts_and_round_trips_follow_the_listed_nodes(qtbot, gui_home, key_file, tmp_path):
    """Every row of the table is a node and is counted (this PC, the chat's local worker, a demo
    node); the round-trip matrix shows the local worker too, and a node that stops leaves it."""
    from engine.fleet.local_agent import start_local_agent, stop_local_agent
    from engine.fleetkey import access_of

    access = access_of(key_file, tls=True)  # the app's default
    local = start_local_agent(access, name="local")  # what the chat's local fleet starts
    demo = start_local_agent(access, name="demo-one", role="demo",
                             options=("--store", str(tmp_path / "demo-store")))
    try:
        window = open_window(qtbot, tiny_settings(tmp_path / "none", fleet_key_file=str(key_file)),
                             settings_store(tmp_path / "s.ini"))
        view = window.show_view("Fleet")
        view.timer.setInterval(300)
        qtbot.waitUntil(lambda: len(view.model.reachable()) == 2, timeout=30000)
        assert view.model.rowCount() == 3
        assert view.summary.text().startswith("3 nodes, 3 answering"), view.summary.text()
        assert "A node is" in view.summary.text()  # said plainly, once

        view.measure_round_trips()
        qtbot.waitUntil(lambda: view._rtt is None, timeout=60000)
        labels = [view.rtt_table.verticalHeaderItem(i).text() for i in range(view.rtt_table.rowCount())]
        assert labels == ["this PC", "local", "demo-one (simulated)"] or \
            labels == ["this PC", "local", "demo-one"], labels
        assert float(view.rtt_table.value("this PC", "local")) > 0

        stop_local_agent(demo)  # a demo node switched off: its row goes, and so does its place in the matrix
        qtbot.waitUntil(lambda: view.model.rowCount() == 2, timeout=20000)
        assert view.summary.text().startswith("2 nodes, 2 answering"), view.summary.text()
        assert [view.rtt_table.verticalHeaderItem(i).text() for i in range(view.rtt_table.rowCount())] == \
            ["this PC", "local"]
    finally:
        stop_local_agent(demo)
        stop_local_agent(local)


def test_add_node_names_the_tray_worker(qtbot, gui_home, tmp_path):
    """The dialog gives the README's instruction: the tray worker on the new PC, `fleet agent` as
    the command-line alternative."""
    from PySide6.QtWidgets import QLabel

    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    dialog = window.show_view("Fleet")._ask_add_node()
    text = " ".join(label.text() for label in dialog.findChildren(QLabel))
    assert "tray worker" in text and "fleetgui --worker" in text
    assert text.index("tray worker") < text.index("fleet agent")  # the command line is the alternative
    dialog.reject()


def test_shards_are_listed_once_each():
    """One entry per shard: two shards of the same layers (other weights) are told apart, never "×2"."""
    from fleetgui.fleet_view import NodeRow

    row = NodeRow(key="n", shards=[{"model": "qwen2", "layers": [2, 4], "weights": "int4", "hash": "a"},
                                   {"model": "qwen2", "layers": [0, 2], "weights": "int4", "hash": "b"},
                                   {"model": "qwen2", "layers": [2, 4], "weights": "f32", "hash": "c"}])
    assert row.shards_text() == "qwen2: layers 0-1, layers 2-3 (f32), layers 2-3 (int4)"


def test_found_by_tells_how_each_node_is_found(qtbot):
    """"Found by" names each way a node is found as it is now: mDNS, the join code or subnet scan that
    made its address known (dialled, no record seen), or an address added by hand; it used to say mDNS
    for every node discovery reported."""
    from engine.fleet.node import NodeInfo
    from fleetgui.fleet_view import NodesModel

    def info(node_id: str, address: str) -> NodeInfo:
        host, port = address.split(":")
        return NodeInfo(node_id, node_id, "Linux", "cpu", 4, 8192, 4096, "", [], int(port), "f", [host])

    model = NodesModel()
    model.learned("join code", ["10.0.0.2:7390"])
    model.learned("subnet scan", ["10.0.0.3:7390"])
    model.discovered("added", info("joined", "10.0.0.2:7390"), ("known",))
    model.discovered("added", info("scanned", "10.0.0.3:7390"), ("known",))
    model.discovered("added", info("earlier", "10.0.0.4:7390"), ("known",))  # known before this app started
    model.discovered("added", info("both", "10.0.0.5:7390"), ("known", "mdns"))
    model.add_address("10.0.0.6:7390")
    assert [(r.name, r.found_by) for r in model.rows] == [
        ("joined", "join code"), ("scanned", "subnet scan"), ("earlier", "join code or scan"),
        ("both", "mDNS + join code or scan"), ("", "by hand")]
    model.discovered("updated", info("both", "10.0.0.5:7390"), ("known",))  # its record went: dialled still
    assert model.row("both").found_by == "join code or scan"


def test_the_fleet_view_says_parts_and_this_pc(qtbot):
    """What nodes serve reads in parts counted from 1 ("serving part 2 of 3"), this PC's row says
    "this PC" and keeps the technical words in its tooltip; a node's own state in parts too."""
    from PySide6.QtCore import Qt
    from test_gui_settings import jargon_in

    from fleetgui.fleet_view import COLUMNS, NodeRow, NodesModel

    model = NodesModel()
    here = model.this_machine()
    node = NodeRow(key="n", name="office-pc", state="serving part 2 of 3, part 3 of 3", node_id="ab" * 8,
                   workers=[{"id": "a", "stage": 1, "stages": 3, "layers": [1, 3]},
                            {"id": "b", "stage": 2, "stages": 3, "layers": [3, 4]}], standbys=frozenset({"b"}))
    assert node.status == "serving part 2 of 3 (layers 1-2); standby for part 3 (layer 3)"
    model._append(node)
    shown = [str(model.index(r, c).data() or "") for r in range(model.rowCount()) for c in range(len(COLUMNS))]
    assert jargon_in(shown) == [], shown
    assert here.status.startswith("this PC")
    tip = model.index(0, COLUMNS.index("Status")).data(Qt.ItemDataRole.ToolTipRole)
    assert "coordinator" in tip and "stage 0" in tip  # the technical words, behind the tooltip
