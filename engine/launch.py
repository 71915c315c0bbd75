"""Starting this installation's ``fleet`` CLI in a new process: a node agent's stage workers, a
local fleet's workers, the app's local agent.

From a Python environment the command is ``python -m engine.cli``; in the bundled app
(``installer/``, PyInstaller) ``sys.executable`` is the app itself and the ``fleet`` executable sits
beside it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CLI_NAME = "fleet.exe" if sys.platform == "win32" else "fleet"
# a console program started by the windowed app (the tray worker) would open a console window
_NO_WINDOW = getattr(subprocess, "CREATE_NO_WINDOW", 0)


def fleet_command(*args: str) -> list[str]:
    if getattr(sys, "frozen", False):
        return [str(Path(sys.executable).with_name(CLI_NAME)), *args]
    return [sys.executable, "-m", "engine.cli", *args]


def start_fleet(args: list[str], log: Path) -> subprocess.Popen:
    """``fleet ARGS`` with its stderr in ``log``, its stdin a pipe (the ``--lifeline`` it watches) and
    its stdout a pipe (the ready line ``engine.runtime.localfleet.await_ready`` reads)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as err:
        return subprocess.Popen(fleet_command(*args), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                text=True, creationflags=_NO_WINDOW)
