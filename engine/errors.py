"""The engine's error types: each carries a message a user can act on."""


class FleetError(Exception):
    """Base of every error the engine raises on purpose (shown to users without a traceback)."""


class SourceError(FleetError):
    """A model source is missing, unknown, corrupt or of an unsupported architecture."""


class ShardError(FleetError):
    """A shard folder is missing, tampered with or does not fit the chain it is loaded into."""


class ExportError(FleetError):
    """An export could not be carried out (bad split, conversion failure)."""


class ContextError(FleetError):
    """A prompt or conversation does not fit the model's context."""


class StageError(FleetError):
    """A pipeline stage failed, died or went silent: names which stage and where it runs."""

    def __init__(self, stage: int, address: str, reason: str, transient: bool = False):
        super().__init__(f"stage {stage} at {address}: {reason}")
        self.stage = stage
        self.address = address
        self.reason = reason
        self.transient = transient  # the stage reported it will pass (a successor being redialed)
