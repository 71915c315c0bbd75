"""Starting this installation's ``fleet`` CLI in a new process: the one lifecycle every fleet process
shares (a node agent's stage workers, local workers, a local agent, demo agents, a simulated PC's
agent).  ``FleetProcess`` is such a process seen from its parent: ``start`` it, wait until it is
``ready`` (its ``address``), it ends when we do (its ``lifeline``), ``stop`` it, read its ``log``, and
the counts it ``report``s while it runs.  Its stderr goes through a pipe into its log, a rotated file
(``LOG_MAX_BYTES``), so that a node agent or a worker that runs for weeks does not fill the disk.

From a Python environment the command is ``python -m engine.cli``; in the bundled app
(``installer/``, PyInstaller) ``sys.executable`` is the app itself and the ``fleet`` executable sits
beside it.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from engine.errors import FleetError

CLI_NAME = "fleet.exe" if sys.platform == "win32" else "fleet"
# a console program started by the windowed app (the tray worker) would open a console window
_NO_WINDOW = getattr(subprocess, "CREATE_NO_WINDOW", 0)


def fleet_command(*args: str) -> list[str]:
    if getattr(sys, "frozen", False):
        return [str(Path(sys.executable).with_name(CLI_NAME)), *args]
    return [sys.executable, "-m", "engine.cli", *args]


LOG_MAX_BYTES = 4 << 20  # a child's log is rotated at this size: the last 8 MB of it are kept, in two files
LOG_BACKUPS = 1  # ``log`` and ``log.1``


def log_stderr(stream, log: Path, max_bytes: int) -> None:
    """Copies a child's stderr, line by line, into ``log``, rotated at ``max_bytes`` (to ``log.1``);
    returns when the child closes it (it exits)."""
    handler = logging.handlers.RotatingFileHandler(log, maxBytes=max_bytes, backupCount=LOG_BACKUPS,
                                                   encoding="utf-8")
    try:
        for line in stream:
            handler.emit(logging.makeLogRecord({"msg": line.rstrip("\n")}))
    finally:
        handler.close()
        stream.close()


READY = "ready"
LOG_TAIL = 5  # lines of its log a process that did not start is reported with


def lifeline(on_close=lambda: os._exit(0)) -> None:
    """The child's side: exit as soon as the parent that holds our stdin goes away (or call
    ``on_close`` instead, to end with a cleanup).  Call it once OpenVINO is up: a thread running
    while a Core starts can hang the child process the Core forks."""
    def watch():
        while sys.stdin.read(4096):
            pass
        on_close()

    threading.Thread(target=watch, daemon=True, name="lifeline").start()


def report(name: str, value: int) -> None:
    """The child's side: tells the parent that holds our stdout a count (after the ready line; the
    latest of each is ``FleetProcess.reported``)."""
    print(f"{name} {value}", flush=True)


class FleetProcess:
    """A ``fleet ARGS`` process this process starts (the module's docstring): its stderr in ``log``, its
    stdin a pipe (the ``--lifeline`` it watches, added to ``args``), its stdout a pipe (the ready line,
    then its reports).  ``prefix``: a command it runs under (``nsenter`` into a namespace); ``env``, ``preexec_fn``:
    as ``subprocess.Popen`` takes them; ``max_bytes``: where its log is rotated (``log_stderr``)."""

    def __init__(self, args: list[str], log: Path, *, prefix: list[str] | tuple[str, ...] = (),
                 env: dict | None = None, preexec_fn=None, max_bytes: int = LOG_MAX_BYTES):
        self.args, self.log, self.prefix = list(args), Path(log), list(prefix)
        self.env, self.preexec_fn, self.max_bytes = env, preexec_fn, max_bytes
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None  # what its ready line says: HOST:PORT
        self.reported: dict[str, int] = {}
        self._ready = threading.Event()
        self._reader: threading.Thread | None = None
        self._writer: threading.Thread | None = None

    def start(self) -> "FleetProcess":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.log.write_bytes(b"")  # each start's log begins empty
        self.proc = subprocess.Popen([*self.prefix, *fleet_command(*self.args, "--lifeline")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     encoding="utf-8", errors="replace", env=self.env, preexec_fn=self.preexec_fn,
                                     creationflags=_NO_WINDOW)
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True, name="fleet stdout")
        self._writer = threading.Thread(target=log_stderr, args=(self.proc.stderr, self.log, self.max_bytes),
                                        daemon=True, name=f"log {self.log.name}")
        self._reader.start()
        self._writer.start()
        return self

    def _read(self, stdout) -> None:
        try:
            for line in stdout:
                if not self._ready.is_set():
                    if line.startswith(READY):
                        self.address = line.split()[1]
                        self._ready.set()
                    continue
                name, _, value = line.strip().partition(" ")
                if value.isdigit():
                    self.reported[name] = int(value)
        except (OSError, ValueError):  # our end closed by ``stop``
            pass

    def wait_ready(self, timeout_s: float) -> str:
        """Waits for its ready line and returns the address it printed; a process that exits or stays
        silent past ``timeout_s`` is ended and reported with the end of its log."""
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.05) and self.proc.poll() is None and time.monotonic() < deadline:
            pass
        if self.proc.poll() is not None:
            self._reader.join(1.0)  # a ready line still in the pipe counts
        if self._ready.is_set():
            return self.address
        reason = (f"it exited with code {self.proc.returncode}" if self.proc.poll() is not None
                  else f"no ready line in {timeout_s:.0f} s")
        self.stop()
        raise FleetError(reason + ":\n  " + "\n  ".join(self.tail()))

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self, lines: int = LOG_TAIL) -> list[str]:
        """The last ``lines`` lines of its log."""
        return self.log.read_text(errors="replace").strip().splitlines()[-lines:] if self.log.exists() else []

    def stop(self, timeout_s: float = 5.0) -> None:
        stop_all([self], timeout_s)


def stop_all(processes: list[FleetProcess], timeout_s: float = 5.0) -> None:
    """Stops fleet processes: all at once, then waits (``end_processes``)."""
    started = [p for p in processes if p.proc is not None]
    _terminate([p.proc for p in started], timeout_s)
    for p in started:
        p._reader.join(1.0)  # its reports to the last
        p._writer.join(5.0)  # and its last words in its log
    _close_pipes([p.proc for p in started])


def end_processes(procs: list[subprocess.Popen], timeout_s: float = 5.0) -> None:
    """Terminates child processes (all at once, then waits; kills what does not exit in time) and
    closes our ends of their pipes."""
    _terminate(procs, timeout_s)
    _close_pipes(procs)


def _terminate(procs: list[subprocess.Popen], timeout_s: float) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _close_pipes(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
