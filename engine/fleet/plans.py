"""The plan document ``fleet place`` writes (and the app's placement view saves): its deployable
stages (``plan``, and the other copies' plans in ``replicas`` when the solver chose several,
``engine.fleet.layout``), and what a deployment keeps of it for failover."""

from __future__ import annotations

from engine.errors import FleetError
from engine.fleet.placement import OBJECTIVES
from engine.fleet.span import StageSpan, ranked


def placement_stages(plan_doc: dict, plan: dict | None = None) -> list[StageSpan]:
    """The deployable stages of a ``fleet place`` plan document (of its ``plan``, or of one of its
    ``replicas``): each stage at its node's agent."""
    try:
        nodes, plan = plan_doc["nodes"], plan or plan_doc["plan"]
        stages = [StageSpan.from_json(s) for s in plan["stages"]]
        stages = [s.at(nodes[s.node]["address"]) for s in stages]
        return ranked(stages) if plan.get("ranks") else stages
    except (KeyError, TypeError) as exc:
        raise FleetError(f"not a plan written by `fleet place` (missing {exc})") from None


def layout_stages(plan_doc: dict) -> list[list[StageSpan]]:
    """Every copy's deployable stages: the plan's, then each replica's."""
    return [placement_stages(plan_doc), *(placement_stages(plan_doc, p) for p in plan_doc.get("replicas", []))]


def planned_by(plan_doc: dict) -> dict:
    """What a deployment record keeps of its plan for failover: the profile, objective and users."""
    plan = plan_doc.get("plan", {})
    objective = plan.get("objective")  # a plan drawn by hand says "manual": failover then plans for latency
    return {"profile": plan_doc.get("profile"), "objective": objective if objective in OBJECTIVES else "latency",
            "users": plan.get("users", 1)}
