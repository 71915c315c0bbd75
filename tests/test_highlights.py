"""The published comparison with llama.cpp (``resources/highlights.json``): it is what its reports
say, the README's five highlights are its figures, the results page shows the whole table, and the
Benchmarks view shows it in plain text."""

from __future__ import annotations

import json
import re
from pathlib import Path

from engine.bench.highlights import PUBLISHED, USERS, collect, markdown

ROOT = Path(__file__).resolve().parent.parent
# the README's highlights, in order: the published row (PCs, users) each one's number comes from
HIGHLIGHTS = ((1, 1), (1, 4), (2, 1), (2, 4), (2, 8))


def published() -> dict:
    return json.loads((ROOT / PUBLISHED).read_text())


def test_the_published_figures_are_those_of_the_reports_they_name():
    doc = published()
    reports = {name: Path(path) for name, path in doc["reports"].items()}
    assert doc == json.loads(json.dumps(collect(**reports, root=ROOT)))
    assert [(r["pcs"], r["users"]) for r in doc["rows"]] == [(pcs, u) for pcs in (1, 2) for u in USERS]
    assert all(r["ratio"] == round(r["ours_tok_s"] / r["peer_tok_s"], 2) for r in doc["rows"])


def test_the_results_page_shows_the_published_table():
    assert markdown(published()) in (ROOT / "docs" / "results.md").read_text()


def test_the_readmes_highlights_are_the_published_figures():
    section = (ROOT / "README.md").read_text().split("\n## Highlights\n")[1].split("\n## ")[0]
    bullets = re.findall(r"^- (.*)$", section, re.M)
    ratios = {(r["pcs"], r["users"]): r["ratio"] for r in published()["rows"]}
    assert [re.findall(r"\*\*([\d.]+)×\*\*", b) for b in bullets] == [[f"{ratios[k]:.2f}"] for k in HIGHLIGHTS]
    assert all("](docs/benchmarks.md" in b for b in bullets)  # each number links to where it was measured


def test_the_benchmarks_view_shows_the_published_table(qtbot, tmp_path):
    from PySide6.QtWidgets import QLabel, QTableWidget

    from fleetgui.bench_panel import published_table

    box = published_table(ROOT / PUBLISHED)
    qtbot.addWidget(box)
    table = box.findChild(QTableWidget, "published")
    rows = published()["rows"]
    assert table.rowCount() == len(rows)
    assert [table.item(i, 4).text() for i in range(len(rows))] == [f"{r['ratio']:.2f}x" for r in rows]
    (tmp_path / "broken.json").write_text("{")
    missing = published_table(tmp_path / "broken.json")
    qtbot.addWidget(missing)
    assert missing.findChild(QTableWidget) is None
    assert "No published results to show (broken.json" in missing.findChild(QLabel).text()
