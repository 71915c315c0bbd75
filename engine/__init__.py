"""fleetshard engine: shard export, the stage runtime and the generation loop (no Qt here)."""

__version__ = "0.1.0"
