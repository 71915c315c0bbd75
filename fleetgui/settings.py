"""The app's preferences and the Settings dialog.

``GuiSettings`` is the engine's ``Settings`` (model, stages, device, drafts, streams, the API... kept
in ``settings.json``, shared with the ``fleet`` command) plus what is the app's alone (the theme),
kept with QSettings.
"""

from __future__ import annotations

import dataclasses

from PySide6.QtCore import QSettings
from PySide6.QtWidgets import (QCheckBox, QDialog, QDialogButtonBox, QFileDialog, QFormLayout,
                               QLabel, QLineEdit, QPushButton, QVBoxLayout, QWidget)

from engine.config import DRAFTS, Settings
from engine.errors import FleetError
from engine.export.compress import WEIGHT_FORMATS
from engine.models.catalog import CATALOG
from fleetgui.theme import THEMES
from fleetgui.widgets import combo_box, field_row, spin_box


@dataclasses.dataclass
class GuiSettings(Settings):
    theme: str = "light"

    @classmethod
    def load(cls, store: QSettings) -> "GuiSettings":
        """The engine's saved settings (the defaults if they cannot be read: the app still starts) and
        the app's own from ``store``."""
        try:
            engine = Settings.load()
        except FleetError:
            engine = Settings()
        theme = store.value("theme")
        return cls(**dataclasses.asdict(engine), **({"theme": str(theme)} if theme is not None else {}))

    def save(self, store: QSettings) -> None:
        """The engine's part to ``settings.json`` (keeping the node list as saved there: the Fleet view and
        ``fleet nodes`` edit it), the app's to ``store``."""
        try:
            nodes = Settings.load().nodes
        except FleetError:
            nodes = self.nodes
        dataclasses.replace(self.engine(), nodes=nodes).save()
        store.setValue("theme", self.theme)
        store.sync()


def default_store() -> QSettings:
    return QSettings("fleetshard", "fleetgui")


class SettingsDialog(QDialog):
    """Edits a copy of the settings; ``result_settings()`` gives them once accepted."""

    def __init__(self, settings: GuiSettings, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Settings")
        self._settings = settings
        form = QFormLayout()

        self.key_file = QLineEdit(settings.fleet_key_file or "")
        self.key_file.setPlaceholderText("default: fleet.key in the config folder")
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse_key)
        form.addRow("Fleet key file", field_row(self.key_file, browse))

        self.model = combo_box(CATALOG, settings.default_model, editable=True)
        self.model.setToolTip("a catalog name, a GGUF file, a Hugging Face folder or an exported shard set")
        form.addRow("Default model", self.model)

        self.stages = spin_box(1, 64, settings.stages)
        form.addRow("Stages", self.stages)
        self.weights = combo_box(WEIGHT_FORMATS, settings.weights)
        form.addRow("Weights", self.weights)
        self.devices = QLineEdit(settings.device)
        self.devices.setToolTip("one OpenVINO device for every stage (CPU, GPU, NPU) or one per stage: CPU,GPU.1")
        form.addRow("Devices", self.devices)
        self.mode = combo_box(["fast", "exact"], settings.mode)
        form.addRow("Mode", self.mode)
        self.local_workers = QCheckBox("run stages 1.. as worker processes on this machine")
        self.local_workers.setChecked(settings.local_workers)
        form.addRow("Local fleet", self.local_workers)
        self.streams = spin_box(1, 16, settings.streams)
        form.addRow("Streams", self.streams)
        self.k = combo_box(["auto", *map(str, range(0, 11))], settings.k, editable=True)
        self.k.setToolTip("draft tokens per speculative round; 0 turns speculation off")
        form.addRow("K", self.k)
        self.draft = combo_box(DRAFTS, settings.draft)
        form.addRow("Draft", self.draft)
        self.draft_model = QLineEdit(settings.draft_model)
        self.draft_model.setPlaceholderText("for model and hybrid drafts, e.g. qwen2.5-coder-0.5b")
        form.addRow("Draft model", self.draft_model)
        self.max_new_tokens = spin_box(1, 32768, settings.max_new_tokens)
        form.addRow("Max new tokens", self.max_new_tokens)
        self.theme = combo_box(THEMES, settings.theme)
        form.addRow("Theme", self.theme)
        self.api_enabled = QCheckBox("serve the chat's model as an OpenAI-compatible API")
        self.api_enabled.setChecked(settings.api_enabled)
        form.addRow("API", self.api_enabled)
        self.api_host = QLineEdit(settings.api_host)
        self.api_host.setToolTip("127.0.0.1: this PC only; another address (0.0.0.0: every network) "
                                 "needs the API key, which the app creates")
        self.api_port = spin_box(0, 65535, settings.api_port)
        form.addRow("API address", field_row(self.api_host, self.api_port))

        self.error = QLabel()
        self.error.setObjectName("hint")
        self.error.setWordWrap(True)
        self.error.hide()
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.error)
        layout.addWidget(buttons)

    def _browse_key(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Fleet key file", self.key_file.text())
        if path:
            self.key_file.setText(path)

    def result_settings(self) -> GuiSettings:
        return dataclasses.replace(
            self._settings, fleet_key_file=self.key_file.text().strip() or None, default_model=self.model.currentText().strip(),
            stages=self.stages.value(), weights=self.weights.currentText(), device=self.devices.text().strip() or "CPU",
            mode=self.mode.currentText(), local_workers=self.local_workers.isChecked(), streams=self.streams.value(),
            k=self.k.currentText().strip() or "auto", draft=self.draft.currentText(),
            draft_model=self.draft_model.text().strip(), max_new_tokens=self.max_new_tokens.value(),
            theme=self.theme.currentText(), api_enabled=self.api_enabled.isChecked(),
            api_host=self.api_host.text().strip(), api_port=self.api_port.value())

    def accept(self) -> None:
        problem = self.result_settings().validate()
        if problem:
            self.error.setText(problem)
            self.error.show()
            return
        super().accept()
