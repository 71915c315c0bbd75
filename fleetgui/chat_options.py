"""A chat's sampling settings: the presets, and the panel that edits them (temperature, top-p,
top-k, repetition penalty, max tokens, seed), each field with a line saying what it does.

The options travel as a plain dict (saved with the conversation in the history); ``sampling_params``
turns them into the engine's ``SamplingParams``.  The default preset samples at temperature 0.7 with
a repetition penalty of 1.1: greedy decoding makes small models such as SmolLM2 loop.
"""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QComboBox, QDoubleSpinBox, QFormLayout, QSpinBox, QVBoxLayout, QWidget

from engine.runtime.decode.sampling import SamplingParams
from fleetgui.widgets import explained

PRESETS = {  # name -> temperature, top_p, top_k, repetition_penalty
    "Balanced": (0.7, 0.9, 40, 1.1),
    "Precise": (0.2, 0.9, 20, 1.1),
    "Creative": (1.0, 0.95, 0, 1.05),
    "Greedy": (0.0, 1.0, 0, 1.0),  # the model's single most likely reply (the same every time)
}
DEFAULT_PRESET = "Balanced"
CUSTOM = "Custom"
KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")


def preset_options(name: str, max_tokens: int) -> dict:
    """The options of preset ``name`` (the default one for an unknown name), no fixed seed."""
    values = PRESETS.get(name, PRESETS[DEFAULT_PRESET])
    return {**dict(zip(KEYS, values)), "max_tokens": max_tokens, "seed": None}


def preset_of(options: dict) -> str:
    for name, values in PRESETS.items():
        if tuple(options.get(k) for k in KEYS) == values:
            return name
    return CUSTOM


def sampling_params(options: dict, seed: int | None = None) -> SamplingParams:
    """The engine's parameters for ``options``; ``seed`` overrides the options' seed."""
    return SamplingParams(temperature=float(options["temperature"]), top_p=float(options["top_p"]),
                          top_k=int(options["top_k"]), repetition_penalty=float(options["repetition_penalty"]),
                          seed=seed if seed is not None else options.get("seed"))


def describe(options: dict) -> str:
    """A short summary for the chat's header button."""
    name = preset_of(options)
    if options["temperature"] == 0:
        return f"{name}: greedy, max {options['max_tokens']} tokens"
    return f"{name}: temperature {options['temperature']:g}, max {options['max_tokens']} tokens"


HELP = {
    "preset": "A starting point; changing a field below makes it Custom.",
    "temperature": "Randomness: 0 always takes the likeliest word; 0.7 is natural; above 1 gets wild.",
    "top_p": "Only words within this share of the probability are drawn (0.9 drops the unlikely tail).",
    "top_k": "Only the k likeliest words are drawn (0: no limit).",
    "repetition_penalty": "Above 1 makes words already said less likely: stops small models looping.",
    "max_tokens": "The longest reply, in tokens (about ¾ of a word each).",
    "seed": "The same seed and message give the same reply; Random draws anew each time.",
}


class SamplingPanel(QWidget):
    """Edits one chat's options; ``changed`` carries them after every edit."""

    changed = Signal(dict)

    def __init__(self, options: dict, parent: QWidget | None = None):
        super().__init__(parent)
        self.preset = QComboBox()
        self.preset.addItems([*PRESETS, CUSTOM])
        self.temperature = self._double(0.0, 2.0, 0.05)
        self.top_p = self._double(0.01, 1.0, 0.05)
        self.top_k = QSpinBox()
        self.top_k.setRange(0, 200)
        self.repetition_penalty = self._double(0.5, 2.0, 0.05)
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(1, 32768)
        self.seed = QSpinBox()
        self.seed.setRange(-1, 2**31 - 1)
        self.seed.setSpecialValueText("Random")  # -1: no fixed seed
        form = QFormLayout()
        form.setRowWrapPolicy(QFormLayout.RowWrapPolicy.WrapLongRows)
        for key, label, field in (("preset", "Preset", self.preset), ("temperature", "Temperature", self.temperature),
                                  ("top_p", "Top-p", self.top_p), ("top_k", "Top-k", self.top_k),
                                  ("repetition_penalty", "Repetition penalty", self.repetition_penalty),
                                  ("max_tokens", "Max tokens", self.max_tokens), ("seed", "Seed", self.seed)):
            form.addRow(label, explained(field, HELP[key]))
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(form)
        self._loading = False
        self.set_options(options)
        self.preset.currentTextChanged.connect(self._preset_chosen)
        for box in (self.temperature, self.top_p, self.top_k, self.repetition_penalty, self.max_tokens, self.seed):
            box.valueChanged.connect(self._edited)

    @staticmethod
    def _double(low: float, high: float, step: float) -> QDoubleSpinBox:
        box = QDoubleSpinBox()
        box.setRange(low, high)
        box.setSingleStep(step)
        box.setDecimals(2)
        return box

    def options(self) -> dict:
        seed = self.seed.value()
        return {"temperature": round(self.temperature.value(), 2), "top_p": round(self.top_p.value(), 2),
                "top_k": self.top_k.value(), "repetition_penalty": round(self.repetition_penalty.value(), 2),
                "max_tokens": self.max_tokens.value(), "seed": None if seed < 0 else seed}

    def set_options(self, options: dict) -> None:
        self._loading = True
        try:
            self.temperature.setValue(options["temperature"])
            self.top_p.setValue(options["top_p"])
            self.top_k.setValue(options["top_k"])
            self.repetition_penalty.setValue(options["repetition_penalty"])
            self.max_tokens.setValue(options["max_tokens"])
            self.seed.setValue(-1 if options.get("seed") is None else options["seed"])
            self.preset.setCurrentText(preset_of(options))
        finally:
            self._loading = False

    def _preset_chosen(self, name: str) -> None:
        if self._loading or name == CUSTOM:
            return
        current = self.options()
        self.set_options({**current, **dict(zip(KEYS, PRESETS[name]))})
        self.changed.emit(self.options())

    def _edited(self) -> None:
        if self._loading:
            return
        self._loading = True
        self.preset.setCurrentText(preset_of(self.options()))
        self._loading = False
        self.changed.emit(self.options())

