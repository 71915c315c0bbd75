"""The chat service's failover: what it knows of its stages' health, and the new chain it asks for
when a stage fails under the replies in flight (``engine.fleet.failover`` gives it)."""

from __future__ import annotations

import collections
from typing import Callable

from engine.errors import StageError


class Recovery:
    """``recover(StageError)`` gives a new chain when a stage fails (None: replies in flight end
    with the error).  Counts what the API's metrics report: each stage's failed forwards
    (``stage_failures``), whether each stage was last seen up (``stages_up``), and failovers by
    outcome (``failovers``: "recovered", "failed", and "kept": replies carried on from the caches
    they had, a standby's switch)."""

    def __init__(self, recover: Callable | None, stages: int):
        self.recover = recover
        self.stage_failures: collections.Counter = collections.Counter()
        self.failovers: collections.Counter = collections.Counter()
        self.stages_up: list[bool] = [True] * stages
        self._recovering = False

    def carry_on(self, exc: Exception, in_flight: bool, replace: Callable) -> bool:
        """A forward failed with ``exc``: asks ``recover`` for a new chain and gives it to
        ``replace``, which carries the replies ``in_flight`` on over it.  False when there is none to
        ask for; raises what ``recover`` raised when it could not.  A chain that fails again while
        ``replace`` runs ends the replies instead of recovering again."""
        if isinstance(exc, StageError):
            self.stage_failures[exc.stage] += 1
            if 0 <= exc.stage < len(self.stages_up):
                self.stages_up[exc.stage] = False
        if self.recover is None or not isinstance(exc, StageError) or not in_flight or self._recovering:
            return False
        self._recovering = True
        try:
            try:
                chain = self.recover(exc)
            except Exception:
                self.failovers["failed"] += 1
                raise
            self.failovers["recovered"] += 1
            self.stages_up = [True] * len(self.stages_up)
            replace(chain)
            return True
        finally:
            self._recovering = False

    def went_through(self) -> None:
        """A reply went through every stage: all are up."""
        if not all(self.stages_up):
            self.stages_up = [True] * len(self.stages_up)
