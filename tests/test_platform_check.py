"""The first-run check on Linux: when Qt's xcb platform plugin lacks system libraries, the app says
which and how to install them instead of Qt's bare "could not load the Qt platform plugin xcb"."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleetgui import platform_check
from fleetgui.platform_check import describe_missing, missing_libraries, uses_xcb, xcb_plugin, xcb_problem

ROOT = Path(__file__).resolve().parent.parent
FAKE_LDD = """\
\tlinux-vdso.so.1 (0x00007ffd6a1f2000)
\tlibQt6XcbQpa.so.6 => /venv/PySide6/Qt/lib/libQt6XcbQpa.so.6 (0x00007f0c1c000000)
\tlibxcb-cursor.so.0 => not found
\tlibxcb-icccm.so.4 => not found
\tlibxkbcommon-x11.so.0 => /lib/x86_64-linux-gnu/libxkbcommon-x11.so.0 (0x00007f0c1bf00000)
\tlibxcb-keysyms.so.1 => not found
\tlibxcb-icccm.so.4 => not found
\tlibfrobnicate.so.7 => not found
"""


def test_the_message_names_the_packages_and_both_commands():
    missing = missing_libraries(FAKE_LDD)
    assert missing == ["libxcb-cursor.so.0", "libxcb-icccm.so.4", "libxcb-keysyms.so.1", "libfrobnicate.so.7"]
    text = describe_missing(missing)
    assert "sudo apt install libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1\n" in text
    assert "sudo dnf install xcb-util-cursor xcb-util-wm xcb-util-keysyms\n" in text
    assert "  libxcb-icccm.so.4  (Debian/Ubuntu: libxcb-icccm4, Fedora: xcb-util-wm)" in text
    assert "libfrobnicate.so.7 with `apt-file search NAME`" in text  # no package known: how to find it
    assert missing_libraries("\tlibxcb.so.1 => /lib/libxcb.so.1 (0x1)\n") == []


def test_only_an_x11_start_is_checked():
    assert uses_xcb({"DISPLAY": ":0"}, platform="linux")
    assert uses_xcb({"DISPLAY": ":0", "QT_QPA_PLATFORM": "xcb"}, platform="linux")
    assert not uses_xcb({"DISPLAY": ":0", "QT_QPA_PLATFORM": "offscreen"}, platform="linux")
    assert not uses_xcb({"DISPLAY": ":0"}, ["-platform", "wayland"], platform="linux")
    assert uses_xcb({"DISPLAY": ":0", "QT_QPA_PLATFORM": "wayland"}, ["-platform", "xcb"], platform="linux")
    assert not uses_xcb({}, platform="linux")  # no X display: Qt will not load xcb
    assert not uses_xcb({"DISPLAY": ":0", "XDG_SESSION_TYPE": "wayland", "WAYLAND_DISPLAY": "wayland-0"},
                        platform="linux")
    assert not uses_xcb({"DISPLAY": ":0"}, platform="win32")
    assert xcb_problem(env={"DISPLAY": ":0", "QT_QPA_PLATFORM": "offscreen"}) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the xcb plugin is Linux's")
def test_the_real_xcb_plugin_is_judged_consistently():
    """Whatever ldd reports missing on this machine really does not load, and the check (and the
    app's start) fails exactly when something is missing."""
    plugin = xcb_plugin()
    assert plugin is not None and plugin.name == "libqxcb.so"
    output = platform_check.run_ldd(plugin)
    assert output and "libxcb" in output
    missing = missing_libraries(output)
    for soname in missing:
        with pytest.raises(OSError):
            ctypes.CDLL(soname)
    problem = xcb_problem(env={"DISPLAY": ":0"})
    if not missing:
        assert problem is None
        return
    assert all(m in problem for m in missing) and "sudo apt install" in problem
    env = {k: v for k, v in os.environ.items() if k not in ("QT_QPA_PLATFORM", "WAYLAND_DISPLAY")}
    env["DISPLAY"] = ":0"
    proc = subprocess.run([sys.executable, "-c",
                           "import sys; from fleetgui.app import main; sys.exit(main(['fleetgui']))"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert (proc.returncode == 1 and problem in proc.stderr
            and "could not load the Qt platform plugin" not in proc.stderr)
