"""Turns a run's JUnit XML (``pytest --junitxml=FILE -o junit_duration_report=total``) into the
markdown table tests/DURATIONS.md holds: every test with its seconds (set-up, call and tear-down),
slowest first, and the seconds of each file.  ``--tiers`` adds each test's tier, as the suite's
markers choose it (``pytest --collect-only -m slow``).

    python tests/durations.py run.xml [--tiers] > tests/DURATIONS.md
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def read(junit: Path) -> list[tuple[str, str, float, str]]:
    """(file, test, seconds, outcome) of every test case in ``junit``."""
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        file = next((f"{part}.py" for part in module if part.startswith("test_")), module[-1])
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        rows.append((file, case.get("name", ""), float(case.get("time", 0.0)), outcome))
    return rows


def slow_tests() -> set[str]:
    """The ids (file::name) the slow tier collects."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "slow",
                          "-p", "no:cacheprovider", "tests"], cwd=ROOT, capture_output=True, text=True)
    return {line.split("/", 1)[-1] for line in out.stdout.splitlines() if "::" in line}


def table(rows, tiers: set[str] | None) -> str:
    total = sum(seconds for _, _, seconds, _ in rows)
    files = collections.Counter()
    for file, _, seconds, _ in rows:
        files[file] += seconds
    lines = [f"{len(rows)} tests, {total / 60:.1f} minutes in all.", "", "### By file", "",
             "| file | tests | seconds |", "|---|---|---|"]
    counts = collections.Counter(file for file, *_ in rows)
    lines += [f"| {file} | {counts[file]} | {seconds:.1f} |" for file, seconds in files.most_common()]
    head = "| file | test | seconds | outcome |" + (" tier |" if tiers is not None else "")
    lines += ["", "### By test", "", head, "|---" * (head.count("|") - 1) + "|"]
    for file, name, seconds, outcome in sorted(rows, key=lambda r: -r[2]):
        tier = "" if tiers is None else (" slow |" if f"{file}::{name}" in tiers else " fast |")
        lines.append(f"| {file} | `{name}` | {seconds:.1f} | {outcome} |{tier}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit", type=Path)
    parser.add_argument("--tiers", action="store_true", help="add each test's tier")
    args = parser.parse_args()
    sys.stdout.write(table(read(args.junit), slow_tests() if args.tiers else None))


if __name__ == "__main__":
    main()
