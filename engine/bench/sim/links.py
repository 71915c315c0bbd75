"""The ``links`` part of ``fleet bench sim``: what the link between PCs costs a fleet.

For each link speed (default 100 Mbit/s and 1 Gbit/s, tc tbf on every PC's cable), two PCs of one
core each: the time to deploy a 2-stage split onto a PC that holds nothing yet (the shard's
transfer, then the whole deployment: transfer, worker start, connection), and the time from a PC's
cable being cut mid-reply (link down: packets vanish, no reset) to the reply's next token, carried
on by the other PC (the silence deadline, the probe of the lost node, moving its layers: sending the
shard, starting a worker, prefilling again; when the node was declared lost and when the new chain
was placed are in the row too), with whether the reply stayed token-identical (greedy, exact mode).
Then the same with a hot standby of the stage on the other PC (``engine.fleet.standby``), for a
worker killed (a reset: no deadline to wait) and for the cable cut: a switch, no redeployment, and
no prefill (the standby was sent a copy of the stage's input all along,
``engine.runtime.relay.mirror``).  What the standby's copies cost while nothing fails, at the fastest
link: one reply's decode tok/s with and without them, alternated ``runs`` times, over the model whole
on pc1 with its standby on pc2, fed from this process pinned to pc1's core (this machine has no
third core: a stage here would share pc2's, which a real office's PCs never do).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

from engine.config import FleetAccess, Scheduling, ShardOptions
from engine.bench.harness import Hooks, interleave
from engine.bench.sim.shared import Sim, on_pc1
from engine.errors import FleetError
from engine.files import write_json
from engine.fleet.control import ControlClient
from engine.fleet.deploy import LOCAL, deploy
from engine.fleet.failover import Failover
from engine.fleet.placement import DeviceProfile, Fleet
from engine.fleet.sim.office import NodeSpec, Office
from engine.fleet.span import StageSpan
from engine.fleet.survey import HERE
from engine.runtime.decode.service import ChatService
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.stage import compile_config

MESSAGES = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
CUT_AFTER = 8  # tokens of the reply before the cable is cut


def check(sim: Sim) -> None:
    if sim.tokens <= CUT_AFTER + 4:
        raise FleetError(f"fleet bench sim needs replies of more than {CUT_AFTER + 4} tokens, not {sim.tokens}")


def run(sim: Sim, hooks: Hooks) -> tuple[list[dict], dict, dict]:
    """Per link rate: deploying onto an empty PC, and a cable cut mid-reply carried on by the other PC."""
    alone = ChatService(LocalChain(sim.split.folders, config=compile_config("exact")), scheduling=Scheduling(streams=1))
    try:
        want = alone.submit(MESSAGES, sim.tokens, ignore_eos=True).wait(600).tokens
    finally:
        alone.close()
    shard_bytes = sum(p.stat().st_size for p in sim.split.folders[1].iterdir())
    rows = []
    for r, rate in enumerate(sim.rates):
        hooks.step(r, len(sim.rates), f"{rate:g} Mbit/s")
        specs = [NodeSpec(f"pc{i + 1}", cpus=str(sim.cores[i]), rate_mbit=rate) for i in range(2)]
        with Office(specs, access=sim.access, root=sim.root / f"office-{r}", log=sim.log) as office:
            rows += _measure(office, sim, shard_bytes, rate, want)
    ratios = {f"{row['rate_mbit']:g} Mbit/s {row['measure']} s": row["seconds"] for row in rows if "seconds" in row}
    ratios.update({f"{row['rate_mbit']:g} Mbit/s decode tok/s, standby copies / none": row["ratio"]
                   for row in rows if "ratio" in row})
    return rows, ratios, {"rates_mbit": list(sim.rates), "cut_after_tokens": CUT_AFTER}


def _measure(office: Office, sim: Sim, shard_bytes: int, rate: float, want: list[int]) -> list[dict]:
    """The deploy row, then three losses of pc1 mid-reply: its cable cut with no standby (its layers
    move to pc2), and, with a hot standby on pc2, its worker killed (a reset) and its cable cut."""
    model, split, shape, key, weights, log = sim.model, sim.split, sim.shape, sim.key, sim.weights, sim.log
    pc1 = office.nodes["pc1"]
    half = split.stages[1].layers[0]
    stages = [StageSpan(LOCAL, "CPU", 0, half), StageSpan(pc1.agent, "CPU", half, shape.num_layers)]
    profile = _profile(office, shape.to_json(), key)
    profile_file = sim.root / f"profile-{rate:g}.json"
    write_json(profile_file, profile)
    sent: list[float] = []

    def progress(event) -> None:
        if event.step == "send":
            sent.append(time.perf_counter())

    started = time.perf_counter()
    deployment, chain = deploy(model, stages, access=FleetAccess(key),
                               shard=ShardOptions(weights=weights, mode="exact"), progress=progress)
    deploy_s = time.perf_counter() - started
    send_s = sent[-1] - sent[0] if len(sent) > 1 else 0.0
    rows = [{"measure": "deploy", "rate_mbit": rate, "shard_mb": round(shard_bytes / 2**20, 1),
             "send_s": round(send_s, 2), "seconds": round(deploy_s, 2),
             "send_mbit_s": round(shard_bytes * 8 / 1e6 / send_s, 1) if send_s else None}]
    log(f"{rate:g} Mbit/s: deployed in {deploy_s:.2f} s (the {shard_bytes / 2**20:.1f} MB shard in {send_s:.2f} s)")
    rows.append(_lose_pc1(office, sim, deployment, chain, profile, rate, want, "cut", "link loss to next token"))
    for how, measure in (("kill", "worker killed to next token, standby"), ("cut", "link loss to next token, standby")):
        deployment, chain = deploy(model, stages, access=FleetAccess(key),
                                   shard=ShardOptions(weights=weights, mode="exact"), standbys=True,
                                   planned={"profile": str(profile_file)})
        if deployment.standby_for(1) is None:
            chain.close()
            deployment.stop(FleetAccess(key))
            raise FleetError("no standby was placed on pc2")
        rows.append(_lose_pc1(office, sim, deployment, chain, profile, rate, want, how, measure))
    if rate == max(sim.rates):
        rows.append(_copies_cost(office, sim, rate, profile_file))
    return rows


def _copies_cost(office: Office, sim: Sim, rate: float, profile_file) -> dict:
    """One reply's decode tok/s over the model whole on pc1, with its standby on pc2 sent copies and
    without, alternated ``sim.runs`` times (the module's docstring)."""
    whole = [StageSpan(office.nodes["pc1"].agent, "CPU", 0, sim.shape.num_layers)]
    deployment, chain = deploy(sim.model, whole, access=FleetAccess(sim.key),
                               shard=ShardOptions(weights=sim.weights, mode="exact"),
                               standbys=True, planned={"profile": str(profile_file)})
    chain.close()
    records = {"copies": deployment, "none": dataclasses.replace(deployment, standbys=[])}

    def decode_tok_s(name: str, _round: int) -> float:
        service = ChatService(records[name].chain(FleetAccess(sim.key)), scheduling=Scheduling(streams=1))
        try:
            reply = service.submit(MESSAGES, sim.tokens, ignore_eos=True).wait(600)
        finally:
            service.close()
        if reply.error:
            raise FleetError(f"a reply over the deployment failed: {reply.error}")
        return reply.decode_tok_s

    try:
        if deployment.standby_for(0) is None:
            raise FleetError("no standby was placed on pc2")
        with on_pc1(sim.cores[0], sim.log):
            speeds = interleave(decode_tok_s, records, sim.runs)
    finally:
        deployment.stop(FleetAccess(sim.key))
    best = {name: max(values) for name, values in speeds.items()}
    sim.log(f"{rate:g} Mbit/s: decode with the standby's copies {best['copies']:.2f} tok/s, "
            f"without {best['none']:.2f} (best of {sim.runs})")
    return {"measure": "decode tok/s, standby copies / none", "rate_mbit": rate,
            "copies_tok_s": round(best["copies"], 2), "none_tok_s": round(best["none"], 2),
            "ratio": round(best["copies"] / best["none"], 3)}


def _lose_pc1(office: Office, sim: Sim, deployment, chain, profile: dict, rate: float, want: list[int], how: str,
              measure: str) -> dict:
    """A reply during which pc1, which runs stage 1, is lost (``how``: its cable ``cut``, or its
    worker ``kill``ed): the time from the loss to the reply's next token, and what failover did."""
    key, log = sim.key, sim.log
    pc1, pc2 = office.nodes["pc1"], office.nodes["pc2"]
    events: list[str] = []
    heard: list[tuple[float, str]] = []  # when each failover event came

    def on_event(text: str) -> None:
        events.append(text)
        heard.append((time.perf_counter(), text))

    failover = Failover(deployment, profile, access=FleetAccess(key), on_event=on_event, chain=chain)
    service = ChatService(chain, scheduling=Scheduling(streams=1), recover=failover.recover)
    worker = deployment.workers[0]
    lost_at: list[float] = []
    resumed: list[float] = []
    lock = threading.Lock()

    def lose() -> None:
        if how == "cut":
            office.partition("pc1")
        else:
            with ControlClient(pc1.agent, FleetAccess(key)) as agent:
                pid = next(w["pid"] for w in agent.status()["workers"] if w["id"] == worker["worker"])
            os.kill(pid, signal.SIGKILL)  # the agent runs in pc1's namespace, but pids are the host's

    def on_text(piece, count):
        with lock:
            if count >= CUT_AFTER and not lost_at:
                lost_at.append(time.perf_counter())
                lose()
            elif lost_at and not resumed and count > CUT_AFTER:
                resumed.append(time.perf_counter())

    try:
        reply = service.submit(MESSAGES, sim.tokens, on_text=on_text, ignore_eos=True).wait(600)
    finally:
        office.reconnect("pc1")
        service.close()
        failover.deployment.stop(FleetAccess(key))
        deployment.stop(FleetAccess(key))
    if reply.error or not resumed:
        raise FleetError(f"the reply did not carry on after pc1 was lost ({how}): {reply.error}; {events}")
    carry_on = resumed[0] - lost_at[0]
    moved = failover.deployment.placement[1].node == pc2.agent
    kept = service.failovers["kept"] > 0
    log(f"{rate:g} Mbit/s: {measure}: {carry_on:.2f} s "
        f"({'identical' if reply.tokens == want else 'DIFFERENT'}; "
        f"{'carried on from the caches' if kept else 'prefilled again'}; "
        + "; ".join(f"{t - lost_at[0]:.2f} s: {e}" for t, e in heard) + ")")
    lost = next((t for t, e in heard if e.startswith("node pc1 lost") or "stopped answering" in e), None)
    placed = next((t for t, e in heard if e.startswith("placed:")), None)
    return {"measure": measure, "rate_mbit": rate, "seconds": round(carry_on, 2),
            "lost_after_s": round(lost - lost_at[0], 2) if lost else None,
            "placed_after_s": round(placed - lost_at[0], 2) if placed else None,
            "rerouted": reply.rerouted, "moved_to_other_pc": moved, "kept_caches": kept,
            "identical": reply.tokens == want}


def _profile(office: Office, model_doc: dict, key: bytes) -> dict:
    """The profile failover re-plans from: the PCs' node ids and addresses, their devices alike (where
    the layers go is what is measured here, not the solver)."""
    nodes = {"coordinator": {"name": HERE, "address": LOCAL}}
    for node in office.nodes.values():
        with ControlClient(node.agent, FleetAccess(key)) as client:
            nodes[client.status()["node"]["node_id"]] = {"name": node.name, "address": node.agent}
    devices = [DeviceProfile(n, "CPU", 4 << 30, layer_ms=1.0, head_ms=2.0) for n in nodes]
    rtt = {(a, b): 0.3 for a in nodes for b in nodes if a < b}
    return {"model": model_doc, "nodes": nodes, "fleet": Fleet(devices=devices, rtt_ms=rtt,
                                                                 coordinator="coordinator").to_json()}
