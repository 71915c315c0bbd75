"""Progress a person can follow: one event type, ``Progress``, for every long step the engine takes
(a model's download, a stage's export, a shard sent to a node, a deployment's phases, a survey, an
index of documents, a benchmark's runs) and one callback shape, ``Report``, that takes it.

An event says what is happening in the app's words, with its count ("Downloading the model: 120 of
270 MB", "Exporting part 2 of 3 (compressing)", "Sending part 2: 40 of 547 MB"), so the terminal
and the app's panels show the same; views that lay the work out per stage (Export, Placement) also
read its ``stage`` and ``step``.  ``pulling``, ``exporting`` and ``deploying`` word those steps.

A finished download is followed by more work (the export, loading the model), so it reads as that
next step with no fraction, never as "ready, 100%" while work goes on.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

# a deployment's phases (``engine.fleet.deploy``), in words
DEPLOY_PHASES = {"export": "exporting", "send": "sending", "start": "starting", "connect": "connecting"}
# a stage export's steps (``engine.export.exporter.STAGE_STEPS``), in words
EXPORT_STEPS = {"load": "loading", "calibrate": "calibrating", "convert": "converting", "stateful": "converting",
                "compress": "compressing", "save": "saving", "tokenizer": "saving", "hash": "checking"}


@dataclasses.dataclass(frozen=True)
class Progress:
    """One report of a long step's progress."""

    text: str  # what is happening, in plain words, with its count
    fraction: float | None = None  # the share done, 0 to 1; None when it is not known
    bytes_done: int | None = None  # for a step that moves bytes: how many have moved
    bytes_total: int | None = None  # and how many there are
    stage: int | None = None  # the stage (or tensor-parallel rank) the step is for
    step: str = ""  # the step's short name (a pull's "assemble", an export's "compress", a deployment's
    #                 "send"); empty for a plain status line


Report = Callable[[Progress], None]


def quiet(_progress: Progress) -> None:
    pass


def _unit(total: float) -> tuple[float, str, int]:
    if total >= 1e9:
        return 1e9, "GB", 2
    if total >= 1e6:
        return 1e6, "MB", 0 if total >= 100e6 else 1
    return 1e3, "kB", 0


def byte_count(done: float, total: float) -> str:
    """ "40 of 547 MB": the unit and precision chosen by the total."""
    scale, unit, digits = _unit(total)
    return f"{done / scale:.{digits}f} of {total / scale:.{digits}f} {unit}"


def byte_size(total: float) -> str:
    scale, unit, digits = _unit(total)
    return f"{total / scale:.{digits}f} {unit}"


def pulling(step: str, done: int, total: int) -> Progress:
    """A catalog model's download (``engine.models.catalog.pull``): ``step`` is "download",
    "assemble", "verify" or "ready"; ``done`` of the model's ``total`` bytes."""
    fraction = done / total if total else 1.0
    if step == "ready" or fraction >= 1.0:
        return Progress("Model downloaded; preparing it", None, done, total, step=step)
    if step == "verify":  # hashing the whole file: no share to show
        return Progress(f"Checking the downloaded model ({byte_size(total)})", None, done, total, step=step)
    verb = "Unpacking" if step == "assemble" else "Downloading"
    return Progress(f"{verb} the model: {byte_count(done, total)}", fraction, done, total, step=step)


def exporting(index: int, count: int, step: str, fraction: float) -> Progress:
    """Stage ``index`` of ``count`` exporting (``engine.export.exporter``), at one of its steps."""
    text = f"Exporting part {index + 1} of {count} ({EXPORT_STEPS.get(step, step)})"
    return Progress(text, fraction, stage=index, step=step)


def deploying(stage: int, phase: str, fraction: float, done: int | None = None, total: int | None = None) -> Progress:
    """A deployment's ``phase`` of ``stage`` (``engine.fleet.deploy``); sending, ``done`` of ``total`` bytes."""
    text = f"{DEPLOY_PHASES.get(phase, phase).capitalize()} part {stage + 1}"
    if total is not None:
        text += f": {byte_count(done, total)}"
    return Progress(text, fraction, done, total, stage=stage, step=phase)
