"""argparse types shared by every ``fleet`` subcommand: a bad number is refused with the option's
name, before any work starts."""

from __future__ import annotations

import argparse


def count(text: str) -> int:
    """Stages, streams, tokens, runs, users...: a whole number, at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"takes a whole number of at least 1, not {text!r}")
    return value


def duration(text: str) -> float:
    """Seconds or milliseconds: a number, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"takes a number of 0 or more, not {text!r}")
    return value


def port(text: str) -> int:
    """A TCP port to listen on: 0 (any free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"takes a port number from 0 to 65535, not {text!r}")
    return value
