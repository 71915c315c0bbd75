"""The ``layout`` part of ``fleet bench sim``: N PCs serving U users through the layout the solver
chooses (``engine.fleet.layout``: one chain, copies of the model, both, or two
tensor-parallel ranks) against N times one PC serving U/N users, and against one PC serving all U.

This process is PC 1 and the office's nodes the others, each PC under the same cgroup CPU quota
(so three PCs fit this machine's two cores), the one-PC baseline too: it is this process alone.
The fleet is surveyed as ``fleet profile`` does it, the solver lays the model out for each number of
users, each distinct layout is deployed once (``deploy_layout``) behind the chat service the app
would open over it (``Replicas`` for several copies), and the layouts and the baseline take turns
wave by wave, ``runs`` times.  The ratio per user count is the fleet's aggregate tok/s over N times
the baseline's at U/N users (issue 56's bar: 0.85), where U divides among the PCs, and the fleet's over
one PC's at U users (the fleet is never slower than one PC: 0.97).
"""

from __future__ import annotations

import os

from engine.config import FleetAccess, Scheduling, ShardOptions
from engine.bench.harness import NO_HOOKS, Hooks
from engine.bench.sim.shared import DeployedWorkers, Sim, chat_wave, close_all, medians, take_turns
from engine.errors import FleetError
from engine.export.exporter import export_model
from engine.fleet.sim import netns
from engine.fleet.deploy import deploy_layout, rank_count
from engine.fleet.layout import solve_layout
from engine.fleet.placement import Fleet, ModelShape
from engine.fleet.plans import layout_stages
from engine.fleet.sim.office import NodeSpec, Office
from engine.fleet.survey import readable, survey
from engine.runtime.decode.replicas import Replicas
from engine.runtime.decode.service import ChatService
from engine.runtime.stages.chain import LocalChain

COORDINATOR = "coordinator"
ONE_PC = "ours, one PC"
OFFICES = ((2, None, (1, 2, 4, 8)), (3, 0.6, (3, 6)))  # PCs, CPU quota of each, user counts


def check(sim: Sim) -> None:
    counts = sorted({u for _, _, users in OFFICES for u in users})
    if sim.users and not set(sim.users) & set(counts):
        raise FleetError(f"fleet bench sim's layout serves {', '.join(map(str, counts))} users, "
                         f"none of {', '.join(map(str, sim.users))}")


def run(sim: Sim, hooks: Hooks) -> tuple[list[dict], dict, dict]:
    """Each of ``OFFICES`` with any of the users asked for: this machine (PC 1) and the others under
    the office's quota, the second on the other core, the third on either."""
    rows, ratios, settings = [], {}, {}
    cores = sim.cores
    for pcs, quota, counts in OFFICES:
        if sim.users and not (counts := tuple(u for u in counts if u in sim.users)):
            continue
        specs = [NodeSpec(f"pc{i + 2}", cpus=str(cores[1]) if i == 0 else f"{cores[0]},{cores[1]}",
                          cpu_quota=quota, rate_mbit=1000.0) for i in range(pcs - 1)]
        with Office(specs, access=sim.access, root=sim.root / f"layout{pcs}", log=sim.log) as office:
            layout_rows, layout_ratios, notes = compare_layout(
                office, sim.model, key=sim.key, weights=sim.weights, tokens=sim.tokens, users=counts, runs=sim.runs,
                core=cores[0], quota=quota, log=sim.log, hooks=hooks)
        rows += layout_rows
        ratios |= layout_ratios
        settings[f"layout, {pcs} PCs"] = {
            "pcs": f"this machine (PC 1) and {pcs - 1} more, " + (f"{quota} of a core each" if quota else
                                                                  "one core each") + ", 1 Gbit/s",
            "users": list(counts), **notes}
    return rows, ratios, settings


def fleet_name(pcs: int) -> str:
    return f"ours, solver's layout on {pcs} PCs"


def compare_layout(office: Office, model: str, *, key: bytes, weights: str, tokens: int, users: tuple[int, ...],
                   runs: int, core: int, quota: float | None, log, hooks: Hooks = NO_HOOKS
                   ) -> tuple[list[dict], dict, dict]:
    """Rows per server and user count (medians over ``runs`` waves), the ratios against N x one PC
    at U/N users and against one PC at U, and notes: each layout the solver chose, in words."""
    pcs = len(office.nodes) + 1
    here = netns.make_cgroup(f"{office.tag}-{COORDINATOR}", None, str(core), quota)
    home = [folder.parent for folder in here]
    opened: list = []
    notes: dict[str, list[str]] = {}
    try:
        netns.move_into(here, os.getpid())  # before anything compiles: OpenVINO sizes its threads then
        doc = survey(model, [node.agent for node in office.nodes.values()], access=FleetAccess(key),
                     local_node=COORDINATOR, weights=weights, progress=lambda p: log(p.text))
        shape, fleet = ModelShape.from_json(doc["model"]), Fleet.from_json(doc["fleet"])
        layouts = {u: solve_layout(shape, fleet, users=u) for u in users}
        services: dict[tuple, object] = {}  # one deployment per distinct layout
        serving, ranks = {}, {}
        for u, layout in layouts.items():
            notes[f"layout, {u} user(s)"] = readable(layout.explain(), doc["nodes"]).splitlines()
            plan, *others = layout.plans
            copies = layout_stages({"plan": plan.to_json(), "replicas": [p.to_json() for p in others],
                                    "nodes": doc["nodes"]})
            ranks[u] = rank_count(copies[0])
            placed = tuple(tuple((s.node, s.device, s.start, s.end, s.rank) for s in c) for c in copies)
            if placed not in services:
                services[placed] = _serve(model, copies, key=key, weights=weights, streams=max(users), opened=opened)
            serving[u] = services[placed]
        for line in (line for lines in notes.values() for line in lines):
            log(line)
        one = ChatService(LocalChain(export_model(model, stages=1, weights=weights).folders),
                          scheduling=Scheduling(streams=max(users)), prefix_cache=False)
        opened.append(one)
        for service in [one, *services.values()]:  # warm every copy: first compiles, first pages of the weights
            chat_wave(service, max(2, len(getattr(service, "services", ()))), tokens)
        alone = set(users) | {u // pcs for u in users if u % pcs == 0}  # one PC at U and at U/N
        waves = sorted([(fleet_name(pcs), u) for u in users] + [(ONE_PC, u) for u in alone], key=lambda w: w[1])
        samples = take_turns(waves, lambda key: chat_wave(one if key[0] == ONE_PC else serving[key[1]], key[1], tokens),
                             runs, log, hooks)
    finally:
        close_all(opened, log)
        netns.move_into(home, os.getpid())
        netns.delete_cgroup(here)
    rows = [{"part": "layout", "server": name, "users": u, "pcs": pcs if name != ONE_PC else 1, **medians(got),
             "copies": len(layouts[u].plans) if name != ONE_PC else 1,
             "ranks": ranks[u] if name != ONE_PC else 1}
            for (name, u), got in samples.items()]
    tok = {(r["server"], r["users"]): r["tok_s"] for r in rows}
    ratios = {}
    for u in users:
        if u % pcs == 0:
            ratios[f"{pcs} PCs, {u} users: solver's layout / ({pcs} x one PC at {u // pcs})"] = round(
                tok[fleet_name(pcs), u] / (pcs * tok[ONE_PC, u // pcs]), 3)
        ratios[f"{pcs} PCs, {u} user(s): solver's layout / one PC at {u}"] = round(
            tok[fleet_name(pcs), u] / tok[ONE_PC, u], 3)
    return rows, ratios, notes


def _serve(model: str, copies, *, key: bytes, weights: str, streams: int, opened: list):
    """The chat service the app would open over a deployed layout (its closing queued in ``opened``)."""
    deployment, chains = deploy_layout(model, copies, access=FleetAccess(key), shard=ShardOptions(weights=weights))
    opened.append(DeployedWorkers(deployment, key))
    services = [ChatService(chain, scheduling=Scheduling(streams=streams), prefix_cache=False) for chain in chains]
    service = services[0] if len(services) == 1 else Replicas(services)
    opened.append(service)
    return service
