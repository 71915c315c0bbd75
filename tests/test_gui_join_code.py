"""The Fleet view's ways past a network that drops multicast (``fleetgui.join_code``,
``fleetgui.discovery_status``), over real agent processes: this fleet's join code is shown to copy,
a code pasted from another PC brings its node into the view once its agent proves the key, a code of
another fleet is refused in plain words, and the line on why no node is found shows the engine's
diagnosis as plain text."""

from __future__ import annotations

import secrets

import pytest
from fleet_support import agent_process
from gui_support import open_window, settings_store, tiny_settings

from engine.fleet import unicast
from engine.runtime.stages.stage import core

core()  # before any test starts a thread: creating an OpenVINO Core forks a child that hangs if threads run


@pytest.fixture
def key_file(gui_home):
    from engine.fleetkey import create_key

    return create_key(gui_home / "keys" / "fleet.key")


@pytest.mark.skipif(not unicast.shared_addresses(), reason="a join code needs a network address other than loopback")
def test_a_pasted_join_code_brings_its_node_into_the_view(qtbot, gui_home, key_file, tmp_path):
    from PySide6.QtWidgets import QApplication

    from engine.config import known_nodes
    from engine.fleetkey import load_key

    key = load_key(key_file)
    with agent_process(key_file, tmp_path / "a", name="alice", listen="0.0.0.0:0", tls=True) as (_, address):
        port = int(address.rpartition(":")[2])
        window = open_window(qtbot, tiny_settings(tmp_path / "none", fleet_key_file=str(key_file)),
                             settings_store(tmp_path / "s.ini"))
        view = window.show_view("Fleet")
        dialog = view._ask_join_code()
        ours = unicast.read_join_code(dialog.code.text(), key)  # this PC's own code, for the other PCs
        assert ours.port == unicast.AGENT_PORT and ours.addresses == tuple(unicast.shared_addresses())
        dialog.copy_button.click()
        assert QApplication.clipboard().text() == dialog.code.text()

        dialog.pasted.setText(unicast.join_code(secrets.token_bytes(32), port=port))  # a code of another fleet
        dialog.join_button.click()
        qtbot.waitUntil(lambda: "another fleet" in dialog.outcome.text(), timeout=10000)
        assert known_nodes() == [] and view.model.row("alice") is None

        dialog.pasted.setText(unicast.join_code(key, port=port))  # alice's PC is this one: its code is ours
        dialog.join_button.click()
        qtbot.waitUntil(lambda: "proved the fleet key" in dialog.outcome.text(), timeout=20000)
        assert "alice" in dialog.outcome.text()
        assert known_nodes() == [f"{a}:{port}" for a in unicast.shared_addresses()]
        qtbot.waitUntil(lambda: view.model.row("alice") is not None, timeout=20000)  # dialled at once
        assert view.model.row("alice").address.endswith(f":{port}")
        assert view.model.row("alice").found_by == "join code"  # dialled, not seen over mDNS
        dialog.reject()


def test_the_line_on_why_no_node_is_found_shows_the_diagnosis_as_plain_text(qtbot, gui_home, key_file, tmp_path):
    from PySide6.QtCore import Qt

    window = open_window(qtbot, tiny_settings(tmp_path / "none", fleet_key_file=str(key_file)),
                         settings_store(tmp_path / "s.ini"))
    view = window.show_view("Fleet")
    status = view.discovery_status
    # the view asks at once when it finds nothing; the engine listens a few seconds off the GUI thread
    qtbot.waitUntil(lambda: status.diagnosis is not None, timeout=30000)
    assert status.text() == status.diagnosis.text and status.isVisible() == bool(status.diagnosis.lines)
    assert status.textFormat() == Qt.TextFormat.PlainText
    hostile = "<img src=file:///dev/zero> <b>x</b>"
    status.show_diagnosis(unicast.diagnose(found=0, multicast=unicast.Multicast(own=True),
                                           reaches=[unicast.Reach(hostile, "refused")]))
    assert status.isVisible() and hostile in status.text() and "No multicast seen from any other PC" in status.text()
    status.show_diagnosis(unicast.diagnose(found=1, multicast=unicast.Multicast(own=True)))
    assert not status.isVisible()  # found meanwhile: nothing to explain
