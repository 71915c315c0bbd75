"""The demo fleet in the app, on one PC: "Try a demo fleet" starts two demo nodes (separate agent
processes with simulated devices) that the Fleet view lists beside this machine, marked demo and
simulated; Profile fleet gives a lane per node; a layer range dragged with the mouse from one demo
node's lane onto the other's, Deploy, and a chat reply streams through the chain, token for token
what the model decodes alone; switching the serving demo node off moves its layers to the other one
and the next reply is the same; closing the window ends every demo node."""

from __future__ import annotations

from pathlib import Path

from gui_support import drag, open_window, settings_store, tiny_settings

from engine.runtime.stages.stage import core

core()  # before any test starts a thread: creating an OpenVINO Core forks a child that hangs if threads run

MESSAGES = [{"role": "user", "content": "Paris is the capital of"}]
TOKENS = 16


def chat(qtbot, window):
    tab = window.chat.new_chat()
    tab.input.setPlainText(MESSAGES[0]["content"])
    with qtbot.waitSignal(tab.finished, timeout=300000) as blocker:
        tab.send()
    return blocker.args[0]


def test_demo_fleet_drag_a_range_deploy_chat_and_lose_a_node(qtbot, gui_home, tiny_models, tmp_path):
    from engine.export.exporter import plan_split
    from fleetgui.placement_model import StageRange
    from engine.runtime.decode.generate import Generator
    from engine.runtime.decode.tokenizer import ChatTokenizer
    from engine.runtime.stages.chain import LocalChain

    settings = tiny_settings(tiny_models["qwen2"], max_new_tokens=TOKENS)  # the default fleet key: none yet
    window = open_window(qtbot, settings, settings_store(tmp_path / "s.ini"))
    fleet_view = window.show_view("Fleet")
    fleet_view.timer.setInterval(500)
    this = fleet_view.model.rows[0]  # this PC is listed from the start, with its facts
    assert this.found_by == "this PC" and this.status.startswith("this PC")
    qtbot.waitUntil(lambda: bool(this.os and this.devices), timeout=30000)
    assert this.name.startswith("this PC (") and "CPU" in this.devices

    fleet_view.start_demo(2)
    assert not fleet_view.demo_button.isEnabled()
    qtbot.waitUntil(lambda: fleet_view.demo is not None, timeout=120000)
    demo = fleet_view.demo
    assert fleet_view.demo_button.text() == "Stop demo fleet" and fleet_view.key.usable
    assert fleet_view.demo_note.isVisible() and "DEMO FLEET: 2 simulated nodes" in fleet_view.demo_note.text()
    qtbot.waitUntil(lambda: sorted(fleet_view.agent_addresses()) == sorted(demo.addresses), timeout=30000)
    for node in demo.nodes:
        row = fleet_view.model.row(node.name)
        assert row.found_by == "demo" and row.simulated and row.devices == [node.device.name]
        index = fleet_view.model.index(fleet_view.model.rows.index(row), 0)
        assert fleet_view.model.data(index) == f"{node.name} (simulated)"
        assert row.memory_mb == node.device.memory_mb and row.status == "idle"
    laptop, gpu = (node.name for node in demo.nodes)

    view = window.show_view("Placement")
    view.profile_button.click()
    qtbot.waitUntil(lambda: view.task is None, timeout=600000)
    assert view.model.loaded, view.banner.message
    model, canvas = view.model, view.canvas
    assert [lane.label for lane in model.lanes] == \
        ["this PC · CPU", f"{laptop} (simulated) · CPU", f"{gpu} (simulated) · GPU"]
    lane = {model.lanes[i].name: i for i in range(len(model.lanes))}
    # the profile ends on the solver's best plan, said to rest on the demo's nodes where it uses them
    simulated = any(model.lanes[s.lane].simulated for s in model.stages)
    assert ("rests on simulated PCs" in view.prediction.text()) == simulated, view.prediction.text()
    spans = plan_split(model.shape.num_layers, 3)  # from here, an expert's plan by hand: the even split
    model.set_stages([StageRange(lane[name], a, b) for name, (a, b) in zip(["this PC", laptop, gpu], spans)])

    # the laptop's range dragged with the mouse onto the GPU box's lane: it runs every layer after stage 0
    drag(canvas, canvas.block_point(1), canvas.lane_point(lane[gpu]))
    assert [(model.lanes[s.lane].name, s.start, s.end) for s in model.stages] == \
        [("this PC", 0, spans[0][1]), (gpu, spans[0][1], model.shape.num_layers)]
    assert "2 stages" in view.technical.text() and view.problems.text() == ""

    deployed = []
    view.deployed.connect(deployed.append)
    view.deploy_button.click()
    qtbot.waitUntil(lambda: view.task is None, timeout=600000)
    assert deployed and deployed[0] is not None, view.banner.message
    deployment = deployed[0]
    assert [s.node for s in deployment.placement[1:]] == [demo.node(gpu).address]

    reply = chat(qtbot, window)
    assert reply.tokens and not reply.error, reply.error
    assert window.service_label.text() == "Chat: qwen2, 2 parts, deployed on the fleet"
    chain = LocalChain(sorted(Path(deployment.stage0).parent.glob("stage*[0-9]")))
    want = Generator(chain, chain.spec.max_position, chain.manifest.eos_token_ids).generate(
        ChatTokenizer(chain.first_folder).chat_ids(MESSAGES), TOKENS).tokens
    assert reply.tokens == want  # through the demo fleet, exactly what the model decodes alone

    # the GPU box switched off from the Fleet view: the next reply runs on the laptop, the same tokens
    window.show_view("Fleet")
    fleet_view.table.selectRow(fleet_view.model.rows.index(fleet_view.model.row(gpu)))
    fleet_view.remove_button.click()
    qtbot.waitUntil(lambda: fleet_view.model.row(gpu) is None, timeout=30000)
    events = []
    window.chat_controller.fleet_event.connect(events.append)
    again = chat(qtbot, window)
    assert again.tokens == want, (again.error, events)
    qtbot.waitUntil(lambda: any(e.startswith(f"node {gpu} lost") for e in events), timeout=30000)  # found after
    # the laptop held the GPU box's part as a hot standby (Settings.standbys): it takes over, nothing is sent
    assert any(f"its standby on {laptop} takes over" in e for e in events), events
    assert deployment.standby_for(1) is not None and deployment.standby_for(1).agent == demo.node(laptop).address
    qtbot.waitUntil(lambda: fleet_view.model.row(laptop).status.startswith("serving part 2"), timeout=30000)

    procs = [node.proc for node in demo.nodes]
    window.close()  # the deployment's workers and the demo nodes end with the app
    assert all(proc.poll() is not None for proc in procs)
