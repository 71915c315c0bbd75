"""The export wizard: the tiny Llama as a Hugging Face source, exported in two stages with every
stage's progress reaching 100% and the shard sizes shown; Cancel ends the export with nothing left."""

from __future__ import annotations

from PySide6.QtWidgets import QLabel, QRadioButton

from gui_support import open_window, screenshot, settings_store, tiny_settings

from engine.manifest import load_manifest


def _to_export_page(wizard, source, out, stages=2):
    wizard.hf_radio.setChecked(True)
    wizard.hf_path.setText(str(source))
    wizard.next_button.click()
    assert wizard.pages.currentIndex() == 1
    wizard.weights.setCurrentText("f32")
    wizard.stages.setValue(stages)
    wizard.by_count.setChecked(True)
    wizard.out.setText(str(out))


def test_export_wizard_exports_the_tiny_model(qtbot, gui_home, tmp_path, tiny_models):
    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    wizard = window.show_view("Export")
    wizard.hf_radio.setChecked(True)
    wizard.next_button.click()  # no folder given yet: refused with a message, stays on page 1
    assert wizard.pages.currentIndex() == 0 and "Choose a model" in wizard.banner.message
    note = wizard.weights.parentWidget().findChild(QLabel, "hint")  # each format says what it is for
    wizard.weights.setCurrentText("gguf")
    assert "answers as the GGUF does in llama.cpp" in note.text()
    wizard.weights.setCurrentText("int4")
    assert note.text().startswith("INT4 (Fast for a GGUF): smallest and fastest")
    out = tmp_path / "export"
    _to_export_page(wizard, tiny_models["llama"], out)
    assert wizard.choice_box.isHidden()  # Faithful / Fast is a GGUF's choice
    seen: dict[int, list[int]] = {}
    with qtbot.waitSignal(wizard.exported, timeout=180000) as blocker:
        wizard.next_button.click()  # "Export"
        assert wizard.pages.currentIndex() == 2 and wizard.cancel_button.isVisible()
        assert len(wizard.stage_bars) == 2 and not wizard.pull_bar.isVisible()  # an HF folder needs no pull
        for i, bar in enumerate(wizard.stage_bars):
            bar.valueChanged.connect(lambda v, i=i: seen.setdefault(i, []).append(v))
    result = blocker.args[0]

    assert [s.index for s in result.stages] == [0, 1] and not result.cached
    for i, bar in enumerate(wizard.stage_bars):
        assert bar.value() == 100
        assert len(seen[i]) > 2 and seen[i] == sorted(seen[i]) and seen[i][-1] == 100  # progress, step by step
    for s in result.stages:
        assert load_manifest(s.folder).layers == tuple(s.layers)
        assert wizard.table.item(s.index, 3).text() == f"{s.size_mb:.2f}"
        assert str(s.folder) in wizard.table.item(s.index, 0).toolTip()  # the folder: in the tooltip
        assert int(wizard.table.item(s.index, 2).text()) > 0  # peak memory of the stage's process
    assert wizard.table.rowCount() == 2
    assert f"{sum(s.size_mb for s in result.stages):.2f} MB" in wizard.total.text()
    assert str(out) not in wizard.total.text() + wizard.summary.text() and str(out) in wizard.total.toolTip()
    assert not wizard.cancel_button.isVisible() and wizard.again_button.isVisible()
    screenshot(window, "export")

    # the export can become the chat's model in one click
    wizard.default_button.click()
    assert window.settings.default_model == str(out) and window.current_view() == "Chat"
    assert window.statusBar().currentMessage() == "Chat now uses llama on this PC"  # its manifest's name


def test_cancel_really_cancels_the_export(qtbot, gui_home, tmp_path, tiny_models):
    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    wizard = window.show_view("Export")
    out = tmp_path / "cancelled"
    _to_export_page(wizard, tiny_models["llama"], out)
    wizard.force.setChecked(True)
    wizard.next_button.click()
    qtbot.waitUntil(lambda: wizard.stage_bars[0].value() > 0, timeout=120000)
    wizard.cancel_button.click()
    qtbot.waitUntil(lambda: wizard.task is None, timeout=60000)
    assert wizard.total.text() == "Export cancelled."
    assert wizard.result is None and not wizard.banner.message
    assert not any(p.is_dir() and p.name.startswith("stage") for p in out.iterdir())
    assert wizard.back_button.isVisible()  # and the user can change the plan and go again


def test_catalog_models_show_their_pull_progress(qtbot, gui_home, tmp_path):
    """A catalog model that is not cached yet is pulled first: the wizard shows that progress too
    (a stub backend reports what EngineBackend.export reports while pulling)."""
    from engine.export.exporter import ExportResult, StageReport
    from engine.progress import exporting, pulling
    from fleetgui.backend import EngineBackend

    class Pulling(EngineBackend):
        def export(self, source, *, progress, cancel=None, **kw):
            assert source == "smollm2-135m" and kw["stages"] == 1 and (kw["weights"], kw["head"]) == ("int8", "int8")
            for fraction in (0.0, 0.4, 1.0):
                progress(pulling("assemble", round(fraction * 270e6), 270_000_000))
            progress(exporting(0, 1, "load", 0.0))
            progress(exporting(0, 1, "done", 1.0))
            return ExportResult(tmp_path, [StageReport(0, (0, 30), tmp_path / "stage0", 812.0, 3.5, 97.25)], False)

    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"),
                         backend=Pulling())
    wizard = window.show_view("Export")
    wizard.choose_catalog("smollm2-135m")
    wizard.weights.setCurrentText("auto")
    wizard.next_button.click()
    # a GGUF's choice in words: Faithful (auto's choice) or Fast, each with what it was measured to cost
    faithful, fast = (wizard.findChild(QRadioButton, f"choice-{w}") for w in ("gguf", "int4"))
    assert not wizard.choice_box.isHidden() and faithful.isChecked() and not fast.isChecked()
    assert wizard.weights.currentText() == "auto"  # shown as Faithful, still auto
    assert faithful.text() == "Same answers as the GGUF" and fast.text() == "Faster, slightly different answers"
    assert "KL" not in wizard.choice_notes["gguf"].text() + wizard.choice_notes["int4"].text()  # the details':
    assert "KL 0.002" in wizard.choice_notes["gguf"].toolTip() and "KL 0.32" in wizard.choice_notes["int4"].toolTip()
    assert not wizard.weights.isVisible() and not wizard.head.isVisible()  # behind Details
    wizard.details_button.click()
    assert wizard.weights.isVisible() and wizard.head.isVisible()
    fast.click()
    assert wizard.weights.currentText() == "int4" and not faithful.isChecked()
    wizard.weights.setCurrentText("int8")
    assert not fast.isChecked() and not faithful.isChecked()
    wizard.weights.setCurrentText("gguf")
    assert faithful.isChecked()
    wizard.weights.setCurrentText("int4")
    wizard.head.setCurrentText("int4")  # an INT4 head, offered with INT4 layers only
    assert wizard.head.isEnabled() and "perplexity" in wizard.head.parentWidget().findChild(QLabel, "hint").text()
    wizard.weights.setCurrentText("int8")
    assert not wizard.head.isEnabled() and wizard.head.currentText() == "int8"
    wizard.stages.setValue(1)
    values = []
    wizard.pull_bar.valueChanged.connect(values.append)
    with qtbot.waitSignal(wizard.exported, timeout=10000):
        wizard.next_button.click()
    assert wizard.pull_bar.isVisible() and values[-1] == 100 and 40 in values
    assert wizard.pull_label.text() == "Model downloaded; preparing it"  # in the words of the chat's panel
    assert wizard.stage_labels[0].text() == "part 1: done, peak 812 MB"
    assert [wizard.table.item(0, c).text() for c in (1, 2, 3)] == ["0-29", "812", "97.25"]
    # the status lines name the model, never its cache folder (that is in a tooltip)
    assert wizard.summary.text() == "Exported SmolLM2 135M in 1 part (int8) on this PC."  # past tense once done
    assert wizard.total.text() == "SmolLM2 135M in 1 part, 97.25 MB in all, saved on this PC."
    assert wizard.total.toolTip() and str(tmp_path) in wizard.total.toolTip()
    assert window.statusBar().currentMessage() == "Exported SmolLM2 135M in 1 part"


def test_the_engine_reports_bytes_and_stage_counts_the_wizard_follows(qtbot, gui_home, tmp_path, monkeypatch):
    """engine.session passes on the pull's and the export's progress with their counts (the model's
    bytes while it downloads, the stage count while it exports), ends the pull with the step that
    follows it, and the wizard follows them."""
    from engine import session
    from engine.export.exporter import ExportResult, StageReport
    from engine.models.catalog import CATALOG
    from engine.progress import exporting, pulling

    size = CATALOG["smollm2-135m"].size
    pulled = [pulling("download", 0, size), pulling("download", round(size / 2), size), pulling("download", size, size),
              pulling("assemble", size // 4, size), pulling("verify", 0, size)]

    def pull(name, progress):  # what engine.models.catalog.pull reports: the packages' bytes, then the file's
        for event in pulled:
            progress(event)

    def export_model(source, *, progress, stages, split, **kw):
        for i in range(stages):
            progress(exporting(i, stages, "compress", 0.5))
        return ExportResult(tmp_path, [StageReport(i, (i, i + 1), tmp_path / f"stage{i}", 1.0, 1.0, 1.0)
                                       for i in range(stages)], False)

    monkeypatch.setattr(session, "pull", pull)
    monkeypatch.setattr(session, "export_model", export_model)
    seen = []
    session.export("smollm2-135m", stages=2, progress=seen.append)
    assert seen == [*pulled, pulling("ready", size, size), exporting(0, 2, "compress", 0.5),
                    exporting(1, 2, "compress", 0.5)]
    assert [(p.bytes_done, p.bytes_total) for p in seen[:3]] == [(0, size), (round(size / 2), size), (size, size)]
    assert [p.text for p in seen[-2:]] == ["Exporting part 1 of 2 (compressing)",
                                           "Exporting part 2 of 2 (compressing)"]

    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    wizard = window.show_view("Export")
    wizard.choose_catalog("smollm2-135m")
    wizard.next_button.click()
    wizard.stages.setValue(2)
    with qtbot.waitSignal(wizard.exported, timeout=10000):
        wizard.next_button.click()
    assert wizard.pull_bar.value() == 100 and wizard.stage_labels[1].text() == "part 2: done, peak 1 MB"


def test_export_wizard_takes_the_split_of_a_placement_plan(qtbot, gui_home, tmp_path, tiny_models):
    import json

    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    wizard = window.show_view("Export")
    _to_export_page(wizard, tiny_models["llama"], tmp_path / "export")
    plan = {"plan": {"stages": [{"node": "a", "device": "CPU", "start": 0, "end": 1},
                                {"node": "b", "device": "CPU", "start": 1, "end": 3},
                                {"node": "c", "device": "CPU", "start": 3, "end": 4}]}, "nodes": {}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    wizard.use_plan(tmp_path / "plan.json")
    assert wizard.by_split.isChecked() and wizard.split.text() == "1,3"
    (tmp_path / "bad.json").write_text("{}")
    wizard.use_plan(tmp_path / "bad.json")
    assert "not a placement plan" in wizard.banner.message and wizard.split.text() == "1,3"
