"""Application entry point (``fleetgui``): builds the main window around the engine.

``fleetgui`` opens the app and starts the chat on the embedded default (the local 2-stage fleet of
the default model, as ``make run`` and ``fleet up`` run it; closing the window stops it).
``fleetgui --worker`` runs this PC as a node of the fleet from the system tray (``fleetgui.tray``).

On Linux, ``main`` first checks that Qt's X11 (xcb) platform plugin's system libraries load
(``fleetgui.platform_check``) and otherwise exits naming the packages to install.

``build_window`` takes every dependency as a parameter (settings store, backend, history), so
tests can hand it their own; ``main`` runs the app.
"""

from __future__ import annotations

import argparse
import logging
import sys

from PySide6.QtWidgets import QApplication

from engine.runtime.stages.stage import core
from fleetgui import qtfix, theme
from fleetgui.history import HistoryStore
from fleetgui.platform_check import xcb_problem
from fleetgui.settings import GuiSettings, default_store
from fleetgui.tray import DEFAULT_LISTEN, run_worker
from fleetgui.widgets import guard_wheel
from fleetgui.workers import on_signals


def build_window(settings=None, *, store=None, backend=None, history=None):
    """The main window.  ``store``: a QSettings (default: the user's); ``settings``: GuiSettings
    (default: loaded from the store); ``backend``: the engine calls (default ``EngineBackend``);
    ``history``: the chat history store (default: SQLite in the user data folder)."""
    # deferred: the window's modules load the whole engine; the tray worker (``--worker``) imports this module too
    from fleetgui.backend import EngineBackend
    from fleetgui.mainwindow import MainWindow  # deferred, see above

    store = store if store is not None else default_store()
    settings = settings or GuiSettings.load(store)
    theme.apply(settings.theme)
    guard_wheel()
    return MainWindow(settings, store, backend or EngineBackend(), history or HistoryStore())


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Our options; whatever else is on the command line is Qt's (``-platform``, ``-style``...)."""
    parser = argparse.ArgumentParser(prog="fleetgui", description="fleetshard desktop app")
    parser.add_argument("--worker", action="store_true",
                        help="serve this PC to the fleet from the system tray (the node agent, in this process)")
    parser.add_argument("--listen", default=DEFAULT_LISTEN, help=f"worker mode: HOST:PORT of the agent's control "
                        f"API (default {DEFAULT_LISTEN})")
    parser.add_argument("--name", help="worker mode: the node's display name (default: the host name)")
    parser.add_argument("--fleet-key-file", help="worker mode: the fleet key file (default: the app's setting)")
    parser.add_argument("--no-mdns", action="store_true", help="worker mode: do not advertise the node over mDNS")
    parser.add_argument("--no-chat", action="store_true", help="do not start the chat's model at start-up")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv)
    args, qt_args = parse_args(argv[1:])
    problem = xcb_problem(qt_args)  # Qt itself would only say it "could not load the Qt platform plugin xcb"
    if problem:
        print(problem, file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    core()  # before Qt starts any thread: creating an OpenVINO Core forks a short-lived child
    app = QApplication(argv[:1] + qt_args)
    qtfix.collect_on_gui_thread(app)
    app.setOrganizationName("fleetshard")
    app.setApplicationName("fleetgui")
    app.setWindowIcon(theme.icon())
    guard_wheel()  # the tray worker's forms too
    if args.worker:
        return run_worker(args)
    window = build_window()
    window.show()
    on_signals(app, window.close)  # Ctrl+C and `kill` close the window: the local fleet stops with it
    if not args.no_chat:
        window.chat_controller.open()  # the embedded default starts now, so the chat is ready when needed
    return app.exec()


if __name__ == "__main__":
    sys.exit(main())
