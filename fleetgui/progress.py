"""Progress a person can follow: the engine's progress payloads (``engine.session``) as a step's
name and fraction, and the panel that shows them (the step, a bar with the count or percentage,
Cancel).

A finished download ("pull", "ready", 1.0) is followed by more work (the export, loading the
model), so it reads as that next step with a busy bar, never as "ready, 100%" while work goes on.
"""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QProgressBar, QPushButton, QWidget

# a deployment's phases (``engine.fleet.deploy``), as the panel says them
DEPLOY_PHASES = {"export": "exporting", "send": "sending", "start": "starting", "connect": "connecting"}


def describe_progress(payload: tuple) -> tuple[str, float | None]:
    """(what is happening, fraction done or None when unknown) for one engine progress payload."""
    kind = payload[0]
    if kind == "pull":
        step, fraction = payload[1:3]
        if step == "ready" or fraction >= 1.0:
            return "Model downloaded; preparing it", None
        if step == "assemble" and len(payload) == 5:  # (done, total) in bytes
            step = f"assemble, {payload[3] / 1e6:.0f} of {payload[4] / 1e6:.0f} MB"
        return f"Downloading the model ({step})", fraction
    if kind == "stage":
        _, index, step, fraction = payload
        return f"Exporting stage {index} ({step})", fraction
    if kind == "deploy":
        _, stage, phase, fraction = payload
        return f"{DEPLOY_PHASES.get(phase, phase).capitalize()} stage {stage}", fraction
    if kind == "status":
        text = str(payload[1])
        return text[:1].upper() + text[1:], None
    return " ".join(map(str, payload)), None


class ProgressPanel(QWidget):
    """A step's name, a bar (busy when the fraction is unknown) and Cancel; hidden when idle."""

    cancel_requested = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("progressPanel")
        self.step = QLabel()
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

    def show_step(self, step: str, fraction: float | None, count: str = "") -> None:
        """Shows ``step``; ``fraction`` None (or below 0) makes the bar busy; ``count`` ("stage 2 of 3")
        replaces the percentage on the bar."""
        self.step.setText(step)
        if fraction is None or fraction < 0:
            self.bar.setRange(0, 0)
            self.bar.setFormat(count)
        else:
            self.bar.setRange(0, 100)
            self.bar.setValue(round(max(0.0, min(1.0, fraction)) * 100))
            self.bar.setFormat(count or "%p%")
        self.cancel_button.setEnabled(True)
        self.show()

    def show_payload(self, payload: tuple) -> None:
        step, fraction = describe_progress(payload)
        self.show_step(step, fraction)

    def done(self) -> None:
        self.hide()

    @property
    def text(self) -> str:
        return "" if self.isHidden() else self.step.text()
