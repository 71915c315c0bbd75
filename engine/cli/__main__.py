"""``python -m engine.cli``: how the engine starts its own worker and agent processes."""

import sys

from engine.cli.main import main

sys.exit(main())
