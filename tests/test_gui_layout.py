"""Every view fits the window at 1366x768 and at 900x600: the window keeps the size it is given (no
view's minimum pushes it wider or taller), and every visible button and field lies whole inside it,
not scrolled away nor clipped by a parent.  Dialogs fit a 900x600 screen too."""

from __future__ import annotations

import pytest
from gui_support import open_window, screenshot, settings_store, tiny_settings

from fleetgui.mainwindow import VIEWS

SIZES = ((1366, 768), (900, 600))


def controls(root):
    """The visible buttons and fields below ``root`` (not the line edit inside a spin or combo box)."""
    from PySide6.QtWidgets import QAbstractButton, QAbstractSpinBox, QComboBox, QLineEdit, QPlainTextEdit, QWidget

    kinds = (QAbstractButton, QLineEdit, QComboBox, QAbstractSpinBox, QPlainTextEdit)
    return [w for w in root.findChildren(QWidget) if isinstance(w, kinds) and w.isVisible()
            and not isinstance(w.parent(), (QComboBox, QAbstractSpinBox)) and not w.objectName().startswith("qt_")]


def clipped(widget, root) -> str | None:
    """Why ``widget`` is not whole on screen inside ``root``: outside an ancestor's rectangle (the
    window, a scroll area's viewport...), or narrower than its own minimum (its text cut).  In a
    form that scrolls up and down (not the view's frame: views must fit), a field below the fold is
    fine; cut off at the side it is not."""
    from PySide6.QtCore import QRect
    from PySide6.QtWidgets import QScrollArea

    from fleetgui.widgets import ViewFrame

    rect = QRect(widget.mapTo(root, widget.rect().topLeft()), widget.size())
    parent = widget.parentWidget()
    while parent is not None:
        if parent is root:
            area = root.rect()
        else:
            area = QRect(parent.mapTo(root, parent.rect().topLeft()), parent.size())
        scroll = parent.parentWidget()
        if parent.objectName() == "qt_scrollarea_viewport" and isinstance(scroll, QScrollArea) \
                and not isinstance(scroll, ViewFrame):
            if not (area.left() <= rect.left() and rect.right() <= area.right()):  # only across
                return f"{rect.getRect()} cut at the side of {type(scroll).__name__} {area.getRect()}"
            rect = QRect(rect.x(), area.y(), rect.width(), min(rect.height(), area.height()))
        elif not area.contains(rect):
            return f"{rect.getRect()} outside {type(parent).__name__} {area.getRect()}"
        if parent is root:
            break
        parent = parent.parentWidget()
    hint = widget.minimumSizeHint()
    if widget.width() < hint.width() or widget.height() < hint.height():
        return f"squeezed to {widget.width()}x{widget.height()} below its minimum {hint.width()}x{hint.height()}"
    return None


def cut_labels(root) -> list[str]:
    """The visible word-wrapped labels below ``root`` given less height than their text needs at their
    width (the bottom lines cut off), each with what it needs."""
    from PySide6.QtWidgets import QApplication, QLabel

    QApplication.processEvents()
    return [f"label {label.text()[:40]!r}: {label.width()}x{label.height()}, its text needs "
            f"{label.heightForWidth(label.width())} px" for label in root.findChildren(QLabel)
            if label.isVisible() and label.wordWrap() and label.text()
            and label.height() < label.heightForWidth(label.width())]


def describe(widget) -> str:
    text = getattr(widget, "text", None)
    label = text() if callable(text) else ""
    return f"{type(widget).__name__} {label or widget.objectName() or widget.toolTip()[:30]!r}"


def assert_fits(window, size, where: str) -> None:
    from PySide6.QtWidgets import QApplication

    QApplication.processEvents()
    assert (window.width(), window.height()) == size, f"{where}: the window became {window.width()}x{window.height()}"
    frame = window.stack.currentWidget()  # the view's ViewFrame: it must not need to scroll
    assert not frame.verticalScrollBar().isVisible() and not frame.horizontalScrollBar().isVisible(), \
        f"{where}: the view needs {frame.widget().minimumSizeHint().toTuple()}, more than the window has"
    found = controls(window)
    assert found, where
    problems = [f"{describe(w)}: {why}" for w in found if (why := clipped(w, window))]
    assert not problems, f"{where}: " + "; ".join(problems)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_view_fits(qtbot, gui_home, tmp_path, size):
    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    for name in VIEWS:
        window.show_view(name)
        window.resize(*size)
        qtbot.waitUntil(window.views[name].isVisible)
        assert_fits(window, size, f"{name} at {size}")
        hint = window.minimumSizeHint()
        assert hint.width() <= size[0] and hint.height() <= size[1], (name, hint)
    window.show_view("Export")
    for page in (1, 2, 0):  # the wizard's other steps, and back
        window.export._show_page(page)
        assert_fits(window, size, f"Export step {page + 1} at {size}")
    window.chat.banner.error("A long message from the engine " * 6)  # a banner takes room: still fits
    window.show_view("Chat")
    assert_fits(window, size, f"Chat with a banner at {size}")
    if size == (1366, 768):  # the other views' screenshots come from their own tests, with content
        window.show_view("Settings")
        screenshot(window, "settings", size)


def test_views_fit_900x600_with_a_larger_font(qtbot, gui_home, tmp_path):
    """A system font a quarter larger (the issue's desktop): still nothing off the window."""
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance()
    font = app.font()
    try:
        bigger = app.font()
        bigger.setPointSizeF(font.pointSizeF() * 1.25)
        app.setFont(bigger)
        window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
        for name in VIEWS:
            window.show_view(name)
            window.resize(900, 600)
            qtbot.waitUntil(window.views[name].isVisible)
            assert_fits(window, (900, 600), f"{name} with a larger font")
    finally:
        app.setFont(font)


def test_a_window_larger_than_the_screen_shrinks_to_it(qtbot, gui_home, tmp_path):
    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    area = window.screen().availableGeometry()
    window.resize(area.width() + 300, area.height() + 200)
    window.fit_screen()
    assert window.width() <= area.width() and window.height() <= area.height()


def test_dialogs_fit_900x600(qtbot, gui_home, tmp_path):
    from fleetgui.fleet_view import AddNodeDialog

    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    dialog = AddNodeDialog([], window)
    qtbot.addWidget(dialog)
    dialog.show()
    qtbot.waitExposed(dialog)
    assert dialog.width() <= 900 and dialog.height() <= 600
    metrics = dialog.address.fontMetrics()
    # the placeholder is whole
    assert dialog.address.width() > metrics.horizontalAdvance(dialog.address.placeholderText())
    problems = [f"{describe(w)}: {why}" for w in controls(dialog) if (why := clipped(w, dialog))]
    assert not problems, problems
    sampling = window.chat.all_tabs()[0].open_sampling()
    qtbot.addWidget(sampling)
    qtbot.waitExposed(sampling)
    assert sampling.width() <= 900 and sampling.height() <= 600, sampling.size()
    problems = [f"{describe(w)}: {why}" for w in controls(sampling) if (why := clipped(w, sampling))]
    assert not problems, problems
