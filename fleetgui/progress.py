"""The panel that shows a long step's progress: its name with a count (an ``engine.progress`` event's
words), a bar with the percentage (busy while the share is unknown), Cancel."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QProgressBar, QPushButton, QWidget

from engine.progress import Progress
from fleetgui.widgets import plain


class ProgressPanel(QWidget):
    """A step's name, a bar (busy when the fraction is unknown) and Cancel; hidden when idle."""

    cancel_requested = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("progressPanel")
        self.step = plain(QLabel())  # a step's words name files and nodes
        self.step.setWordWrap(True)
        self.bar = QProgressBar()
        self.bar.setRange(0, 100)
        self.bar.setMinimumWidth(self.fontMetrics().averageCharWidth() * 16)
        self.bar.setMaximumWidth(self.fontMetrics().averageCharWidth() * 40)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self.cancel_requested)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.step, 1)
        layout.addWidget(self.bar)
        layout.addWidget(self.cancel_button)
        self.hide()

    def show_progress(self, progress: Progress) -> None:
        """Shows the step's words and its share, or a busy bar while the share is unknown."""
        self.step.setText(progress.text)
        if progress.fraction is None:
            self.bar.setRange(0, 0)
            self.bar.setFormat("")
        else:
            self.bar.setRange(0, 100)
            self.bar.setValue(round(max(0.0, min(1.0, progress.fraction)) * 100))
            self.bar.setFormat("%p%")
        self.cancel_button.setEnabled(True)
        self.show()

    def done(self) -> None:
        self.hide()

    @property
    def text(self) -> str:
        return "" if self.isHidden() else self.step.text()
