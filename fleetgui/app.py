"""Application entry point (``fleetgui``): builds the main window around the engine.

``build_window`` takes every dependency as a parameter (settings store, backend, history), so
tests and later views can hand it their own; ``main`` runs the app.
"""

from __future__ import annotations

import logging
import sys


def build_window(settings=None, *, store=None, backend=None, history=None):
    """The main window.  ``store``: a QSettings (default: the user's); ``settings``: GuiSettings
    (default: loaded from the store); ``backend``: the engine calls (default ``EngineBackend``);
    ``history``: the chat history store (default: SQLite in the user data folder)."""
    from fleetgui import theme
    from fleetgui.backend import EngineBackend
    from fleetgui.history import HistoryStore
    from fleetgui.mainwindow import MainWindow
    from fleetgui.settings import GuiSettings, default_store

    store = store if store is not None else default_store()
    settings = settings or GuiSettings.load(store)
    theme.apply(settings.theme)
    return MainWindow(settings, store, backend or EngineBackend(), history or HistoryStore())


def main(argv: list[str] | None = None) -> int:
    from PySide6.QtWidgets import QApplication

    from engine.runtime.stage import core
    from fleetgui import theme

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    core()  # before Qt starts any thread: creating an OpenVINO Core forks a short-lived child
    app = QApplication(argv if argv is not None else sys.argv)
    app.setOrganizationName("fleetshard")
    app.setApplicationName("fleetgui")
    app.setWindowIcon(theme.icon())
    window = build_window()
    window.show()
    return app.exec()


if __name__ == "__main__":
    sys.exit(main())
