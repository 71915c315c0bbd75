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
