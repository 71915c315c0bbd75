"""The app's preferences and the Settings view (a page of the sidebar in sections, each field explained).

``GuiSettings`` is the engine's ``Settings`` (model, stages, device, drafts, streams, the API... kept
in ``settings.json``, shared with the ``fleet`` command) plus what is the app's alone (the theme),
kept with QSettings.
"""

from __future__ import annotations

import dataclasses

from PySide6.QtCore import QSettings, Qt, Signal
from PySide6.QtWidgets import (QCheckBox, QFileDialog, QFormLayout, QGroupBox, QLabel, QLineEdit, QPushButton,
                               QScrollArea, QVBoxLayout, QWidget)

from engine.config import DRAFTS, Settings, paths
from engine.errors import FleetError
from engine.export.compress import WEIGHT_FORMATS, WEIGHT_NOTES
from engine.files import lock
from fleetgui.chat_options import DEFAULT_PRESET, PRESETS
from fleetgui.mcp_settings import McpServersDialog, summary
from fleetgui.theme import THEMES
from fleetgui.widgets import (ModelField, combo_box, explained, explained_choice, field_row, flow_bar, plain,
                              spin_box)


@dataclasses.dataclass
class GuiSettings(Settings):
    theme: str = "light"
    chat_preset: str = DEFAULT_PRESET  # the sampling a new chat starts with (``fleetgui.chat_options``)

    @classmethod
    def load(cls, store: QSettings) -> "GuiSettings":
        """The engine's saved settings (the defaults if they cannot be read: the app still starts) and
        the app's own from ``store``."""
        try:
            engine = Settings.load()
        except FleetError:
            engine = Settings()
        own = {key: str(store.value(key)) for key in ("theme", "chat_preset") if store.value(key) is not None}
        return cls(**dataclasses.asdict(engine), **own)

    def save(self, store: QSettings) -> None:
        """The engine's part to ``settings.json`` (keeping the known nodes as saved there: the Fleet view,
        join codes, scans and ``fleet nodes`` edit them), the app's to ``store``."""
        with lock(paths().settings_file):  # `fleet nodes` may edit the list meanwhile
            try:
                known = Settings.load().known_nodes
            except FleetError:
                known = self.known_nodes
            dataclasses.replace(self.engine(), known_nodes=known).save()
        store.setValue("theme", self.theme)
        store.setValue("chat_preset", self.chat_preset)
        store.sync()


def default_store() -> QSettings:
    return QSettings("fleetshard", "fleetgui")


HELP = {  # one line under each field, in words a new user understands
    "key": "The shared secret every PC of your fleet uses; copy this file to each of them.",
    "model": "What the chat runs: a catalog name, a GGUF file, a Hugging Face folder or an exported shard set.",
    "stages": "How many parts the model is split into, one for each PC (or process) that runs a part.",
    "devices": "Where each part runs: CPU, GPU or NPU, one for all parts or one per part (CPU,GPU.1).",
    "mode": "fast: the quickest exchange between PCs; exact: bit-identical to one PC.",
    "local": "Run the model's later parts as separate processes on this PC, as a fleet of PCs would.",
    "standbys": "After a deploy, another PC with room keeps each part loaded, so a PC that leaves is replaced "
                "within seconds; it uses that PC's memory.",
    "streams": "How many chats can write their answers at the same time.",
    "k": "Speculative decoding: tokens guessed ahead per step (auto picks; 0 turns guessing off).",
    "draft": "How the guesses are made: lookup copies from the conversation, a model drafts with a small model, "
             "remote has another PC draft with it while this one checks.",
    "draft_model": "The small model for model and hybrid drafts.",
    "draft_at": "For a remote draft: HOST:PORT of the PC that drafts for this one (it runs `fleet worker --role "
                "draft`). Empty: the draft server of the deployment, if it has one.",
    "max_new_tokens": "The longest answer a new chat allows, in tokens (about ¾ of a word each; each chat can "
                      "change it).",
    "chat_preset": "How a new chat picks its words (Balanced stops small models repeating themselves).",
    "theme": "Light or dark colours.",
    "api": "Let other programs use the chat's model through an OpenAI-compatible address.",
    "api_address": "127.0.0.1 keeps the API on this PC; another address needs the API key the app creates.",
    "mcp": "Tools the chat can use: MCP servers (a command or a URL); the chat asks before each call.",
}
GROUPS = ("Chat", "Models", "Fleet", "API and tools", "Advanced")  # the page's sections, in order


def _section(title: str) -> tuple[QGroupBox, QFormLayout]:
    box = QGroupBox(title)
    form = QFormLayout(box)
    form.setRowWrapPolicy(QFormLayout.RowWrapPolicy.WrapLongRows)
    form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
    return box, form


class SettingsPage(QWidget):
    """The Settings view: edits a copy of the settings in sections (``GROUPS``), each field with a
    line saying what it does; the technical ones (speculative decoding, weights, mode, devices) are
    under Advanced, shown on request.  Save checks them and emits ``saved`` with the new settings,
    Revert shows the current ones."""

    saved = Signal(object)  # GuiSettings

    def __init__(self, settings: GuiSettings, parent: QWidget | None = None):
        super().__init__(parent)
        self._settings = settings
        self.sections: dict[str, QGroupBox] = {}
        forms = {}
        for title in GROUPS:
            self.sections[title], forms[title] = _section(title)
        chat, models, fleet, api, advanced = (forms[t] for t in GROUPS)

        self.chat_preset = combo_box(PRESETS)
        chat.addRow("Answer style", explained(self.chat_preset, HELP["chat_preset"]))
        self.max_new_tokens = spin_box(1, 32768, 256)
        chat.addRow("Longest answer", explained(self.max_new_tokens, HELP["max_new_tokens"]))
        self.streams = spin_box(1, 16, 2)
        chat.addRow("Chats at once", explained(self.streams, HELP["streams"]))
        self.theme = combo_box(THEMES)
        chat.addRow("Theme", explained(self.theme, HELP["theme"]))

        self.model = ModelField()
        models.addRow("Default model", explained(self.model, HELP["model"]))

        self.key_file = QLineEdit()
        self.key_file.setPlaceholderText("default: fleet.key in the config folder")
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse_key)
        fleet.addRow("Fleet key file", explained(field_row(self.key_file, browse), HELP["key"]))
        self.stages = spin_box(1, 64, 2)
        fleet.addRow("Parts", explained(self.stages, HELP["stages"]))
        self.local_workers = QCheckBox("run the later parts as separate processes on this PC")
        fleet.addRow("Fleet on this PC", explained(self.local_workers, HELP["local"]))
        self.standbys = QCheckBox("keep each part ready on a second PC")
        fleet.addRow("Standbys", explained(self.standbys, HELP["standbys"]))

        self.api_enabled = QCheckBox("serve the chat's model as an OpenAI-compatible API")
        api.addRow("API", explained(self.api_enabled, HELP["api"]))
        self.api_host = QLineEdit()
        self.api_port = spin_box(0, 65535, 8000)
        address = explained(field_row(self.api_host, self.api_port), HELP["api_address"])
        self.api_error = plain(QLabel())  # why the API could not serve on the address (``show_api_error``)
        self.api_error.setObjectName("apiError")
        self.api_error.setWordWrap(True)
        self.api_error.hide()
        address.layout().addWidget(self.api_error)
        api.addRow("API address", address)
        self.mcp_summary = plain(QLabel())  # the servers' names, as imported
        self.mcp_summary.setWordWrap(True)
        mcp_button = QPushButton("MCP servers…")
        mcp_button.clicked.connect(lambda: self.edit_mcp_servers())
        api.addRow("Tools", explained(field_row(self.mcp_summary, mcp_button), HELP["mcp"]))

        self.k = combo_box(["auto", *map(str, range(0, 11))], editable=True)
        advanced.addRow("Tokens guessed ahead", explained(self.k, HELP["k"]))
        self.draft = combo_box(DRAFTS)
        advanced.addRow("Draft", explained(self.draft, HELP["draft"]))
        self.draft_model = QLineEdit()
        self.draft_model.setPlaceholderText("e.g. qwen2.5-coder-0.5b")
        advanced.addRow("Draft model", explained(self.draft_model, HELP["draft_model"]))
        self.draft_at = QLineEdit()
        self.draft_at.setPlaceholderText("e.g. 192.168.1.20:7311")
        advanced.addRow("Draft server", explained(self.draft_at, HELP["draft_at"]))
        self.weights = combo_box(WEIGHT_FORMATS)
        advanced.addRow("Weights", explained_choice(self.weights, WEIGHT_NOTES))
        self.mode = combo_box(["fast", "exact"])
        advanced.addRow("Mode", explained(self.mode, HELP["mode"]))
        self.devices = QLineEdit()
        advanced.addRow("Devices", explained(self.devices, HELP["devices"]))
        self.show_advanced = QPushButton("Show advanced settings")
        self.show_advanced.setCheckable(True)
        self.show_advanced.setToolTip("speculative decoding, weight format, exchange mode and devices")
        self.show_advanced.toggled.connect(self._toggle_advanced)
        self.sections["Advanced"].hide()

        inner = QWidget()
        sections = QVBoxLayout(inner)
        for title in GROUPS[:-1]:
            sections.addWidget(self.sections[title])
        sections.addWidget(self.show_advanced, 0, Qt.AlignmentFlag.AlignLeft)
        sections.addWidget(self.sections["Advanced"])
        sections.addStretch(1)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        scroll.setWidget(inner)
        self.error = plain(QLabel())  # it quotes the values typed
        self.error.setObjectName("hint")
        self.error.setWordWrap(True)
        self.error.hide()
        self.save_button = QPushButton("Save")
        self.save_button.setObjectName("primary")
        self.save_button.clicked.connect(self.accept)
        revert = QPushButton("Revert")
        revert.setToolTip("show the settings in force again")
        revert.clicked.connect(lambda: self.load(self._settings))
        title = QLabel("Settings")
        title.setObjectName("hint")
        layout = QVBoxLayout(self)
        layout.addWidget(title)
        layout.addWidget(scroll, 1)
        layout.addWidget(self.error)
        layout.addWidget(flow_bar(revert, self.save_button, align_right=True)[0])
        self.load(settings)

    def _toggle_advanced(self, shown: bool) -> None:
        self.sections["Advanced"].setVisible(shown)
        self.show_advanced.setText("Hide advanced settings" if shown else "Show advanced settings")

    def load(self, settings: GuiSettings) -> None:
        """Shows ``settings`` in the fields."""
        self._settings = settings
        self.key_file.setText(settings.fleet_key_file or "")
        self.model.set_source(settings.default_model)
        self.stages.setValue(settings.stages)
        self.weights.setCurrentText(settings.weights)
        self.devices.setText(settings.device)
        self.mode.setCurrentText(settings.mode)
        self.local_workers.setChecked(settings.local_workers)
        self.standbys.setChecked(settings.standbys)
        self.streams.setValue(settings.streams)
        self.k.setCurrentText(settings.k)
        self.draft.setCurrentText(settings.draft)
        self.draft_model.setText(settings.draft_model)
        self.draft_at.setText(settings.draft_at)
        self.max_new_tokens.setValue(settings.max_new_tokens)
        self.chat_preset.setCurrentText(settings.chat_preset)
        self.theme.setCurrentText(settings.theme)
        self.api_enabled.setChecked(settings.api_enabled)
        self.api_host.setText(settings.api_host)
        self.api_port.setValue(settings.api_port)
        self._set_mcp_servers(settings.mcp_servers, None)
        self.error.hide()

    def show_api_error(self, text: str) -> None:
        """Shows why the API could not serve on its address beside the field ("": hides it)."""
        self.api_error.setText(text)
        self.api_error.setHidden(not text)

    def _set_mcp_servers(self, entries: list[dict], always: list[str] | None) -> None:
        """``always`` None: the always-allowed tools as they are (the chat adds to them meanwhile)."""
        self._mcp_servers, self._mcp_always = [dict(e) for e in entries], always
        self.mcp_summary.setText(summary(self._mcp_servers))

    def _always_allowed(self) -> list[str]:
        return list(self._settings.mcp_always_allowed if self._mcp_always is None else self._mcp_always)

    def edit_mcp_servers(self, dialog: McpServersDialog | None = None) -> McpServersDialog:
        """The MCP servers dialog (non-modal); OK takes its list into the fields (Save keeps it)."""
        dialog = dialog or McpServersDialog(self._mcp_servers, self._always_allowed(), self)
        dialog.accepted.connect(lambda: self._set_mcp_servers(dialog.servers(), dialog.always))
        dialog.finished.connect(dialog.deleteLater)
        dialog.open()
        return dialog

    def apply_settings(self, settings: GuiSettings) -> None:
        self.load(settings)

    def _browse_key(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Fleet key file", self.key_file.text())
        if path:
            self.key_file.setText(path)

    def result_settings(self) -> GuiSettings:
        return dataclasses.replace(
            self._settings, fleet_key_file=self.key_file.text().strip() or None,
            default_model=self.model.source(),
            stages=self.stages.value(), weights=self.weights.currentText(), device=self.devices.text().strip() or "CPU",
            mode=self.mode.currentText(), local_workers=self.local_workers.isChecked(),
            standbys=self.standbys.isChecked(), streams=self.streams.value(),
            k=self.k.currentText().strip() or "auto", draft=self.draft.currentText(),
            draft_model=self.draft_model.text().strip(), draft_at=self.draft_at.text().strip(),
            max_new_tokens=self.max_new_tokens.value(),
            chat_preset=self.chat_preset.currentText(), theme=self.theme.currentText(),
            api_enabled=self.api_enabled.isChecked(), api_host=self.api_host.text().strip(),
            api_port=self.api_port.value(), mcp_servers=[dict(e) for e in self._mcp_servers],
            mcp_always_allowed=self._always_allowed())

    def accept(self) -> bool:
        """Saves the fields when they are valid (True); otherwise says what is wrong under them."""
        result = self.result_settings()
        problem = result.validate()
        if problem:
            self.error.setText(problem)
            self.error.show()
            advanced = ("k", "draft", "draft_model", "draft_at", "weights", "mode", "device")
            if any(getattr(result, f) != getattr(self._settings, f) for f in advanced):
                self.show_advanced.setChecked(True)  # the field at fault may be among them
            return False
        self.error.hide()
        self.saved.emit(result)
        return True
