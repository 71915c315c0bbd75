"""Light and dark themes: a Fusion palette plus a QSS from ``resources/styles``, and the app icon.

Stylesheets set colours only; every size follows the system font, so the app scales with it.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from PySide6.QtGui import QColor, QIcon, QPalette
from PySide6.QtWidgets import QApplication


def resources_folder(beside: Path, data_paths: list[Path]) -> Path:
    """``resources/`` beside the packages (a checkout, the bundle), else where a wheel installed it
    as data files (``share/fleetshard`` under a data path)."""
    installed = [Path(p) / "share" / "fleetshard" for p in data_paths]
    return next((p for p in (beside, *installed) if p.is_dir()), beside)


RESOURCES = resources_folder(Path(__file__).resolve().parent.parent / "resources",
                             [sysconfig.get_path("data", scheme)
                              for scheme in (sysconfig.get_default_scheme(), sysconfig.get_preferred_scheme("user"))])
THEMES = ("light", "dark")

# (window, base, text, button, highlight, disabled text) per theme
_COLOURS = {
    "light": ("#f6f8fb", "#ffffff", "#1d2733", "#e9eef4", "#1f4e79", "#8a94a3"),
    "dark": ("#20262f", "#161b22", "#dde4ee", "#2a323d", "#2e86c1", "#6d7887"),
}
# pyqtgraph: (background, foreground) per theme
PLOT_COLOURS = {"light": ("#ffffff", "#1d2733"), "dark": ("#161b22", "#dde4ee")}
# a colour per plotted series, readable on both backgrounds
SERIES = ("#2e86c1", "#e67e22", "#27ae60", "#c0392b", "#8e44ad", "#16a085", "#d4ac0d", "#7f8c8d")


def icon() -> QIcon:
    path = RESOURCES / "icons" / "fleetshard.svg"
    return QIcon(str(path)) if path.exists() else QIcon()


def stylesheet(theme: str) -> str:
    path = RESOURCES / "styles" / f"{_known(theme)}.qss"
    return path.read_text() if path.exists() else ""


def palette(theme: str) -> QPalette:
    window, base, text, button, highlight, disabled = (QColor(c) for c in _COLOURS[_known(theme)])
    p = QPalette()
    for role, colour in ((QPalette.ColorRole.Window, window), (QPalette.ColorRole.Base, base),
                         (QPalette.ColorRole.AlternateBase, window), (QPalette.ColorRole.Button, button),
                         (QPalette.ColorRole.Highlight, highlight), (QPalette.ColorRole.ToolTipBase, base)):
        p.setColor(role, colour)
    for role in (QPalette.ColorRole.WindowText, QPalette.ColorRole.Text, QPalette.ColorRole.ButtonText,
                 QPalette.ColorRole.ToolTipText, QPalette.ColorRole.PlaceholderText):
        p.setColor(role, text)
    p.setColor(QPalette.ColorRole.PlaceholderText, disabled)
    p.setColor(QPalette.ColorRole.HighlightedText, QColor("#ffffff"))
    for role in (QPalette.ColorRole.WindowText, QPalette.ColorRole.Text, QPalette.ColorRole.ButtonText):
        p.setColor(QPalette.ColorGroup.Disabled, role, disabled)
    return p


def apply(theme: str) -> None:
    """Applies the theme to the whole application (dialogs and menus included)."""
    app = QApplication.instance()
    if app is None:
        return
    app.setStyle("Fusion")
    app.setPalette(palette(theme))
    app.setStyleSheet(stylesheet(theme))


def _known(theme: str) -> str:
    return theme if theme in THEMES else "light"
