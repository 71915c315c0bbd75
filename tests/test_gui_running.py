"""One truth about what runs (``fleetgui.running``): a real deployment on a real agent process,
made the way the Placement view's Deploy makes it; Placement and the status bar say the same about
it (starting while the chat's chain on it starts, running once it connects, which it does without
waiting for a first message); the running state holds the deployment, the chat's chain, the nodes
and what each one serves."""

from __future__ import annotations

import pytest
from fleet_support import agent_process
from gui_support import open_window, settings_store, tiny_settings

from engine.runtime.stages.stage import core

core()  # before any test starts a thread: creating an OpenVINO Core forks a child that hangs if threads run


@pytest.fixture
def key_file(gui_home):
    from engine.fleetkey import create_key

    return create_key(gui_home / "keys" / "fleet.key")


def test_after_deploy_placement_and_the_status_bar_agree(qtbot, gui_home, key_file, tiny_models, tmp_path):
    from PySide6.QtWidgets import QLabel, QProgressBar

    from engine.fleet.deploy import LOCAL
    from engine.fleet.span import StageSpan

    with agent_process(key_file, tmp_path / "pc", name="office-pc", tls=True) as (_, address):
        settings = tiny_settings(tiny_models["qwen2"], fleet_key_file=str(key_file))
        window = open_window(qtbot, settings, settings_store(tmp_path / "s.ini"))
        placement = window.show_view("Placement")
        stages = [StageSpan(LOCAL, "CPU", 0, 2), StageSpan(address, "CPU", 2, 4)]
        deployment = window.backend.deploy(str(tiny_models["qwen2"]), stages, window.settings)
        placement.deploy_bars = [(QLabel("waiting"), QProgressBar()) for _ in stages]  # its Deploy's parts
        placement._deployed(deployment)  # what Placement runs once its Deploy has finished
        # at once: the chat's chain on it is starting, and both the status bar and Placement say so
        assert window.running.deployment_state(deployment) == "starting"
        assert " on the fleet, starting" in window.service_label.text(), window.service_label.text()
        assert [label.text() for label, _ in placement.deploy_bars] == ["starting", "starting"]
        assert "The chat is starting on it" in placement.activity.text()
        assert "running" not in placement.activity.text() + "".join(lab.text() for lab, _ in placement.deploy_bars)
        # connected with no message sent: the chain Placement names is the one the chat runs on
        qtbot.waitUntil(lambda: window.service_label.text() == "Chat: qwen2, 2 parts, deployed on the fleet",
                        timeout=60000)
        assert window.running.deployment_state(deployment) == "running"
        assert [label.text() for label, _ in placement.deploy_bars] == ["running", "running"]
        assert "The chat now uses this deployment." in placement.activity.text()
        window.close()


def test_the_running_state_holds_the_deployment_the_chat_and_the_nodes(qtbot, gui_home, key_file, tiny_models,
                                                                      tmp_path):
    from engine.fleet.deploy import LOCAL
    from engine.fleet.span import StageSpan
    from fleetgui.running import CONNECTED

    with agent_process(key_file, tmp_path / "pc", name="office-pc", tls=True) as (_, address):
        settings = tiny_settings(tiny_models["qwen2"], fleet_key_file=str(key_file))
        window = open_window(qtbot, settings, settings_store(tmp_path / "s.ini"))
        running, fleet = window.running, window.show_view("Fleet")
        fleet.timer.setInterval(300)
        assert running.chat.deployment is None and running.chat.where == "on this PC"
        assert window.service_label.text() == "Chat: qwen2 on this PC, not started yet"
        fleet.add_node(address)
        qtbot.waitUntil(lambda: any(n.name == "office-pc" and n.answering for n in running.nodes), timeout=20000)
        assert len(running.nodes) == fleet.model.rowCount() == 2
        assert window.fleet_label.text().startswith("2 nodes, 2 answering")

        stages = [StageSpan(LOCAL, "CPU", 0, 2), StageSpan(address, "CPU", 2, 4)]
        deployment = window.backend.deploy(str(tiny_models["qwen2"]), stages, window.settings)
        window.placement._deployed(deployment)
        assert running.deployment is deployment and running.chat.deployment is deployment
        assert running.deployment_parts() == [("this PC", "layers 0-1"), ("office-pc", "layers 2-3")]
        qtbot.waitUntil(lambda: running.chat.state == CONNECTED, timeout=60000)
        assert window.service_label.text() == running.chat_text() == f"Chat: {running.chat.detail}"
        # the Fleet view's polling says what the node serves now
        qtbot.waitUntil(lambda: any(n.serving for n in running.nodes if n.name == "office-pc"), timeout=20000)
        assert next(n for n in running.nodes if n.name == "office-pc").serving == ("serving part 2 of 2 (layers 2-3)",)

        window.placement.stop_deployment()  # Stop in Placement: the chat goes back to the settings' model
        assert running.deployment is None and running.chat.deployment is None
        qtbot.waitUntil(lambda: window.placement.task is None, timeout=30000)
        window.close()


def test_the_status_bar_names_a_catalog_model_as_the_pickers_do(qapp):
    """A connected chain's line names its model as the Chat view's picker does ("SmolLM2 135M"), not
    by the catalog's file name; a model that is not the catalog's keeps its own name."""
    from fleetgui.running import CONNECTED, Running

    running = Running()
    running.set_chat("smollm2-135m", None, CONNECTED, "smollm2-135m, 2 parts, local fleet")
    assert running.chat_text() == "Chat: SmolLM2 135M, 2 parts, local fleet"
    running.set_chat("qwen2", None, CONNECTED, "qwen2, 1 part, in process")
    assert running.chat_text() == "Chat: qwen2, 1 part, in process"
