"""A stage's span: which layers one stage of a model runs, and where.

The one type for "a layer range on a node": the solver's plans (``engine.fleet.placement``, whose
``PlannedStage`` adds its predictions), the plan documents (``engine.fleet.plans``), deployments
(``engine.fleet.deploy``) and the app's Placement view all read and write it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class StageSpan:
    """Layers ``start``..``end`` (half-open) of a model, run on ``device`` of ``node``.

    ``node`` names the node as the document that holds the span does: its id in a fleet profile and
    the plans made from it, its agent's HOST:PORT in a deployment (``engine.fleet.deploy.LOCAL`` for
    this machine); ``at`` turns one into the other.  ``rank``: this stage is tensor-parallel rank
    ``rank`` of the whole model (every rank spans every layer); None for a stage of a chain.
    """

    node: str
    device: str
    start: int
    end: int
    rank: int | None = None

    def at(self, node: str) -> StageSpan:
        """The same layers, device and rank on ``node`` (a plan's node id to its agent's address)."""
        return StageSpan(node, self.device, self.start, self.end, self.rank)

    def to_json(self, node_key: str = "node") -> dict:
        """The JSON object of its fields, the node under ``node_key`` (a deployment record says "agent")."""
        d = dataclasses.asdict(self)
        d[node_key] = d.pop("node")
        return d

    @classmethod
    def from_json(cls, d: dict, node_key: str = "node"):
        """The span of a JSON object, the node under ``node_key``; keys it does not know are left out
        (a ``StageSpan`` read from a plan's stages, which carry predictions too)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"node"}
        return cls(node=d[node_key], **{k: v for k, v in d.items() if k in names})


def ranked(spans: list[StageSpan]) -> list[StageSpan]:
    """``spans`` as tensor-parallel ranks, numbered in their order."""
    return [dataclasses.replace(s, rank=i) for i, s in enumerate(spans)]
