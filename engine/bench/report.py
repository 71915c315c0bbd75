"""The benchmark report format every ``fleet bench`` writes, and the table it prints.

``{"bench": NAME, "machine": {...}, "rows": [...], "ratios": {name: value}}``, and where a run has
repeats, ``"spread": {name: value}``: how far a ratio moved between them, in its own unit (half the
range of its per-round values), so that a reader can tell a result from the noise
(``engine.bench.summary``).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import openvino as ov

from engine.hostcpu import cpu_model, int8_dot


def machine() -> dict:
    info = {
        "cpu": cpu_model(),
        "int8_dot": int8_dot() or "unknown",  # decides OpenVINO's speed on the CPU (engine.hostcpu)
        "logical_cores": os.cpu_count(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "openvino": ov.get_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
    try:  # the report does without the memory size where psutil is missing
        import psutil

        info["memory_gb"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    return info


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def half_range(values: list[float]) -> float | None:
    """How far repeated measurements of one figure spread: half their range (None: fewer than 2)."""
    return (max(values) - min(values)) / 2 if len(values) > 1 else None


def write_report(name: str, rows: list[dict], ratios: dict, out: Path | None, settings: dict | None = None,
                 spread: dict | None = None) -> dict:
    report = {"bench": name, "machine": machine(), "settings": settings or {}, "rows": rows, "ratios": ratios}
    if spread:
        report["spread"] = spread
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2))
    return report


def format_table(rows: list[dict], columns: list[str]) -> str:
    cells = [[_fmt(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.2f}"
    return str(value)
