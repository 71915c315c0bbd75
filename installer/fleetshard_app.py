"""The bundled app's entry point: ``fleetshard`` (the desktop app; ``fleetshard --worker`` is the tray
worker)."""

import multiprocessing
import sys

from fleetgui.app import main

if __name__ == "__main__":
    multiprocessing.freeze_support()
    sys.exit(main())
