"""The ``fleet`` command: a leaf over the engine that only the entry points import.

``main`` builds the parser from one module per command group (``models``, ``generate``, ``serve``,
``worker``, ``keys``, ``bench``, ``fleet``); ``args`` holds the shared options and turns them into
the engine's settings; ``docs`` generates the CLI reference from the parser itself.
"""
