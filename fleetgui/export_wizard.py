"""The Export view: a three-step wizard from a model source to verified shard folders.

1. Model: a catalog model, a Hugging Face folder or a GGUF file, each shown as a card
   (``fleetgui.model_cards``: its facts, whether it fits this PC and the fleet, its predicted speed).
2. Split and format: for a GGUF, the same answers as the GGUF or faster, slightly different ones
   (``engine.export.choices``' Faithful and Fast, with what each was measured to cost; the KL in the
   note's tooltip), a part count, the output folder; behind "Details" the weight format behind the
   choice, the head's and explicit layer boundaries.
3. Export: the catalog pull's progress (when the model is not cached yet), a progress bar per part,
   a Cancel that ends the running stage's process, and at the end the shard folders with their
   sizes and each stage's peak memory.
"""

from __future__ import annotations

import json
from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QButtonGroup, QCheckBox, QFileDialog, QFormLayout, QGridLayout, QGroupBox,
                               QHBoxLayout, QHeaderView, QLabel, QLineEdit, QProgressBar, QPushButton, QRadioButton,
                               QStackedWidget, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget)

from engine.config import int4_layers, paths
from engine.errors import FleetError
from engine.export.choices import CHOICES, choice_of, describe
from engine.export.compress import HEAD_FORMATS, HEAD_NOTES, WEIGHT_FORMATS, WEIGHT_NOTES
from engine.manifest import layer_numbers
from engine.models.catalog import CATALOG, DEFAULT_MODEL
from engine.progress import Progress
from fleetgui.model_cards import ModelCards, read_model
from fleetgui.running import folder_tip, model_name
from fleetgui.widgets import Banner, combo_box, explained_choice, field_row, flow_bar, plain, plain_tip, spin_box
from fleetgui.workers import TaskRunner

RESULT_COLUMNS = ("part", "layers", "peak MB", "size MB", "seconds")  # each row's folder: its tooltip


def parse_split(text: str) -> list[int]:
    try:
        split = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise FleetError(f"the split takes layer boundaries like 10,20, not {text!r}") from None
    if not split:
        raise FleetError("give at least one layer boundary, like 10 for two parts")
    return split


class ExportWizard(QWidget):
    exported = Signal(object)  # ExportResult
    use_as_default = Signal(str)  # an export folder the user wants to chat with
    checked = Signal(bool)  # a model given by path (``use_path``) was read: whether it could be

    def __init__(self, backend, tasks: TaskRunner, settings, parent: QWidget | None = None):
        super().__init__(parent)
        self.backend = backend
        self.tasks = tasks
        self.settings = settings
        self.task = None
        self.result = None
        self.checking = ""  # the model file or folder whose header is being read (``use_path``)
        self.then_choices = False  # a typed GGUF path is being read: its choices show once it is
        self.banner = Banner()
        self.pages = QStackedWidget()
        self.pages.addWidget(self._source_page())
        self.pages.addWidget(self._split_page())
        self.pages.addWidget(self._run_page())
        self.back_button = QPushButton("Back")
        self.next_button = QPushButton("Next")
        self.next_button.setObjectName("primary")
        self.cancel_button = QPushButton("Cancel")
        self.again_button = QPushButton("New export")
        self.default_button = QPushButton("Chat with this export")
        self.back_button.clicked.connect(self.back)
        self.next_button.clicked.connect(self.next)
        self.cancel_button.clicked.connect(self.cancel)
        self.again_button.clicked.connect(self.restart)
        self.default_button.clicked.connect(lambda: self.result and self.use_as_default.emit(str(self.result.out)))
        self.step = QLabel()
        self.step.setObjectName("hint")
        buttons = QHBoxLayout()
        buttons.addWidget(self.step, 1)
        for b in (self.default_button, self.again_button, self.back_button, self.cancel_button, self.next_button):
            buttons.addWidget(b)
        layout = QVBoxLayout(self)
        layout.addWidget(self.banner)
        layout.addWidget(self.pages, 1)
        layout.addLayout(buttons)
        self._show_page(0)

    # --- pages ---------------------------------------------------------------------------------------

    def _source_page(self) -> QWidget:
        page = QGroupBox("1. Model")
        self.kind = QButtonGroup(page)
        self.catalog_radio = QRadioButton("Catalog model")
        self.hf_radio = QRadioButton("Hugging Face folder (safetensors)")
        self.gguf_radio = QRadioButton("GGUF file")
        for i, r in enumerate((self.catalog_radio, self.hf_radio, self.gguf_radio)):
            self.kind.addButton(r, i)
        self.catalog_radio.setChecked(True)
        self.cards = ModelCards(self.tasks, self.settings.weights)
        self.cards.chosen.connect(self._card_chosen)
        self.cards.select(DEFAULT_MODEL)
        drop_hint = QLabel("Drop a .gguf file or a Hugging Face folder on the window to see its card. Speeds are "
                           "predictions from the last fleet profile (Fleet view) until the model has run here.")
        drop_hint.setObjectName("hint")
        drop_hint.setWordWrap(True)
        self.hf_path = QLineEdit()
        self.hf_path.setPlaceholderText("a folder holding config.json, *.safetensors and the tokenizer")
        self.gguf_path = QLineEdit()
        self.gguf_path.setPlaceholderText("a .gguf file")
        hf_browse, gguf_browse = QPushButton("Browse…"), QPushButton("Browse…")
        hf_browse.clicked.connect(self._browse_hf)
        gguf_browse.clicked.connect(self._browse_gguf)
        self.hf_path.textEdited.connect(lambda: self.hf_radio.setChecked(True))
        self.gguf_path.textEdited.connect(lambda: self.gguf_radio.setChecked(True))
        grid = QGridLayout(page)
        grid.addWidget(self.catalog_radio, 0, 0, 1, 3)
        grid.addWidget(self.cards, 1, 0, 1, 3)
        grid.addWidget(self.hf_radio, 2, 0)
        grid.addWidget(self.hf_path, 2, 1)
        grid.addWidget(hf_browse, 2, 2)
        grid.addWidget(self.gguf_radio, 3, 0)
        grid.addWidget(self.gguf_path, 3, 1)
        grid.addWidget(gguf_browse, 3, 2)
        grid.addWidget(drop_hint, 4, 0, 1, 3)
        grid.setColumnStretch(1, 1)
        grid.setRowStretch(1, 1)
        return page

    def _head_allowed(self, weights: str) -> None:
        """An INT4 head goes with INT4 layers (``auto`` gives INT4 layers); any other format keeps the INT8 head."""
        allowed = int4_layers(weights)
        if not allowed:
            self.head.setCurrentText(HEAD_FORMATS[0])
        self.head.setEnabled(allowed)

    def _show_choice(self, weights: str) -> None:
        """Checks Faithful or Fast as the weight format says (``auto`` is Faithful for a GGUF), or
        neither for another format."""
        choice = choice_of(weights)
        self.choices.setExclusive(False)
        for radio in self.choices.buttons():
            radio.blockSignals(True)  # showing the format is not choosing one: "auto" stays "auto"
            radio.setChecked(choice is not None and radio.text() == choice.label)
            radio.blockSignals(False)
        self.choices.setExclusive(True)

    def _prepare_choices(self) -> None:
        """Faithful / Fast for a GGUF source, each with the figures measured on it (or on the
        reference model); hidden for a Hugging Face folder, which has no GGUF weights to keep, and for
        a GGUF whose types cannot be carried over."""
        source = self.source()
        # a GGUF's was read off the GUI thread with its card (``use_path``), a typed path's on Next
        self.choice_box.setVisible(source in CATALOG or (self.gguf_radio.isChecked()
                                                         and self.cards.can_carry.get(source, False)))
        for choice in CHOICES:
            measured_on = source if source in CATALOG else None
            self.choice_notes[choice.weights].setText(describe(choice, measured_on, kl=False))
            self.choice_notes[choice.weights].setToolTip(plain_tip(describe(choice, measured_on)))  # with its KL
        self._show_choice(self.weights.currentText())

    def _split_page(self) -> QWidget:
        page = QGroupBox("2. Split and weight format")
        self.weights = combo_box(WEIGHT_FORMATS, self.settings.weights)
        self.head = combo_box(HEAD_FORMATS, HEAD_FORMATS[0])
        self.weights.currentTextChanged.connect(self._head_allowed)
        self._head_allowed(self.weights.currentText())
        self.choices = QButtonGroup(page)
        self.choice_box = QWidget()
        choice_layout = QVBoxLayout(self.choice_box)
        choice_layout.setContentsMargins(0, 0, 0, 0)
        self.choice_notes: dict[str, QLabel] = {}
        for choice in CHOICES:
            radio = QRadioButton(choice.label)
            radio.setObjectName(f"choice-{choice.weights}")
            radio.toggled.connect(lambda on, c=choice: on and self.weights.setCurrentText(c.weights))
            self.choices.addButton(radio)
            note = QLabel()
            note.setObjectName("hint")
            note.setWordWrap(True)
            self.choice_notes[choice.weights] = note
            choice_layout.addWidget(radio)
            choice_layout.addWidget(note)
        self.weights.currentTextChanged.connect(self._show_choice)
        self.by_count = QRadioButton("Number of parts (layers split evenly)")
        self.by_split = QRadioButton("Explicit layer boundaries")
        self.by_count.setChecked(True)
        self.stages = spin_box(1, 64, self.settings.stages)
        self.split = QLineEdit()
        self.split.setPlaceholderText("first layer of each later part: 10,20 gives layers 0-9, 10-19, 20-…")
        self.split.textEdited.connect(lambda: self.by_split.setChecked(True))
        self.stages.valueChanged.connect(lambda: self.by_count.setChecked(True))
        plan_button = QPushButton("From a placement plan…")
        plan_button.setToolTip("take the boundaries of a plan written by `fleet place` or the Placement view")
        plan_button.clicked.connect(self._browse_plan)
        self.out = QLineEdit()
        self.out.setPlaceholderText("default: the shard cache")
        out_browse = QPushButton("Browse…")
        out_browse.clicked.connect(self._browse_out)
        self.force = QCheckBox("export again even if this export is cached")
        # the weight format, the head's and explicit boundaries are for experts: behind "Details"
        self.details = QWidget()
        details = QFormLayout(self.details)
        details.setContentsMargins(0, 0, 0, 0)
        details.addRow("Weights", explained_choice(self.weights, WEIGHT_NOTES))
        details.addRow("LM head", explained_choice(self.head, HEAD_NOTES))
        details.addRow(self.by_split, field_row(self.split, plan_button))
        self.details.hide()
        self.details_button = QPushButton("Details")
        self.details_button.setCheckable(True)
        self.details_button.setToolTip("the weight format, the output layer's format and explicit layer boundaries")
        self.details_button.toggled.connect(self.details.setVisible)
        self.by_split.toggled.connect(lambda on: on and self.details_button.setChecked(True))
        form = QFormLayout(page)
        form.addRow("Answers", self.choice_box)
        form.addRow(self.by_count, self.stages)
        form.addRow("Output folder", field_row(self.out, out_browse))
        form.addRow("", self.force)
        form.addRow("", flow_bar(self.details_button)[0])
        form.addRow(self.details)
        return page

    def _run_page(self) -> QWidget:
        page = QGroupBox("3. Export")
        self.summary = plain(QLabel())
        self._what = ""  # the export under way, in words ("SmolLM2 135M in 2 parts (auto) on this PC")
        self.summary.setWordWrap(True)
        self.pull_label = plain(QLabel("Pulling the model"))
        self.pull_bar = QProgressBar()
        self.stage_box = QWidget()
        self.stage_grid = QGridLayout(self.stage_box)
        self.stage_grid.setContentsMargins(0, 0, 0, 0)
        self.stage_bars: list[QProgressBar] = []
        self.stage_labels: list[QLabel] = []
        self.table = QTableWidget(0, len(RESULT_COLUMNS))
        self.table.setHorizontalHeaderLabels(RESULT_COLUMNS)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.verticalHeader().hide()
        self.total = plain(QLabel())
        layout = QVBoxLayout(page)
        layout.addWidget(self.summary)
        layout.addWidget(self.pull_label)
        layout.addWidget(self.pull_bar)
        layout.addWidget(self.stage_box)
        layout.addWidget(self.table, 1)
        layout.addWidget(self.total)
        return page

    def _card_chosen(self, source: str) -> None:
        facts = next((f for f in self.cards.facts if f.source == source), None)
        if facts is None or facts.kind == "catalog":
            self.catalog_radio.setChecked(True)
        elif facts.kind == "hf":
            self.hf_path.setText(source)
            self.hf_radio.setChecked(True)
        else:
            self.gguf_path.setText(source)
            self.gguf_radio.setChecked(True)

    def use_path(self, path: str | Path, kind: QRadioButton | None = None) -> None:
        """Shows the card of a GGUF file or a Hugging Face folder (dropped on the window or browsed to)
        and makes it the export's source.  Its header is read off the GUI thread (``read_model``): the
        wizard says it is checking the file meanwhile, and once the card (or what is wrong with the
        file) shows, ``checked`` says whether it could be read.  ``kind``: the source kind it was
        browsed for (its path stays in that field even when it cannot be read)."""
        path = str(path)
        self.checking = path  # the last given wins: an earlier one read later is dropped
        self.banner.info(f"Checking {Path(path).name}…")
        self.next_button.setEnabled(False)
        self.tasks.start(lambda report, cancel: read_model(path), "model check",
                         succeeded=lambda result: self._model_read(path, result),
                         failed=lambda message: self._model_unreadable(path, message, kind))

    def _model_read(self, path: str, result: tuple) -> None:
        """``use_path``'s model read: its card joins the others, selected (the export's source)."""
        if path != self.checking:
            return
        self._checked()
        self.banner.hide()
        facts, can_carry = result
        if self.task is None:
            self._show_page(0)
        self.cards.can_carry.update(can_carry)  # read with the header: the card reads no file here
        self.cards.can_carry.setdefault(path, can_carry.get(facts.source, False))  # as typed ("~/…")
        self.cards.add_model(facts)
        if self.then_choices:  # Next on a typed path: on to its choices, as it was read
            self.then_choices = False
            self._prepare_choices()
            self._show_page(1)
        self.checked.emit(True)

    def _model_unreadable(self, path: str, message: str, kind: QRadioButton | None) -> None:
        if path != self.checking:
            return
        self.then_choices = False
        self._checked()
        self.banner.error(message)
        if kind is not None:
            {self.hf_radio: self.hf_path, self.gguf_radio: self.gguf_path}[kind].setText(path)
            kind.setChecked(True)
        self.checked.emit(False)

    def _checked(self) -> None:
        self.checking = ""
        self.next_button.setEnabled(True)

    def choose_catalog(self, name: str) -> None:
        self.cards.select(name)
        self.catalog_radio.setChecked(True)

    def showEvent(self, event) -> None:
        super().showEvent(event)
        self.cards.refresh()  # the fleet profile or the measured speeds may have changed meanwhile

    def _browse_hf(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Hugging Face model folder", self.hf_path.text())
        if path:
            self.use_path(path, self.hf_radio)

    def _browse_gguf(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "GGUF file", self.gguf_path.text(), "GGUF (*.gguf)")
        if path:
            self.use_path(path, self.gguf_radio)

    def _browse_plan(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Placement plan", str(paths().data), "Plans (*.json)")
        if path:
            self.use_plan(Path(path))

    def use_plan(self, path: Path) -> None:
        """Fills the split with a plan's stage boundaries (``fleet place`` output or a bare Plan)."""
        try:
            doc = json.loads(Path(path).read_text())
            stages = (doc.get("plan") or doc)["stages"]
            self.split.setText(",".join(str(s["end"]) for s in stages[:-1]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.banner.error(f"{path} is not a placement plan ({exc})")
            return
        if len(stages) > 1:
            self.by_split.setChecked(True)
        else:
            self.by_count.setChecked(True)
            self.stages.setValue(1)

    def _browse_out(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Output folder", self.out.text())
        if path:
            self.out.setText(path)

    # --- navigation ----------------------------------------------------------------------------------

    def source(self) -> str:
        if self.hf_radio.isChecked():
            return self.hf_path.text().strip()
        if self.gguf_radio.isChecked():
            return self.gguf_path.text().strip()
        source = self.cards.current_source()
        return source if source in CATALOG else ""

    def _show_page(self, index: int) -> None:
        self.pages.setCurrentIndex(index)
        running = self.task is not None
        done = index == 2 and not running
        self.step.setText(f"Step {index + 1} of 3")
        self.back_button.setVisible(index > 0 and not running)
        self.back_button.setEnabled(index > 0 and not running)
        self.next_button.setVisible(index < 2)
        self.next_button.setText("Export" if index == 1 else "Next")
        self.cancel_button.setVisible(running)
        self.again_button.setVisible(done)
        self.default_button.setVisible(done and self.result is not None)

    def back(self) -> None:
        if self.task is None and self.pages.currentIndex() > 0:
            self._show_page(self.pages.currentIndex() - 1)

    def next(self) -> None:
        self.banner.hide()
        index = self.pages.currentIndex()
        if index == 0:
            if not self.source():
                self.banner.error("Choose a model: a catalog entry, a Hugging Face folder or a GGUF file.")
                return
            if self.gguf_radio.isChecked() and self.source() not in self.cards.can_carry:
                self.then_choices = True  # a typed path: read off the GUI thread first, as a dropped one
                self.use_path(self.source(), self.gguf_radio)
                return
            self._prepare_choices()
            self._show_page(1)
        elif index == 1:
            self.start()

    def restart(self) -> None:
        self.result = None
        self._show_page(0)

    # --- the export ----------------------------------------------------------------------------------

    def start(self) -> None:
        if self.task is not None:
            return
        source = self.source()
        try:
            split = parse_split(self.split.text()) if self.by_split.isChecked() else None
        except FleetError as exc:
            self.banner.error(str(exc))
            return
        stages = None if split else self.stages.value()
        count = len(split) + 1 if split else stages
        weights, head = self.weights.currentText(), self.head.currentText()
        out = Path(self.out.text().strip()).expanduser() if self.out.text().strip() else None
        force = self.force.isChecked()
        self.result = None
        self._prepare(count, source)
        self._what = (f"{model_name(source)} in {count} part{'s' if count > 1 else ''} "
                      f"({weights}{', INT4 head' if head == 'int4' else ''}) on this PC")
        self.summary.setText(f"Exporting {self._what}.")
        self.summary.setToolTip(plain_tip("\n".join(filter(None, (folder_tip(source), out and f"Into: {out}")))))
        backend = self.backend
        self.task = self.tasks.start(
            lambda report, cancel: backend.export(source, stages=stages, split=split, weights=weights, out=out,
                                                  head=head, force=force, progress=report, cancel=cancel),
            "export", progressed=self._progress, succeeded=self._done, failed=self._failed,
            cancelled=lambda: self._failed("export cancelled"))
        self._show_page(2)

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.cancel_button.setEnabled(False)
            self.total.setText("Cancelling…")

    def _prepare(self, count: int, source: str) -> None:
        for w in self.stage_bars + self.stage_labels:
            self.stage_grid.removeWidget(w)
            w.deleteLater()
        self.stage_bars, self.stage_labels = [], []
        for i in range(count):
            label, bar = QLabel(f"part {i + 1}: waiting"), QProgressBar()
            bar.setRange(0, 100)
            self.stage_grid.addWidget(label, i, 0)
            self.stage_grid.addWidget(bar, i, 1)
            self.stage_labels.append(label)
            self.stage_bars.append(bar)
        self.stage_grid.setColumnStretch(1, 1)
        pulling = source in CATALOG
        self.pull_label.setVisible(pulling)
        self.pull_bar.setVisible(pulling)
        self.pull_bar.setRange(0, 100)
        self.pull_bar.setValue(0)
        self.table.setRowCount(0)
        self.total.setText("")
        self.total.setToolTip("")
        self.cancel_button.setEnabled(True)

    def _progress(self, progress: Progress) -> None:
        if progress.stage is None:  # the catalog model's download
            self.pull_label.setText(progress.text)
            self.pull_bar.setValue(100 if progress.fraction is None else round(progress.fraction * 100))
        elif 0 <= progress.stage < len(self.stage_bars):
            self.stage_bars[progress.stage].setValue(round(progress.fraction * 100))
            self.stage_labels[progress.stage].setText(f"part {progress.stage + 1}: {progress.step}")

    def _finish(self) -> None:
        self.task = None
        self._show_page(2)

    def _done(self, result) -> None:
        self.result = result
        self._finish()
        self.summary.setText(f"Exported {self._what}.")
        for report in result.stages:
            if report.index < len(self.stage_bars):
                self.stage_bars[report.index].setValue(100)
                self.stage_labels[report.index].setText(
                    f"part {report.index + 1}: done, peak {report.peak_rss_mb:.0f} MB")
        self.table.setRowCount(len(result.stages))
        for row, s in enumerate(result.stages):
            cells = (str(s.index + 1), layer_numbers(*s.layers), f"{s.peak_rss_mb:.0f}", f"{s.size_mb:.2f}",
                     f"{s.seconds:.1f}")
            for col, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setToolTip(plain_tip(f"Files: {s.folder}"))
                self.table.setItem(row, col, item)
        size = sum(s.size_mb for s in result.stages)
        count = len(result.stages)
        self.total.setText(f"{model_name(self.source())} in {count} part{'s' if count > 1 else ''}, {size:.2f} MB "
                           "in all, saved on this PC"
                           + (" (exported before: reused)." if result.cached else "."))
        self.total.setToolTip(plain_tip(f"Files: {result.out}"))
        self.exported.emit(result)

    def _failed(self, message: str) -> None:
        self._finish()
        cancelled = message == "export cancelled"
        self.summary.setText(f"{'Cancelled' if cancelled else 'Failed'}: exporting {self._what}.")
        self.total.setText("Export cancelled." if message == "export cancelled" else "Export failed.")
        if message != "export cancelled":
            self.banner.error(f"The export failed: {message}")

    def apply_settings(self, settings) -> None:
        self.settings = settings
        if self.cards.weights != settings.weights:
            self.cards.weights = settings.weights
            self.cards.refresh()
