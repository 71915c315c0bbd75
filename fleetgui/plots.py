"""Plots: live tokens per second per stream, and benchmark results (pyqtgraph).

``RateMeter`` is the only piece other threads touch: engine callbacks add token counts under a
lock, and the plot samples it on a GUI-thread timer, so a fast stream costs no signal per token.
A stream that ``begin``s (a chat reply) is plotted against the seconds since its first token; the live
plot's key names each stream (a chat tab's title) above the plot, off the data.
"""

from __future__ import annotations

import collections
import html
import threading
import time

import pyqtgraph as pg
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from fleetgui.theme import PLOT_COLOURS, SERIES


class RateMeter:
    """Token counts per stream label (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: dict[str, int] = collections.defaultdict(int)
        self.started: dict[str, float] = {}  # stream -> monotonic time of its current run's first token
        self.waiting: set[str] = set()  # streams whose run has begun and has had no token yet

    def begin(self, stream: str) -> None:
        """A new run of ``stream`` (a reply) begins: the plot's time axis restarts at 0 for it at its
        first token, so the wait for the model before it (starting, reading the prompt) is not plotted."""
        with self._lock:
            self.started.pop(stream, None)
            self.waiting.add(stream)

    def add(self, stream: str, tokens: int = 1) -> None:
        with self._lock:
            if stream in self.waiting:
                self.waiting.discard(stream)
                self.started[stream] = time.monotonic()
            self._counts[stream] += tokens

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def runs(self) -> tuple[dict[str, float], set[str]]:
        """When each stream's current run had its first token, and the streams still waiting for one."""
        with self._lock:
            return dict(self.started), set(self.waiting)

    def clear(self) -> None:
        with self._lock:
            self._counts.clear()
            self.started.clear()
            self.waiting.clear()


def make_plot(title: str, x_label: str, y_label: str, theme: str = "light", legend: bool = True) -> pg.PlotWidget:
    plot = pg.PlotWidget(title=title)
    plot.setLabel("bottom", x_label)
    plot.setLabel("left", y_label)
    plot.showGrid(x=True, y=True, alpha=0.25)
    for axis in ("left", "bottom"):  # plain numbers: no "(x0.001)" scale beside the label
        plot.getAxis(axis).enableAutoSIPrefix(False)
    if legend:
        plot.addLegend(offset=(10, 10))
    style_plot(plot, theme)
    return plot


def pad_range(values: list[float]) -> tuple[float, float] | None:
    """A range around values that are all equal (one point): pyqtgraph would otherwise spread a
    zero-width range over a tiny scale ("-400...400 (x0.001)").  None when they differ."""
    if not values or max(values) != min(values):
        return None
    value = values[0]
    half = max(abs(value) * 0.5, 1.0)
    return (value - half, value + half)


def style_plot(plot: pg.PlotWidget, theme: str) -> None:
    background, foreground = PLOT_COLOURS.get(theme, PLOT_COLOURS["light"])
    plot.setBackground(background)
    item = plot.getPlotItem()
    for name in ("left", "bottom"):
        axis = item.getAxis(name)
        axis.setPen(pg.mkPen(foreground))
        axis.setTextPen(pg.mkPen(foreground))
    item.titleLabel.setText(item.titleLabel.text, color=foreground)


class LiveRatePlot(QWidget):
    """Tokens per second of every stream over the last minute, sampled from a ``RateMeter``."""

    SAMPLE_MS = 250
    WINDOW = 4  # samples averaged per point (one second)
    HISTORY_S = 60.0

    def __init__(self, meter: RateMeter, title: str = "Live tokens per second", theme: str = "light",
                 parent: QWidget | None = None, x_label: str = "seconds"):
        super().__init__(parent)
        self.meter = meter
        self.names: dict[str, str] = {}  # stream -> the name the key shows (default: the stream)
        self.plot = make_plot(title, x_label, "tok/s", theme, legend=False)
        self.plot.setMinimumHeight(self.fontMetrics().height() * 8)
        self.key = QLabel()  # the streams' colours and names, above the plot rather than over the curves
        self.key.setObjectName("hint")
        self.key.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.key)
        layout.addWidget(self.plot, 1)
        self._theme = theme
        self._start = time.monotonic()
        self._samples: list[tuple[float, dict[str, int]]] = []
        self.series: dict[str, tuple[list[float], list[float]]] = {}
        self._curves: dict[str, pg.PlotDataItem] = {}
        self._timer = QTimer(self)
        self._timer.timeout.connect(self.sample)
        self._timer.start(self.SAMPLE_MS)

    def set_theme(self, theme: str) -> None:
        style_plot(self.plot, theme)

    def set_name(self, stream: str, name: str) -> None:
        self.names[stream] = name
        self._update_key()

    def _update_key(self) -> None:
        parts = []
        for stream, curve in self._curves.items():
            colour = curve.opts["pen"].color().name()
            parts.append(f"<span style='color:{colour}'>&#9632;</span> {html.escape(self.names.get(stream, stream))}")
        self.key.setText("&nbsp;&nbsp;&nbsp;".join(parts))
        self.key.setVisible(bool(parts))

    def sample(self) -> None:
        clock = time.monotonic()
        now = clock - self._start
        counts = self.meter.snapshot()
        started, waiting = self.meter.runs()
        self._samples.append((now, counts))
        del self._samples[: -(self.WINDOW + 1)]
        if len(self._samples) < 2:
            return
        then, before = self._samples[0]
        for stream, count in counts.items():
            if stream in waiting:  # a new reply that has not begun to come: its curve starts at its first token
                if self.points(stream):
                    self.series[stream] = ([], [])
                    self._curves[stream].setData([], [])
                continue
            rate = (count - before.get(stream, 0)) / max(now - then, 1e-6)
            xs, ys = self.series.setdefault(stream, ([], []))
            if rate == 0 and (not ys or ys[-1] == 0):
                continue  # an idle stream adds no points until it runs again
            began = started.get(stream)
            x = now if began is None else clock - began  # seconds since its reply's first token
            if xs and x < xs[-1]:  # a new reply of this stream: its curve starts again at 0
                xs.clear()
                ys.clear()
            xs.append(x)
            ys.append(rate)
            while xs and xs[0] < x - self.HISTORY_S:
                xs.pop(0)
                ys.pop(0)
            curve = self._curves.get(stream)
            if curve is None:
                colour = SERIES[len(self._curves) % len(SERIES)]
                curve = self._curves[stream] = self.plot.plot([], [], name=stream, pen=pg.mkPen(colour, width=2))
                self._update_key()
            curve.setData(xs, ys)

    def points(self, stream: str) -> int:
        return len(self.series.get(stream, ([], []))[0])

    def clear(self) -> None:
        """Forgets every stream; a stream that never ``begin``s (a benchmark's) counts its seconds from now."""
        self._start = time.monotonic()
        self.meter.clear()
        self._samples.clear()
        self.series.clear()
        for curve in self._curves.values():
            self.plot.removeItem(curve)
        self._curves.clear()
        self._update_key()
