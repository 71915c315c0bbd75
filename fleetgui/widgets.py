"""Small widgets the views share: the inline message banner and the placeholder view."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget


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


class PlaceholderView(QWidget):
    """A view that arrives later: its name and one line saying when."""

    def __init__(self, title: str, line: str, parent: QWidget | None = None):
        super().__init__(parent)
        heading = QLabel(title)
        font = heading.font()
        font.setBold(True)
        font.setPointSizeF(font.pointSizeF() * 1.4)
        heading.setFont(font)
        self.line = QLabel(line)
        self.line.setObjectName("placeholder")
        self.line.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.addStretch(1)
        for label in (heading, self.line):
            label.setAlignment(Qt.AlignmentFlag.AlignCenter)
            layout.addWidget(label)
        layout.addStretch(2)
