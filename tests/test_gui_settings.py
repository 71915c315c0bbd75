"""The Settings view as an office IT admin meets it: the mouse wheel scrolls the page instead of
changing the combo and spin box under the pointer (in every form of the app, not only Settings),
the fields are grouped (Chat, Models, Fleet, API and tools, Advanced) with the technical ones under
Advanced, and the main path of the app speaks plain words: the jargon the walkthrough found is not
in the visible text of Settings, Placement, the model cards or Export."""

from __future__ import annotations

from gui_support import open_window, settings_store, tiny_settings


def wheel(widget, steps: int = -1) -> None:
    """One notch of the mouse wheel over the middle of ``widget`` (down for a negative ``steps``),
    through the window system as a real wheel's: Qt gives it to the widget under the pointer, then
    to its parents while it is ignored."""
    from PySide6.QtCore import QPoint
    from PySide6.QtTest import QTest
    from PySide6.QtWidgets import QApplication

    window = widget.window()
    QTest.wheelEvent(window.windowHandle(), widget.mapTo(window, widget.rect().center()), QPoint(0, 120 * steps))
    QApplication.processEvents()


def test_the_wheel_scrolls_past_combo_and_spin_boxes_unless_they_have_the_focus(qtbot, gui_home, tmp_path):
    from PySide6.QtWidgets import QApplication, QScrollArea

    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    window.resize(1024, 640)
    page = window.open_settings()
    qtbot.waitUntil(page.isVisible)
    page.chat_preset.setCurrentText("Balanced")
    before = (page.chat_preset.currentText(), page.max_new_tokens.value(), page.theme.currentText())
    scroll = page.findChild(QScrollArea)
    bar = scroll.verticalScrollBar()
    assert bar.maximum() > 0  # the page is longer than the window: the wheel has somewhere to go
    for box in (page.chat_preset, page.max_new_tokens, page.theme):
        scroll.ensureWidgetVisible(box)
        QApplication.processEvents()
        assert not box.hasFocus() and box.visibleRegion().contains(box.rect().center())
        at = bar.value()
        wheel(box)
        assert bar.value() > at or at == bar.maximum()  # the page scrolled instead
    assert (page.chat_preset.currentText(), page.max_new_tokens.value(), page.theme.currentText()) == before

    # a box the user clicked into takes the wheel, as it should
    scroll.ensureWidgetVisible(page.max_new_tokens)
    page.max_new_tokens.setFocus()
    qtbot.waitUntil(page.max_new_tokens.hasFocus)
    wheel(page.max_new_tokens, 1)
    assert page.max_new_tokens.value() == before[1] + 1

    # the same in another view's form: Placement's "for N people at once"
    placement = window.show_view("Placement")
    qtbot.waitUntil(placement.isVisible)
    assert not placement.users.hasFocus()
    users = placement.users.value()
    wheel(placement.users, 1)
    assert placement.users.value() == users


# The jargon the walkthrough found on the main path (issue 81), as patterns: each may stand behind a
# details control, never in the text a view shows before one is opened.
JARGON = {
    "coordinator": r"coordinator", "stage": r"\bstages?\b", "layers ×2": r"×\s*\d", "lane": r"\blanes?\b",
    "pin": r"\bpin(s|ned)?\b", "objective": r"\bobjective\b", "KL": r"\bKL\b", "nats": r"\bnats\b",
    "GPTQ": r"GPTQ", "LM head": r"LM head", "hop delay": r"hop delay", "ksweep": r"ksweep",
    "microbatch": r"micro-?batch", "Guess ahead (K)": r"guess ahead", "stages 1..": r"\d\.\.",
}


def visible_texts(root) -> list[str]:
    """Every text ``root`` shows as it stands: labels, buttons, group titles, check boxes, the current
    choice of combo boxes, placeholders, the headers and cells of item views (a table's every column,
    a list's or tree's first) and the blocks of the plan's picture; only widgets visible within ``root``
    (a collapsed details section's are not)."""
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import (QAbstractButton, QAbstractItemView, QComboBox, QGroupBox, QLabel, QLineEdit,
                                   QTableView, QTreeView, QWidget)

    texts = []
    for widget in [root, *root.findChildren(QWidget)]:
        if widget is not root and not widget.isVisibleTo(root):
            continue
        if isinstance(widget, (QLabel, QAbstractButton)):
            texts.append(widget.text())
        elif isinstance(widget, QGroupBox):
            texts.append(widget.title())
        elif isinstance(widget, QComboBox):
            texts.append(widget.currentText())
        elif isinstance(widget, QLineEdit):
            texts.append(widget.placeholderText())
        if isinstance(widget, QAbstractItemView) and widget.model() is not None:
            model = widget.model()
            if isinstance(widget, (QTableView, QTreeView)):
                header = widget.header() if isinstance(widget, QTreeView) else widget.horizontalHeader()
                texts += [str(model.headerData(c, Qt.Orientation.Horizontal) or "") for c in range(header.count())]
            columns = range(model.columnCount()) if isinstance(widget, QTableView) else range(1)
            texts += [str(model.index(r, c).data() or "") for r in range(min(model.rowCount(), 50)) for c in columns]
        if hasattr(widget, "block_label") and getattr(widget, "model", None) is not None:  # the plan's picture
            texts += [widget.block_label(i) for i in range(len(widget.model.stages))]
    return [t for t in texts if t]


def jargon_in(texts: list[str]) -> list[tuple[str, str]]:
    import re

    return [(name, text) for text in texts for name, pattern in JARGON.items()
            if re.search(pattern, text, re.IGNORECASE)]


def test_the_main_path_speaks_plain_words(qtbot, gui_home, tmp_path):
    """Settings, Placement (a plan found and drawn), the model cards and the export wizard's steps
    show none of the jargon until their details are opened; opened, the technical terms are there
    (so the walk sees what it should)."""
    from PySide6.QtWidgets import QApplication
    from test_gui_placement import office_profile

    window = open_window(qtbot, tiny_settings(tmp_path / "none", weights="auto"), settings_store(tmp_path / "s.ini"))
    page = window.open_settings()
    assert [box.title() for box in page.sections.values()] == ["Chat", "Models", "Fleet", "API and tools", "Advanced"]
    for field in (page.k, page.draft, page.weights, page.mode, page.devices):  # technical: under Advanced
        assert page.sections["Advanced"].isAncestorOf(field) and not field.isVisibleTo(page)
    assert jargon_in(visible_texts(page)) == []
    page.show_advanced.click()
    assert page.k.isVisibleTo(page) and jargon_in(visible_texts(page))  # "GPTQ" in the weights' note

    placement = window.show_view("Placement")
    placement.load_profile(office_profile())
    placement.optimise()
    qtbot.waitUntil(lambda: placement.task is None, timeout=60000)
    placement.model.move_range(12, 24, placement.model.lane_of("a1b2c3d4e5f60002", "CPU"))  # a plan by hand
    assert "the best found" in placement.prediction.text()
    assert jargon_in(visible_texts(placement)) == []
    placement.details_button.click()
    assert jargon_in(visible_texts(placement))  # the stages, lanes and pins of the expert's view

    wizard = window.show_view("Export")
    wizard.cards.weights = "auto"
    wizard.cards.render()
    assert jargon_in(visible_texts(wizard)) == []  # page 1: the model cards
    wizard.choose_catalog("smollm2-135m")
    wizard.next_button.click()
    QApplication.processEvents()
    assert wizard.pages.currentIndex() == 1 and wizard.choice_box.isVisibleTo(wizard)
    assert jargon_in(visible_texts(wizard)) == []  # page 2: the choice in words
    wizard.details_button.click()
    assert jargon_in(visible_texts(wizard))  # the LM head, behind Details

    fleet = window.show_view("Fleet")  # this PC's row, and what it does
    qtbot.waitUntil(lambda: fleet.model.rowCount() >= 1)
    assert jargon_in(visible_texts(fleet)) == []
    bench = window.show_view("Benchmarks")  # "How fast is my fleet?", chosen from the start
    assert bench.chosen() == "fleet" and jargon_in(visible_texts(bench)) == []


def test_the_default_model_is_named_with_where_it_runs_its_folder_in_the_tooltip(qtbot, gui_home, tmp_path,
                                                                                   tiny_exports):
    """Settings › Default model shows an exported model by its name and where it runs, never by its
    cache path (that is in the tooltip); saving keeps the folder, a catalog choice saves its name
    and a typed path is taken as typed."""
    from fleetgui.settings import GuiSettings

    shards = tiny_exports["qwen2", "2"].out
    path = tmp_path / "s.ini"
    window = open_window(qtbot, tiny_settings(shards), settings_store(path))
    page = window.open_settings()
    assert page.model.currentText() == "qwen2 — on this PC"
    texts = visible_texts(page.sections["Models"])
    assert not any(str(shards) in t or "/" in t for t in texts), texts
    assert str(shards) in page.model.toolTip()
    assert page.accept() and window.settings.default_model == str(shards)  # the folder, as it was

    page.model.setCurrentIndex(page.model.findData("smollm2-135m"))
    assert page.model.currentText().startswith("SmolLM2 135M — ") and page.model.toolTip() == ""
    assert page.accept() and GuiSettings.load(settings_store(path)).default_model == "smollm2-135m"
    page.model.setEditText(str(tmp_path / "model.gguf"))
    assert page.model.source() == str(tmp_path / "model.gguf")
