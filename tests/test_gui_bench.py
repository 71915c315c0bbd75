"""The benchmark panel: the WAN sweep on the tiny export (loopback workers, tiny token counts)
plots throughput against hop delay, live tok/s per stream, and saves PNG, CSV and JSON; Cancel
stops a run; and the bench functions' hooks leave their results unchanged."""

from __future__ import annotations

import csv
import json
import threading

import pytest
from gui_support import open_window, screenshot, settings_store, tiny_settings

from engine.bench.registry import BENCHES


@pytest.fixture(scope="module")
def shards(tiny_exports):
    return tiny_exports["llama", "2"].out


def test_wan_sweep_plots_and_saves(qtbot, gui_home, tmp_path, shards):
    window = open_window(qtbot, tiny_settings(shards), settings_store(tmp_path / "s.ini"))
    panel = window.show_view("Benchmarks")
    panel.name.setCurrentText("wan")
    panel.tokens.setValue(6)
    panel.runs.setValue(1)
    panel.delays.setText("0,20")
    panel.draft_kind.setCurrentText("lookup")
    rows_seen = []
    panel._rows.row.connect(rows_seen.append)
    with qtbot.waitSignal(panel.finished, timeout=180000) as blocker:
        panel.run_button.click()
        assert not panel.run_button.isEnabled() and panel.cancel_button.isEnabled()
    report = blocker.args[0]

    assert report["bench"] == "wan" and [r["delay_ms"] for r in report["rows"]] == [0.0, 20.0]
    assert rows_seen == report["rows"]  # rows arrived one by one while it ran
    assert panel.progress.value() == 100
    assert panel.plotted_points() == 4  # naive and full stack at two delays
    legend = panel.plot.getPlotItem().legend
    assert [label.text for _, label in legend.items] == ["naive: 1 stream", "full stack: 2 streams + speculation"]
    assert report["rows"][1]["naive_tok_s"] < report["rows"][0]["naive_tok_s"]  # 20 ms per hop costs
    qtbot.waitUntil(lambda: any(panel.live.points(s) for s in panel.meter.snapshot()), timeout=5000)
    assert set(panel.meter.snapshot()) >= {"stream 0", "stream 1"}
    assert panel.table.rowCount() == 2

    png, csv_path, json_path = tmp_path / "wan.png", tmp_path / "wan.csv", tmp_path / "wan.json"
    panel.save_png(png)
    panel.save_csv(csv_path)
    panel.save_json(json_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert [float(r["delay_ms"]) for r in rows] == [0.0, 20.0] and float(rows[0]["full_tok_s"]) > 0
    assert json.loads(json_path.read_text())["rows"] == report["rows"]
    screenshot(window, "benchmarks")


def test_cancel_stops_a_benchmark(qtbot, gui_home, tmp_path, shards):
    window = open_window(qtbot, tiny_settings(shards), settings_store(tmp_path / "s.ini"))
    panel = window.show_view("Benchmarks")
    panel.name.setCurrentText("wan")
    panel.tokens.setValue(400)
    panel.delays.setText("50,100")
    with qtbot.waitSignal(panel.finished, timeout=120000) as blocker:
        panel.run_button.click()
        qtbot.waitUntil(lambda: bool(panel.meter.snapshot()), timeout=60000)  # decoding has begun
        panel.cancel_button.click()
    assert blocker.args[0] is None
    assert panel.status.text() == "Cancelled." and not panel.banner.message
    assert panel.run_button.isEnabled() and panel.report is None


def test_bench_hooks_report_progress_and_cancel_without_changing_results(shards):
    from engine.bench.harness import BenchCancelled, Hooks
    from engine.bench.wan import run_wan

    progress, tokens = [], []
    report = run_wan("tiny", "none", shards=shards, delays=(0.0,), tokens=4, draft_kind="lookup", log=lambda m: None,
                     hooks=Hooks(progress=lambda p: progress.append(p.fraction),
                                 on_token=lambda s, t: tokens.append(s)))
    assert progress[0] == 0.0 and progress[-1] == 1.0 and progress == sorted(progress)
    assert set(tokens) == {0, 1} and report["settings"]["stages"] == 2
    quiet = run_wan("tiny", "none", shards=shards, delays=(0.0,), tokens=4, draft_kind="lookup", log=lambda m: None)
    assert quiet["rows"][0].keys() == report["rows"][0].keys()
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(BenchCancelled):
        run_wan("tiny", "none", shards=shards, delays=(0.0,), tokens=4, draft_kind="lookup", log=lambda m: None,
                hooks=Hooks(cancel=cancel))


def test_plots_read_plainly_with_one_point_and_name_chats(qtbot, gui_home, tmp_path):
    """One measured row: the axes span a readable range around it (not "-400...400 (x0.001)").  The
    live plot counts seconds from each reply's start and names its streams in a key above the plot."""
    import time

    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    panel = window.show_view("Benchmarks")
    panel.bench_name, panel.rows = "wan", [{"delay_ms": 0.0, "naive_tok_s": 40.0, "full_tok_s": 40.0}]
    panel._draw()
    (x0, x1), (y0, y1) = panel.plot.getPlotItem().viewRange()
    assert x0 <= -0.5 and x1 >= 0.5 and x1 - x0 <= 4
    assert y0 <= 30 and y1 >= 50 and y1 - y0 <= 60
    assert "x0.001" not in panel.plot.getAxis("bottom").labelString()

    chat = window.chat
    live, meter = chat.live, chat.meter
    live._start -= 100.0  # the app has been open a while: the axis must not count from its start
    meter.begin("chat 1")
    live.set_name("chat 1", "Paris trip")
    live.sample()
    meter.add("chat 1", 5)
    time.sleep(0.05)
    live.sample()
    xs, ys = live.series["chat 1"]
    assert xs and xs[-1] < 5 and ys[-1] > 0
    assert "Paris trip" in live.key.text() and live.key.isVisible() is chat.isVisible()
    assert live.plot.getPlotItem().legend is None  # no legend over the curves


def test_the_office_comparison_plots_a_line_per_server(qtbot, gui_home, tmp_path):
    """`fleet bench sim`'s office rows: tok/s against users at once, one line per server, named as
    the report names it; the choice says what the run needs."""
    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    panel = window.show_view("Benchmarks")
    assert "needs root" in BENCHES["sim"].description
    panel.bench_name = "sim"
    panel.rows = [{"server": server, "users": u, "tok_s": rate * u, "ttft_ms": 500.0}
                  for server, rate in (("ours, one PC", 13.0), ("llama.cpp RPC split, 2 PCs", 11.0)) for u in (1, 2, 4)]
    panel._draw()
    lines = {item.name(): item.getData() for item in panel.plot.getPlotItem().listDataItems()}
    assert set(lines) == {"ours, one PC", "llama.cpp RPC split, 2 PCs"}
    assert list(lines["ours, one PC"][0]) == [1.0, 2.0, 4.0] and list(lines["ours, one PC"][1]) == [13.0, 26.0, 52.0]
    assert panel.plot.getPlotItem().getAxis("bottom").labelText == "users at once"


def test_a_parts_progress_fills_its_share_of_the_whole_run():
    """`fleet bench sim` reports each part's own progress through ``Hooks.part``: the Benchmarks
    view's bar moves on from the part's start instead of starting again from zero."""
    from engine.bench.harness import Hooks

    seen = []
    hooks = Hooks(progress=lambda p: seen.append((round(p.fraction, 3), p.text)))
    hooks.step(1, 4, "the office")
    within = hooks.part(1, 4)
    within.step(0, 10, "wave 0")
    within.step(5, 10, "wave 5")
    within.step(10, 10, "wave 10")
    assert seen == [(0.25, "the office"), (0.25, "wave 0"), (0.375, "wave 5"), (0.5, "wave 10")]
    assert Hooks().part(1, 4).progress is None


PIPELINE_REPORT = {  # a real run's ratios: the loopback chain ran faster than in process, a "negative cost"
    "bench": "pipeline", "machine": {}, "settings": {"stages": 2, "runs": 1},
    "rows": [{"config": "2-stage loopback TCP", "tok_s": 30.1}],
    "ratios": {"tcp_vs_inprocess": 1.343, "split_vs_whole": 1.045, "loopback_extra_ms_per_hop": -7.574,
               "network_ms_per_hop": 3.2},
}


def test_the_summary_says_each_ratio_in_words_and_a_negative_cost_is_no_cost():
    from engine.bench.summary import COST_NOISE_MS, in_words

    said = in_words(PIPELINE_REPORT)
    assert len(said) == 4 and not any(key in " ".join(said) for key in PIPELINE_REPORT["ratios"])
    tcp, split, hop, network = said
    assert tcp.startswith("The split model with its parts talking over the network") and "34% faster" in tcp
    assert "no measurable difference" in split and f"±{0.05:.2f}x" in split  # 4.5%: inside the stated 5%
    assert hop.startswith("Each network hop between parts") and "no measurable cost" in hop and "-7.6 ms" in hop
    assert network == "Waiting on the network costs 3.2 ms per hop and token."
    assert COST_NOISE_MS < 3.2

    # with repeats, the run's own spread decides: 1.343 moved by ±0.4 between rounds is no difference
    repeated = {**PIPELINE_REPORT, "spread": {"tcp_vs_inprocess": 0.4, "loopback_extra_ms_per_hop": 9.0}}
    tcp, _, hop, _ = in_words(repeated)
    assert "no measurable difference" in tcp and "from the run's repeats" in tcp
    assert "no measurable cost" in hop and "±9.0 ms" in hop
    # a ratio the registry does not describe is said from its name
    assert in_words({"bench": "x", "ratios": {"a_vs_b": 3.0, "extra_ms": 0.2, "best K": 4}}) == [
        "A is 3.0x faster than b.", "Extra: no measurable cost (measured +0.2 ms, within the noise of ±1.0 ms).",
        "Best K: 4."]
    # named as fleet bench serve names them: the measure, the pair, when; a time's lower side is the faster
    assert in_words({"bench": "x", "ratios": {"tok/s, fleet serve / llama.cpp, 4 user(s)": 2.2,
                                              "TTFT ours / llama.cpp, 512 tokens": 0.5}}) == [
        "Fleet serve is 2.2x faster than llama.cpp at 4 user(s).",
        "Llama.cpp is 50% slower than ours at 512 tokens (0.50x)."]


def test_the_benchmarks_view_shows_the_summary_in_words(qtbot, gui_home, tmp_path):
    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    panel = window.show_view("Benchmarks")
    panel.bench_name = "pipeline"
    panel._done(PIPELINE_REPORT)
    text = panel.summary.text()
    assert "no measurable cost" in text and "loopback_extra_ms_per_hop" not in text and "-7.574" not in text
    assert panel.summary.isVisible() and panel.status.text() == "Done."


def test_a_summary_on_a_short_screen_scrolls_rather_than_being_cut(qtbot, gui_home, tmp_path):
    """At 1024x640 (found by the walkthrough) the benchmark's description and the summary's sentences
    stay whole: the column of controls scrolls."""
    from test_gui_layout import assert_fits, cut_labels

    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    panel = window.show_view("Benchmarks")
    panel.bench_name = "pipeline"
    panel._done(PIPELINE_REPORT)
    window.resize(1024, 640)
    assert_fits(window, (1024, 640), "Benchmarks with a summary at 1024x640")
    assert not cut_labels(window), cut_labels(window)


def test_how_fast_is_my_fleet_is_the_first_choice_and_answers_in_a_sentence(qtbot, gui_home, tmp_path, shards):
    """The one-click benchmark: the chat's model as parts in worker processes (a local fleet on
    loopback) against this PC alone, for 1 person and 2 at once; the answer is a sentence."""
    window = open_window(qtbot, tiny_settings(shards, local_workers=True), settings_store(tmp_path / "s.ini"))
    panel = window.show_view("Benchmarks")
    assert panel.chosen() == "fleet" and panel.name.currentText() == "How fast is my fleet?"
    research = panel.name.findText("Research")
    assert 0 < research < panel.name.findText("wan") and not panel.name.model().item(research).isEnabled()
    assert panel.users.isEnabled() and not panel.delays.isEnabled()
    panel.users.setValue(2)
    panel.tokens.setValue(4)
    panel.runs.setValue(2)
    with qtbot.waitSignal(panel.finished, timeout=300000) as blocker:
        panel.run_button.click()
    report = blocker.args[0]
    assert report is not None, panel.banner.message
    assert set(report) >= {"bench", "machine", "rows", "ratios"} and report["bench"] == "fleet"
    assert [(r["who"], r["users"]) for r in report["rows"]] == [
        ("your fleet", 1), ("this PC alone", 1), ("your fleet", 2), ("this PC alone", 2)]
    assert all(r["tok_s"] > 0 for r in report["rows"])
    assert set(report["ratios"]) == {"fleet_vs_alone_1_user", "fleet_vs_alone_n_users"}
    assert set(report["spread"]) == set(report["ratios"])  # two rounds: the run's own spread
    assert "local fleet" in report["settings"]["fleet"]
    first, second = panel.summary.text().split("\n")
    assert first.startswith("Your fleet is ") and "this PC alone for 1 person" in first
    assert second.startswith("Your fleet is ") and "this PC alone for 2 people at once" in second
    assert panel.plotted_points() == 4


def axis_labels(axis) -> list[tuple]:
    """(rect in the plot's scene, text) of each label ``axis`` draws now, as pyqtgraph lays them out
    (a label that would not fit the axis is left out there)."""
    from PySide6.QtGui import QImage, QPainter

    image = QImage(8, 8, QImage.Format.Format_ARGB32)
    painter = QPainter(image)
    try:
        _, _, texts = axis.generateDrawSpecs(painter)
    finally:
        painter.end()
    return [(axis.mapRectToScene(rect), text) for rect, _, text in texts]


@pytest.mark.parametrize("bench, names", [
    ("fleet", [f"{who}, {people}" for who in ("your fleet", "this PC alone") for people in ("1 person",
                                                                                          "4 people at once")]),
    ("progression", ["the whole model on one PC", "split in 3 parts, one person", "+ several people at once",
                     "+ guessing ahead with a small model drafting for the large one on another PC",
                     "+ everything above, with the network delay of an office", "the end"])])
def test_bar_labels_stay_readable_at_1024x640(qtbot, gui_home, tmp_path, bench, names):
    """The bar charts' names (found overlapping at 1024x640): every name is drawn, none over another
    and all within the plot; one too long for its place is cut short, whole in the plot's tooltip."""
    from PySide6.QtWidgets import QApplication

    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    window.resize(1024, 640)
    panel = window.show_view("Benchmarks")
    panel.bench_name, panel.rows = bench, [{"config": n, "tok_s": 10.0 + i} for i, n in enumerate(names)]
    panel._draw()
    for _ in range(3):
        QApplication.processEvents()
    labels = [label for axis in ("left", "bottom") for label in axis_labels(panel.plot.getAxis(axis))]
    shown = [text for _, text in axis_labels(panel.plot.getAxis("left"))]
    assert len(shown) == len(names) and panel.plotted_points() == len(names)
    assert all(text == name or (text.endswith("…") and name.startswith(text[:-1])) for text, name in
               zip(shown, names)), shown
    for i, (rect, text) in enumerate(labels):
        assert not any(rect.intersects(other) for other, _ in labels[i + 1:]), text
    width = panel.plot.width()
    assert all(rect.left() >= 0 and rect.right() <= width for rect, _ in labels)
    assert all(name in panel.plot.toolTip() for name in names)


def test_the_live_plot_counts_from_a_replys_first_token(qtbot, gui_home, tmp_path):
    """The chat's live plot leaves out the wait for the model (starting it, reading the prompt): a
    reply's curve starts at 0 s at its first token, not when it was asked for."""
    import time

    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    live, meter = window.chat.live, window.chat.meter
    meter.begin("chat 1")
    live.sample()
    time.sleep(0.6)  # the model starts
    live.sample()
    assert live.points("chat 1") == 0  # nothing plotted while it waits
    meter.add("chat 1", 3)
    live.sample()
    xs, ys = live.series["chat 1"]
    assert xs[0] < 0.3 and ys[0] > 0, xs
    meter.begin("chat 1")  # the next reply starts its curve again, at its own first token
    time.sleep(0.6)
    live.sample()
    meter.add("chat 1", 2)
    time.sleep(0.05)
    live.sample()
    xs, _ = live.series["chat 1"]
    assert len(xs) == 1 and xs[0] < 0.3, xs
    assert live.plot.getAxis("bottom").labelText == "seconds since the first token"


def test_the_benchmarks_live_plot_counts_from_the_benchmarks_start(qtbot, gui_home, tmp_path):
    """A benchmark's streams count their seconds from when it started (its plot is cleared then),
    not from when the app opened."""
    import time

    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    panel = window.bench
    time.sleep(0.8)  # the app has been open a while
    panel.live.clear()  # what starting a benchmark does
    panel.live.sample()
    panel.meter.add("stream 0", 4)
    time.sleep(0.05)
    panel.live.sample()
    xs, ys = panel.live.series["stream 0"]
    assert xs[0] < 0.5 and ys[0] > 0, xs
    assert panel.live.plot.getAxis("bottom").labelText == "seconds since the benchmark started"
