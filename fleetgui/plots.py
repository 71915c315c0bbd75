"""Plots: live tokens per second per stream, and benchmark results (pyqtgraph).

``RateMeter`` is the only piece other threads touch: engine callbacks add token counts under a
lock, and the plot samples it on a GUI-thread timer, so a fast stream costs no signal per token.
"""

from __future__ import annotations

import collections
import threading
import time

import pyqtgraph as pg
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QVBoxLayout, QWidget

from fleetgui.theme import PLOT_COLOURS, SERIES


class RateMeter:
    """Token counts per stream label (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: dict[str, int] = collections.defaultdict(int)

    def add(self, stream: str, tokens: int = 1) -> None:
        with self._lock:
            self._counts[stream] += tokens

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def clear(self) -> None:
        with self._lock:
            self._counts.clear()


def make_plot(title: str, x_label: str, y_label: str, theme: str = "light") -> pg.PlotWidget:
    plot = pg.PlotWidget(title=title)
    plot.setLabel("bottom", x_label)
    plot.setLabel("left", y_label)
    plot.showGrid(x=True, y=True, alpha=0.25)
    plot.addLegend(offset=(10, 10))
    style_plot(plot, theme)
    return plot


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
                 parent: QWidget | None = None):
        super().__init__(parent)
        self.meter = meter
        self.plot = make_plot(title, "seconds", "tok/s", theme)
        self.plot.setMinimumHeight(self.fontMetrics().height() * 10)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.plot)
        self._start = time.monotonic()
        self._samples: list[tuple[float, dict[str, int]]] = []
        self.series: dict[str, tuple[list[float], list[float]]] = {}
        self._curves: dict[str, pg.PlotDataItem] = {}
        self._timer = QTimer(self)
        self._timer.timeout.connect(self.sample)
        self._timer.start(self.SAMPLE_MS)

    def set_theme(self, theme: str) -> None:
        style_plot(self.plot, theme)

    def sample(self) -> None:
        now = time.monotonic() - self._start
        counts = self.meter.snapshot()
        self._samples.append((now, counts))
        del self._samples[: -(self.WINDOW + 1)]
        if len(self._samples) < 2:
            return
        then, before = self._samples[0]
        for stream, count in counts.items():
            rate = (count - before.get(stream, 0)) / max(now - then, 1e-6)
            xs, ys = self.series.setdefault(stream, ([], []))
            if rate == 0 and (not ys or ys[-1] == 0):
                continue  # an idle stream adds no points until it runs again
            xs.append(now)
            ys.append(rate)
            while xs and xs[0] < now - self.HISTORY_S:
                xs.pop(0)
                ys.pop(0)
            curve = self._curves.get(stream)
            if curve is None:
                colour = SERIES[len(self._curves) % len(SERIES)]
                curve = self._curves[stream] = self.plot.plot([], [], name=stream, pen=pg.mkPen(colour, width=2))
            curve.setData(xs, ys)

    def points(self, stream: str) -> int:
        return len(self.series.get(stream, ([], []))[0])

    def clear(self) -> None:
        self.meter.clear()
        self._samples.clear()
        self.series.clear()
        for curve in self._curves.values():
            self.plot.removeItem(curve)
        self._curves.clear()
        legend = self.plot.getPlotItem().legend
        if legend is not None:
            legend.clear()
