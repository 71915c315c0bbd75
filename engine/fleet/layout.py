"""Layouts: the model as one chain over the fleet, or as replicas (several chains), and which
serves more users.

Where the model fits on one PC, two PCs serving two copies add up better than one chain split over
both: each copy batches its own users and nothing waits on a hop.  A copy on another node holds the
whole model there; the coordinator (it holds the tokenizer and the chat service) only feeds it token
ids (``deploy``'s fed placement).  An earlier layout kept each copy's first layer on the
coordinator: that layer then waited, every token, for the coordinator's own copy to finish a whole
forward on the same cores, and the second copy served half what it should.  ``solve_layout``
weighs, for the expected users: one chain over every node (``placement.solve``), and the same with
some nodes each serving a copy of their own, the chain (if any) keeping the coordinator and the
remaining nodes.  Users spread evenly over the copies (``engine.runtime.decode.replicas`` routes
each request to the least busy one).  Like ``placement``, a pure function of the measured profiles.
"""

from __future__ import annotations

import dataclasses
import itertools

from engine.fleet.placement import (Fleet, Infeasible, ModelShape, Plan, PlacementError, Record, evaluate,
                                    price_ranks, solve, stage_time)
from engine.tuning import CHAIN_MARGIN, RANKS_MARGIN



@dataclasses.dataclass(frozen=True)
class Layout(Record):
    """Chains that serve the same model side by side, each priced at its share of the users."""

    plans: list[Plan]
    users: int
    aggregate_tok_s: float
    coordinator_load: float  # the share of the coordinator's time its stages take at that rate

    def explain(self) -> str:
        if len(self.plans) == 1:
            return self.plans[0].explain()
        lines = [f"{len(self.plans)} copies of the model, {self.users} user(s) spread over them: "
                 f"{self.aggregate_tok_s:.1f} tok/s aggregate predicted (a copy on another PC holds the whole "
                 f"model there; this PC only feeds it token ids)"]
        for i, plan in enumerate(self.plans):
            lines.append(f"copy {i + 1}:")
            lines.extend("  " + line for line in plan.explain().splitlines())
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "plans": [p.to_json() for p in self.plans]}

    @classmethod
    def from_json(cls, d: dict) -> Layout:
        return cls(**{**d, "plans": [Plan.from_json(p) for p in d["plans"]]})


def shares(users: int, replicas: int) -> list[int]:
    """Users per copy as the router spreads them (the least busy copy takes the next)."""
    return [users // replicas + (i < users % replicas) for i in range(replicas)]


def price_layout(model: ModelShape, fleet: Fleet, plans: list[Plan], users: int) -> Layout:
    """The aggregate tok/s of ``plans`` side by side.  Each plan's own ``aggregate_tok_s`` must be
    priced at its share of ``users``; where the coordinator's stages of all copies together would
    take more than its time, every copy slows by that factor."""
    load = 0.0
    for plan in plans:
        if plan.aggregate_tok_s <= 0:
            continue
        first = plan.stages[0]
        dev = fleet.device(first.node, first.device)
        if dev is None or first.node != fleet.coordinator:
            continue
        rows = 1 if plan.ranks else max(plan.users, 1)  # ranks run one stream's forward at a time
        step_ms = first.ms if plan.ranks else stage_time(dev, rows).at(first.end - first.start, True,
                                                                        len(plan.stages) == 1)
        load += step_ms * plan.aggregate_tok_s / rows / 1000.0  # rounds per second x one round's time
    total = sum(p.aggregate_tok_s for p in plans)
    if load > 1.0:
        total /= load
    return Layout(plans=plans, users=users, aggregate_tok_s=total, coordinator_load=load)


def _own_copy(model: ModelShape, fleet: Fleet, node: str, users: int) -> Plan | None:
    """A copy whole on ``node``'s best device, fed by the coordinator; None where it does not fit."""
    best = None
    for there in (d for d in fleet.devices if d.node == node and d.supported):
        evaluation = evaluate(model, fleet, [(node, there.device, 0, model.num_layers)], users=users, fed=True)
        if evaluation.ok and (best is None or evaluation.plan.aggregate_tok_s > best.aggregate_tok_s):
            best = dataclasses.replace(evaluation.plan, objective="throughput")
    return best


def _without(fleet: Fleet, nodes: set[str]) -> Fleet:
    return Fleet(devices=[d for d in fleet.devices if d.node not in nodes], rtt_ms=fleet.rtt_ms,
                 coordinator=fleet.coordinator)


def solve_layout(model: ModelShape, fleet: Fleet, *, users: int, max_stages: int | None = None,
                 replicas: bool = True, time_limit_s: float = 30) -> Layout:
    """The layout that serves ``users`` fastest by the cost model (see the module's docstring):
    one chain (``solve`` for throughput), or copies of the model on nodes of their own beside a
    chain over the rest, or copies only; a layout with a chain split over PCs must predict
    ``CHAIN_MARGIN`` more than the best of whole copies.  Raises Infeasible when even one chain
    does not fit."""
    one = price_layout(model, fleet, [solve(model, fleet, objective="throughput", users=users, max_stages=max_stages,
                                            time_limit_s=time_limit_s)], users)
    c = fleet.coordinator
    if c is None:
        return one
    others = [n for n in fleet.nodes if n != c]
    layouts = [one, *(price_layout(model, fleet, [plan], users) for plan in _rank_pairs(model, fleet, others, users))]
    if not replicas or users < 2:
        return _best(layouts)
    for count in range(1, len(others) + 1):
        for homes in itertools.combinations(others, count):
            rest = _without(fleet, set(homes))
            for with_chain in (True, False):
                n = count + with_chain
                if n > users or (not with_chain and count < 2):
                    continue
                split = shares(users, n)
                copies = [_own_copy(model, fleet, node, u) for node, u in zip(homes, split[with_chain:])]
                if any(p is None for p in copies):
                    continue
                if with_chain:
                    try:
                        chain = solve(model, rest, objective="throughput", users=split[0], max_stages=max_stages,
                                      time_limit_s=time_limit_s / 4)
                    except (Infeasible, PlacementError):
                        continue
                    copies.insert(0, chain)
                layouts.append(price_layout(model, fleet, copies, users))

    return _best(layouts)


def fastest_for_one(model: ModelShape, fleet: Fleet, plan: Plan) -> Plan:
    """``plan`` (the solver's fastest chain for one user), or two PCs as tensor-parallel ranks where
    they predict more tok/s than it and ``RANKS_MARGIN`` more than the model whole on one PC."""
    whole = max((e.plan.tok_s for d in fleet.devices if d.node == fleet.coordinator and d.supported
                 if (e := evaluate(model, fleet, [(d.node, d.device, 0, model.num_layers)])).ok), default=0.0)
    ranks = max(_rank_pairs(model, fleet, [n for n in fleet.nodes if n != fleet.coordinator], 1),
                key=lambda p: p.tok_s, default=None)
    if ranks is not None and ranks.tok_s > max(plan.tok_s, whole * RANKS_MARGIN):
        return dataclasses.replace(ranks, objective=plan.objective)
    return plan


def _rank_pairs(model: ModelShape, fleet: Fleet, others: list[str], users: int) -> list[Plan]:
    """The coordinator and each other node as two tensor-parallel ranks, on their fastest pair of
    devices that fits (``placement.price_ranks``); none where the model's export cannot be split."""
    if model.max_ranks < 2:
        return []
    plans = []
    for node in others:
        pairs = [price_ranks(model, fleet, [(a.node, a.device), (b.node, b.device)], users=users)
                 for a in fleet.devices if a.node == fleet.coordinator and a.supported
                 for b in fleet.devices if b.node == node and b.supported]
        fits = [e.plan for e in pairs if e.ok]
        if fits:
            plans.append(max(fits, key=lambda plan: plan.tok_s))
    return plans


def _best(layouts: list[Layout]) -> Layout:
    """The fastest layout; one that spreads a copy over several PCs only where it predicts more than
    whole copies by its margin: ``CHAIN_MARGIN`` for a chain split over them, ``RANKS_MARGIN`` for
    tensor-parallel ranks."""
    def spread(layout: Layout) -> bool:
        return any(len(p.stages) > 1 for p in layout.plans)

    def margin(layout: Layout) -> float:
        return RANKS_MARGIN if any(p.ranks for p in layout.plans) else CHAIN_MARGIN

    whole = max((layout for layout in layouts if not spread(layout)), key=lambda w: w.aggregate_tok_s, default=None)
    candidates = [layout for layout in layouts if not spread(layout) or whole is None
                  or layout.aggregate_tok_s > whole.aggregate_tok_s * margin(layout)]
    return max(candidates, key=lambda layout: layout.aggregate_tok_s)
