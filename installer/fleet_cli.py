"""The bundled command line's entry point: ``fleet``, which the app also starts for a node's agent
and its stage workers."""

import multiprocessing
import sys

from engine.cli.main import main

if __name__ == "__main__":
    multiprocessing.freeze_support()
    sys.exit(main())
