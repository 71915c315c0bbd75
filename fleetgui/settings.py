"""The app's preferences, kept with QSettings, and the Settings dialog.

Where the engine has a setting of the same meaning (``engine.config.Settings``: model, stages,
weights, device, mode, fleet key file), its value is the app's default, so the app and the ``fleet``
command start out alike; the app's own choices then live in QSettings.
"""

from __future__ import annotations

import dataclasses

from PySide6.QtCore import QSettings
from PySide6.QtWidgets import (QCheckBox, QDialog, QDialogButtonBox, QFileDialog, QFormLayout,
                               QLabel, QLineEdit, QPushButton, QVBoxLayout, QWidget)

from engine.config import Settings
from fleetgui.theme import THEMES
from fleetgui.widgets import combo_box, field_row, spin_box

WEIGHTS = ("int4", "int8", "fp16", "f32")
DRAFTS = ("none", "lookup", "model", "hybrid")


@dataclasses.dataclass
class GuiSettings:
    fleet_key_file: str = ""  # empty: the engine's default (fleet.key in the config folder)
    default_model: str = "smollm2-135m"  # catalog name, GGUF file, HF folder or an exported shard set
    stages: int = 2
    weights: str = "int4"
    devices: str = "CPU"  # one OpenVINO device for every stage, or one per stage: "CPU,GPU.1"
    mode: str = "fast"
    local_workers: bool = True  # stages 1.. as worker processes on this machine (else all in process)
    streams: int = 2  # chats that generate at the same time (micro-batched streams)
    k: str = "auto"  # draft tokens per round: a number or "auto"; 0 turns speculation off
    draft: str = "lookup"  # none | lookup | model | hybrid
    draft_model: str = ""  # the draft model source for "model" and "hybrid"
    max_new_tokens: int = 256
    theme: str = "light"
    api_enabled: bool = False  # serve the chat's model as the OpenAI-compatible API too
    api_host: str = "127.0.0.1"
    api_port: int = 8000

    @classmethod
    def defaults(cls) -> "GuiSettings":
        try:
            engine = Settings.load()
        except (OSError, ValueError, TypeError):  # an unreadable settings.json: the app still starts
            engine = Settings()
        return cls(fleet_key_file=engine.fleet_key_file or "", default_model=engine.default_model,
                   stages=engine.stages, weights=engine.weights, devices=engine.device, mode=engine.mode,
                   api_enabled=engine.api_enabled, api_host=engine.api_host, api_port=engine.api_port)

    @classmethod
    def load(cls, store: QSettings) -> "GuiSettings":
        base = cls.defaults()
        values = {}
        for f in dataclasses.fields(cls):
            raw = store.value(f.name)
            if raw is None:
                continue
            default = getattr(base, f.name)
            try:
                if isinstance(default, bool):
                    values[f.name] = str(raw).lower() in ("1", "true", "yes")
                elif isinstance(default, int):
                    values[f.name] = int(raw)
                else:
                    values[f.name] = str(raw)
            except ValueError:  # a hand-edited or damaged value: keep the default
                continue
        return dataclasses.replace(base, **values)

    def save(self, store: QSettings) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            store.setValue(f.name, ("true" if value else "false") if isinstance(value, bool) else value)
        store.sync()

    @property
    def k_value(self) -> int | str:
        return "auto" if self.k == "auto" else int(self.k)

    def validate(self) -> str | None:
        """What is wrong with these settings, in words; None when they are usable."""
        from engine.errors import FleetError
        from engine.runtime.stages.chain import parse_devices

        if self.k != "auto":
            try:
                if not 0 <= int(self.k) <= 32:
                    return "K must be between 0 and 32, or auto"
            except ValueError:
                return f"K takes a number or 'auto', not {self.k!r}"
        if not self.default_model.strip():
            return "choose a default model"
        if self.draft in ("model", "hybrid") and not self.draft_model.strip():
            return f"a {self.draft} draft needs a draft model"
        try:
            parse_devices(self.devices, self.stages)
        except FleetError as exc:
            return str(exc)
        if not self.api_host.strip():
            return "the API needs an address to listen on (127.0.0.1: this PC only)"
        if not 0 <= self.api_port <= 65535:
            return f"the API port must be between 0 and 65535, not {self.api_port}"
        return None


def default_store() -> QSettings:
    return QSettings("fleetshard", "fleetgui")


class SettingsDialog(QDialog):
    """Edits a copy of the settings; ``result_settings()`` gives them once accepted."""

    def __init__(self, settings: GuiSettings, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Settings")
        self._settings = settings
        form = QFormLayout()

        self.key_file = QLineEdit(settings.fleet_key_file)
        self.key_file.setPlaceholderText("default: fleet.key in the config folder")
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse_key)
        form.addRow("Fleet key file", field_row(self.key_file, browse))

        from engine.models.catalog import CATALOG

        self.model = combo_box(CATALOG, settings.default_model, editable=True)
        self.model.setToolTip("a catalog name, a GGUF file, a Hugging Face folder or an exported shard set")
        form.addRow("Default model", self.model)

        self.stages = spin_box(1, 64, settings.stages)
        form.addRow("Stages", self.stages)
        self.weights = combo_box(WEIGHTS, settings.weights)
        form.addRow("Weights", self.weights)
        self.devices = QLineEdit(settings.devices)
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
            self._settings, fleet_key_file=self.key_file.text().strip(), default_model=self.model.currentText().strip(),
            stages=self.stages.value(), weights=self.weights.currentText(), devices=self.devices.text().strip() or "CPU",
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
