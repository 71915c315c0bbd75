"""The Benchmarks view: the published comparison with llama.cpp (``engine.bench.highlights``), and one
click that runs a ``fleet bench`` benchmark on the current shard set, with progress, Cancel, live tok/s
per stream, a results plot that grows as rows are measured (for the WAN sweep: throughput against
injected hop latency; for the simulated office: tok/s against users, one line per server), the
results said in sentences (``engine.bench.summary``), and saved as PNG, CSV or JSON.

The first choice, selected from the start, is "How fast is my fleet?" (``engine.bench.fleet``): what
the chat runs on against this PC alone.  The paper's benchmarks follow under "Research"."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyqtgraph as pg
from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QFontMetrics, QStandardItemModel
from PySide6.QtWidgets import (QComboBox, QFileDialog, QFormLayout, QHBoxLayout, QHeaderView, QLabel, QLineEdit,
                               QPlainTextEdit, QProgressBar, QPushButton, QTableWidget,
                               QTableWidgetItem, QVBoxLayout, QWidget)

from engine.bench.harness import Hooks
from engine.bench.summary import in_words
from engine.errors import FleetError
from engine.progress import Progress
from fleetgui.backend import APP_BENCHES
from fleetgui.plots import LiveRatePlot, RateMeter, make_plot, pad_range, style_plot
from fleetgui.running import model_name
from fleetgui.theme import RESOURCES, SERIES
from fleetgui.widgets import Banner, ScrollColumn, combo_box, plain, plain_tip, spin_box, splitter, unbidi
from fleetgui.workers import TaskRunner


def parse_delays(text: str) -> tuple[float, ...]:
    try:
        delays = tuple(float(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise FleetError(f"delays are comma-separated milliseconds, like 0,10,50, not {text!r}") from None
    if not delays or any(d < 0 for d in delays):
        raise FleetError("give at least one network delay of 0 ms or more")
    return delays


def published_table(path: Path) -> QWidget:
    """The published comparison with llama.cpp (``resources/highlights.json``): per number of PCs and
    users, ours and llama.cpp's tok/s and the ratio, with where and when it was measured."""
    box = QWidget()
    layout = QVBoxLayout(box)
    layout.setContentsMargins(0, 0, 0, 0)
    title = plain(QLabel())
    title.setWordWrap(True)
    layout.addWidget(title)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        title.setText(f"No published results to show ({path.name}: {exc})")
        return box
    title.setText(f"Published: {doc['model']} against llama.cpp on the same GGUF, measured {doc['date']} "
                  f"on {doc['cpu']} ({'no int8 dot products' if doc['int8_dot'] == 'none' else doc['int8_dot']})")
    table = QTableWidget(len(doc["rows"]), 5)
    table.setObjectName("published")
    table.setHorizontalHeaderLabels(["PCs", "People at once", "Ours, tok/s", "llama.cpp, tok/s", "Ours / llama.cpp"])
    table.verticalHeader().hide()
    table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
    table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
    for i, row in enumerate(doc["rows"]):
        cells = [str(row["pcs"]), str(row["users"]), f"{row['ours_tok_s']:g}", f"{row['peer_tok_s']:g}",
                 f"{row['ratio']:.2f}x"]
        tips = [row["setup"], "", row["ours"], row["peer"], row["report"]]
        for j, (text, tip) in enumerate(zip(cells, tips)):
            item = QTableWidgetItem(text)
            item.setToolTip(tip)
            table.setItem(i, j, item)
    layout.addWidget(table)
    return box


BAR_LABEL_CHARS = 36  # a bar's name is cut to about this many characters (the plot's tooltip has them whole)


def bench_choice() -> QComboBox:
    """The benchmarks to choose from: those for everyone first, then a "Research" heading over the
    paper's, each by ``Bench.shown_name``.  Each item's data is its name."""
    combo = QComboBox()
    everyone = [name for name, bench in APP_BENCHES.items() if not bench.group]
    for name in everyone:
        combo.addItem(APP_BENCHES[name].shown_name, name)
    groups = dict.fromkeys(bench.group for bench in APP_BENCHES.values() if bench.group)
    for group in groups:
        combo.insertSeparator(combo.count())
        combo.addItem(group, None)
        heading = combo.model().item(combo.count() - 1) if isinstance(combo.model(), QStandardItemModel) else None
        if heading is not None:
            heading.setEnabled(False)  # a heading, not a choice
        for name, bench in APP_BENCHES.items():
            if bench.group == group:
                combo.addItem(APP_BENCHES[name].shown_name, name)
    return combo


class _Rows(QObject):
    row = Signal(object)  # a result row (dict), emitted on the benchmark's thread, delivered on the GUI thread


class BenchPanel(QWidget):
    finished = Signal(object)  # the report, or None when the run failed or was cancelled

    def __init__(self, backend, tasks: TaskRunner, settings, parent: QWidget | None = None):
        super().__init__(parent)
        self.backend = backend
        self.tasks = tasks
        self.settings = settings
        self.task = None
        self.report: dict | None = None
        self.rows: list[dict] = []
        self.bench_name = ""
        self.meter = RateMeter()
        self._rows = _Rows()
        self._rows.row.connect(self._add_row)
        self.banner = Banner()

        self.current = lambda: (None, None)  # the chat's (service, deployment): the window sets it
        self.name = bench_choice()
        self.name.currentIndexChanged.connect(lambda _: self._chosen(self.chosen()))
        self.description = QLabel()
        self.description.setObjectName("hint")
        self.description.setWordWrap(True)
        self.tokens = spin_box(1, 4096, 32)
        self.runs = spin_box(1, 20, 1)
        self.delays = QLineEdit("0,10,50")
        self.draft_kind = combo_box(["lookup", "model", "hybrid"])
        self.users = spin_box(2, 64, 4)
        self.target = plain(QLabel())
        self.target.setObjectName("hint")
        self.target.setWordWrap(True)
        form = QFormLayout()
        form.addRow("Benchmark", self.name)
        form.addRow("", self.description)
        form.addRow("Tokens per reply", self.tokens)
        form.addRow("Runs", self.runs)
        self.delays.setToolTip("the research benchmarks' sweep: a one-way delay added at each hop between the "
                               "model's parts, as a slower network would")
        form.addRow("Network delays (ms)", self.delays)
        form.addRow("Drafts", self.draft_kind)
        form.addRow("People at once", self.users)
        form.addRow("Runs on", self.target)
        # the form's fields, by the option each gives (a benchmark that takes none of them leaves it off)
        self.fields = {("tokens",): self.tokens, ("runs",): self.runs, ("delays", "delay_ms"): self.delays,
                       ("draft_kind",): self.draft_kind}

        self.run_button = QPushButton("Run benchmark")
        self.run_button.setObjectName("primary")
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setEnabled(False)
        self.run_button.clicked.connect(self.run)
        self.cancel_button.clicked.connect(self.cancel)
        self.progress = QProgressBar()
        self.progress.setRange(0, 100)
        self.status = plain(QLabel("Idle"))
        self.status.setObjectName("hint")
        self.status.setWordWrap(True)
        self.summary = plain(QLabel())  # the results in sentences
        self.summary.setObjectName("summary")
        bold = self.summary.font()
        bold.setBold(True)
        self.summary.setFont(bold)
        self.summary.setWordWrap(True)
        self.summary.hide()
        self.log = QPlainTextEdit()
        self.log.setReadOnly(True)
        self.log.setMaximumBlockCount(500)
        self.png_button, self.csv_button, self.json_button = (QPushButton(f"Save {k}…") for k in ("PNG", "CSV", "JSON"))
        self.png_button.clicked.connect(lambda: self._save("PNG image (*.png)", ".png", self.save_png))
        self.csv_button.clicked.connect(lambda: self._save("CSV (*.csv)", ".csv", self.save_csv))
        self.json_button.clicked.connect(lambda: self._save("JSON (*.json)", ".json", self.save_json))
        run_row = QHBoxLayout()
        run_row.addWidget(self.run_button)
        run_row.addWidget(self.cancel_button)
        save_row = QHBoxLayout()
        for b in (self.png_button, self.csv_button, self.json_button):
            save_row.addWidget(b)
        controls = QWidget()
        left = QVBoxLayout(controls)
        left.addLayout(form)
        left.addLayout(run_row)
        left.addWidget(self.progress)
        left.addWidget(self.status)
        left.addWidget(self.summary)
        left.addWidget(self.log, 1)
        left.addLayout(save_row)

        self.plot = make_plot("Results", "", "tok/s", settings.theme)  # the x axis: the benchmark's own, once run
        self.live = LiveRatePlot(self.meter, "Live tokens per second per stream", settings.theme,
                                 x_label="seconds since the benchmark started")
        self.table = QTableWidget(0, 0)
        self.table.verticalHeader().hide()
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.published = published_table(RESOURCES / "highlights.json")
        plots = splitter(Qt.Orientation.Vertical, (self.published, 2), (self.plot, 3), (self.live, 2), (self.table, 2))
        # on a short screen (1024x640) the column's wrapped texts and the summary scroll, rather than being cut
        split = splitter(Qt.Orientation.Horizontal, (ScrollColumn(controls), 1), (plots, 3))
        layout = QVBoxLayout(self)
        layout.addWidget(self.banner)
        layout.addWidget(split, 1)
        self.apply_settings(settings)
        self._chosen(self.chosen())
        self._update_buttons()

    # --- running -------------------------------------------------------------------------------------

    def chosen(self) -> str:
        """The chosen benchmark's name."""
        return self.name.currentData() or ""

    def choose(self, name: str) -> None:
        self.name.setCurrentIndex(self.name.findData(name))

    def _chosen(self, name: str) -> None:
        """Says what the benchmark measures, and turns on the fields it takes."""
        bench = APP_BENCHES.get(name)
        if bench is None:
            return
        self.description.setText(bench.description[:1].upper() + bench.description[1:] + ".")
        for options, widget in self.fields.items():
            widget.setEnabled(any(option in bench.options for option in options))
        self.users.setEnabled(bench.current)  # the others that take users have their own waves

    def options(self) -> dict:
        """The form's options, the hop delays where the chosen benchmark takes them (the backend passes
        each benchmark those it takes)."""
        options = {"tokens": self.tokens.value(), "runs": self.runs.value(),
                   "draft_kind": self.draft_kind.currentText()}
        if self.users.isEnabled():
            options["users"] = (self.users.value(),)
        if self.delays.isEnabled():
            options["delays"] = parse_delays(self.delays.text())
        return options

    def run(self) -> None:
        if self.task is not None:
            return
        self.banner.hide()
        try:
            options = self.options()
        except FleetError as exc:
            self.banner.error(str(exc))
            return
        name, settings, backend = self.chosen(), self.settings, self.backend
        current = APP_BENCHES[name].current
        service, deployment = self.current() if current else (None, None)
        self.report, self.rows = None, []
        self.summary.hide()
        self.bench_name = name
        self._draw()
        self.live.clear()
        self.table.setRowCount(0)
        self.log.clear()
        self.progress.setValue(0)
        self.status.setText("Starting the benchmark…")
        meter, rows = self.meter, self._rows

        def work(report, cancel):
            hooks = Hooks(progress=report, on_token=lambda stream, _token: meter.add(f"stream {stream}"),
                          on_row=rows.row.emit, cancel=cancel)
            return backend.bench(name, settings, options, hooks, log=lambda line: report(str(line)),
                                 **({"service": service, "deployment": deployment} if current else {}))

        self.task = self.tasks.start(work, f"bench {name}", progressed=self._progress, succeeded=self._done,
                                     failed=self._failed, cancelled=lambda: self._failed("cancelled"))
        self._update_buttons()

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.status.setText("Cancelling at the next decode round…")
            self.cancel_button.setEnabled(False)

    def _progress(self, reported: Progress | str) -> None:
        """The run's progress on the bar, or a line of its log."""
        if isinstance(reported, Progress):
            self.progress.setValue(round(reported.fraction * 100))
            self.status.setText(reported.text)
        else:
            self.log.appendPlainText(unbidi(reported))

    def _add_row(self, row: dict) -> None:
        self.rows.append(row)
        self._fill_table()
        self._draw()

    def _done(self, report: dict) -> None:
        self.task = None
        self.report = report
        self.rows = list(report.get("rows", []))
        self.progress.setValue(100)
        self.status.setText("Done.")
        sentences = in_words(report)
        self.summary.setText("\n".join(sentences))
        self.summary.setVisible(bool(sentences))
        self._fill_table()
        self._draw()
        self._update_buttons()
        self.finished.emit(report)

    def _failed(self, message: str) -> None:
        self.task = None
        self.status.setText("Cancelled." if message == "cancelled" else "Failed.")
        if message != "cancelled":
            self.banner.error(f"The benchmark failed: {message}")
        self._update_buttons()
        self.finished.emit(None)

    def _update_buttons(self) -> None:
        running = self.task is not None
        self.run_button.setEnabled(not running)
        self.cancel_button.setEnabled(running)
        for b in (self.png_button, self.csv_button, self.json_button):
            b.setEnabled(bool(self.rows) and not running)

    # --- results -------------------------------------------------------------------------------------

    def columns(self) -> list[str]:
        return list(dict.fromkeys(c for row in self.rows for c in row))

    def _fill_table(self) -> None:
        columns = self.columns()
        self.table.setColumnCount(len(columns))
        self.table.setHorizontalHeaderLabels(columns)
        self.table.setRowCount(len(self.rows))
        for r, row in enumerate(self.rows):
            for c, column in enumerate(columns):
                value = row.get(column, "")
                self.table.setItem(r, c, QTableWidgetItem("" if value is None else str(value)))

    def plotted_points(self) -> int:
        """How many data points the results plot shows (bars count one each)."""
        total = 0
        for item in self.plot.getPlotItem().listDataItems():
            if isinstance(item, pg.BarGraphItem):  # a data item too in newer pyqtgraph: counted below
                continue
            xs, _ = item.getData()
            total += 0 if xs is None else len(xs)
        for item in self.plot.getPlotItem().items:
            if isinstance(item, pg.BarGraphItem):
                total += len(item.opts.get("y", []))
        return total

    def _draw(self) -> None:
        item = self.plot.getPlotItem()
        item.clear()
        if item.legend is not None:
            item.legend.clear()
        bench = APP_BENCHES.get(self.bench_name)
        plot = bench.plot if bench else None
        bottom, left = item.getAxis("bottom"), item.getAxis("left")
        left.setTicks(None)
        self.plot.setToolTip("")
        if plot is None or not self.rows:
            bottom.setTicks(None)
            return
        item.setLabel("bottom", plot.x_label)
        if plot.kind == "lines":
            item.setLabel("left", "tok/s")
            bottom.setTicks(None)
            lines: dict[str, tuple[list, list]] = {}
            for row in self.rows:
                if plot.x not in row or any(row.get(c) for c in plot.skip):  # side-by-side rows
                    continue
                for y, label in plot.ys.items():
                    if row.get(y) is None:
                        continue
                    name = label if plot.series is None else plot.series.format_map(row)
                    xs_, ys_ = lines.setdefault(name, ([], []))
                    xs_.append(float(row[plot.x]))
                    ys_.append(float(row[y]))
            for i, (name, (xs_, ys_)) in enumerate(lines.items()):
                colour = SERIES[i % len(SERIES)]
                item.plot(xs_, ys_, name=name, pen=pg.mkPen(colour, width=2), symbol="o", symbolBrush=colour,
                          symbolPen=colour)
            item.enableAutoRange()
            for axis, values in (("x", [v for xs_, _ in lines.values() for v in xs_]),
                                 ("y", [v for _, ys_ in lines.values() for v in ys_])):
                padded = pad_range(values)  # one point (or one value): a readable range around it
                if padded is None and axis == "y" and values:
                    # headroom above the highest point: the legend (top left) sits over empty plot, not a curve
                    low, high = min(0.0, min(values)), max(values)
                    padded = (low, high + (high - low) * 0.12 * (len(lines) + 1))
                if padded is not None:
                    (item.setXRange if axis == "x" else item.setYRange)(*padded, padding=0)
        else:  # bars, lying: each row's name on a line of its own at the left, however long or many
            (value, label), = plot.ys.items()
            rows = [r for r in self.rows if r.get(value) is not None]
            names = [str(r.get(plot.x, i)) for i, r in enumerate(rows)]
            values = [float(r[value]) for r in rows]
            ys = list(range(len(rows)))[::-1]  # the first row on top
            item.setLabel("bottom", label)
            item.setLabel("left", plot.x_label)
            item.addItem(pg.BarGraphItem(x0=0, y=ys, width=values, height=0.6, brush=SERIES[0]))
            metrics = QFontMetrics(self.plot.font())
            room = metrics.averageCharWidth() * BAR_LABEL_CHARS
            left.setTicks([[(y, metrics.elidedText(name, Qt.TextElideMode.ElideRight, room))
                            for y, name in zip(ys, names)]])
            bottom.setTicks(None)
            item.setXRange(min(0.0, *values), max(0.0, *values) * 1.05 or 1.0, padding=0.02)
            item.setYRange(-0.6, len(rows) - 0.4, padding=0)
            self.plot.setToolTip(plain_tip("\n".join(f"{name}: {v:g} {label}" for name, v in zip(names, values))))

    def save_png(self, path: str | Path) -> Path:
        """The results plot as an image (the plot widget grabbed at its on-screen size)."""
        path = Path(path)
        if not self.plot.grab().save(str(path)):
            raise FleetError(f"could not write {path}")
        return path

    def save_csv(self, path: str | Path) -> Path:
        path = Path(path)
        columns = self.columns()
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            for row in self.rows:
                writer.writerow({c: row.get(c, "") for c in columns})
        return path

    def save_json(self, path: str | Path) -> Path:
        path = Path(path)
        report = self.report or {"bench": self.bench_name, "rows": self.rows}
        path.write_text(json.dumps(report, indent=2))
        return path

    def _save(self, kind: str, suffix: str, save) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Save results", f"{self.bench_name or 'bench'}{suffix}", kind)
        if not path:
            return
        try:
            save(path)
        except (OSError, FleetError) as exc:
            self.banner.error(f"Could not save: {exc}")
        else:
            self.banner.info(f"Saved {path}")

    def apply_settings(self, settings) -> None:
        self.settings = settings
        self.target.setText(f"{model_name(settings.default_model)}"
                            + ("" if Path(settings.default_model).expanduser().is_dir()
                               else f", in {settings.stages} part{'s' if settings.stages != 1 else ''}, "
                                    f"{settings.weights}"))
        style_plot(self.plot, settings.theme)
        self.live.set_theme(settings.theme)
