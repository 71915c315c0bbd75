"""Pinning a process to a set of CPUs, so a benchmark can give each stage its own cores.

CPU sets are written like ``taskset -c``: ``"0-3"``, ``"0,2,4-5"``.  Several stages' sets are
separated by ``;`` (``"0-1;2-3"``: stage 0 on cores 0-1, stage 1 on 2-3).
"""

from __future__ import annotations

import os

from engine.errors import FleetError


def parse_cpus(text: str) -> set[int]:
    """The CPUs a ``taskset -c`` list such as ``"0,2,4-5"`` names."""
    cpus: set[int] = set()
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise FleetError(f"{text!r} is not a CPU list like 0-3 or 0,2,4-5") from None
    if not cpus:
        raise FleetError(f"{text!r} names no CPU")
    return cpus


def parse_cpu_sets(text: str, stages: int) -> list[str | None]:
    """One CPU list per stage from ``"0-1;2-3"``; an empty text pins nothing."""
    if not text:
        return [None] * stages
    sets = [s.strip() for s in text.split(";")]
    if len(sets) != stages:
        raise FleetError(f"{text!r} gives {len(sets)} CPU sets for {stages} stages")
    for s in sets:
        parse_cpus(s)
    return sets


def pin(text: str | None) -> None:
    """Restricts this process (and the OpenVINO threads it starts later) to the CPUs in ``text``."""
    if not text:
        return
    cpus = parse_cpus(text)
    if not hasattr(os, "sched_setaffinity"):
        raise FleetError("pinning to CPUs is only supported on Linux")
    # Not checked against this process's affinity: a worker inherits its parent's (stage 0, pinned
    # already) and may still take other CPUs.  The kernel keeps what the cpuset allows; compare.
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)
        got = os.sched_getaffinity(0)
    except OSError:  # none of them allowed
        got = set()
    if got != cpus:
        os.sched_setaffinity(0, before)
        raise FleetError(f"CPUs {sorted(cpus - got)} are not available here (this PC has "
                         f"{os.cpu_count()} CPUs; a cpuset may allow fewer)")
