"""Starting the tray worker (``fleetgui --worker``) with the user's session.

Linux (and other XDG desktops): a desktop entry in ``$XDG_CONFIG_HOME/autostart`` (default
``~/.config/autostart``), ``fleetshard-worker.desktop``.  Windows: a value ``fleetshard-worker``
under the user's ``HKCU\\Software\\Microsoft\\Windows\\CurrentVersion\\Run`` key.  Elsewhere
``supported()`` says why not.  Nothing here touches Qt.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from engine.errors import FleetError
from fleetgui.theme import RESOURCES

APP_ID = "fleetshard-worker"
RUN_KEY = r"Software\Microsoft\Windows\CurrentVersion\Run"
_RESERVED = set(" \t\n\"'\\><~|&;$*?#()`")


def worker_command() -> list[str]:
    """The command that starts the worker: a bundled app's own executable, the installed
    ``fleetgui`` script, else this Python."""
    if getattr(sys, "frozen", False):  # a PyInstaller bundle: its executable is the app
        return [sys.executable, "--worker"]
    windows = sys.platform == "win32"
    here = Path(sys.executable).parent
    script = here / ("fleetgui.exe" if windows else "fleetgui")
    if not script.exists():
        found = shutil.which("fleetgui")
        script = Path(found) if found else None
    if script is not None:
        return [str(script), "--worker"]
    python = here / "pythonw.exe" if windows and (here / "pythonw.exe").exists() else Path(sys.executable)
    return [str(python), "-m", "fleetgui.app", "--worker"]


def supported() -> str | None:
    """None where autostart works here, else the reason."""
    if sys.platform == "win32" or sys.platform.startswith(("linux", "freebsd", "openbsd")):
        return None
    return f"starting with the session is not supported on {sys.platform}"


def desktop_entry_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "autostart" / f"{APP_ID}.desktop"


def desktop_exec(command: list[str]) -> str:
    """An Exec= value: arguments quoted as the Desktop Entry Specification asks."""
    parts = []
    for arg in command:
        arg = arg.replace("%", "%%")
        if arg and not _RESERVED & set(arg):
            parts.append(arg)
            continue
        quoted = "".join("\\" + c if c in '"`$\\' else c for c in arg)
        parts.append('"' + quoted.replace("\\", "\\\\") + '"')  # the string-value escape applies on top
    return " ".join(parts)


def desktop_entry(command: list[str]) -> str:
    icon = RESOURCES / "icons" / "fleetshard.svg"
    return "\n".join([
        "[Desktop Entry]",
        "Type=Application",
        "Name=fleetshard worker",
        "Comment=Lend this PC to the office's fleetshard LLM (node agent in the system tray)",
        f"Exec={desktop_exec(command)}",
        f"Icon={icon}",
        "Terminal=false",
        "X-GNOME-Autostart-enabled=true",
        "",
    ])


def is_enabled() -> bool:
    if sys.platform == "win32":
        return _registry_value() is not None
    return desktop_entry_path().exists()


def enable(command: list[str] | None = None) -> str:
    """Registers the worker to start with the session; returns where."""
    problem = supported()
    if problem:
        raise FleetError(problem)
    command = command or worker_command()
    if sys.platform == "win32":
        import winreg  # Windows only: the module does not exist elsewhere

        with winreg.CreateKey(winreg.HKEY_CURRENT_USER, RUN_KEY) as key:
            winreg.SetValueEx(key, APP_ID, 0, winreg.REG_SZ, subprocess.list2cmdline(command))
        return f"HKCU\\{RUN_KEY}\\{APP_ID}"
    path = desktop_entry_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(desktop_entry(command))
        os.replace(tmp, path)
    except OSError as exc:
        raise FleetError(f"cannot write {path}: {exc.strerror or exc}") from None
    return str(path)


def disable() -> None:
    if sys.platform == "win32":
        import winreg  # Windows only: the module does not exist elsewhere

        try:
            with winreg.OpenKey(winreg.HKEY_CURRENT_USER, RUN_KEY, 0, winreg.KEY_SET_VALUE) as key:
                winreg.DeleteValue(key, APP_ID)
        except FileNotFoundError:
            pass
        return
    try:
        desktop_entry_path().unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise FleetError(f"cannot remove {desktop_entry_path()}: {exc.strerror or exc}") from None


def _registry_value() -> str | None:
    import winreg  # Windows only: the module does not exist elsewhere

    try:
        with winreg.OpenKey(winreg.HKEY_CURRENT_USER, RUN_KEY) as key:
            return winreg.QueryValueEx(key, APP_ID)[0]
    except FileNotFoundError:
        return None
