"""A benchmark report's ratios said in sentences, for a person rather than a script: "The split model
over the network is 1.34x faster than the same split in one process", "One more network hop: no
measurable cost".

What a ratio compares comes from the benchmark's registry entry (``registry.Ratio``); a ratio it
does not describe is said from its name (``a_vs_b``: a speed ratio; a name with ``ms``: a cost in
milliseconds; anything else as it is).  A value inside the noise is said as such: the run's own
spread where the report has one (``report["spread"]``, in the ratio's own unit, from the repeats of
the run), otherwise the thresholds below.
"""

from __future__ import annotations

import re

from engine.bench.registry import BENCHES, Ratio

SPEED_NOISE = 0.05  # speed ratios within 5% of 1 are no measurable difference (a run without repeats)
COST_NOISE_MS = 1.0  # a cost of 1 ms or less is no measurable cost (a run without repeats)


def in_words(report: dict) -> list[str]:
    """One sentence per ratio of ``report`` (``engine.bench.report``'s format)."""
    bench = BENCHES.get(report.get("bench", ""))
    said = bench.ratios if bench else {}
    spread = report.get("spread") or {}
    context = {**(report.get("settings") or {})}
    return [sentence(said.get(key) or ratio_from_name(key), value, spread.get(key), context)
            for key, value in (report.get("ratios") or {}).items()]


def ratio_from_name(key: str) -> Ratio:
    """What a ratio no registry entry describes compares, from its name."""
    words = key.replace("_", " ").strip()
    pieces = re.split(r",\s+", words)  # "tok/s, ours / theirs, 4 user(s)": the measure, the pair, when
    pair = next((i for i, p in enumerate(pieces) if re.search(r"\s/\s|\svs\s", p)), None)
    if pair is not None and len(pieces) > 1:
        a, b = re.split(r"\s+/\s+|\s+vs\s+", pieces[pair], maxsplit=1)
        rest = ", ".join(pieces[pair + 1:])
        when = (f" at {rest}" if rest[:1].isdigit() else f", {rest}") if rest else ""
        timed = re.match(r"(TTFT|time|latency)\s+(.+)", a)  # "TTFT ours / theirs"
        a = timed.group(2) if timed else a
        if timed or re.search(r"\b(TTFT|ms|time|latency)\b", " ".join(pieces[:pair])):  # the lower, the faster
            a, b = b, a
        return Ratio("speed", a, b, when)
    parts = re.split(r"\s+vs\s+|\s+/\s+", words, maxsplit=1)  # not "Mbit/s" or "tok/s"
    if len(parts) == 2:
        return Ratio("speed", parts[0], parts[1])
    if re.search(r"\bms\b", words):
        return Ratio("cost", re.sub(r"\s*\bms\b\s*", " ", words).strip())
    return Ratio("value", words)


def sentence(ratio: Ratio, value, spread: float | None, context: dict) -> str:
    subject, against = ratio.subject.format_map(_Missing(context)), ratio.against.format_map(_Missing(context))
    when = ratio.when.format_map(_Missing(context))
    if ratio.kind == "value" or not isinstance(value, (int, float)) or isinstance(value, bool):
        return f"{_capital(subject)}{when}: {value}."
    if ratio.kind == "cost":
        noise = spread if spread is not None else COST_NOISE_MS
        if value <= noise:
            why = "below zero, so" if value < 0 else "within"
            return (f"{_capital(subject)}{when}: no measurable cost (measured {value:+.1f} ms, {why} the noise of "
                    f"±{noise:.1f} ms{_source(spread)}).")
        return f"{_capital(subject)} costs {value:.1f} ms{when}."
    noise = spread if spread is not None else SPEED_NOISE
    if value <= 0:
        return f"{_capital(subject)}{when}: not measured."
    if abs(value - 1) <= noise:
        return (f"{_capital(subject)} is as fast as {against}{when}: no measurable difference ({value:.2f}x, "
                f"within the noise of ±{noise:.2f}x{_source(spread)}).")
    if value >= 2:
        return f"{_capital(subject)} is {value:.1f}x faster than {against}{when}."
    if value > 1:
        return f"{_capital(subject)} is {(value - 1) * 100:.0f}% faster than {against}{when} ({value:.2f}x)."
    return f"{_capital(subject)} is {(1 - value) * 100:.0f}% slower than {against}{when} ({value:.2f}x)."


def _source(spread: float | None) -> str:
    return ", from the run's repeats" if spread is not None else ""


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


class _Missing(dict):
    """A ``format_map`` mapping that leaves an unknown ``{name}`` as it is."""

    def __missing__(self, key: str) -> str:
        return "{" + key + "}"
