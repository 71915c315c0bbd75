"""Compute turns: stages that share one computer's cores run their inferences one at a time.

A local fleet puts every stage on this computer; a node agent's workers may share a computer with
each other or with the coordinator.  With several streams in flight, two stages would
otherwise compute at once, each with a full set of OpenVINO threads on the same cores; on a machine
whose decode is bound by memory bandwidth that gets no more done than one stage at a time, and the
oversubscribed threads lose another 10-20% to each other.  Taking turns keeps what overlapping is
for (one stream computes while the others wait on the network) without that loss.

The turn is an exclusive lock on a file every stage process opens (``flock``; on Windows a ``filelock``
lock on ``<file>.lock``), plus a first-come-first-served lock for the threads of one process
(``FifoLock``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys
import threading
from pathlib import Path

from engine.config import paths

if sys.platform == "win32":
    import filelock

    class _FileTurn:
        """``msvcrt.locking`` waits ten one-second tries at most, then raises into the inference; filelock
        waits for as long as the turn is taken, polling every 2 ms (a second per miss would cost tokens)."""

        def __init__(self, path: Path, fd: int):
            self._lock = filelock.FileLock(f"{path}.lock", thread_local=False)

        def acquire(self) -> None:
            self._lock.acquire(poll_interval=0.002)

        def release(self) -> None:
            self._lock.release()
else:
    import fcntl

    class _FileTurn:
        """``flock`` on the held file: a fraction of what filelock (which opens the file each time) takes,
        on every token of every stage."""

        __slots__ = ("_fd",)

        def __init__(self, path: Path, fd: int):
            self._fd = fd

        def acquire(self) -> None:
            fcntl.flock(self._fd, fcntl.LOCK_EX)

        def release(self) -> None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)


class FifoLock:
    """A lock handed to waiting threads in the order they asked.  ``threading.Lock`` lets the
    thread that just released take it straight back: a whole copy of the model on the coordinator
    then kept the turn from another copy's stage 0 waiting beside it, which got half its share
    (docs/benchmarks.md, "The solver's layout")."""

    def __init__(self):
        self._guard = threading.Lock()
        self._held = False
        self._waiters: collections.deque = collections.deque()

    def acquire(self) -> None:
        with self._guard:
            if not self._held:
                self._held = True
                return
            waiter = threading.Lock()
            waiter.acquire()
            self._waiters.append(waiter)
        try:
            waiter.acquire()  # released by ``release``, which hands the lock over held
        except BaseException:
            with self._guard:
                try:
                    self._waiters.remove(waiter)
                except ValueError:  # handed over as we were interrupted: pass it on
                    self._hand_over()
            raise

    def release(self) -> None:
        with self._guard:
            self._hand_over()

    @property
    def waiting(self) -> int:
        """How many threads wait for the lock."""
        return len(self._waiters)

    def _hand_over(self) -> None:
        if self._waiters:
            self._waiters.popleft().release()  # the lock stays held: the first waiter owns it now
        else:
            self._held = False


class ComputeTurns:
    """``with turns:`` around an inference waits for this computer's compute turn."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)  # held for the process's life
        self._thread = FifoLock()
        self._file = _FileTurn(self.path, self._fd)

    def __enter__(self) -> "ComputeTurns":
        self._thread.acquire()
        try:
            self._file.acquire()
        except BaseException:
            self._thread.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._file.release()
        finally:
            self._thread.release()

    @property
    def waiting(self) -> int:
        """How many threads of this process wait for the turn (a process's own threads queue here
        before the file lock)."""
        return self._thread.waiting

    @functools.cached_property
    def identity(self) -> str:
        """The same for every stage that takes these turns (the file's device and inode), so a
        coordinator can tell which stages cannot compute at once."""
        info = os.fstat(self._fd)
        return f"{info.st_dev}:{info.st_ino}"


def turns_identity(turns) -> str | None:
    """Which computer's turns a stage takes (``ComputeTurns.identity``); None when it takes none."""
    return getattr(turns, "identity", None)


# Stages with cores of their own: every inference runs at once.
NO_TURNS = contextlib.nullcontext()


@functools.cache
def compute_turns(path: Path | str | None):
    """The turns shared through ``path`` (one lock per file in this process), or none."""
    return ComputeTurns(path) if path else NO_TURNS


def machine_turns_file() -> Path:
    """The turns file of this computer's stages: a local fleet's, a node agent's workers and the coordinator's."""
    folder = paths().data
    folder.mkdir(parents=True, exist_ok=True)
    return folder / "compute.turns"
