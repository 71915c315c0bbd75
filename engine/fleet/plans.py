"""The plan document ``fleet place`` writes (and the app's placement view saves): its deployable
stages, and what a deployment keeps of it for failover."""

from __future__ import annotations

from engine.errors import FleetError
from engine.fleet.deploy import StagePlacement
from engine.fleet.placement import OBJECTIVES


def placement_stages(plan_doc: dict):
    """The deployable stages of a ``fleet place`` plan document."""
    try:
        nodes = plan_doc["nodes"]
        return [StagePlacement(agent=nodes[s["node"]]["address"], device=s["device"], start=s["start"], end=s["end"])
                for s in plan_doc["plan"]["stages"]]
    except (KeyError, TypeError) as exc:
        raise FleetError(f"not a plan written by `fleet place` (missing {exc})") from None


def planned_by(plan_doc: dict) -> dict:
    """What a deployment record keeps of its plan for failover: the profile, objective and users."""
    plan = plan_doc.get("plan", {})
    objective = plan.get("objective")  # a plan drawn by hand says "manual": failover then plans for latency
    return {"profile": plan_doc.get("profile"), "objective": objective if objective in OBJECTIVES else "latency",
            "users": plan.get("users", 1)}
