"""Small widgets the views share: the inline message banner, the splitter and field-with-button
rows several views lay out, and ready-filled spin and combo boxes for their forms."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QComboBox, QFrame, QHBoxLayout, QLabel, QPushButton, QSpinBox, QSplitter, QWidget


class Banner(QFrame):
    """An inline message above a view (errors from the engine, notices); hidden until shown."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("banner")
        self.text = QLabel()
        self.text.setObjectName("bannerText")
        self.text.setWordWrap(True)
        self.text.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        close = QPushButton("Dismiss")
        close.setFlat(True)
        close.clicked.connect(self.hide)
        layout = QHBoxLayout(self)
        layout.addWidget(self.text, 1)
        layout.addWidget(close, 0, Qt.AlignmentFlag.AlignTop)
        self.hide()

    def show_message(self, message: str, level: str = "error") -> None:
        self.setProperty("level", level)
        self.style().unpolish(self)
        self.style().polish(self)
        self.text.setText(message)
        self.show()

    def error(self, message: str) -> None:
        self.show_message(message, "error")

    def info(self, message: str) -> None:
        self.show_message(message, "info")

    @property
    def message(self) -> str:
        return "" if self.isHidden() else self.text.text()


def splitter(orientation: Qt.Orientation, *parts: tuple[QWidget, int]) -> QSplitter:
    """A splitter of (widget, stretch factor) parts."""
    split = QSplitter(orientation)
    for i, (widget, stretch) in enumerate(parts):
        split.addWidget(widget)
        split.setStretchFactor(i, stretch)
    return split


def field_row(field: QWidget, *buttons: QWidget) -> QHBoxLayout:
    """A field that takes the width, with its buttons beside it."""
    row = QHBoxLayout()
    row.addWidget(field, 1)
    for button in buttons:
        row.addWidget(button)
    return row


def spin_box(low: int, high: int, value: int) -> QSpinBox:
    box = QSpinBox()
    box.setRange(low, high)
    box.setValue(value)
    return box


def combo_box(items, current: str | None = None, *, editable: bool = False) -> QComboBox:
    box = QComboBox()
    box.setEditable(editable)
    box.addItems(list(items))
    if current is not None:
        box.setCurrentText(current)
    return box
