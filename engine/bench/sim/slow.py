"""The ``slow`` part of ``fleet bench sim``: a third PC with a fifth of a core, beside two with 0.9
of one each, must cost the fleet nothing.

This process is PC 1 (its core at 0.9: a cgroup CPU quota), PC 2 has the other core at 0.9 and
PC 3 a fifth of a core on either, so the three fit this machine's two cores.  The fleet is
surveyed as ``fleet profile`` does it (every PC's device measured under its quota, every round trip)
and the solver places the model for each number of users twice (throughput objective): over the
three PCs and over the first two.  Each distinct placement is deployed once; they take turns wave
by wave, ``runs`` times.  The report has each one's tok/s and time to first token at 1 and 4 users,
the placements, and what the solver said of PC 3 (``placement.left_out``) where it left it out;
there, the plan with PC 3's best single layer (``placement.one_layer_on``) runs too, to show what
leaving it out saves.
"""

from __future__ import annotations

import os

from engine.config import FleetAccess, Scheduling, ShardOptions
from engine.bench.harness import NO_HOOKS, Hooks
from engine.bench.sim.shared import DeployedWorkers, Sim, chat_wave, close_all, medians, take_turns
from engine.export.exporter import export_model
from engine.fleet.sim import netns
from engine.fleet.deploy import deploy
from engine.fleet.placement import Fleet, ModelShape, left_out, one_layer_on, solve
from engine.fleet.plans import placement_stages
from engine.fleet.sim.office import NodeSpec, Office
from engine.fleet.survey import readable, survey
from engine.runtime.decode.service import ChatService
from engine.runtime.stages.chain import LocalChain

USERS = (1, 4)
QUOTA, SLOW_QUOTA = 0.9, 0.2
WITH, WITHOUT = "ours, 3 PCs (one slow)", "ours, the 2 fast PCs"
FORCED = "ours, 3 PCs, one layer forced onto the slow one"
COORDINATOR = "coordinator"


def run(sim: Sim, hooks: Hooks) -> tuple[list[dict], dict, dict]:
    """PC 2 on the second core and PC 3 on either, beside this process (PC 1, the first core)."""
    cores = sim.cores
    specs = [NodeSpec("pc2", cpus=str(cores[1]), cpu_quota=QUOTA, rate_mbit=1000.0),
             NodeSpec("pc3", cpus=f"{cores[0]},{cores[1]}", cpu_quota=SLOW_QUOTA, rate_mbit=1000.0)]
    with Office(specs, access=sim.access, root=sim.root / "slow", log=sim.log) as office:
        rows, ratios, notes = compare_slow(office, sim.model, key=sim.key, weights=sim.weights, tokens=sim.tokens,
                                           runs=sim.runs, core=cores[0], log=sim.log, hooks=hooks)
    return rows, ratios, {"slow": {"users": list(USERS), "pcs": "this machine (PC 1) and PC 2 at 0.9 of a core "
                                   "each, PC 3 at 0.2, 1 Gbit/s", "objective": "throughput", **notes}}


def compare_slow(office: Office, model: str, *, key: bytes, weights: str, tokens: int, runs: int, core: int,
                 log, hooks: Hooks = NO_HOOKS) -> tuple[list[dict], dict, dict]:
    """Rows per placement and user count (medians over ``runs`` waves), the ratio with the slow PC
    to without, and notes: both placements and the solver's word on the slow PC."""
    fast, slow = office.nodes.values()
    here = netns.make_cgroup(f"{office.tag}-{COORDINATOR}", None, str(core), QUOTA)
    home = [folder.parent for folder in here]
    opened: list = []
    try:
        netns.move_into(here, os.getpid())  # before anything compiles: OpenVINO sizes its threads then
        doc = survey(model, [fast.agent, slow.agent], access=FleetAccess(key), local_node=COORDINATOR, weights=weights,
                     progress=lambda p: log(p.text))
        shape, fleet = ModelShape.from_json(doc["model"]), Fleet.from_json(doc["fleet"])
        slow_id = next(n for n, info in doc["nodes"].items() if info.get("address") == slow.agent)
        two = Fleet([d for d in fleet.devices if d.node != slow_id],
                    {pair: ms for pair, ms in fleet.rtt_ms.items() if slow_id not in pair}, COORDINATOR)
        fleets = {WITH: fleet, WITHOUT: two}
        plans = {(name, users): solve(shape, fleets[name], objective="throughput", users=users)
                 for users in USERS for name in fleets}
        for users in USERS:  # what leaving it out saves: its best single layer, where the solver gave it none
            if slow_id not in {s.node for s in plans[WITH, users].stages}:
                moved = one_layer_on(shape, fleet, plans[WITH, users], slow_id)
                if moved is not None:
                    plans[FORCED, users] = moved[0]
        notes = {}
        for (name, users), plan in plans.items():
            notes[f"{name}, {users} user(s)"] = readable(plan.explain(), doc["nodes"]).splitlines()
            if name == WITH:  # what the solver says of the slow PC
                notes[f"left out, {users} user(s)"] = [readable(f"{node}: {why}", doc["nodes"])
                                                       for node, why in left_out(shape, fleet, plan).items()]
        for line in (line for lines in notes.values() for line in lines):
            log(line)
        def placement(plan) -> tuple:
            return tuple((s.node, s.device, s.start, s.end) for s in plan.stages)

        services: dict[tuple, ChatService] = {}  # one deployment per distinct placement
        for plan in plans.values():
            if placement(plan) in services:
                continue
            if len(plan.stages) == 1:  # the whole model here: nothing to deploy
                chain = LocalChain(export_model(model, stages=1, weights=weights).folders)
            else:
                deployment, chain = deploy(model, placement_stages({"plan": plan.to_json(), "nodes": doc["nodes"]}),
                                           access=FleetAccess(key), shard=ShardOptions(weights=weights))
                opened.append(DeployedWorkers(deployment, key))
            services[placement(plan)] = ChatService(chain, scheduling=Scheduling(streams=max(USERS)),
                                                    prefix_cache=False)
            opened.append(services[placement(plan)])
        serving = {k: services[placement(plan)] for k, plan in plans.items()}
        for service in services.values():  # warm: first compiles, first pages of the weights
            chat_wave(service, 2, tokens)
        samples = take_turns(serving, lambda key: chat_wave(serving[key], key[1], tokens), runs, log, hooks)
    finally:
        close_all(opened, log)
        netns.move_into(home, os.getpid())
        netns.delete_cgroup(here)
    rows = [{"part": "slow", "server": name, "users": users, **medians(got), "stages": len(plans[name, users].stages)}
            for (name, users), got in samples.items()]
    tok = {(r["server"], r["users"]): r["tok_s"] for r in rows}
    ratios = {f"slow PC, {u} user(s): {WITH} / {WITHOUT}": round(tok[WITH, u] / tok[WITHOUT, u], 3) for u in USERS}
    ratios |= {f"slow PC, {u} user(s): {FORCED} / {WITHOUT}": round(tok[FORCED, u] / tok[WITHOUT, u], 3)
               for u in USERS if (FORCED, u) in tok}
    return rows, ratios, notes
