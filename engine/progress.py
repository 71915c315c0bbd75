"""Progress a person can follow: the engine's progress payloads (``engine.session``) as a step's
name with a count ("Downloading the model: 120 of 270 MB", "Exporting stage 2 of 3 (compressing)",
"Sending stage 1: 40 of 547 MB") and the fraction done, for the app's panels and the terminal alike.

A finished download ("pull", "ready", 1.0) is followed by more work (the export, loading the
model), so it reads as that next step with no fraction, never as "ready, 100%" while work goes on.
Older payload shapes (without the counts at their end) read as before, without a count.
"""

from __future__ import annotations

# a deployment's phases (``engine.fleet.deploy``), in words
DEPLOY_PHASES = {"export": "exporting", "send": "sending", "start": "starting", "connect": "connecting"}
# a stage export's steps (``engine.export.exporter.STAGE_STEPS``), in words
EXPORT_STEPS = {"load": "loading", "calibrate": "calibrating", "convert": "converting", "stateful": "converting",
                "compress": "compressing", "save": "saving", "tokenizer": "saving", "hash": "checking"}


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


def describe_progress(payload: tuple) -> tuple[str, float | None]:
    """(what is happening with its count, fraction done or None when unknown) for one engine
    progress payload."""
    kind = payload[0]
    if kind == "pull":
        step, fraction = payload[1:3]
        if step == "ready" or fraction >= 1.0:
            return "Model downloaded; preparing it", None
        if len(payload) < 5 or not payload[4]:
            return f"Downloading the model ({step})", fraction
        done, total = payload[3:5]
        if step == "verify":  # hashing the whole file: no share to show
            return f"Checking the downloaded model ({byte_size(total)})", None
        verb = "Unpacking" if step == "assemble" else "Downloading"
        return f"{verb} the model: {byte_count(done, total)}", fraction
    if kind == "stage":
        index, step, fraction = payload[1:4]
        doing = EXPORT_STEPS.get(step, step)
        if len(payload) < 5:
            return f"Exporting stage {index} ({doing})", fraction
        return f"Exporting stage {index + 1} of {payload[4]} ({doing})", fraction
    if kind == "deploy":
        stage, phase, fraction = payload[1:4]
        text = f"{DEPLOY_PHASES.get(phase, phase).capitalize()} stage {stage}"
        if len(payload) >= 6:
            text += f": {byte_count(*payload[4:6])}"
        return text, fraction
    if kind == "status":
        text = str(payload[1])
        return text[:1].upper() + text[1:], None
    return " ".join(map(str, payload)), None
