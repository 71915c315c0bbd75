"""The published comparison with llama.cpp (``resources/highlights.json``): it is what its reports
say, the README shows it, and the Benchmarks view shows it in plain text."""

from __future__ import annotations

import json
from pathlib import Path

from engine.bench.highlights import PUBLISHED, USERS, collect, markdown

ROOT = Path(__file__).resolve().parent.parent


def published() -> dict:
    return json.loads((ROOT / PUBLISHED).read_text())


def test_the_published_figures_are_those_of_the_reports_they_name():
    doc = published()
    reports = {name: Path(path) for name, path in doc["reports"].items()}
    assert doc == json.loads(json.dumps(collect(**reports, root=ROOT)))
    assert [(r["pcs"], r["users"]) for r in doc["rows"]] == [(pcs, u) for pcs in (1, 2) for u in USERS]
    assert all(r["ratio"] == round(r["ours_tok_s"] / r["peer_tok_s"], 2) for r in doc["rows"])


def test_the_readme_shows_the_published_table():
    assert markdown(published()) in (ROOT / "README.md").read_text()


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
