"""The options every ``fleet`` subcommand shares, and how they become the engine's settings.

argparse types refuse a bad value with the option's name before any work starts.  ``settings_of``
lays the command line over the saved ``Settings``; ``launch_of`` says where the chain runs
(``engine.session.Launch``); ``progress_printer`` shows the engine's progress (``engine.progress``) on stderr.
``printable`` is what the commands print of text from elsewhere (nodes' names, agents' errors).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from engine.config import Settings
from engine.errors import FleetError
from engine.fleet.deploy import Deployment, default_record
from engine.progress import Progress, Report
from engine.session import Launch


def _number(text: str, kind, within, wanted: str):
    """``text`` as a ``kind`` (int or float) for which ``within(value)`` holds, else argparse's error
    saying what the option takes (``wanted``)."""
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not within(value):  # a float's test also refuses nan
        raise argparse.ArgumentTypeError(f"takes {wanted}, not {text!r}")
    return value


def count(text: str) -> int:
    """Stages, streams, tokens, runs, users...: a whole number, at least 1."""
    return _number(text, int, lambda v: v >= 1, "a whole number of at least 1")


def duration(text: str) -> float:
    """Seconds or milliseconds: a number, 0 or more."""
    return _number(text, float, lambda v: v >= 0, "a number of 0 or more")


def interval(text: str) -> float:
    """How often something repeats: a number of seconds above 0."""
    return _number(text, float, lambda v: v > 0, "a number of seconds above 0")


def port(text: str) -> int:
    """A TCP port to listen on: 0 (any free one) to 65535."""
    return _number(text, int, lambda v: 0 <= v <= 65535, "a port number from 0 to 65535")


def draft_tokens(text: str):
    """``--k``: draft tokens per round, 0 to 32, or ``auto``."""
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--k takes a number or 'auto', not {text!r}") from None
    if not 0 <= value <= 32:
        raise argparse.ArgumentTypeError("--k must be between 0 and 32")
    return value


def connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fleet-key-file", help="the shared fleet key (default: from the settings)")
    # --tls too: a caller's TLS must hold against a saved tls: false (the local fleet's agent)
    parser.add_argument("--tls", action=argparse.BooleanOptionalAction,
                        help="mutual TLS with the fleet certificate (default: the tls setting, on unless the "
                             "fleet turned it off)")
    parser.add_argument("--deadline", type=duration, help="seconds of silence before a part counts as dead")


def chain_args(parser: argparse.ArgumentParser) -> None:
    """Where the model runs and how it decodes: what `generate` and `serve` open (``engine.session``)."""
    parser.add_argument("--shards", nargs="+", help="shard folders in the parts' order (or one export folder)")
    parser.add_argument("--model", help="export (or reuse) this model instead of giving --shards")
    parser.add_argument("--stages", type=count, help="with --model: number of parts")
    parser.add_argument("--draft", help="speculative decoding: 'lookup' (prompt lookup, no model), a draft "
                        "model (shard folder or model source with the target's tokenizer), hybrid:MODEL, or "
                        "remote:HOST:PORT (a draft server, `fleet worker --role draft`, drafting ahead on another "
                        "computer)")
    parser.add_argument("--isolate-streams", action="store_true",
                        help="compile each part once per stream instead of sharing one compiled model")
    parser.add_argument("--k", type=draft_tokens, default=4, help="draft tokens per round, or 'auto' (default 4)")
    parser.add_argument("--speculate-ahead", action=argparse.BooleanOptionalAction,
                        help="one user on a pipeline: send the next speculative round while one is verified, "
                             "drafted as if every draft is accepted (default: the speculate_ahead setting)")
    parser.add_argument("--mode", choices=["fast", "exact"],
                        help="exact: speculative output token-identical to plain greedy decoding (f32 compute)")
    parser.add_argument("--device", help="OpenVINO device for every part (CPU, GPU, NPU, GPU.1...), "
                        "or one per part separated by commas (CPU,GPU.1)")
    parser.add_argument("--precision", help="the target's inference precision hint (f32, bf16, f16); "
                        "a draft keeps its device's default")
    parser.add_argument("--remote", help="run part 1 here and the rest on workers: HOST:PORT of part 2 "
                        "(and optionally of the later parts, comma-separated)")
    parser.add_argument("--local-workers", action="store_true",
                        help="run the parts after the first as worker processes on this PC (the local fleet)")
    parser.add_argument("--deployment", nargs="?", const="last",
                        help="use the chain `fleet deploy`/`fleet up` started (default: the last one recorded)")
    parser.add_argument("--delay-ms", type=duration,
                        help="with --local-workers: one-way delay per hop (WAN simulation)")
    connection_args(parser)
    parser.add_argument("--connect-timeout", type=duration, default=60.0,
                        help="seconds to wait for the chain to come up")


# command-line option -> the settings field it overrides
OVERRIDES = {"model": "default_model", "stages": "stages", "device": "device", "mode": "mode",
             "fleet_key_file": "fleet_key_file", "deadline": "deadline_s", "max_new_tokens": "max_new_tokens"}


def settings_of(args: argparse.Namespace, settings: Settings | None = None) -> Settings:
    """The saved settings with what the command line says instead (options it has and was given)."""
    settings = settings or Settings.load()
    changes = {field: getattr(args, option) for option, field in OVERRIDES.items() if getattr(args, option, None)}
    for flag in ("tls", "speculate_ahead"):
        if getattr(args, flag, None) is not None:
            changes[flag] = getattr(args, flag)
    if hasattr(args, "draft"):
        changes.update(_draft(args.draft))
    if getattr(args, "k", None) is not None:
        changes["k"] = str(args.k)
    return dataclasses.replace(settings, **changes)


def _draft(spec: str | None) -> dict:
    """``--draft``: ``lookup``, a draft model (shard folder or model source), ``hybrid:MODEL`` or
    ``remote:HOST:PORT`` (a draft server on another computer)."""
    if not spec or spec == "lookup":
        return {"draft": "lookup" if spec else "none", "draft_model": ""}
    if spec.startswith("remote:"):
        return {"draft": "remote", "draft_at": spec.split(":", 1)[1]}
    if spec.startswith("hybrid:"):
        return {"draft": "hybrid", "draft_model": spec.split(":", 1)[1]}
    return {"draft": "model", "draft_model": spec}


def launch_of(args: argparse.Namespace, *, in_process: bool) -> Launch:
    """Where the chain runs: ``--shards``, ``--remote``, ``--local-workers`` or ``--deployment``; with
    none of them, in this process (``in_process``) or as the settings say (the local fleet)."""
    if sum(map(bool, (args.remote, args.local_workers, args.deployment))) > 1:
        raise FleetError("--remote, --local-workers and --deployment exclude each other")
    if args.remote and not args.shards:
        raise FleetError("with --remote, give the stage-0 shard folder in --shards")
    deployment = record = None
    if args.deployment:
        record = default_record() if args.deployment == "last" else Path(args.deployment)
        deployment = Deployment.load(record)
    workers = "processes" if args.local_workers else ("none" if in_process or args.shards else None)
    return Launch(shards=args.shards, remote=[a.strip() for a in (args.remote or "").split(",") if a.strip()],
                  deployment=deployment, record=record, workers=workers, precision=args.precision,
                  isolate=args.isolate_streams, delay_ms=args.delay_ms or 0.0, connect_timeout_s=args.connect_timeout)


class Bar:
    """A one-line progress display on stderr (redrawn in place on a terminal; elsewhere a line each
    tenth of a step)."""

    def __init__(self):
        self._tty = sys.stderr.isatty()
        self._last = None

    def show(self, progress: Progress) -> None:
        fraction = max(0.0, min(1.0, progress.fraction))
        filled = int(fraction * 30)
        line = f"{printable(progress.text):<28} [{'#' * filled}{'.' * (30 - filled)}] {fraction * 100:5.1f}%"
        if self._tty:
            sys.stderr.write("\r" + line + ("\n" if fraction >= 1.0 else ""))
            sys.stderr.flush()
        elif (progress.stage, progress.step, int(fraction * 10)) != self._last:
            self._last = (progress.stage, progress.step, int(fraction * 10))
            print(line, file=sys.stderr, flush=True)


# C0, DEL and C1: a node names itself (over mDNS, in its status), and a name holding "\x1b[2J" would
# clear the terminal, or rewrite what was printed before it, were it printed as it came
CONTROL = dict.fromkeys([*range(0x20), *range(0x7f, 0xa0)])


def printable(text, *, lines: bool = False) -> str:
    """``text`` from elsewhere (a node's name, an agent's error) without control characters, for the
    terminal; ``lines`` keeps its line breaks (a message of several lines)."""
    text = str(text)
    return "\n".join(line.translate(CONTROL) for line in text.split("\n")) if lines else text.translate(CONTROL)


# a model's reply keeps its line breaks and tabs (code); its other control characters go, as a node's do
REPLY_CONTROL = {c: None for c in CONTROL if chr(c) not in "\n\t"}


def reply_text(text: str) -> str:
    """A model's reply (or a piece of one, as it streams) for the terminal: an escape sequence in it
    ("\x1b[2J", a window title, a cursor move) would act on the terminal, a carriage return overwrite
    what came before, were it printed as generated."""
    return text.translate(REPLY_CONTROL)


def say(msg: str) -> None:
    print(printable(msg, lines=True), file=sys.stderr, flush=True)


def progress_printer() -> Report:
    """Shows the engine's progress in the app's words (``engine.progress``): a bar while a step's
    share is known, a line for the others."""
    bar = Bar()

    def progress(event: Progress) -> None:
        if event.fraction is None:
            say(event.text)
        else:
            bar.show(event)

    return progress
