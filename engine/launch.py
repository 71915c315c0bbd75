"""Starting this installation's ``fleet`` CLI in a new process (a node agent's stage workers, a
local fleet's workers, the app's local agent), waiting for its ready line, tying it to its parent
(``lifeline``) and ending it.  Its stderr goes through a pipe into its log, a rotated file
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


def start_fleet(args: list[str], log: Path, max_bytes: int = LOG_MAX_BYTES) -> subprocess.Popen:
    """``fleet ARGS`` with its stderr in ``log`` (rotated at ``max_bytes``: ``log_stderr``), its
    stdin a pipe (the ``--lifeline`` it watches) and its stdout a pipe (the ready line
    ``engine.launch.await_ready`` reads)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_bytes(b"")  # each start's log begins empty, as it did when the child wrote the file itself
    proc = subprocess.Popen(fleet_command(*args), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, encoding="utf-8", errors="replace", creationflags=_NO_WINDOW)
    proc.log_writer = threading.Thread(target=log_stderr, args=(proc.stderr, log, max_bytes), daemon=True,
                                       name=f"log {log.name}")
    proc.log_writer.start()
    return proc


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


def lifeline(on_close=lambda: os._exit(0)) -> None:
    """The child's side: exit as soon as the parent that holds our stdin goes away (or call
    ``on_close`` instead, to end with a cleanup).  Call it once OpenVINO is up: a thread running
    while a Core starts can hang the child process the Core forks."""
    def watch():
        while sys.stdin.read(4096):
            pass
        on_close()

    threading.Thread(target=watch, daemon=True, name="lifeline").start()


def await_ready(proc: subprocess.Popen, log: Path, timeout_s: float) -> str:
    """Waits for a ``fleet worker`` process's ready line and returns the address it printed; a worker
    that exits or stays silent past ``timeout_s`` is ended and reported with the end of its log."""
    found: list[str] = []

    def read():
        for line in proc.stdout:
            if line.startswith(READY):
                found.append(line.split()[1])
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    if found:
        return found[0]
    reason = f"it exited with code {proc.poll()}" if proc.poll() is not None else f"no ready line in {timeout_s:.0f} s"
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=5)
    writer = getattr(proc, "log_writer", None)
    if writer is not None:
        writer.join(5)  # the child's last words reach its log
    tail = log.read_text(errors="replace").strip().splitlines()[-5:] if log.exists() else []
    raise FleetError(reason + ":\n  " + "\n  ".join(tail))


def end_processes(procs: list[subprocess.Popen], timeout_s: float = 5.0) -> None:
    """Terminates child processes (all at once, then waits; kills what does not exit in time) and
    closes our ends of their pipes."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
