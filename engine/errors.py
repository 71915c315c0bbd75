"""The engine's error types: each carries a message a user can act on."""


class FleetError(Exception):
    """Base of every error the engine raises on purpose (shown to users without a traceback)."""


class SourceError(FleetError):
    """A model source is missing, unknown, corrupt or of an unsupported architecture."""


class ShardError(FleetError):
    """A shard folder is missing, tampered with or does not fit the chain it is loaded into."""


class ExportError(FleetError):
    """An export could not be carried out (bad split, conversion failure)."""
