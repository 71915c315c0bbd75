"""Model cards: one list entry per model with its facts, whether it fits this PC and the fleet, and
its predicted (and last measured) speed.

``card_lines`` words a card from the model's facts (``engine.models.facts``), its ``engine.fleet.fit.Fit``
and the last measured tok/s; ``ModelCards`` is the list the Export wizard's first step shows, and
``ModelBrowser`` the chat's model browser around it.  The facts appear at once; the fit needs the
placement solver, so ``refresh`` prices every card off the GUI thread and fills the figures in when
it is done.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from PySide6.QtCore import QStandardPaths, Qt, Signal
from PySide6.QtWidgets import (QAbstractItemView, QDialog, QDialogButtonBox, QLabel, QLineEdit, QListWidget,
                               QListWidgetItem, QVBoxLayout)

from engine.config import AUTO_WEIGHTS, DEFAULT_WEIGHTS, paths
from engine.errors import FleetError
from engine.export.choices import FAITHFUL, FAST, choice_of, measured_on, other_than
from engine.export.gguf_weights import carries
from engine.fleet.fit import NO_PROFILE, USERS, Fit, load_profile, measured_key, measured_tok_s, predict
from engine.manifest import is_shard_set
from engine.models.catalog import CATALOG, DEFAULT_MODEL, is_cached
from engine.models.facts import ModelFacts, catalog_facts, facts_of, found_models
from fleetgui.placement_model import default_profile
from fleetgui.widgets import plain, plain_tip

SOURCE = Qt.ItemDataRole.UserRole
READING_TOK_S = 8.0  # a reply at least this fast reads as it comes, for one person (the "best" card's bar)
BEST_LINE = f"Best for your fleet: the largest model it runs at reading speed ({READING_TOK_S:g} tok/s or more)"


def _bytes(n: int) -> str:
    return f"{n / 2**30:.1f} GB" if n >= 2**30 else f"{n / 2**20:.0f} MB"


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def facts_line(facts: ModelFacts) -> str:
    parts = [_bytes(facts.size) if facts.size else "size unknown",
             f"{_count(facts.parameters)} parameters" if facts.parameters else "",
             facts.weight_format,
             (f"{facts.context // 1024}K context" if facts.context % 1024 == 0 else f"{facts.context} context")
             if facts.context else "",
             f"license {facts.license}" if facts.license else "license not stated"]
    if facts.kind == "catalog" and facts.source in CATALOG:
        parts.append("cached" if is_cached(CATALOG[facts.source]) else "not downloaded yet")
    return f"{facts.name} — " + " · ".join(p for p in parts if p)


def fit_line(fit: Fit) -> str:
    here = (f"fits this PC ({_bytes(fit.need_bytes)} of {_bytes(fit.here_bytes)})" if fit.fits_here else
            f"does not fit this PC (needs {_bytes(fit.need_bytes)}, it has {_bytes(fit.here_bytes)})")
    here = here[0].upper() + here[1:]
    if not fit.fleet_pcs:
        return here
    if fit.pcs_needed is None:
        fleet = f"the fleet's {fit.fleet_pcs} PC{'s' if fit.fleet_pcs > 1 else ''} cannot hold it"
    else:
        fleet = f"needs {fit.pcs_needed} of the fleet's {fit.fleet_pcs} PC{'s' if fit.fleet_pcs > 1 else ''}"
    return f"{here} · {fleet}"


def speed_line(fit: Fit, measured: float | None, simulated: bool = False) -> str:
    """The predicted speeds and the last measured one; ``simulated``: the prediction rests on
    simulated PCs (the demo fleet's), which the line says."""
    if fit.tok_s_1 is not None:
        text = (f"Predicted {fit.tok_s_1:.1f} tok/s for 1 user, {fit.tok_s_users:.1f} tok/s for {USERS} users"
                if fit.tok_s_users is not None else f"Predicted {fit.tok_s_1:.1f} tok/s for 1 user")
        if simulated:
            text += " (on simulated PCs: real ones will differ)"
    elif fit.fleet_pcs:
        text = "No prediction: the fleet cannot run it"
    else:
        text = NO_PROFILE[0].upper() + NO_PROFILE[1:]
    return text + (f" · measured {measured:.1f} tok/s" if measured else "")


def carried(path: str) -> bool:
    """Whether the Faithful format can carry the GGUF at ``path`` (``gguf_weights.carries``); a file
    that cannot be read is not (its export names what is wrong with it)."""
    try:
        return carries(Path(path).expanduser())
    except (OSError, ValueError, struct.error):
        return False


def export_line(facts: ModelFacts, weights: str, carries_weights: bool = True) -> str | None:
    """How a GGUF exports with ``weights``, in words: the same answers as the GGUF, or faster and
    slightly different ones (its KL is in ``export_details``).  ``carries_weights``: whether the
    GGUF's own weights can be kept (else ``auto`` gives the faster choice)."""
    choice = choice_of(weights)
    if facts.kind == "hf" or choice is None:
        return None
    if not carries_weights and choice is FAITHFUL:
        fast = weights == AUTO_WEIGHTS
        return (f"Exports with {_inline(FAST.label if fast else FAITHFUL.label)}"
                + (f" — {FAST.what}" if fast else ": it will fail")
                + " (this file's weight types cannot be kept as they are: float, Q2_K, Q3_K or IQ)")
    return f"Exports with {_inline(choice.label)} ({_inline(other_than(choice).label)}: in the Export wizard)"


def _inline(label: str) -> str:
    """A choice's label inside a sentence."""
    return label[0].lower() + label[1:]


def export_details(facts: ModelFacts, weights: str) -> str:
    """The export's choice in technical terms, for the card's details: its format and the KL measured
    against the other one."""
    choice = choice_of(weights)
    if facts.kind == "hf" or choice is None:
        return ""
    other = other_than(choice)
    measured, on = measured_on(facts.source)
    kl = f"KL {measured[choice.weights].kl:g} nats against {other.name}'s {measured[other.weights].kl:g}"
    return f"{choice.name} ({choice.weights}): {choice.what}; {kl}" + (f" on {on}" if on != facts.source else "") + "."


def best_for_fleet(facts: list[ModelFacts], fits: dict[str, Fit]) -> str | None:
    """The model to suggest: the largest (most parameters) that the fleet is predicted to run for one
    person at ``READING_TOK_S`` or faster, draft models left out; None without predictions."""
    fast = [f for f in facts if (fit := fits.get(f.source)) is not None and fit.tok_s_1 is not None
            and fit.tok_s_1 >= READING_TOK_S and not (f.source in CATALOG and CATALOG[f.source].draft_for)]
    return max(fast, key=lambda f: (f.parameters, fits[f.source].tok_s_1)).source if fast else None


def card_lines(facts: ModelFacts, fit: Fit | None, measured: float | None, weights: str = DEFAULT_WEIGHTS,
               carries_weights: bool = True, simulated: bool = False, best: bool = False) -> list[str]:
    """A card's lines; ``best``: it is the model ``best_for_fleet`` suggests, which its last line says."""
    lines = [facts_line(facts)]
    if facts.description:
        lines.append(facts.description)
    if fit is None:
        lines.append("Working out whether it fits…" if facts.has_shape else
                     "Its layers and sizes are not known: no fit or speed prediction")
        if measured:
            lines.append(f"Measured {measured:.1f} tok/s")
    else:
        lines += [fit_line(fit), speed_line(fit, measured, simulated)]
    export = export_line(facts, weights, carries_weights)
    return lines + ([export] if export else []) + ([BEST_LINE] if best else [])


def card_tooltip(fit: Fit | None, export: str = "") -> str:
    """A card's details: how its figures were made, and its export in technical terms."""
    notes = [export] if export else []
    if fit is None:
        return "\n".join(notes)
    if fit.estimated_shape:
        notes.append("Memory estimated from the model's layers, sizes and the export's weight format.")
    if fit.tok_s_1 is not None:
        notes.append("Speeds are predictions of the placement solver from the last fleet profile, its per-layer "
                     "times scaled to this model's weights (decode reads every weight once a token).")
    if fit.note and fit.note != NO_PROFILE:
        notes.append(fit.note)
    return "\n".join(notes)


def price(facts: list[ModelFacts], weights: str) -> tuple[dict[str, Fit], bool]:
    """Every card's fit over the last fleet profile (runs off the GUI thread), and whether that
    profile has simulated PCs in it (the demo fleet's)."""
    profile = load_profile()
    return {f.source: predict(f, profile, weights=weights) for f in facts if f.has_shape}, simulated_profile()


def simulated_profile() -> bool:
    """Whether the last fleet profile measured simulated PCs (``engine.fleet.demo``'s nodes)."""
    try:
        nodes = json.loads(default_profile().read_text()).get("nodes", {})
        return any(isinstance(info, dict) and info.get("simulated") for info in nodes.values())
    except (OSError, ValueError, AttributeError):
        return False


class ModelCards(QListWidget):
    """A card per model; ``chosen(source)`` when the user selects one."""

    chosen = Signal(str)
    priced = Signal()  # the fits of a refresh arrived

    def __init__(self, tasks, weights: str = DEFAULT_WEIGHTS, parent=None):
        super().__init__(parent)
        self.tasks = tasks
        self.weights = weights
        self.facts: list[ModelFacts] = []
        self.fits: dict[str, Fit] = {}
        self.simulated = False  # the predictions rest on simulated PCs
        self.can_carry: dict[str, bool] = {}  # a user's own GGUF: whether Faithful can carry it (read once)
        self._task = None
        self._again = False
        self.search = ""  # only the cards with every word of it show (``set_search``)
        self.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.setAlternatingRowColors(True)
        self.setSpacing(2)
        self.currentItemChanged.connect(lambda item, _: item is not None and self.chosen.emit(item.data(SOURCE)))
        self.set_models([catalog_facts(e) for e in CATALOG.values()])

    def set_models(self, facts: list[ModelFacts]) -> None:
        current = self.current_source()
        self.facts = list(facts)
        self.can_carry = {f.source: self.can_carry[f.source] if f.source in self.can_carry else carried(f.source)
                          for f in self.facts if f.kind == "gguf"}
        self.blockSignals(True)
        self.clear()
        for f in self.facts:
            item = QListWidgetItem()
            item.setData(SOURCE, f.source)
            self.addItem(item)
        self.blockSignals(False)
        self.render()
        if current:
            self.select(current)
        self.set_search(self.search)

    def set_search(self, text: str) -> int:
        """Shows only the cards whose model has every word of ``text`` (any case) in its name, file,
        description, architecture, weight format or licence; the selection moves to the first shown
        when its card hides.  Returns how many show."""
        self.search = text
        words = text.lower().split()
        shown = 0
        for i, f in enumerate(self.facts):
            about = " ".join((f.name, f.source if f.kind == "catalog" else Path(f.source).name, f.description,
                              f.architecture, f.weight_format, f.license)).lower()
            hidden = not all(word in about for word in words)
            self.item(i).setHidden(hidden)
            shown += not hidden
        current = self.currentItem()
        if words and (current is None or current.isHidden()):
            first = next((i for i in range(self.count()) if not self.item(i).isHidden()), None)
            if first is not None:
                self.setCurrentRow(first)
        return shown

    def add_model(self, facts: ModelFacts) -> None:
        """Adds (or replaces) the card of ``facts`` and selects it."""
        self.set_models([f for f in self.facts if f.source != facts.source] + [facts])
        self.select(facts.source)
        self.refresh()

    def render(self) -> None:
        best = best_for_fleet(self.facts, self.fits)
        for i, f in enumerate(self.facts):
            item = self.item(i)
            fit = self.fits.get(f.source)
            item.setText("\n".join(card_lines(f, fit, measured_tok_s(measured_key(f.source)), self.weights,
                                               self.can_carry.get(f.source, True), self.simulated,
                                               best=f.source == best)))
            item.setToolTip(plain_tip(card_tooltip(fit, export_details(f, self.weights))))

    def refresh(self) -> None:
        """Prices every card again (the profile or the measured speeds may have changed)."""
        if self._task is not None:
            self._again = True
            return
        facts, weights = list(self.facts), self.weights
        self._task = self.tasks.start(lambda report, cancel: price(facts, weights), "model cards",
                                      succeeded=self._priced, failed=self._unpriced)

    def _priced(self, result: tuple[dict, bool]) -> None:
        self._task = None
        self.fits, self.simulated = result
        self.render()
        self.priced.emit()
        if self._again:
            self._again = False
            self.refresh()

    def _unpriced(self, message: str) -> None:
        self._task = None
        self.render()
        for i in range(self.count()):
            self.item(i).setToolTip(plain_tip(f"No fit could be worked out: {message}"))
        self.priced.emit()

    # --- selection -------------------------------------------------------------------------------------

    def select(self, source: str) -> bool:
        for i in range(self.count()):
            if self.item(i).data(SOURCE) == source:
                self.setCurrentRow(i)
                return True
        return False

    def current_source(self) -> str | None:
        item = self.currentItem()
        return item.data(SOURCE) if item is not None else None

    def card_text(self, source: str) -> str:
        for i in range(self.count()):
            if self.item(i).data(SOURCE) == source:
                return self.item(i).text()
        raise KeyError(source)


def model_folders() -> list[Path]:
    """Where the model browser looks for a user's own models: the desktop's downloads folder and the
    app's models folder (``engine.models.facts.found_models``)."""
    downloads = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.DownloadLocation)
    return ([Path(downloads)] if downloads else []) + [paths().models]


def own_models(folders: list[Path], current: str) -> tuple[list[ModelFacts], dict[str, bool]]:
    """The model browser's cards of the user's own models, read off the GUI thread (each file's
    header is read): those ``found_models`` finds in ``folders``, and ``current`` where it is a model
    file or folder of the user's not among them; with whether Faithful can carry each GGUF (``carried``)."""
    own = found_models(folders)
    if (current and current not in CATALOG and Path(current).expanduser().exists() and not is_shard_set(current)
            and all(Path(f.source) != Path(current).expanduser() for f in own)):
        try:
            own.append(facts_of(current))
        except FleetError:
            pass
    return own, {f.source: carried(f.source) for f in own if f.kind == "gguf"}


def read_model(source: str) -> tuple[ModelFacts, dict[str, bool]]:
    """The card of a model file or folder the user gives (dropped on the window, browsed to), read off
    the GUI thread (its header is read): its facts, with whether Faithful can carry it for a GGUF
    (``carried``).  Raises FleetError when it is not a model that can be read."""
    facts = facts_of(source)
    return facts, {facts.source: carried(facts.source)} if facts.kind == "gguf" else {}


class ModelBrowser(QDialog):
    """The chat's model browser: the catalog's cards, the GGUF files and Hugging Face folders found in
    ``model_folders``, and the current model's where it is one of those; accepting it picks the
    selected model.  The catalog's cards show at once; the user's own join them when a worker has
    read them (``own_models``), and ``found`` is emitted then."""

    found = Signal()  # the user's own models are read and their cards added (``looking`` is False)

    def __init__(self, tasks, current: str, weights: str = DEFAULT_WEIGHTS, parent=None):
        super().__init__(parent)
        self.setWindowTitle("Choose a model")
        self.current = current
        self.cards = ModelCards(tasks, weights)
        self.cards.select(current) or self.cards.select(DEFAULT_MODEL)
        self._shown_first = self.cards.current_source()  # the selection until the user moves it
        self.looking = True  # the user's own models are being read
        self.cards.itemActivated.connect(lambda _: self.accept())
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search models (the catalog, your GGUF files and Hugging Face folders): "
                                       "a name, a licence, a word of the description")
        self.search.setClearButtonEnabled(True)
        self.nothing = plain(QLabel())  # said when no card matches the search (it quotes what was typed)
        self.nothing.hide()
        self.search.textChanged.connect(self._search)
        hint = QLabel("Speeds are predictions from the last fleet profile until a model has run here.")
        hint.setObjectName("hint")
        hint.setWordWrap(True)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.button(QDialogButtonBox.StandardButton.Ok).setText("Chat with this model")
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        self.ok = buttons.button(QDialogButtonBox.StandardButton.Ok)
        layout = QVBoxLayout(self)
        layout.addWidget(self.search)
        layout.addWidget(self.nothing)
        layout.addWidget(self.cards, 1)
        layout.addWidget(hint)
        layout.addWidget(buttons)
        chars = self.fontMetrics().averageCharWidth()
        self.resize(chars * 110, self.fontMetrics().lineSpacing() * 28)
        self.cards.refresh()
        folders = model_folders()
        tasks.start(lambda report, cancel: own_models(folders, current), "model browser",
                    succeeded=self._found, failed=self._not_found)

    def _found(self, result: tuple[list[ModelFacts], dict[str, bool]]) -> None:
        """The user's own models read (``own_models``): their cards join the catalog's and are priced;
        the current model's is selected unless the user has chosen another meanwhile."""
        own, can_carry = result
        self.looking = False
        if own:
            self.cards.can_carry.update(can_carry)
            self.cards.set_models([*self.cards.facts, *own])
            if self.cards.current_source() == self._shown_first:
                self.cards.select(self.current)
            self._search(self.search.text())
            self.cards.refresh()
        self.found.emit()

    def _not_found(self, message: str) -> None:
        """Reading the user's own models failed (``found_models`` skips what it cannot read, so rarely):
        the catalog's cards stay."""
        self._found(([], {}))

    def _search(self, text: str) -> None:
        shown = self.cards.set_search(text)
        self.nothing.setText(f"No model matches “{text.strip()}”." if not shown else "")
        self.nothing.setVisible(not shown)
        self.ok.setEnabled(bool(shown))

    def chosen_source(self) -> str | None:
        item = self.cards.currentItem()
        return None if item is None or item.isHidden() else self.cards.current_source()
