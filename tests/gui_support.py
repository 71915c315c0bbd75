"""What the GUI tests share: an isolated home and settings file, a window builder, screenshots."""

from __future__ import annotations

from pathlib import Path

SCREENSHOTS: Path | None = None  # set from pytest's --screenshots; None encodes them in memory only
SIZE = (1366, 768)


def settings_store(path: Path):
    from PySide6.QtCore import QSettings

    return QSettings(str(path), QSettings.Format.IniFormat)


def tiny_settings(shards, **changes):
    """Settings that chat with a tiny export in process, greedy (new chats start on the Greedy
    preset, so replies can be compared with the chain's own decoding), no speculation."""
    from fleetgui.settings import GuiSettings

    values = dict(default_model=str(shards), local_workers=False, draft="none", k="0", streams=2,
                  max_new_tokens=64, weights="f32", stages=2, chat_preset="Greedy")
    values.update(changes)
    return GuiSettings(**values)


def open_window(qtbot, settings, store, **kw):
    from fleetgui.app import build_window

    window = build_window(settings, store=store, **kw)
    qtbot.addWidget(window)
    window.resize(*SIZE)
    window.show()
    qtbot.waitExposed(window)
    return window


def screenshot(window, name: str, size: tuple[int, int] = SIZE, palette: bool = False) -> None:
    """Grabs the window at ``size`` (1366x768, a common laptop screen) and encodes it as PNG: into
    SCREENSHOTS/NAME.png with `--screenshots DIR`, otherwise in memory, so a test run leaves
    docs/screenshots alone.  ``palette``: in 256 colours, nearest without dithering (a quarter of the
    bytes, the text as sharp; the walkthrough's pictures are many)."""
    from PySide6.QtCore import QBuffer, QIODevice, Qt
    from PySide6.QtGui import QImage
    from PySide6.QtWidgets import QApplication

    window.resize(*size)
    QApplication.processEvents()
    image = window.grab()
    assert (image.width(), image.height()) == size
    if palette:
        flags = Qt.ImageConversionFlag.ThresholdDither | Qt.ImageConversionFlag.AvoidDither
        image = image.toImage().convertToFormat(QImage.Format.Format_Indexed8, flags)
    if SCREENSHOTS is None:
        buffer = QBuffer()
        buffer.open(QIODevice.OpenModeFlag.WriteOnly)
        assert image.save(buffer, "PNG") and buffer.size() > 0
        return
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    assert image.save(str(SCREENSHOTS / f"{name}.png"))


def drag(canvas, start, end, steps=3):
    """Press, move in steps and release the left button on the canvas (synthetic mouse events)."""
    from PySide6.QtCore import QPoint, Qt
    from PySide6.QtTest import QTest

    left, none = Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier
    QTest.mousePress(canvas, left, none, start)
    for k in range(1, steps + 1):
        QTest.mouseMove(canvas, QPoint(start.x() + (end.x() - start.x()) * k // steps,
                                       start.y() + (end.y() - start.y()) * k // steps))
    QTest.mouseRelease(canvas, left, none, end)
