"""Placement: which nodes run which layer ranges, on which device, in which chain order.

A pure function of measured device profiles and a model's memory shape; it knows nothing of sockets
or UIs, and its inputs and outputs travel as JSON.  ``solve`` states the choice as an integer linear
program for HiGHS (``scipy.optimize.milp``); ``evaluate`` prices a plan the user drew by hand with
the same cost model and lists its problems instead of raising, cheaply enough to run on every drag.
Layer ranges are half-open: ``start, end = 0, 40`` means layers 0..39, written "layers 0-40".
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random
import time
import warnings
from collections.abc import Iterable, Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csr_array, vstack

from engine.config import RelayOptions
from engine.errors import FleetError
from engine.fleet.span import StageSpan, ranked
from engine.manifest import layer_span, part_name
from engine.tuning import EXCHANGE_FIXED_MS, EXCHANGE_WAIT, LINK_MBIT

OBJECTIVES = ("latency", "throughput")
GB = 2**30
MIP_REL_GAP = 1e-8  # HiGHS's default 1e-4 would leave plans measurably short of the optimum


class PlacementError(FleetError):
    """The placement inputs are malformed (unknown objective, a missing round-trip time, ...)."""


class Infeasible(PlacementError):
    """No placement satisfies the fleet's memory, the pins and the coordinator; says why."""


class Record:
    """A dataclass that travels as the JSON object of its fields."""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict):
        return cls(**d)


def gb(n: float) -> str:
    return f"{n / GB:.1f} GB"


@dataclasses.dataclass(frozen=True)
class ModelShape(Record):
    name: str
    num_layers: int
    layer_bytes: int  # weights of one decoder layer
    embed_bytes: int  # stage 0 extra: the embedding
    head_bytes: int  # last stage extra: final norm + LM head
    kv_bytes_per_layer: int  # KV cache of one layer at the planned context and streams
    overhead_bytes: int = 0  # fixed runtime cost of each stage process
    max_ranks: int = 1  # tensor-parallel ranks its export can split it into (``price_ranks``): 2, or 1 for none
    exchange_bytes: int = 0  # what a rank sends at a layer's exchange for one token: its partial hidden state


@dataclasses.dataclass(frozen=True)
class DeviceProfile(Record):
    node: str
    device: str  # "CPU", "GPU.0", "NPU", ...
    memory_bytes: int  # memory available for shards
    layer_ms: float  # one decoder layer, one token of decode
    head_ms: float
    embed_ms: float = 0.0
    prefill_layer_ms: float = 0.0
    supported: bool = True
    call_ms: float = 0.0  # fixed cost of running one stage for a token, whatever its layers


@dataclasses.dataclass(frozen=True)
class Pin(Record):
    node: str
    start: int
    end: int
    device: str | None = None


@dataclasses.dataclass(frozen=True)
class Fleet:
    devices: list[DeviceProfile]
    rtt_ms: dict[tuple[str, str], float]  # symmetric: either order may be given
    coordinator: str | None = None  # runs stage 0 (tokenizer and embedding) when set

    @property
    def nodes(self) -> list[str]:
        return list(dict.fromkeys(d.node for d in self.devices))

    def device(self, node: str, device: str) -> DeviceProfile | None:
        return next((d for d in self.devices if d.node == node and d.device == device), None)

    def rtt(self, a: str, b: str) -> float:
        if a == b:
            return self.rtt_ms.get((a, a), 0.0)
        for key in ((a, b), (b, a)):
            if key in self.rtt_ms:
                return self.rtt_ms[key]
        raise PlacementError(f"no round-trip time measured between {a} and {b}")

    def to_json(self) -> dict:
        return {
            "devices": [d.to_json() for d in self.devices],
            "rtt": [{"a": a, "b": b, "ms": ms} for (a, b), ms in self.rtt_ms.items()],
            "coordinator": self.coordinator,
        }

    @classmethod
    def from_json(cls, d: dict) -> Fleet:
        return cls(
            devices=[DeviceProfile.from_json(x) for x in d["devices"]],
            rtt_ms={(r["a"], r["b"]): float(r["ms"]) for r in d.get("rtt", [])},
            coordinator=d.get("coordinator"),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlannedStage(StageSpan):
    """A stage of a plan (``node`` a fleet profile's node id) with the cost model's predictions."""

    ms: float  # predicted time of this stage per token
    memory_bytes: int
    memory_limit_bytes: int  # the device's memory_bytes

    def to_json(self, node_key: str = "node") -> dict:
        """As a plan document holds it: without ``rank``, which the plan's ``ranks`` implies."""
        d = super().to_json(node_key)
        del d["rank"]
        return d


@dataclasses.dataclass(frozen=True)
class Plan(Record):
    """Stages in chain order with their predictions; objective is "manual" for a plan from evaluate."""

    model: str
    stages: list[PlannedStage]
    objective: str
    users: int
    network_ms: float
    token_ms: float
    tok_s: float
    aggregate_tok_s: float
    solve_ms: float
    fed: bool = False  # stage 0 is on a node that the coordinator feeds its token ids (one more hop)
    ranks: bool = False  # the stages are tensor-parallel ranks, each with every layer (``price_ranks``)

    def explain(self) -> str:
        if self.ranks:
            lines = [f"{self.model}: {len(self.stages)} PCs as tensor-parallel ranks, each computing its share "
                     f"of every layer of the same token"]
        else:
            lines = [f"{self.model}: {len(self.stages)} part(s), objective {self.objective}"
                     + (", fed its token ids by this PC" if self.fed else "")]
        for i, s in enumerate(self.stages):
            share = f"{100 * s.memory_bytes / s.memory_limit_bytes:.0f}%" if s.memory_limit_bytes else "no limit known"
            what, layers = ((f"rank {i}", f"1/{len(self.stages)} of each of {layer_span(s.start, s.end)}")
                            if self.ranks else (part_name(i), layer_span(s.start, s.end)))
            lines.append(f"  {what}: {s.node} {s.device}, {layers}, {s.ms:.2f} ms, "
                         f"{gb(s.memory_bytes)} of {gb(s.memory_limit_bytes)} ({share})")
        hops = max(len(self.stages) - 1 + self.fed, 0)
        lines.append(f"  network: {self.network_ms:.2f} ms per token over "
                     + (f"{exchanges(self.stages[0].end)} exchanges" if self.ranks else f"{hops} hop(s)"))
        lines.append(f"  predicted: {self.token_ms:.2f} ms per token, {self.tok_s:.1f} tok/s for one user, "
                     f"{self.aggregate_tok_s:.1f} tok/s aggregate for {self.users} user(s)")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "stages": [s.to_json() for s in self.stages]}

    @classmethod
    def from_json(cls, d: dict) -> Plan:
        stages = [PlannedStage.from_json(s) for s in d["stages"]]
        return cls(**{**d, "stages": ranked(stages) if d.get("ranks") else stages})


@dataclasses.dataclass(frozen=True)
class Evaluation:
    plan: Plan
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {"plan": self.plan.to_json(), "problems": list(self.problems)}

    @classmethod
    def from_json(cls, d: dict) -> Evaluation:
        return cls(plan=Plan.from_json(d["plan"]), problems=list(d["problems"]))


# ---- the cost model: solve takes its coefficients, evaluate and the plans its values ----

@dataclasses.dataclass(frozen=True)
class _Linear:
    """A stage quantity linear in its layer count, plus extras for the first and the last stage."""

    per_layer: float
    first: float
    last: float
    fixed: float = 0.0

    def at(self, layers: int, first: bool, last: bool) -> float:
        return self.per_layer * layers + self.first * first + self.last * last + self.fixed


def row_share(dev: DeviceProfile) -> float:
    """The share of a one-row step's time that each further row (a stream packed into the same
    step) adds; the rest is paid once a step (mostly reading the weights).  From the profile's
    prefill, whose per-token cost is nearly all row cost; 1.0 (every row costs a whole step) where
    no prefill was measured."""
    if dev.layer_ms <= 0 or dev.prefill_layer_ms <= 0:
        return 1.0
    return min(1.0, dev.prefill_layer_ms / dev.layer_ms)


def stage_time(dev: DeviceProfile, rows: float = 1.0) -> _Linear:
    """A stage's time for one step of ``rows`` packed streams."""
    k = 1.0 + row_share(dev) * (rows - 1.0)
    return _Linear(dev.layer_ms * k, dev.embed_ms * k, dev.head_ms * k, dev.call_ms)


def stage_memory(model: ModelShape) -> _Linear:
    return _Linear(model.layer_bytes + model.kv_bytes_per_layer, model.embed_bytes, model.head_bytes,
                   model.overhead_bytes)


def even_split(model: ModelShape, stages: int) -> list[int]:
    """Layer boundaries that give each of ``stages`` alike devices the same weights to read per
    token: the embedding is a lookup (nearly free), the last stage reads the LM head whole."""
    total = model.num_layers * model.layer_bytes + model.head_bytes
    bounds = [round(i * total / stages / model.layer_bytes) for i in range(1, stages)]
    return [min(max(b, i + 1), model.num_layers - stages + i + 1) for i, b in enumerate(bounds)]


def balanced_split(model: ModelShape, dev: DeviceProfile, stages: int) -> list[int]:
    """Layer boundaries that give each of ``stages`` devices alike ``dev`` the same time per decode
    step, by its measured costs: the busiest stage as light as it can be.  Where a device computes
    in float (no int8 dot product), the head costs less than its bytes say, and this differs from
    ``even_split``."""
    cost, layers = stage_time(dev), model.num_layers
    if not 1 <= stages <= layers:
        raise PlacementError(f"{layers} layers cannot be split into {stages} parts")

    @functools.cache
    def best(start: int, stage: int) -> tuple[float, tuple[int, ...]]:
        """The least busiest time of stages ``stage``.. holding layers ``start``.., and their boundaries."""
        if stage == stages - 1:
            return cost.at(layers - start, stage == 0, True), ()
        options = []
        for end in range(start + 1, layers - (stages - stage - 1) + 1):
            rest, bounds = best(end, stage + 1)
            options.append((max(cost.at(end - start, stage == 0, False), rest), (end, *bounds)))
        return min(options)

    return list(best(0, 0)[1])


def aggregate_tok_s(steps: Sequence[tuple[DeviceProfile, int, bool, bool]], network_ms: float, users: int) -> float:
    """Tokens per second of ``users`` streams, packed into the best number of groups in flight (as
    the relay keeps them): with G groups of users/G rows, a cycle in which every stream makes a
    token takes the longer of one group's trip (every stage's packed step, and the network) and the
    busiest stage's G steps.  ``steps``: each stage's (device, layers, first, last)."""
    best = 0.0
    for groups in range(1, min(users, RelayOptions.max_groups) + 1):
        ms = [stage_time(dev, users / groups).at(layers, first, last) for dev, layers, first, last in steps]
        cycle = max(sum(ms) + network_ms, groups * max(ms, default=0.0))
        if cycle > 0:
            best = max(best, users * 1000.0 / cycle)
    return best


def _price(model: ModelShape, fleet: Fleet, stages: Sequence[tuple[str, str, int, int]], *, objective: str,
           users: int, solve_ms: float = 0.0, fed: bool = False) -> tuple[Plan, list[str]]:
    """The plan's predictions; problems (unknown devices, missing RTTs) are returned, not raised.
    ``fed``: stage 0 is on a node, fed its token ids by the coordinator (one more hop)."""
    problems, planned, network, steps = [], [], 0.0, []
    memory = stage_memory(model)
    for i, (node, device, start, end) in enumerate(stages):
        first, last = i == 0, i == len(stages) - 1
        dev = fleet.device(node, device)
        layers = max(end - start, 0)
        ms = stage_time(dev).at(layers, first, last) if dev else 0.0
        if dev:
            steps.append((dev, layers, first, last))
        planned.append(PlannedStage(node, device, start, end, ms=ms, memory_bytes=int(memory.at(layers, first, last)),
                                    memory_limit_bytes=dev.memory_bytes if dev else 0))
        if i or fed:
            try:
                network += fleet.rtt(stages[i - 1][0] if i else fleet.coordinator, node)
            except PlacementError as e:
                problems.append(str(e))
    token_ms = sum(s.ms for s in planned) + network
    plan = Plan(model=model.name, stages=planned, objective=objective, users=users, network_ms=network,
                token_ms=token_ms, tok_s=1000.0 / token_ms if token_ms > 0 else 0.0,
                aggregate_tok_s=aggregate_tok_s(steps, network, users),
                solve_ms=solve_ms, fed=fed)
    return plan, problems


def evaluate(model: ModelShape, fleet: Fleet, stages: Sequence[tuple[str, str, int, int]], *,
             users: int = 1, fed: bool = False) -> Evaluation:
    """Predictions and problems of a hand-drawn chain of (node, device, start, end); never raises.

    A node may appear in several stages here (one machine running a local multi-stage chain).
    ``fed``: stage 0 runs on a node, which the coordinator feeds (a copy of the model on a node).
    """
    stages = [tuple(s) for s in stages]
    plan, problems = _price(model, fleet, stages, objective="manual", users=max(users, 1), fed=fed)
    if users < 1:
        problems.append("users must be at least 1 (priced for 1)")
    known = set(fleet.nodes)
    if not stages:
        problems.append("the plan has no parts")
    expected = 0
    for i, ((node, device, start, end), planned) in enumerate(zip(stages, plan.stages)):
        dev = fleet.device(node, device)
        if node not in known:
            problems.append(f"{part_name(i)}: unknown node {node}")
        elif dev is None:
            problems.append(f"{part_name(i)}: node {node} has no device {device}")
        elif not dev.supported:
            problems.append(f"{part_name(i)}: {device} on {node} cannot run a part")
        elif planned.memory_bytes > dev.memory_bytes:
            problems.append(f"{part_name(i)} on {node} {device} needs {gb(planned.memory_bytes)} but has "
                            f"{gb(dev.memory_bytes)}: {gb(planned.memory_bytes - dev.memory_bytes)} over")
        if end <= start:
            problems.append(f"{part_name(i)} has no layers")
        if start > expected:
            problems.append(f"gap: {layer_span(expected, start)} in no part")
        elif start < expected:
            problems.append(f"overlap: {layer_span(start, min(expected, end))} of {part_name(i)} already in an "
                            f"earlier part")
        expected = max(expected, end)
    if stages and expected < model.num_layers:
        problems.append(f"gap: {layer_span(expected, model.num_layers)} in no part")
    elif expected > model.num_layers:
        problems.append(f"{layer_span(model.num_layers, expected)} past the model's {model.num_layers} layers")
    if stages and fleet.coordinator is not None and not fed and stages[0][0] != fleet.coordinator:
        problems.append(f"{part_name(0)} must run on the coordinator {fleet.coordinator}, not {stages[0][0]}")
    return Evaluation(plan=plan, problems=problems)


# ---- tensor-parallel ranks ----


def exchanges(num_layers: int) -> int:
    """Exchanges a token costs tensor-parallel ranks: after each layer's attention and MLP, and
    the head's vocabulary (``engine.transport.mesh``)."""
    return 2 * num_layers + 1


def exchange_cost(model: ModelShape, ranks: int, link_ms: float, slowest_ms: float) -> float:
    """What a token's exchanges cost tensor-parallel ranks beyond the slowest rank's compute, in ms:
    the ids out and the result back (a round trip, ``link_ms``); at every exchange the part's one way
    over the link (half a round trip), its bytes at the link's rate (``LINK_MBIT``: the survey
    measures round trips, not rates), and what the exchange itself costs the ranks in Python (the
    graph's call into the collective, sealing, the socket's send and receive: ``EXCHANGE_FIXED_MS``);
    and the waits for the slower rank, whose share of the compute between two exchanges is never
    quite equal to the other's (the OS, caches, the shares' shapes: ``EXCHANGE_WAIT``).  The
    vocabulary's gather sends a few bytes a row (each rank's top-1): only its trip and its fixed cost."""
    # two ranks swap their parts at once, one crossing each way; more send theirs to rank 0 and
    # take the sum back, one after another over its link
    crossings = 1 if ranks <= 2 else 2 * (ranks - 1)
    bytes_ms = crossings * model.exchange_bytes / (LINK_MBIT * 125.0)  # 1 Mbit/s is 125 bytes a ms
    count = exchanges(model.num_layers)
    return (link_ms + count * (link_ms / 2 + EXCHANGE_FIXED_MS) + (count - 1) * bytes_ms
            + slowest_ms * EXCHANGE_WAIT)


def price_ranks(model: ModelShape, fleet: Fleet, units: Sequence[tuple[str, str]], *, users: int = 1) -> Evaluation:
    """Prices ``units`` ((node, device), rank 0 first: the coordinator) as tensor-parallel ranks:
    each holds the embedding and 1/R of every layer and of the head, and a token takes the slowest
    rank's share plus its exchanges over the slowest link (``exchange_cost``).  A rank chain runs one
    forward at a time (``engine.runtime.relay.ranks``), so users take turns: the aggregate is one
    user's rate.  Never raises; problems are listed."""
    ranks, L = len(units), model.num_layers
    problems, planned, slowest, link = [], [], 0.0, 0.0
    if ranks < 2 or ranks > model.max_ranks:
        problems.append(f"{model.name} is not split into {ranks} tensor-parallel ranks (its export allows "
                        f"{model.max_ranks})")
    memory = stage_memory(model)
    need = int((memory.per_layer * L + memory.last) / max(ranks, 1) + memory.first + memory.fixed)
    for i, (node, device) in enumerate(units):
        dev = fleet.device(node, device)
        if dev is None:
            problems.append(f"rank {i}: node {node} has no device {device}")
            ms = 0.0
        else:
            cost = stage_time(dev)
            ms = (cost.per_layer * L + cost.last) / ranks + cost.first + cost.fixed
            if not dev.supported:
                problems.append(f"rank {i}: {device} on {node} cannot run a part")
            if need > dev.memory_bytes:
                problems.append(f"rank {i} on {node} {device} needs {gb(need)} but has {gb(dev.memory_bytes)}")
        if i:
            try:
                link = max(link, fleet.rtt(units[0][0], node))
            except PlacementError as e:
                problems.append(str(e))
        slowest = max(slowest, ms)
        planned.append(PlannedStage(node, device, 0, L, i, ms=ms, memory_bytes=need,
                                    memory_limit_bytes=dev.memory_bytes if dev else 0))
    if fleet.coordinator is not None and units and units[0][0] != fleet.coordinator:
        problems.append(f"rank 0 must run on the coordinator {fleet.coordinator}, not {units[0][0]}")
    network = exchange_cost(model, ranks, link, slowest)
    token_ms = slowest + network
    tok_s = 1000.0 / token_ms if token_ms > 0 else 0.0
    plan = Plan(model=model.name, stages=planned, objective="throughput", users=max(users, 1), network_ms=network,
                token_ms=token_ms, tok_s=tok_s, aggregate_tok_s=tok_s, solve_ms=0.0, ranks=True)
    return Evaluation(plan=plan, problems=problems)


# ---- the solver ----

def solve(model: ModelShape, fleet: Fleet, *, objective: str = "latency", users: int = 1,
          pins: Sequence[Pin] = (), max_stages: int | None = None, time_limit_s: float = 30) -> Plan:
    """The best chain for ``objective``, with the fewest stages among equals; a node runs one stage.

    "latency" minimises one user's time per token; "throughput" maximises the aggregate tok/s of
    ``users`` micro-batched streams.  Raises Infeasible with the reason when nothing fits.  On the
    time limit, the best plan found so far is returned.
    """
    if objective not in OBJECTIVES:
        raise PlacementError(f"unknown objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
    if users < 1:
        raise PlacementError("users must be at least 1")
    if max_stages is not None and max_stages < 1:
        raise PlacementError("max_stages must be at least 1")
    if model.num_layers < 1:
        raise PlacementError(f"model {model.name} has no layers")
    began = time.perf_counter()
    units = _usable_units(model, fleet)
    pins = _check_pins(model, fleet, units, list(pins), max_stages)
    nodes = list(dict.fromkeys(u.node for u in units))
    rtt = {(a, b): fleet.rtt(a, b) for a in nodes for b in nodes if a != b}
    _check_memory(model, fleet, units, max_stages)
    # throughput: a program for each number of groups in flight, the best of their chains kept
    counts = range(1, min(users, RelayOptions.max_groups) + 1) if objective == "throughput" else [1]
    chains = [chain for groups in counts for chain in _Program.placement(
        model, fleet, units, nodes, rtt, objective, users, pins, max_stages, groups).run(time_limit_s / len(counts))]
    solve_ms = (time.perf_counter() - began) * 1000
    plans = [_price(model, fleet, chain, objective=objective, users=users, solve_ms=solve_ms)[0] for chain in chains]
    best = min(plans, key=_objective_value)
    for fewer in plans:  # HiGHS keeps the objective within its tolerances; the cost model has the last word
        if len(fewer.stages) < len(best.stages) and _objective_value(fewer) <= _objective_value(best) * (1 + 1e-9):
            best = fewer
    return best


def one_layer_on(model: ModelShape, fleet: Fleet, plan: Plan, node: str) -> tuple[Plan, DeviceProfile] | None:
    """The plan with one layer moved onto ``node`` (the last of a stage, placed right after it), the
    move and device that do best by the plan's objective; None where no move fits."""
    chain = [(s.node, s.device, s.start, s.end) for s in plan.stages]
    one_layer = stage_memory(model).at(1, False, False)
    best = None
    for dev in [d for d in fleet.devices if d.node == node and d.supported and d.memory_bytes >= one_layer]:
        for i, (n, device, start, end) in enumerate(chain):
            if end - start < 2:
                continue
            moved = [*chain[:i], (n, device, start, end - 1), (node, dev.device, end - 1, end), *chain[i + 1:]]
            priced = evaluate(model, fleet, moved, users=plan.users)
            if priced.ok:
                alt = dataclasses.replace(priced.plan, objective=plan.objective)
                if best is None or _objective_value(alt) < _objective_value(best[0]):
                    best = (alt, dev)
    return best


SLOWER = 1.5  # a left-out device this many times the plan's slowest per layer is called slower, not a hop's cost


def left_out(model: ModelShape, fleet: Fleet, plan: Plan) -> dict[str, str]:
    """Why each node the plan does not use is left out, in words, keyed by node: none of its
    devices can run a stage or hold one layer, or its best single layer (``one_layer_on``) would
    make the plan's objective worse by the same cost model."""
    return {node: detail for node, (_, detail) in _left_out(model, fleet, plan).items()}


def left_out_plainly(model: ModelShape, fleet: Fleet, plan: Plan) -> dict[str, str]:
    """``left_out``'s reasons in an office admin's words, without the figures."""
    return {node: words for node, (words, _) in _left_out(model, fleet, plan).items()}


def _left_out(model: ModelShape, fleet: Fleet, plan: Plan) -> dict[str, tuple[str, str]]:
    """(plain words, the reason with its figures) for each node the plan leaves out."""
    used = {s.node for s in plan.stages}
    one_layer = stage_memory(model).at(1, False, False)
    slowest = max((d.layer_ms for s in plan.stages if (d := fleet.device(s.node, s.device))), default=0.0)
    reasons = {}
    for node in fleet.nodes:
        if node in used:
            continue
        devices = [d for d in fleet.devices if d.node == node and d.supported]
        if not devices:
            reasons[node] = ("it cannot run this model", "none of its devices can run a part")
            continue
        if all(d.memory_bytes < one_layer for d in devices):
            reasons[node] = ("it has too little free memory for any part of the model",
                             f"it cannot hold one layer ({gb(one_layer)} with the runtime; "
                             f"{gb(max(d.memory_bytes for d in devices))} free)")
            continue
        if plan.ranks:
            reasons[node] = ("two PCs sharing every step were faster, and the pair with this one was predicted "
                             "slower", "tensor-parallel ranks pair this PC with one other PC, and the pair "
                             "with it was predicted slower")
            continue
        moved = one_layer_on(model, fleet, plan, node)
        if moved is None:
            reasons[node] = ("no part of the model fits there, or its network was not measured",
                             "no layer of the plan can move there (its memory, or its round trips are not measured)")
            continue
        alt, dev = moved
        words = ("it is slower than the PCs in use: a part there would slow every answer"
                 if dev.layer_ms > slowest * SLOWER else "one more network hop costs more than it saves")
        speed = f"its {dev.device} takes {dev.layer_ms:.2f} ms a layer (the plan's slowest {slowest:.2f} ms)"
        if plan.objective == "latency":
            reasons[node] = (words, f"{speed}; with one layer there a token would take {alt.token_ms:.2f} ms "
                                    f"instead of {plan.token_ms:.2f}")
        else:
            reasons[node] = (words, f"{speed}; with one layer there {plan.users} user(s) would get "
                                    f"{alt.aggregate_tok_s:.1f} tok/s instead of {plan.aggregate_tok_s:.1f}")
    return reasons


def _objective_value(plan: Plan) -> float:
    return plan.token_ms if plan.objective == "latency" else 1000.0 / plan.aggregate_tok_s


def _usable_units(model: ModelShape, fleet: Fleet) -> list[DeviceProfile]:
    seen = set()
    for d in fleet.devices:
        if (d.node, d.device) in seen:
            raise PlacementError(f"device {d.device} of node {d.node} is listed twice")
        seen.add((d.node, d.device))
    supported = [d for d in fleet.devices if d.supported]
    if not supported:
        raise Infeasible("no device in the fleet is supported")
    one_layer = stage_memory(model).at(1, False, False)
    units = [d for d in supported if one_layer <= d.memory_bytes]  # the others can never take a stage
    if not units:
        raise Infeasible(f"no supported device can hold even one layer of {model.name} ({gb(one_layer)} "
                         f"with the runtime overhead)")
    c = fleet.coordinator
    if c is not None:
        if c not in fleet.nodes:
            raise Infeasible(f"coordinator {c} is not in the fleet")
        mine = [d for d in units if d.node == c]
        if not mine:
            raise Infeasible(f"coordinator {c} has no supported device that can hold a layer")
        need = stage_memory(model).at(1, True, model.num_layers == 1)
        best = max(mine, key=lambda d: d.memory_bytes)
        if need > best.memory_bytes:
            raise Infeasible(f"coordinator {c} must run {part_name(0)} (embedding and at least one layer, "
                             f"{gb(need)}) but its {best.device} has {gb(best.memory_bytes)}")
    return units


def _check_pins(model: ModelShape, fleet: Fleet, units: list[DeviceProfile], pins: list[Pin],
                max_stages: int | None) -> list[Pin]:
    L, c = model.num_layers, fleet.coordinator
    for p in pins:
        if p.end <= p.start:
            raise Infeasible(f"a pin on node {p.node} holds no layers")
        where = f"pin of {layer_span(p.start, p.end)} on node {p.node}"
        if p.start < 0 or p.end > L:
            raise Infeasible(f"{where} lies outside the model's {layer_span(0, L)}")
        if p.node not in fleet.nodes:
            raise Infeasible(f"{where}: unknown node")
        if p.device is not None:
            dev = fleet.device(p.node, p.device)
            if dev is None:
                raise Infeasible(f"{where}: the node has no device {p.device}")
            if not dev.supported:
                raise Infeasible(f"{where}: its {p.device} cannot run a part")
            candidates = [dev]
        else:
            candidates = [d for d in fleet.devices if d.node == p.node and d.supported]
            if not candidates:
                raise Infeasible(f"{where}: the node has no supported device")
        need = stage_memory(model).at(p.end - p.start, p.start == 0, p.end == L)
        best = max(candidates, key=lambda d: d.memory_bytes)
        if need > best.memory_bytes:
            which = best.device if len(candidates) == 1 else f"largest device ({best.device})"
            raise Infeasible(f"{where} needs {gb(need)}, its {which} has {gb(best.memory_bytes)}")
        if c is not None and p.node == c and p.start != 0:
            raise Infeasible(f"{where}: the coordinator must run {part_name(0)}, from layer 0")
        if c is not None and p.node != c and p.start == 0:
            raise Infeasible(f"{where}: {part_name(0)} must run on the coordinator {c}")
    pins = sorted(pins, key=lambda p: p.start)
    for a, b in zip(pins, pins[1:]):
        if b.start < a.end:
            raise Infeasible(f"pins overlap: {layer_span(a.start, a.end)} on {a.node} and "
                             f"{layer_span(b.start, b.end)} on {b.node}")
    for a, b in itertools.combinations(pins, 2):
        if a.node == b.node:
            raise Infeasible(f"node {a.node} is pinned twice; each node runs at most one part")
    edges = [0, *(x for p in pins for x in (p.start, p.end)), L]
    gaps = [(a, b) for a, b in zip(edges[::2], edges[1::2]) if a < b]
    free = {u.node for u in units} - {p.node for p in pins}
    if len(gaps) > len(free):
        shown = "; ".join(layer_span(a, b) for a, b in gaps)
        raise Infeasible(f"the pins leave {len(gaps)} unpinned range(s) ({shown}) but only {len(free)} other "
                         f"node(s) can take a part")
    if max_stages is not None and len(pins) + len(gaps) > max_stages:
        raise Infeasible(f"the pins need at least {len(pins) + len(gaps)} parts but at most {max_stages} are allowed")
    return pins


def _check_memory(model: ModelShape, fleet: Fleet, units: list[DeviceProfile], max_stages: int | None) -> None:
    per_node: dict[str, int] = {}
    for u in units:  # a node runs one stage, so it brings its largest device
        per_node[u.node] = max(per_node.get(u.node, 0), u.memory_bytes - model.overhead_bytes)
    held = sum(sorted(per_node.values(), reverse=True)[:max_stages])
    need = stage_memory(model).at(model.num_layers, True, True) - model.overhead_bytes
    if need > held:
        extra = f" after {gb(model.overhead_bytes)} runtime overhead per part" if model.overhead_bytes else ""
        limit = f" in at most {max_stages} part{'s' if max_stages != 1 else ''}" if max_stages is not None else ""
        raise Infeasible(f"the model needs {gb(need)} (weights + KV) but the fleet's usable devices hold "
                         f"{gb(held)}{extra}{limit}")


class _Program:
    """A mixed-integer program built column by column and row by row, then handed to HiGHS."""

    def __init__(self):
        self.lb, self.ub, self.integer, self.cost = [], [], [], []
        self.rows, self.cols, self.vals, self.lo, self.hi = [], [], [], [], []
        self.stage_cols: list[int] = []  # the columns that count stages, for the tie-break
        self.decode = None

    def var(self, lb: float, ub: float, integer: bool = False, cost: float = 0.0) -> int:
        self.lb.append(lb)
        self.ub.append(ub)
        self.integer.append(int(integer))
        self.cost.append(cost)
        return len(self.lb) - 1

    def row(self, terms: Iterable[tuple[int, float]], lo: float, hi: float) -> None:
        r = len(self.lo)
        for col, val in terms:
            self.rows.append(r)
            self.cols.append(col)
            self.vals.append(val)
        self.lo.append(lo)
        self.hi.append(hi)

    @classmethod
    def placement(cls, model: ModelShape, fleet: Fleet, units: list[DeviceProfile], nodes: list[str],
                  rtt: dict[tuple[str, str], float], objective: str, users: int, pins: list[Pin],
                  max_stages: int | None, groups: int = 1) -> _Program:
        """The pins cut the layers into blocks: each pin a block of its own node, each range between
        pins a block for any number of free nodes.  Per unit u = (node, device) and block b, x[u,b]
        runs a stage of c[u,b] layers there; f[u] / g[u]: the stage is the first / the last.
        e[n,m]: node m follows node n, within a block or into the next one.  q[n], the node's place
        in the chain, rises along every used arc, which rules out cycles.

        Layers cost the same at any depth, so only the first and last stage and the hops depend on the
        order, and the layer counts of each block add up to its length without reference to q.
        """
        p, L, inf = cls(), model.num_layers, np.inf
        memory = stage_memory(model)
        rows = users / groups if objective == "throughput" else 1.0  # each group's packed streams
        times = [stage_time(u, rows) for u in units]
        scale = 1.0 / _typical_objective(model, units, rows)  # objective near 1
        ms = scale if objective == "latency" else 0.0
        pin_of = {pin.node: pin for pin in pins}
        edges = sorted({0, L, *(x for pin in pins for x in (pin.start, pin.end))})
        blocks = list(zip(edges, edges[1:]))
        pinned = {(pin.start, pin.end): pin for pin in pins}
        B = len(blocks)

        def cap(u: DeviceProfile) -> int:
            return min(L, int((u.memory_bytes - memory.fixed) // memory.per_layer)) if memory.per_layer else L

        def fits(u: DeviceProfile, b: int) -> bool:
            pin = pinned.get(blocks[b])
            if pin is None:
                return u.node not in pin_of
            return pin.node == u.node and pin.device in (None, u.device)

        x, c = {}, {}  # (unit index, block) -> column, only where the unit may run in that block
        for i, u in enumerate(units):
            for b, (lo, hi) in enumerate(blocks):
                if fits(u, b):
                    x[i, b] = p.var(0, 1, True, ms * times[i].fixed)
                    c[i, b] = p.var(0, min(cap(u), hi - lo), True, ms * times[i].per_layer)
        f = [p.var(0, 1 if (i, 0) in x else 0, True, ms * tm.first) for i, tm in enumerate(times)]
        g = [p.var(0, 1 if (i, B - 1) in x else 0, True, ms * tm.last) for i, tm in enumerate(times)]
        e = {(a, b): p.var(0, 1, True, ms * rtt[a, b]) for a in nodes for b in nodes if a != b}
        q = {n: p.var(0, len(nodes) - 1) for n in nodes}
        p.stage_cols = list(x.values())
        on_node = {n: [key for key in x if units[key[0]].node == n] for n in nodes}
        in_block = {(n, b): [x[key] for key in on_node[n] if key[1] == b] for n in nodes for b in range(B)}

        for (i, b), col in x.items():
            u, (lo, hi) = units[i], blocks[b]
            if blocks[b] in pinned:
                p.row([(c[i, b], 1), (col, -(hi - lo))], 0, 0)
            else:
                p.row([(c[i, b], 1), (col, -min(cap(u), hi - lo))], -inf, 0)
                p.row([(c[i, b], 1), (col, -1)], 0, inf)  # a stage holds at least one layer
            m = u.memory_bytes  # the row is divided by it to keep coefficients near 1
            terms = [(c[i, b], memory.per_layer / m), (col, memory.fixed / m - 1)]
            if b == 0:
                terms.append((f[i], memory.first / m))
            if b == B - 1:
                terms.append((g[i], memory.last / m))
            p.row(terms, -inf, 0)
        for i in range(len(units)):
            if (i, 0) in x:
                p.row([(f[i], 1), (x[i, 0], -1)], -inf, 0)
            if (i, B - 1) in x:
                p.row([(g[i], 1), (x[i, B - 1], -1)], -inf, 0)
        p.row([(col, 1) for col in f], 1, 1)
        p.row([(col, 1) for col in g], 1, 1)
        for b, (lo, hi) in enumerate(blocks):
            p.row([(c[key], 1) for key in c if key[1] == b], hi - lo, hi - lo)
        if max_stages is not None:
            p.row([(col, 1) for col in x.values()], 1, max_stages)
        if fleet.coordinator is not None:
            p.row([(f[i], 1) for i, u in enumerate(units) if u.node == fleet.coordinator], 1, 1)
        for n in nodes:
            X = [(x[key], 1) for key in on_node[n]]
            F = [(f[i], 1) for i, u in enumerate(units) if u.node == n]
            G = [(g[i], 1) for i, u in enumerate(units) if u.node == n]
            p.row(X, 1 if n in pin_of else 0, 1)
            # one arc in unless first, one arc out unless last
            p.row([*((e[m, n], 1) for m in nodes if m != n), *F, *((col, -1) for col, _ in X)], 0, 0)
            p.row([*((e[n, m], 1) for m in nodes if m != n), *G, *((col, -1) for col, _ in X)], 0, 0)
        for (a, b), col in e.items():
            p.row([(q[b], 1), (q[a], -1), (col, -len(nodes))], 1 - len(nodes), inf)
            for k in range(B if B > 1 else 0):  # a in block k: b in block k or k + 1
                nxt = in_block[b, k + 1] if k + 1 < B else []
                p.row([(col, 1), *((v, 1) for v in in_block[a, k]), *((v, -1) for v in in_block[b, k] + nxt)],
                      -inf, 1)
        if objective == "throughput":  # the cycle: >= a group's trip and >= each stage's steps of all groups
            t = p.var(0, inf, cost=scale)
            stage = {n: [(c[key], times[key[0]].per_layer) for key in on_node[n]]
                     + [(x[key], times[key[0]].fixed) for key in on_node[n]]
                     + [(f[i], times[i].first) for i, u in enumerate(units) if u.node == n]
                     + [(g[i], times[i].last) for i, u in enumerate(units) if u.node == n] for n in nodes}
            for n in nodes:  # a row per node, summed over its devices (one is used): tighter than per device
                p.row([(t, 1), *((col, -groups * v) for col, v in stage[n])], 0, inf)
            hops = [(col, rtt[ab]) for ab, col in e.items()]
            p.row([(t, 1), *((col, -v) for n in nodes for col, v in stage[n]), *((col, -v) for col, v in hops)],
                  0, inf)

        def decode(sol: np.ndarray) -> list[tuple[str, str, int, int]]:
            used = {units[i].node: (i, round(sol[c[i, b]])) for (i, b), col in x.items() if sol[col] > 0.5}
            node = next(units[i].node for i, col in enumerate(f) if sol[col] > 0.5)
            chain, at = [], 0
            for _ in used:
                i, count = used[node]
                chain.append((node, units[i].device, at, at + count))
                at += count
                node = next((m for m in nodes if m != node and sol[e[node, m]] > 0.5), None)
                if node is None:
                    break
            return chain

        p.decode = decode
        return p

    def run(self, time_limit_s: float) -> list[list[tuple[str, str, int, int]]]:
        """The optimal chain, then (if HiGHS finds one in the time left) one with fewer stages and an
        equal objective: a second solve, as a small cost per stage would trade objective for stages."""
        deadline = time.perf_counter() + time_limit_s
        a = csr_array((self.vals, (self.rows, self.cols)), shape=(len(self.lo), len(self.lb)))
        cost = np.array(self.cost)
        best = self._milp(cost, a, self.lo, self.hi, time_limit_s)
        if best.status == 2:
            raise Infeasible("no placement fits the devices' memory with these pins and coordinator "
                             "(the solver proved every combination infeasible)")
        if best.x is None:
            raise PlacementError(f"the solver found no placement within {time_limit_s:g} s: {best.message}")
        chains = [self.decode(best.x)]
        stages = round(best.x[self.stage_cols].sum())
        left = deadline - time.perf_counter()
        if best.status == 0 and stages > 1 and left > 0:
            count = np.zeros(len(cost))
            count[self.stage_cols] = 1
            rows = vstack([a, csr_array(cost[None, :]), csr_array(count[None, :])])
            fewer = self._milp(count, rows, [*self.lo, -np.inf, 1],
                               [*self.hi, best.fun + 1e-9 * max(abs(best.fun), 1.0), stages - 1], left)
            if fewer.x is not None:
                chains.append(self.decode(fewer.x))
        return chains

    def _milp(self, cost, a, lo, hi, time_limit_s: float):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # mip_abs_gap reaches HiGHS verbatim, with a warning
            return milp(cost, integrality=np.array(self.integer), bounds=Bounds(self.lb, self.ub),
                        constraints=LinearConstraint(a, lo, hi),
                        options={"time_limit": time_limit_s, "mip_rel_gap": MIP_REL_GAP, "mip_abs_gap": 0.0})


def _typical_objective(model: ModelShape, units: list[DeviceProfile], rows: float) -> float:
    """The median device running the whole model for a step of ``rows`` streams: only a scale."""
    ms = sorted(stage_time(u, rows).at(model.num_layers, True, True) for u in units)[len(units) // 2]
    return ms if ms > 0 else 1.0


def simulated_fleet(n_nodes: int, seed: int) -> Fleet:
    """A random office: every PC has a CPU, most an integrated GPU, some an NPU (not all supported);
    PCs sit on two switches, so round trips within a switch are shorter than across."""
    rng = random.Random(seed)
    devices, switch = [], {}
    for k in range(n_nodes):
        node = f"pc{k:02d}"
        switch[node] = rng.random() < 0.5
        cpu_ms = rng.uniform(2.0, 8.0)
        devices.append(DeviceProfile(node, "CPU", int(rng.uniform(4, 16) * GB), cpu_ms, cpu_ms * rng.uniform(3, 6),
                                     embed_ms=rng.uniform(0.05, 0.2), prefill_layer_ms=cpu_ms * 4))
        if rng.random() < 0.7:
            gpu_ms = rng.uniform(0.5, 3.0)
            devices.append(DeviceProfile(node, "GPU.0", int(rng.uniform(2, 8) * GB), gpu_ms,
                                         gpu_ms * rng.uniform(3, 6), embed_ms=rng.uniform(0.05, 0.2),
                                         prefill_layer_ms=gpu_ms * 2))
        if rng.random() < 0.3:
            npu_ms = rng.uniform(1.0, 4.0)
            devices.append(DeviceProfile(node, "NPU", int(rng.uniform(1, 4) * GB), npu_ms, npu_ms * 5,
                                         supported=rng.random() < 0.5))
    names = list(switch)
    rtt = {(a, b): rng.uniform(0.2, 0.6) if switch[a] == switch[b] else rng.uniform(0.8, 2.0)
           for i, a in enumerate(names) for b in names[i + 1:]}
    return Fleet(devices=devices, rtt_ms=rtt)
