"""The Placement view on a real fleet: two agent processes on loopback (alpha advertised over mDNS,
beta added by address) and this process as the coordinator, with the tiny Qwen2 model in f32.

"Profile fleet" runs a real survey and shows a lane per device; dragging a boundary and a range
with the mouse (and a range through the model's own drop API) re-prices the plan live; a pinned
range survives Optimise; a device too small for its layers, and a pin no solver can honour, show
the reason, as does a machine the solver leaves out; Deploy starts the chain on the two agents (the
Fleet view shows each node's stage being exported) and a chat reply streams through it, token for
token what the model decodes alone, and another app instance chats on the recorded deployment.  The
embedded default (``fleetgui`` with no arguments) chats on its local fleet, and closing the window
stops its agent."""

from __future__ import annotations

import json
import types

import pytest
from fleet_support import agent_process
from gui_support import drag, open_window, screenshot, settings_store, tiny_settings

from engine.runtime.stages.stage import core

core()  # before any test starts a thread: creating an OpenVINO Core forks a child that hangs if threads run


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_models):
    """The app's home and two agents; every test of the module shares them (and the shard cache)."""
    from engine.fleetkey import create_key, load_tls

    root = tmp_path_factory.mktemp("placement")
    patch = pytest.MonkeyPatch()
    patch.setenv("FLEETSHARD_HOME", str(root / "home"))
    key_file = create_key(root / "keys" / "fleet.key")
    try:
        with agent_process(key_file, root / "alpha", mdns=True, name="alpha", tls=True) as (_, alpha), \
                agent_process(key_file, root / "beta", name="beta", tls=True) as (_, beta):  # the app's default
            yield types.SimpleNamespace(root=root, key_file=key_file, alpha=alpha, beta=beta,
                                        model=str(tiny_models["qwen2"]), tls=load_tls(True, key_file))
    finally:
        patch.undo()


def settings(fleet, **changes):
    values = dict(fleet_key_file=str(fleet.key_file), weights="f32")
    values.update(changes)
    return tiny_settings(fleet.model, **values)


def open_app(qtbot, fleet, **changes):
    window = open_window(qtbot, settings(fleet, **changes), settings_store(fleet.root / "settings.ini"))
    return window, window.views["Fleet"], window.views["Placement"]


def wait_for_agents(qtbot, fleet_view, fleet):
    if fleet.beta not in [r.address for r in fleet_view.model.rows if r.added]:
        fleet_view.add_node(fleet.beta)
    fleet_view.timer.setInterval(500)
    qtbot.waitUntil(lambda: sorted(fleet_view.agent_addresses()) == sorted([fleet.alpha, fleet.beta]), timeout=30000)


def surveyed(qtbot, fleet):
    """The fleet profile: the one the first test made with Profile fleet, or a survey made now."""
    from fleetgui.backend import EngineBackend
    from fleetgui.placement_model import default_profile

    path = default_profile()
    if not path.exists():
        doc = EngineBackend().survey(fleet.model, [fleet.alpha, fleet.beta], settings(fleet))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc))
    return json.loads(path.read_text())


def names(model):
    return [(model.lanes[s.lane].name, s.start, s.end) for s in model.stages]


def even_split(model):
    from fleetgui.placement_model import StageRange

    lane = {model.lanes[i].name: i for i in range(len(model.lanes))}
    model.set_stages([StageRange(lane["this PC"], 0, 1), StageRange(lane["alpha"], 1, 3),
                      StageRange(lane["beta"], 3, 4)])
    return lane


def optimised(qtbot, fleet, doc: dict, users: int):
    """The app on the fleet, ``doc`` loaded in its Placement view and optimised for throughput at
    ``users``: (window, view)."""
    window, fleet_view, view = open_app(qtbot, fleet, max_new_tokens=8)
    wait_for_agents(qtbot, fleet_view, fleet)
    window.show_view("Placement")
    view.load_profile(doc)
    view.objective.setCurrentText("throughput")
    view.users.setValue(users)
    view.optimise_button.click()
    qtbot.waitUntil(lambda: view.task is None, timeout=60000)
    return window, view


def deployed_and_chatted(qtbot, window, view, deploy: bool = True):
    """Deploys the view's plan (unless it is deployed already) and chats one reply through it; the
    Deployment."""
    if deploy:
        deployed = []
        view.deployed.connect(deployed.append)
        view.deploy_button.click()
        qtbot.waitUntil(lambda: view.task is None, timeout=600000)
        assert deployed and deployed[0] is not None, view.banner.message
    else:
        deployed = [view.deployment]
    tab = window.chat.new_chat()
    tab.input.setPlainText("Paris is the capital of")
    with qtbot.waitSignal(tab.finished, timeout=120000) as blocker:
        tab.send()
    assert blocker.args[0].tokens, blocker.args[0].error
    view.show_measured()  # (what showing the view again does) the chat's speed beside the prediction
    assert view.measured.text().startswith("Measured in the chat: ") and "predicted" in view.measured.text()
    return deployed[0]


def test_profile_fleet_shows_a_lane_per_device(qtbot, fleet):
    from engine.fleet.deploy import LOCAL
    from fleetgui.placement_model import default_profile

    window, fleet_view, view = open_app(qtbot, fleet)
    wait_for_agents(qtbot, fleet_view, fleet)
    window.show_view("Placement")
    assert not view.model.loaded and "No plan yet" in view.prediction.text()
    seen = []
    view.profile_button.click()
    assert not view.profile_button.isEnabled() and view.cancel_button.isEnabled() and view.busy.isVisible()
    view.task.progressed.connect(seen.append)
    qtbot.waitUntil(lambda: view.task is None, timeout=600000)
    assert view.model.loaded, view.banner.message
    assert sorted(lane.label for lane in view.model.lanes) == ["alpha · CPU", "beta · CPU", "this PC · CPU"]
    assert view.model.lanes[0].name == "this PC"  # the coordinator's lane comes first
    # the profile ends on the best plan the solver finds, not on a starting split: Optimise finds no better
    profiled, predicted = view.model.chain(), view.prediction.text()
    view.optimise_button.click()
    qtbot.waitUntil(lambda: view.task is None, timeout=60000)
    assert view.model.chain() == profiled and view.prediction.text() == predicted
    assert view.model.placement()[0].node == LOCAL and view.model.stages[0].lane == 0
    said = [p.text for p in seen if not p.step]  # each with the count a person follows
    assert "Node 1 of 3: profiling this PC's CPU" in said, said
    assert any(line.startswith("Node 3 of 3: profiling") for line in said), said
    doc = json.loads(default_profile().read_text())
    assert doc["source"] == fleet.model and doc["weights"] == "f32" and len(doc["fleet"]["devices"]) == 3
    assert view.model.rowCount() == 3 and view.tree.model() is view.model
    assert "tok/s predicted for one person" in view.prediction.text()
    assert "best layout found" in view.prediction.text()
    assert "Predicted" in view.technical.text() and "tok/s" in view.technical.text()
    assert view.optimise_button.isEnabled() and view.deploy_button.isEnabled()
    # a new window opens on the last profile of the data folder
    _, _, again = open_app(qtbot, fleet)
    assert again.model.loaded and [a.label for a in again.model.lanes] == [b.label for b in view.model.lanes]


def test_dragging_ranges_and_boundaries_reprices_the_plan(qtbot, fleet):
    from PySide6.QtCore import QMimeData, QPoint, Qt

    from engine.fleet.placement import evaluate
    from fleetgui.placement_model import MIME

    surveyed(qtbot, fleet)
    window, _, view = open_app(qtbot, fleet)
    window.show_view("Placement")
    model, canvas = view.model, view.canvas
    lane = even_split(model)

    def priced():  # the label shows what evaluate() says of the chain on screen
        plan = evaluate(model.shape, model.fleet, model.chain(), users=model.users).plan
        return f"Predicted {plan.tok_s:.1f} tok/s for one user" in view.technical.text()

    assert priced() and view.problems.text() == ""
    before, alpha_memory = view.technical.text(), model.lane_memory(lane["alpha"])

    # the boundary between alpha (layers 1-2) and beta (layer 3), dragged with the mouse to layer 2's start
    handle = canvas.boundary_point(1)
    assert canvas.boundary_at(handle) == 1
    drag(canvas, handle, QPoint(round(canvas.layer_x(2)), handle.y()))
    assert names(model) == [("this PC", 0, 1), ("alpha", 1, 2), ("beta", 2, 4)]
    assert view.technical.text() != before and priced()
    assert model.lane_memory(lane["alpha"]) < alpha_memory  # the memory bar follows

    # beta's range dragged onto alpha's lane: alpha now runs layers 1-3, two stages remain
    drag(canvas, canvas.block_point(2), canvas.lane_point(lane["alpha"]))
    assert names(model) == [("this PC", 0, 1), ("alpha", 1, 4)]
    assert "2 stages" in view.technical.text() and priced()

    # the same drop through the model's own API (what a QTreeView drop calls): layer 3 onto beta
    data = QMimeData()
    data.setData(MIME, json.dumps({"start": 3, "end": 4}).encode())
    assert model.canDropMimeData(data, Qt.DropAction.MoveAction, -1, 0, model.lane_index(lane["beta"]))
    assert model.dropMimeData(data, Qt.DropAction.MoveAction, -1, 0, model.lane_index(lane["beta"]))
    assert names(model) == [("this PC", 0, 1), ("alpha", 1, 3), ("beta", 3, 4)] and priced()
    assert [model.data(model.range_index(i)) for i in range(3)] == ["layer 0", "layers 1-2", "layer 3"]
    dragged = model.mimeData([model.range_index(1)])
    assert json.loads(bytes(dragged.data(MIME)).decode()) == {"start": 1, "end": 3}

    # a later range on this machine cannot be deployed (it runs stage 0 only): said, not hidden
    drag(canvas, canvas.block_point(2), canvas.lane_point(lane["this PC"]))
    assert names(model) == [("this PC", 0, 1), ("alpha", 1, 3), ("this PC", 3, 4)]
    assert "part 3 (layer 3) is on this PC" in view.problems.text()


def test_a_pinned_range_survives_optimise(qtbot, fleet):
    from PySide6.QtCore import Qt

    from engine.fleet.placement import solve

    surveyed(qtbot, fleet)
    window, _, view = open_app(qtbot, fleet)
    window.show_view("Placement")
    model = view.model
    lane = even_split(model)
    free = solve(model.shape, model.fleet, objective="latency")
    beta = model.lanes[lane["beta"]].node
    assert (beta, 3, 4) not in [(s.node, s.start, s.end) for s in free.stages]  # so the pin has work to do

    assert model.setData(model.range_index(2), Qt.CheckState.Checked, Qt.ItemDataRole.CheckStateRole)  # the tree
    assert model.data(model.range_index(2), Qt.ItemDataRole.CheckStateRole) == Qt.CheckState.Checked
    view.optimise_button.click()
    qtbot.waitUntil(lambda: view.task is None, timeout=60000)
    assert view.banner.message == "" and "Optimised" in view.activity.text()
    assert ("beta", 3, 4) in names(model) and model.stages[-1].pinned
    assert [(s.node, s.start, s.end) for s in solve(model.shape, model.fleet, pins=model.pins()).stages] == \
        [(model.lanes[s.lane].node, s.start, s.end) for s in model.stages]
    assert view.problems.text() == ""


def test_infeasible_plans_say_why(qtbot, fleet):
    from PySide6.QtCore import Qt

    doc = surveyed(qtbot, fleet)
    beta = next(n for n, info in doc["nodes"].items() if info["name"] == "beta")
    for device in doc["fleet"]["devices"]:
        if device["node"] == beta:
            device["memory_bytes"] = 1 << 20  # beta now has 1 MB for shards
    window, _, view = open_app(qtbot, fleet)
    window.show_view("Placement")
    view.load_profile(doc)
    even_split(view.model)
    assert "part 3 on beta CPU needs" in view.problems.text() and "has 0.0 GB" in view.problems.text()
    view.deploy_button.click()
    assert "cannot be deployed" in view.banner.message and view.task is None

    view.model.set_pinned(2, True)  # beta must keep layer 3: no solver can make that fit
    view.optimise_button.click()
    qtbot.waitUntil(lambda: view.task is None, timeout=60000)
    assert view.problems.text().startswith("Infeasible: pin of layer 3 on node beta needs")
    assert names(view.model) == [("this PC", 0, 1), ("alpha", 1, 3), ("beta", 3, 4)]  # left as drawn
    view.model.setData(view.model.range_index(2), Qt.CheckState.Unchecked, Qt.ItemDataRole.CheckStateRole)
    view.optimise_button.click()  # without the pin the solver routes around beta
    qtbot.waitUntil(lambda: view.task is None, timeout=60000)
    assert "beta" not in [n for n, _, _ in names(view.model)] and "beta" not in view.problems.text()
    assert "beta is left out: it has too little free memory" in view.left_out.text()  # and the view says why,
    assert "Left out beta: it cannot hold one layer" in view.reasons.text()  # with the figures for experts


def test_deploy_then_chat_through_the_deployed_chain(qtbot, fleet):
    from pathlib import Path

    from engine.config import FleetAccess
    from engine.fleet.control import ControlClient
    from engine.fleetkey import load_key
    from engine.runtime.decode.generate import Generator
    from engine.runtime.decode.tokenizer import ChatTokenizer
    from engine.runtime.stages.chain import LocalChain

    surveyed(qtbot, fleet)
    key = load_key(fleet.key_file)
    window, fleet_view, view = open_app(qtbot, fleet, max_new_tokens=24)
    wait_for_agents(qtbot, fleet_view, fleet)
    window.show_view("Placement")
    even_split(view.model)
    deployed, seen = [], set()
    view.deployed.connect(deployed.append)
    fleet_view.model.dataChanged.connect(lambda *_: seen.update((r.address, r.status) for r in fleet_view.model.rows))
    view.deploy_button.click()
    assert view.deploy_box.isVisible() and len(view.deploy_bars) == 3
    sent = []  # sending a stage reports its bytes: done of total
    view.task.progressed.connect(lambda p: sent.append(p) if p.step == "send" else None)
    qtbot.waitUntil(lambda: view.task is None, timeout=600000)
    assert {p.stage for p in sent} == {1, 2} and all(0 <= p.bytes_done <= p.bytes_total for p in sent), sent
    assert sent[-1].bytes_done == sent[-1].bytes_total > 0
    assert deployed and deployed[0] is not None, view.banner.message
    deployment = deployed[0]
    # the fleet view showed each node's stage being exported here, and shows it no more
    exporting = {(address, status.split(" (")[0]) for address, status in seen if status.startswith("preparing")}
    assert exporting == {(fleet.alpha, "preparing part 2"), (fleet.beta, "preparing part 3")}, seen
    assert not any(r.preparing for r in fleet_view.model.rows)
    assert [bar.value() for _, bar in view.deploy_bars] == [1000] * 3
    # each node runs its stage, and the other's hot standby (Settings.standbys, on by default)
    assert {(s["stage"], s["agent"]) for s in deployment.standbys} == {(1, fleet.beta), (2, fleet.alpha)}
    assert "Kept ready as standbys" in view.activity.text() and "part 2 on " in view.activity.text()
    for address in (fleet.alpha, fleet.beta):
        with ControlClient(address, FleetAccess(key, fleet.tls)) as agent:
            workers = agent.status()["workers"]
        assert sorted((w["stage"], w["layers"]) for w in workers) == [(1, [1, 3]), (2, [3, 4])]

    tab = window.chat.all_tabs()[0]
    messages = [{"role": "user", "content": "Paris is the capital of"}]
    tab.input.setPlainText(messages[0]["content"])
    with qtbot.waitSignal(tab.finished, timeout=120000) as blocker:
        tab.send()
    reply = blocker.args[0]
    assert reply.stopped_by in ("eos", "max_tokens") and reply.tokens and reply.text, reply.error
    assert window.service_label.text() == "Chat: qwen2, 3 parts, deployed on the fleet"
    chain = LocalChain(sorted(Path(deployment.stage0).parent.glob("stage*[0-9]")))
    want = Generator(chain, chain.spec.max_position, chain.manifest.eos_token_ids).generate(
        ChatTokenizer(chain.first_folder).chat_ids(messages), 24).tokens
    assert reply.tokens == want  # the deployed pipeline decodes exactly what the model does alone

    screenshot(window, "placement")
    window.show_view("Fleet")
    fleet_view.measure_round_trips()
    qtbot.waitUntil(lambda: all(r.status.startswith("serving part") and r.shards for r in fleet_view.model.node_rows())
                    and fleet_view.rtt_table.rowCount() == 3, timeout=60000)
    statuses = {r.address: r.status for r in fleet_view.model.rows}
    assert statuses[fleet.alpha] == "serving part 2 of 3 (layers 1-2); standby for part 3 (layer 3)", statuses
    assert statuses[fleet.beta] == "serving part 3 of 3 (layer 3); standby for part 2 (layers 1-2)", statuses
    shards = {r.address: r.shards_text() for r in fleet_view.model.rows}[fleet.alpha]
    assert shards.startswith("qwen2: ") and "layers 1-2" in shards, shards  # by model, profiling shards too
    screenshot(window, "fleet")

    # Remove unused shards: alpha keeps the shard it serves, its profiling shards go
    alpha_row = next(i for i, r in enumerate(fleet_view.model.rows) if r.address == fleet.alpha)
    fleet_view.table.selectRow(alpha_row)
    unused = fleet_view.model.rows[alpha_row].unused_shards()
    assert unused and len(unused) < len(fleet_view.model.rows[alpha_row].shards)
    box = fleet_view._ask_prune()
    assert box.text().startswith(f"Remove {len(unused)} shard(s), ") and "from alpha?" in box.text()
    box.accept()
    qtbot.waitUntil(lambda: fleet_view.banner.message.startswith(f"Removed {len(unused)} shard(s)"), timeout=30000)
    # alpha keeps the shard it serves and the one it holds as stage 2's standby
    qtbot.waitUntil(lambda: fleet_view.model.rows[alpha_row].shards_text() == "qwen2: layers 1-2, layer 3",
                    timeout=30000)

    # another app instance chats on the recorded deployment (Deployment.load().chain(key)) and leaves it running
    other, _, other_view = open_app(qtbot, fleet, max_new_tokens=24)
    assert other_view.use_recorded()
    tab = other.chat.new_chat()  # (the first tab reopened the saved conversation, with its history)
    tab.input.setPlainText(messages[0]["content"])
    with qtbot.waitSignal(tab.finished, timeout=120000) as blocker:
        tab.send()
    assert blocker.args[0].tokens == want and "deployed on the fleet" in other.service_label.text()
    other.close()

    def workers(address):
        with ControlClient(address, FleetAccess(key, fleet.tls)) as agent:
            return agent.status()["workers"]

    assert [len(workers(a)) for a in (fleet.alpha, fleet.beta)] == [2, 2]  # its stage and the other's standby
    window.close()  # the workers this session deployed are stopped
    assert workers(fleet.alpha) == [] and workers(fleet.beta) == []


def test_optimise_for_several_users_deploys_the_copies_the_solver_chose(qtbot, fleet):
    from engine.config import FleetAccess
    from engine.fleet.control import ControlClient
    from engine.fleet.layout import solve_layout
    from engine.fleetkey import load_key
    from fleetgui.placement_model import parse_profile

    doc = surveyed(qtbot, fleet)
    for device in doc["fleet"]["devices"]:  # PCs alike, each able to hold the model: copies serve 4 users best
        device.update(layer_ms=2.0, head_ms=12.0, embed_ms=0.1, call_ms=1.0, prefill_layer_ms=0.3,
                      memory_bytes=8 << 30)
    shape, _, fleet_model = parse_profile(doc)
    layout = solve_layout(shape, fleet_model, users=4)
    assert len(layout.plans) >= 2, layout.explain()
    key = load_key(fleet.key_file)
    # the admin's way: for 4 people, "Deploy the best layout" (the solver's best, then deployed)
    window, fleet_view, view = open_app(qtbot, fleet, max_new_tokens=8)
    wait_for_agents(qtbot, fleet_view, fleet)
    window.show_view("Placement")
    view.load_profile(doc)
    view.users.setValue(4)
    assert view.objective.currentText() == "throughput"
    deployed = []
    view.deployed.connect(deployed.append)
    view.best_button.click()
    qtbot.waitUntil(lambda: view.task is None, timeout=600000)
    assert deployed and deployed[0] is not None, view.banner.message
    assert "best layout found" in view.prediction.text() and "for 4 people at once" in view.prediction.text()
    assert f"{len(layout.plans) - 1} more cop" in view.prediction.text()
    deployment = deployed_and_chatted(qtbot, window, view, deploy=False)
    assert len(deployment.copies) == len(layout.plans)
    assert view.activity.text().count(", a copy on ") == len(layout.plans) - 1, view.activity.text()
    assert "127.0.0.1" not in view.activity.text()  # the PCs by name

    def workers(address):
        with ControlClient(address, FleetAccess(key, fleet.tls)) as agent:
            return agent.status()["workers"]

    assert {w["agent"] for copy in deployment.copies for w in copy.workers} == {fleet.alpha, fleet.beta}
    assert sum(len(workers(a)) for a in (fleet.alpha, fleet.beta)) == sum(len(c.workers) for c in deployment.copies)
    assert f"{len(layout.plans)} copies" in window.service_label.text()  # the chat serves from every copy
    window.close()  # every copy's workers are stopped with the window
    assert workers(fleet.alpha) == [] and workers(fleet.beta) == []


def test_optimise_for_one_user_on_slow_pcs_draws_and_deploys_two_tensor_parallel_ranks(qtbot, fleet):
    from engine.config import FleetAccess
    from engine.fleet.control import ControlClient
    from engine.fleetkey import load_key

    doc = surveyed(qtbot, fleet)
    assert doc["model"]["max_ranks"] == 2  # the tiny Qwen2's export splits into two ranks
    for device in doc["fleet"]["devices"]:  # PCs alike whose layers cost far more than an exchange
        device.update(layer_ms=60.0, head_ms=100.0, embed_ms=0.1, call_ms=1.0, prefill_layer_ms=20.0,
                      memory_bytes=8 << 30)
    window, view = optimised(qtbot, fleet, doc, 1)
    model = view.model
    assert model.ranks and [(start, end) for _, start, end in names(model)] == [(0, 4), (0, 4)], names(model)
    assert names(model)[0][0] == "this PC" and not model.problems, model.problems
    assert [s.rank for s in model.placement()] == [0, 1]
    assert not model.move_boundary(0, 2)  # ranks have no boundary to drag
    screenshot(window, "placement-ranks")
    deployment = deployed_and_chatted(qtbot, window, view)
    assert deployment.ranks == 2 and len(deployment.workers) == 1
    window.close()
    with ControlClient(deployment.workers[0]["agent"], FleetAccess(load_key(fleet.key_file), fleet.tls)) as agent:
        assert agent.status()["workers"] == []
    model.move_range(0, 2, model.lane_of(*next((lane.node, lane.device) for lane in model.lanes
                                                 if lane.name != "this PC")))
    assert not model.ranks and [(a, b) for _, a, b in names(model)] == [(0, 2), (2, 4)]  # a chain by hand again


def test_a_cancelled_deployment_leaves_no_workers(qtbot, fleet):
    from engine.config import FleetAccess
    from engine.fleet.control import ControlClient
    from engine.fleetkey import load_key

    surveyed(qtbot, fleet)
    window, _, view = open_app(qtbot, fleet)
    window.show_view("Placement")
    even_split(view.model)
    deployed = []
    view.deployed.connect(deployed.append)
    view.deploy_button.click()
    assert view.cancel_button.isEnabled()
    view.cancel_button.click()
    qtbot.waitUntil(lambda: view.task is None, timeout=120000)
    assert deployed == [] and view.activity.text() == "Cancelled." and view.deployment is None
    for address in (fleet.alpha, fleet.beta):
        with ControlClient(address, FleetAccess(load_key(fleet.key_file), fleet.tls)) as agent:
            assert agent.status()["workers"] == []
    assert view.deploy_button.isEnabled() and not view.cancel_button.isEnabled()


def test_embedded_default_chats_on_a_local_fleet_and_stops_with_the_window(qtbot, fleet):
    window, _, _ = open_app(qtbot, fleet, local_workers=True, stages=2, fleet_key_file="")
    controller = window.chat_controller
    with qtbot.waitSignal(controller.ready, timeout=600000):
        controller.open()
    service = controller.service
    assert service.description.endswith("2 parts, local fleet")
    agent = service._owned[0].proc
    assert agent.poll() is None
    fleet_view = window.show_view("Fleet")  # the local fleet's agent is listed as a node, not offered to placements
    qtbot.waitUntil(lambda: any(r.found_by == "local fleet" and r.status.startswith("serving part 2")
                                for r in fleet_view.model.rows), timeout=30000)
    local = next(r.address for r in fleet_view.model.rows if r.found_by == "local fleet")
    assert local not in fleet_view.agent_addresses()
    tab = window.chat.all_tabs()[0]
    tab.input.setPlainText("hello")
    with qtbot.waitSignal(tab.finished, timeout=120000) as blocker:
        tab.send()
    assert blocker.args[0].stopped_by in ("eos", "max_tokens") and blocker.args[0].tokens
    window.close()
    assert agent.wait(timeout=15) is not None


def office_profile() -> dict:
    """A profile as the survey writes it, of three PCs: this one, a laptop as fast (simulated, as the
    demo fleet's are) and an old PC nine times as slow a layer; the model fits this PC alone."""
    from engine.fleet.deploy import LOCAL
    from engine.fleet.placement import DeviceProfile, Fleet, ModelShape

    gb = 2**30
    here, laptop, old = "a1b2c3d4e5f60001", "a1b2c3d4e5f60002", "a1b2c3d4e5f60003"
    shape = ModelShape("office-model", 24, gb // 20, gb // 5, gb // 5, gb // 250, gb // 5)
    fleet = Fleet([DeviceProfile(here, "CPU", 8 * gb, 1.0, 8.0, 0.1, 0.5),
                   DeviceProfile(laptop, "CPU", 8 * gb, 1.0, 8.0, 0.1, 0.5),
                   DeviceProfile(old, "CPU", 8 * gb, 9.0, 60.0, 0.1, 3.0)],
                  {(here, laptop): 0.5, (here, old): 0.5, (laptop, old): 0.5}, here)
    return {"model": shape.to_json(), "fleet": fleet.to_json(), "source": "office-model", "weights": "int4",
            "nodes": {here: {"name": "this PC", "address": LOCAL},
                      laptop: {"name": "laptop-2", "address": "127.0.0.1:9", "simulated": True},
                      old: {"name": "old-pc", "address": "127.0.0.1:8"}}}


def test_a_profile_saved_when_this_pc_was_this_machine_shows_this_pc(qtbot, gui_home, tmp_path):
    """A profile saved when the app called the coordinator "this machine" opens with this PC named
    as the app names it now, in the PC boxes and the lanes, and is kept (for the deployment) so."""
    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    view = window.show_view("Placement")
    doc = office_profile()
    doc["nodes"]["a1b2c3d4e5f60001"]["name"] = "this machine"
    path = tmp_path / "old-profile.json"
    path.write_text(json.dumps(doc))
    view.open_profile(path)
    assert view.banner.isHidden()  # read, not refused
    assert [box.text() for box in view.pc_checks.values()] == ["this PC", "laptop-2 (simulated)", "old-pc"]
    assert view.model.lanes[0].label == "this PC · CPU" and view.doc["nodes"]["a1b2c3d4e5f60001"]["name"] == "this PC"


def test_an_admin_picks_pcs_and_people_and_reads_the_plan_in_plain_words(qtbot, gui_home, tmp_path):
    """No fleet needed: the admin's controls over a profile, the best layout's words, a hand edit
    compared with the best, a prediction on simulated PCs said to be one, and plain reasons for a
    PC left out; the expert's controls stay behind Details."""
    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    view = window.show_view("Placement")
    view.load_profile(office_profile())
    assert [box.text() for box in view.pc_checks.values()] == ["this PC", "laptop-2 (simulated)", "old-pc"]
    assert not view.pc_checks["a1b2c3d4e5f60001"].isEnabled()  # this PC runs the chat: always in
    assert view.best_button.isVisible() and view.best_button.text() == "Deploy the best layout"
    assert not view.objective.isVisible() and not view.tree.isVisible() and not view.optimise_button.isVisible()

    view.optimise()  # what "Deploy the best layout" runs before it deploys
    qtbot.waitUntil(lambda: view.task is None, timeout=60000)
    assert names(view.model) == [("this PC", 0, 24)]  # the model whole here: no hop to pay
    assert "for one person, on this PC. It is the best layout found." in view.prediction.text()
    left = view.left_out.text().splitlines()
    assert "laptop-2 is left out: one more network hop costs more than it saves." in left, left
    assert "old-pc is left out: it is slower than the PCs in use: a part there would slow every answer." in left
    assert "ms a layer" in view.reasons.text() and not view.reasons.isVisible()  # the figures, for experts

    # a hand-made plan says how it compares with the best, and that it rests on a simulated PC
    view.model.move_range(12, 24, view.model.lane_of("a1b2c3d4e5f60002", "CPU"))
    best = view.best.tok_s
    assert f"; the best found: {best:.1f}." in view.prediction.text()
    assert f"This layout: {view.model.evaluation.plan.tok_s:.1f} tok/s predicted" in view.prediction.text()
    assert "rests on simulated PCs (laptop-2)" in view.prediction.text()

    # for several people the solver weighs the most words in all; a PC not ticked is not used
    view.users.setValue(3)
    assert view.objective.currentText() == "throughput" and "for 3 people at once" in view.prediction.text()
    view.pc_checks["a1b2c3d4e5f60002"].setChecked(False)
    assert "Deploy the best layout finds the fastest" in view.prediction.text()  # the best was for other PCs
    view.optimise()
    qtbot.waitUntil(lambda: view.task is None, timeout=60000)
    assert "laptop-2" not in [name for name, _, _ in names(view.model)]
    assert all(span.node != "127.0.0.1:9" for copy in view.copies[1] for span in copy)
    assert "best layout found" in view.prediction.text()

    view.details_button.click()
    assert view.objective.isVisible() and view.tree.isVisible() and view.reasons.isVisible()


def test_the_best_layout_on_this_pc_alone_is_said_not_refused(qtbot, gui_home, tmp_path):
    """For one person the best layout can be the model whole on this PC (found by the walkthrough on the
    demo fleet): "Deploy the best layout" says the chat already runs so, instead of refusing it in the
    engine's words, and starts nothing."""
    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    view = window.show_view("Placement")
    view.load_profile(office_profile())
    deployed = []
    view.deployed.connect(deployed.append)
    view.best_button.click()
    qtbot.waitUntil(lambda: view.task is None, timeout=60000)
    assert names(view.model) == [("this PC", 0, 24)] and not deployed
    assert "nothing to deploy" in view.banner.message and view.banner.property("level") == "info", view.banner.message
    assert "node agent" not in view.banner.message and view.problems.text() == ""
    assert "It is the best layout found. This PC alone runs this layout" in view.prediction.text()
    view.model.move_range(12, 24, view.model.lane_of("a1b2c3d4e5f60002", "CPU"))  # a chain: deployable again
    assert "nothing to deploy" not in view.prediction.text() and view.problems.text() == ""


def test_the_model_to_place_is_named_not_given_by_its_path(qtbot, gui_home, tmp_path, tiny_exports):
    """Placement's model field, as Settings' default model: the exported model by its name and where it
    runs, the folder in the tooltip; a profile's own source shown so too; a typed name taken as typed."""
    shards = tiny_exports["qwen2", "2"].out
    window = open_window(qtbot, tiny_settings(shards), settings_store(tmp_path / "s.ini"))
    view = window.show_view("Placement")
    assert view.source.currentText() == "qwen2 — on this PC" and str(shards) in view.source.toolTip()
    assert view.source.source() == str(shards)
    folder = tmp_path / "office-model"
    view.load_profile({**office_profile(), "source": str(folder)})
    assert view.source.currentText() == "office-model — on this PC" and view.source.source() == str(folder)
    assert str(folder) not in view.source.currentText() and str(folder) in view.source.toolTip()
    view.source.setEditText("smollm2-135m")
    assert view.source.source() == "smollm2-135m"
