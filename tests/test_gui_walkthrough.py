"""The user guide's walkthrough, as a new user takes it, in one window on the tiny Qwen2 model: first
start (the chat is ready, nothing to choose), a chat, the demo fleet, Profile fleet → Deploy the best
layout → a chat on the fleet, an export, "How fast is my fleet?", Settings and a chat with documents.
At each step the window is looked at on a 1366x768 laptop screen and a 1024x640 one: the view fits
(``test_gui_layout.assert_fits``: no scrolling view, no button or field cut off), it shows the step's
state, and with ``--screenshots DIR`` it is saved as walkthrough-WxH-NN-step.png (docs/guide.md's
Walkthrough shows them)."""

from __future__ import annotations

from gui_support import open_window, screenshot, settings_store, tiny_settings
from PySide6.QtWidgets import QFileDialog, QInputDialog
from test_gui_documents import handbook
from test_gui_layout import assert_fits, cut_labels

from engine.runtime.stages.stage import core

core()  # before any test starts a thread: creating an OpenVINO Core forks a child that hangs if threads run

SIZES = ((1366, 768), (1024, 640))
TOKENS = 16


class Walk:
    """Looks at the window at every size after each step: it fits, and its picture is kept."""

    def __init__(self, qtbot, window):
        self.qtbot, self.window, self.step = qtbot, window, 0

    def look(self, name: str) -> None:
        self.step += 1
        for size in SIZES:
            self.window.resize(*size)
            where = f"step {self.step} ({name}) at {size[0]}x{size[1]}"
            assert_fits(self.window, size, where)
            assert not cut_labels(self.window), f"{where}: " + "; ".join(cut_labels(self.window))
            screenshot(self.window, f"walkthrough-{size[0]}x{size[1]}-{self.step:02d}-{name}", size, palette=True)
        self.window.resize(*SIZES[0])

    def chat(self, text: str):
        tab = self.window.chat.tabs.currentWidget()
        tab.input.setPlainText(text)
        with self.qtbot.waitSignal(tab.finished, timeout=300000) as blocker:
            tab.send()
        reply = blocker.args[0]
        assert reply.tokens and not reply.error, reply.error
        return tab, reply


def test_the_walkthrough(qtbot, gui_home, tiny_models, tmp_path, monkeypatch):
    settings = tiny_settings(tiny_models["qwen2"], max_new_tokens=TOKENS)
    window = open_window(qtbot, settings, settings_store(tmp_path / "s.ini"))
    walk = Walk(qtbot, window)

    # 1. first start: the Chat view, ready to type in, nothing to choose first
    assert window.current_view() == "Chat"
    tab = window.chat.tabs.currentWidget()
    assert tab.input.isEnabled() and tab.send_button.isEnabled() and not tab.busy
    walk.look("first-start")

    # 2. a chat: the reply streams in, with its speed
    tab, reply = walk.chat("What is the capital of France?")
    assert reply.text in tab.transcript.toPlainText() and "tok/s" in tab.stats.text()
    assert window.service_label.text().startswith("Chat: qwen2")
    walk.look("chat")

    # 3. the demo fleet: demo nodes on this PC, listed beside this machine, marked simulated
    fleet_view = window.show_view("Fleet")
    fleet_view.timer.setInterval(500)
    fleet_view.start_demo(2)
    qtbot.waitUntil(lambda: fleet_view.demo is not None, timeout=120000)
    demo = fleet_view.demo
    qtbot.waitUntil(lambda: sorted(fleet_view.agent_addresses()) == sorted(demo.addresses), timeout=30000)
    assert fleet_view.demo_note.isVisible() and "DEMO FLEET: 2 simulated nodes" in fleet_view.demo_note.text()
    for node in demo.nodes:
        row = fleet_view.model.row(node.name)
        assert row.found_by == "demo" and row.simulated
    placement = window.views["Placement"]
    assert placement.best_button.text() in fleet_view.banner.message  # what to do next, with the buttons there are
    walk.look("demo-fleet")

    # 4. Profile fleet: a lane per PC, and the best plan the solver finds, said to rest on simulated PCs
    window.show_view("Placement")
    placement.profile_button.click()
    qtbot.waitUntil(lambda: placement.task is None, timeout=600000)
    assert placement.model.loaded, placement.banner.message
    assert len(placement.model.lanes) == 3 and "best layout found" in placement.prediction.text()
    walk.look("profile")
    if placement.alone_here():  # for one person the tiny model runs fastest whole here: said, nothing started
        placement.best_button.click()
        qtbot.waitUntil(lambda: placement.task is None, timeout=60000)
        assert "nothing to deploy" in placement.banner.message and placement.deployment is None

    # 5. for 2 people at once, Deploy the best layout (a copy of the model on each demo node), then chat on
    # the fleet: the status bar and Placement agree
    deployed = []
    placement.deployed.connect(deployed.append)
    for people in (2, 4, 8):  # the profile is measured: on a busy machine this PC alone may win for two
        placement.users.setValue(people)
        placement.best_button.click()
        qtbot.waitUntil(lambda: placement.task is None, timeout=600000)  # the solve, then the deployment
        if deployed:
            break
    assert deployed and deployed[0] is not None, (placement.banner.message, placement.activity.text())
    said = window.statusBar().currentMessage() + " " + window.service_label.text()
    assert str(tiny_models["qwen2"]) not in said, said  # the model by its name, not its folder
    walk.look("deploy")
    window.show_view("Chat")
    tab = window.chat.new_chat()
    tab, reply = walk.chat("Paris is the capital of")
    assert window.service_label.text().startswith("Chat: qwen2") and "deployed on the fleet" in \
        window.service_label.text(), window.service_label.text()
    walk.look("fleet-chat")
    window.show_view("Placement")
    assert placement.measured.text().startswith("Measured in the chat: "), placement.measured.text()
    walk.look("measured")

    # 6. an export: the tiny Llama's folder in two parts, each part's progress at 100%
    wizard = window.show_view("Export")
    walk.look("export-models")
    wizard.hf_radio.setChecked(True)
    wizard.hf_path.setText(str(tiny_models["llama"]))
    wizard.next_button.click()
    assert wizard.pages.currentIndex() == 1, wizard.banner.message
    wizard.weights.setCurrentText("f32")
    wizard.stages.setValue(2)
    wizard.by_count.setChecked(True)
    wizard.out.setText(str(tmp_path / "export"))
    with qtbot.waitSignal(wizard.exported, timeout=180000) as exported:
        wizard.next_button.click()
    assert [s.index for s in exported.args[0].stages] == [0, 1]
    assert all(bar.value() == 100 for bar in wizard.stage_bars) and wizard.default_button.isVisible()
    walk.look("export")

    # 7. "How fast is my fleet?": the deployment against this PC alone, in a sentence
    panel = window.show_view("Benchmarks")
    assert panel.chosen() == "fleet"
    panel.users.setValue(2)
    panel.tokens.setValue(4)
    panel.runs.setValue(1)
    with qtbot.waitSignal(panel.finished, timeout=300000) as finished:
        panel.run_button.click()
    assert finished.args[0] is not None, panel.banner.message
    assert panel.summary.isVisible() and panel.summary.text().startswith("Your fleet is "), panel.summary.text()
    walk.look("benchmarks")

    # 8. Settings: grouped, each field explained
    window.show_view("Settings")
    walk.look("settings")

    # 9. a chat with documents: a folder indexed in the Documents panel, a reply that cites its source
    window.show_view("Chat")
    folder = handbook(tmp_path / "handbook")
    panel, tab = window.chat.documents, window.chat.new_chat()
    monkeypatch.setattr(QInputDialog, "getText", staticmethod(lambda *a, **k: ("Handbook", True)))
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", staticmethod(lambda *a, **k: str(folder)))
    panel.new_button.click()
    with qtbot.waitSignal(panel.indexed, timeout=30000):
        panel.folder_action.trigger()
    assert "3 files" in panel.status.text()
    tab.documents_picker.setCurrentIndex(tab.documents_picker.findData("Handbook"))
    tab, reply = walk.chat("Where are the toner cartridges kept?")
    assert "Sources  [1] printers.md" in tab.transcript.toPlainText()
    walk.look("documents")

    procs = [node.proc for node in demo.nodes]
    window.close()  # the deployment's workers and the demo nodes end with the app
    assert all(proc.poll() is not None for proc in procs)

