"""Before Qt starts on Linux: do the X11 (xcb) platform plugin's system libraries load?

Qt 6.5+ needs libxcb-cursor0, libxcb-icccm4, libxcb-keysyms1 and friends, which a fresh desktop install
often lacks; Qt then aborts with only "could not load the Qt platform plugin xcb".  ``xcb_problem``
runs ``ldd`` on PySide6's ``libqxcb.so`` when the app is about to use xcb, and words what is missing:
the libraries, their Debian/Ubuntu and Fedora packages and the apt and dnf commands that install
them.  ``missing_libraries`` and ``describe_missing`` are pure functions of ``ldd``'s output.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

# soname -> (Debian/Ubuntu package, Fedora package)
PACKAGES: dict[str, tuple[str, str]] = {
    "libxcb-cursor.so.0": ("libxcb-cursor0", "xcb-util-cursor"),
    "libxcb-icccm.so.4": ("libxcb-icccm4", "xcb-util-wm"),
    "libxcb-keysyms.so.1": ("libxcb-keysyms1", "xcb-util-keysyms"),
    "libxcb-image.so.0": ("libxcb-image0", "xcb-util-image"),
    "libxcb-render-util.so.0": ("libxcb-render-util0", "xcb-util-renderutil"),
    "libxcb-util.so.1": ("libxcb-util1", "xcb-util"),
    "libxkbcommon-x11.so.0": ("libxkbcommon-x11-0", "libxkbcommon-x11"),
    "libxkbcommon.so.0": ("libxkbcommon0", "libxkbcommon"),
    "libxcb-xinerama.so.0": ("libxcb-xinerama0", "libxcb"),
    "libxcb-randr.so.0": ("libxcb-randr0", "libxcb"),
    "libxcb-shape.so.0": ("libxcb-shape0", "libxcb"),
    "libxcb-xkb.so.1": ("libxcb-xkb1", "libxcb"),
    "libxcb-shm.so.0": ("libxcb-shm0", "libxcb"),
    "libxcb-sync.so.1": ("libxcb-sync1", "libxcb"),
    "libxcb-xfixes.so.0": ("libxcb-xfixes0", "libxcb"),
    "libxcb-render.so.0": ("libxcb-render0", "libxcb"),
    "libxcb-glx.so.0": ("libxcb-glx0", "libxcb"),
    "libxcb.so.1": ("libxcb1", "libxcb"),
    "libX11-xcb.so.1": ("libx11-xcb1", "libX11-xcb"),
    "libX11.so.6": ("libx11-6", "libX11"),
    "libSM.so.6": ("libsm6", "libSM"),
    "libICE.so.6": ("libice6", "libICE"),
    "libEGL.so.1": ("libegl1", "mesa-libEGL"),
    "libGL.so.1": ("libgl1", "mesa-libGL"),
    "libOpenGL.so.0": ("libopengl0", "libglvnd-opengl"),
    "libfontconfig.so.1": ("libfontconfig1", "fontconfig"),
    "libfreetype.so.6": ("libfreetype6", "freetype"),
    "libdbus-1.so.3": ("libdbus-1-3", "dbus-libs"),
    "libglib-2.0.so.0": ("libglib2.0-0", "glib2"),
}
# What the README's setup line names: the libraries Qt 6.5+'s xcb plugin needs beyond a base desktop.
APT_SETUP = "libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1 libxkbcommon-x11-0 libegl1"
DNF_SETUP = "xcb-util-cursor xcb-util-wm xcb-util-keysyms libxkbcommon-x11 mesa-libEGL"

_NOT_FOUND = re.compile(r"^\s*(\S+)\s*=>\s*not found", re.MULTILINE)


def missing_libraries(ldd_output: str) -> list[str]:
    """The sonames ``ldd`` reports as "not found", each once, in the order it lists them."""
    return list(dict.fromkeys(_NOT_FOUND.findall(ldd_output)))


def describe_missing(missing: Sequence[str]) -> str:
    """What to tell a user whose xcb plugin lacks ``missing``: the libraries, their packages and the
    commands that install them."""
    known = [m for m in missing if m in PACKAGES]
    unknown = [m for m in missing if m not in PACKAGES]
    debian = list(dict.fromkeys(PACKAGES[m][0] for m in known))
    fedora = list(dict.fromkeys(PACKAGES[m][1] for m in known))
    lines = ["fleetgui cannot start: Qt's X11 (xcb) platform plugin needs system libraries this PC lacks:",
             *(f"  {m}" + (f"  (Debian/Ubuntu: {PACKAGES[m][0]}, Fedora: {PACKAGES[m][1]})" if m in PACKAGES else "")
               for m in missing)]
    if known:
        lines += ["Install them with", f"  Debian/Ubuntu:  sudo apt install {' '.join(debian)}",
                  f"  Fedora:         sudo dnf install {' '.join(fedora)}"]
    if unknown:
        lines.append("Find the package of " + ", ".join(unknown) + " with `apt-file search NAME` (Debian/Ubuntu) "
                     "or `dnf provides '*/NAME'` (Fedora).")
    lines.append("Then run the app again.  (Or choose another Qt platform, e.g. QT_QPA_PLATFORM=wayland on a "
                 "Wayland desktop.)")
    return "\n".join(lines)


def uses_xcb(env: Mapping[str, str], qt_args: Sequence[str] = (), platform: str = sys.platform) -> bool:
    """Whether Qt will load its xcb plugin: Linux with an X display, no other platform asked for
    (``QT_QPA_PLATFORM`` or ``-platform``), and not a Wayland session Qt would prefer."""
    if not platform.startswith("linux") or not env.get("DISPLAY"):
        return False
    args = list(qt_args)
    asked = args[args.index("-platform") + 1] if "-platform" in args[:-1] else env.get("QT_QPA_PLATFORM", "")
    if asked:
        return asked.split(":")[0].split(";")[0] == "xcb"
    return not (env.get("XDG_SESSION_TYPE") == "wayland" and env.get("WAYLAND_DISPLAY"))


def xcb_plugin() -> Path | None:
    """PySide6's ``libqxcb.so``, found without importing Qt."""
    spec = importlib.util.find_spec("PySide6")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for candidate in (Path(folder) / "Qt" / "plugins" / "platforms" / "libqxcb.so",
                          Path(folder) / "plugins" / "platforms" / "libqxcb.so"):
            if candidate.is_file():
                return candidate
    return None


def run_ldd(library: Path) -> str | None:
    """``ldd``'s output for ``library``, or None where ldd is not there or fails."""
    try:
        proc = subprocess.run(["ldd", str(library)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def xcb_problem(qt_args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> str | None:
    """The message to print instead of starting Qt, or None when the xcb plugin's libraries load
    (or xcb is not going to be used, or it cannot be checked)."""
    env = os.environ if env is None else env
    if not uses_xcb(env, qt_args):
        return None
    plugin = xcb_plugin()
    output = run_ldd(plugin) if plugin is not None else None
    missing = missing_libraries(output) if output else []
    return describe_missing(missing) if missing else None
