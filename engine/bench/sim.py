"""``fleet bench sim``: what loopback cannot measure, on a simulated office (``engine.fleet.sim``;
Linux, root): two PCs of one core each, this machine the coordinator.

For each link speed (default 100 Mbit/s and 1 Gbit/s, tc tbf on every PC's cable): the time to
deploy a 2-stage split onto a PC that holds nothing yet (the shard's transfer, then the whole
deployment: transfer, worker start, connection), and the time from a PC's cable being cut mid-reply
(link down: packets vanish, no reset) to the reply's next token, carried on by the other PC (the
silence deadline, the probe of the lost node, moving its layers: sending the shard, starting a
worker, prefilling again; when the node was declared lost and when the new chain was placed are
in the row too), with whether the reply stayed token-identical (greedy, exact mode).

Then the office comparison (``engine.bench.office``): two PCs of one core each at 1 Gbit/s, ours
and llama.cpp's, whole on one PC and split over both, at 1-8 users (a GGUF source: llama.cpp runs
the same file).  Then a model too big for one PC (``engine.bench.capped``): two PCs of ``memory_mb``
each, the solver's split against llama.cpp whole on one (paging) and llama.cpp's split.  Then a slow
PC (``engine.bench.slowpc``): two PCs of 0.9 of a core and one of a fifth, the solver's placement
with the slow one and without it.  Then one user with a second PC that drafts
(``engine.bench.draftpc``): the target on this PC, its draft model on PC 2, against the best
speculation of this PC alone.  Then one user on two PCs as tensor-parallel ranks
(``engine.bench.rankpc``): every layer's heads and MLP split between this PC and PC 2, and what
the fleet deploys for one user by itself (survey, solver, agents), against the same bar.  Then the
solver's layout (``engine.bench.copies``): on 2 PCs of one core and on 3 PCs of 0.6 of a core each,
whatever ``engine.fleet.layout`` chooses (a chain, copies of the model, both, or ranks for one user)
against N times one PC at U/N users and one PC at U.  ``parts`` picks any of ``links`` (the
deployment and cable-cut rows), ``office``, ``big``, ``slow``, ``draft``, ``ranks`` and ``layout``.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

from engine.bench import capped, draftpc, rankpc
from engine.bench import office as office_bench
from engine.bench import copies, slowpc
from engine.bench.harness import NO_HOOKS, Hooks
from engine.bench.llamacpp import LlamaCppUnavailable
from engine.bench.parity import llamacpp_gguf
from engine.bench.report import write_report
from engine.errors import FleetError
from engine.export.exporter import export_model
from engine.fleet.control import ControlClient
from engine.fleet.deploy import LOCAL, StagePlacement, deploy
from engine.fleet.failover import Failover
from engine.fleet.netns import require_root
from engine.fleet.placement import DeviceProfile, Fleet, ModelShape, even_split
from engine.fleet.profile import model_shape
from engine.fleet.sim import NodeSpec, Office
from engine.fleetkey import create_key, load_key
from engine.manifest import load_manifest
from engine.runtime.decode.service import ChatService
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.stage import compile_config

MESSAGES = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
CUT_AFTER = 8  # tokens of the reply before the cable is cut


def _profile(office: Office, model_doc: dict, key: bytes) -> dict:
    """The profile failover re-plans from: the PCs' node ids and addresses, their devices alike (where
    the layers go is what is measured here, not the solver)."""
    nodes = {"coordinator": {"name": "this machine", "address": LOCAL}}
    for node in office.nodes.values():
        with ControlClient(node.agent, key) as client:
            nodes[client.status()["node"]["node_id"]] = {"name": node.name, "address": node.agent}
    devices = [DeviceProfile(n, "CPU", 4 << 30, layer_ms=1.0, head_ms=2.0) for n in nodes]
    rtt = {(a, b): 0.3 for a in nodes for b in nodes if a < b}
    return {"model": model_doc, "nodes": nodes, "fleet": Fleet(devices=devices, rtt_ms=rtt,
                                                                 coordinator="coordinator").to_json()}


PARTS = ("links", "office", "big", "slow", "draft", "ranks", "layout")
OFFICE_USERS = (1, 2, 4, 8)
LAYOUT_OFFICES = ((2, None, (1, 2, 4, 8)), (3, 0.6, (3, 6)))  # PCs, CPU quota of each, user counts


def run_sim(model: str, *, rates=(100.0, 1000.0), tokens: int = 64, users=None, weights: str = "int4",
            runs: int = 2, parts: tuple[str, ...] = PARTS, memory_mb: int = 1000, draft: str = "qwen2.5-coder-0.5b",
            out: Path | None = None, log=print,
            hooks: Hooks = NO_HOOKS) -> dict:
    """``users``: the user counts of the office (default 1, 2, 4, 8), of the drafting PC (default 1,
    2, 4) and of the ranks (default 1), and which of the layout's offices run (those with any of them; default both)."""
    require_root("fleet bench sim")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise FleetError("fleet bench sim needs two CPUs: one for this machine, one for a simulated PC")
    if unknown := set(parts) - set(PARTS):
        raise FleetError(f"fleet bench sim measures {', '.join(PARTS)}, not {', '.join(sorted(unknown))}")
    if "links" in parts and tokens <= CUT_AFTER + 4:
        raise FleetError(f"fleet bench sim needs replies of more than {CUT_AFTER + 4} tokens, not {tokens}")
    office_users, draft_users = tuple(users or OFFICE_USERS), tuple(users or draftpc.USERS)
    rank_users = tuple(users or rankpc.USERS)
    layout_counts = sorted({u for _, _, counts in LAYOUT_OFFICES for u in counts})
    if "layout" in parts and users and not set(users) & set(layout_counts):
        raise FleetError(f"fleet bench sim's layout serves {', '.join(map(str, layout_counts))} users, "
                         f"none of {', '.join(map(str, users))}")
    gguf = None
    if {"office", "big", "ranks"} & set(parts):
        try:
            gguf = llamacpp_gguf(model)
        except LlamaCppUnavailable as exc:
            if "office" in parts or "big" in parts:
                raise FleetError(f"the office comparisons run llama.cpp on the model's GGUF: {exc}") from None
            log(f"the ranks run without llama.cpp's rows: {exc}")
    later = [part for part in ("office", "big", "slow", "draft", "ranks", "layout") if part in parts]  # a step each
    steps = len(rates) * ("links" in parts) + len(later) + 1

    def begin(part: str, what: str) -> Hooks:
        """Reports that ``part`` begins; returns the hooks whose progress fills its step."""
        index = steps - len(later) + later.index(part)
        hooks.step(index, steps, what)
        return hooks.part(index, steps)

    hooks.step(0, steps, "exporting the model")
    whole = export_model(model, stages=1, weights=weights)
    shape = ModelShape(**model_shape(load_manifest(whole.folders[0])))
    rows, ratios = [], {}
    settings = {"model": model, "weights": weights, "tokens": tokens, "shaping": "tc tbf", "parts": list(parts)}
    if "links" in parts or "office" in parts:  # the parts that run the forced 2-stage split
        by_bytes = even_split(shape, 2)
        split = export_model(model, split=by_bytes, weights=weights)
        boundary = office_bench.balanced_boundary(split.folders, shape, cores[0])
        if [boundary] != by_bytes:
            split = export_model(model, split=[boundary], weights=weights)
        settings |= {"stages": 2, "split": boundary, "pcs": "2, one core each",
                     "split_rule": f"both stages take the same measured decode time on one core here "
                                   f"(placement.balanced_split; by weight bytes: {by_bytes[0]})"}
    with tempfile.TemporaryDirectory(prefix="fleet-bench-sim-") as tmp:
        key_file = create_key(Path(tmp) / "fleet.key")
        key = load_key(key_file)
        if "links" in parts:
            rows += _links(model, split, rates, tokens, weights, shape, key_file, key, Path(tmp), log, hooks, steps)
            ratios |= {f"{row['rate_mbit']:g} Mbit/s {row['measure']} s": row["seconds"] for row in rows}
            settings |= {"rates_mbit": list(rates), "cut_after_tokens": CUT_AFTER}
        if "office" in parts:
            within = begin("office", "the office: one PC against two, ours and llama.cpp's")
            spec = NodeSpec("pc2", cpus=str(cores[1]), rate_mbit=1000.0)
            with Office([spec], key_file=key_file, root=Path(tmp) / "office", log=log) as office:
                office_rows, office_ratios = office_bench.compare(
                    office, model, gguf, whole.folders, split, key=key, weights=weights, tokens=tokens,
                    users=office_users, runs=runs, core=cores[0], log=log, hooks=within)
            for row in office_rows:
                hooks.row(row)
            rows += office_rows
            ratios |= office_ratios
            settings |= {"users": list(office_users), "runs": runs, "office": "this machine is PC 1 (one core); PC 2 "
                         "one core at 1 Gbit/s; greedy, no speculation, no prompt cache"}
        if "big" in parts:
            within = begin("big", "a model too big for one PC")
            specs = [NodeSpec(f"pc{i + 1}", memory_mb=memory_mb, cpus=str(cores[i]), rate_mbit=1000.0)
                     for i in range(2)]
            with Office(specs, key_file=key_file, root=Path(tmp) / "big", log=log) as office:
                big_rows, big_ratios, plan = capped.compare_capped(office, model, gguf, shape, key=key,
                                                                   weights=weights, runs=runs, log=log, hooks=within)
            for row in big_rows:
                hooks.row(row)
            rows += big_rows
            ratios |= big_ratios
            settings |= {"big": {"memory_mb": memory_mb, "users": list(capped.USERS), "tokens": capped.TOKENS,
                                 "pcs": "2, one core and the memory cap each, 1 Gbit/s; no swap",
                                 "placement": plan.explain().splitlines()}}
        if "slow" in parts:
            within = begin("slow", "a slow PC beside two fast ones")
            specs = [NodeSpec("pc2", cpus=str(cores[1]), cpu_quota=slowpc.QUOTA, rate_mbit=1000.0),
                     NodeSpec("pc3", cpus=f"{cores[0]},{cores[1]}", cpu_quota=slowpc.SLOW_QUOTA, rate_mbit=1000.0)]
            with Office(specs, key_file=key_file, root=Path(tmp) / "slow", log=log) as office:
                slow_rows, slow_ratios, notes = slowpc.compare_slow(office, model, key=key, weights=weights,
                                                                    tokens=tokens, runs=runs, core=cores[0], log=log,
                                                                    hooks=within)
            for row in slow_rows:
                hooks.row(row)
            rows += slow_rows
            ratios |= slow_ratios
            settings |= {"slow": {"users": list(slowpc.USERS), "pcs": "this machine (PC 1) and PC 2 at 0.9 of a "
                                  "core each, PC 3 at 0.2, 1 Gbit/s", "objective": "throughput", **notes}}
        if "draft" in parts:
            within = begin("draft", "one user, and a second PC that drafts")
            spec = NodeSpec("pc2", cpus=str(cores[1]), rate_mbit=1000.0)
            with Office([spec], key_file=key_file, root=Path(tmp) / "draft", log=log) as office:
                draft_rows, draft_ratios = draftpc.compare_draft(office, model, draft, key=key, weights=weights,
                                                                 tokens=tokens, users=draft_users, runs=runs,
                                                                 core=cores[0], log=log, hooks=within)
            for row in draft_rows:
                hooks.row(row)
            rows += draft_rows
            ratios |= draft_ratios
            settings |= {"draft": {"draft_model": draft, "users": list(draft_users),
                                   "pcs": "this machine (PC 1, one core) holds the target; PC 2 (one core, "
                                          "1 Gbit/s) the draft model"}}
        if "ranks" in parts:
            within = begin("ranks", "one user on two PCs as tensor-parallel ranks")
            spec = NodeSpec("pc2", cpus=str(cores[1]), rate_mbit=1000.0)
            with Office([spec], key_file=key_file, root=Path(tmp) / "ranks", log=log) as office:
                rank_rows, rank_ratios, notes = rankpc.compare_ranks(
                    office, model, draft, key=key, weights=weights, tokens=tokens, users=rank_users, runs=runs,
                    core=cores[0], log=log, hooks=within, gguf=gguf)
            for row in rank_rows:
                hooks.row(row)
            rows += rank_rows
            ratios |= rank_ratios
            settings |= {"ranks": {"draft_model": draft, "users": list(rank_users), **notes}}
        if "layout" in parts:
            within = begin("layout", "the solver's layout on 2 and 3 PCs")
            for pcs, quota, counts in LAYOUT_OFFICES:
                if users and not (counts := tuple(u for u in counts if u in users)):
                    continue
                specs = [NodeSpec(f"pc{i + 2}", cpus=str(cores[1]) if i == 0 else f"{cores[0]},{cores[1]}",
                                  cpu_quota=quota, rate_mbit=1000.0) for i in range(pcs - 1)]
                with Office(specs, key_file=key_file, root=Path(tmp) / f"layout{pcs}", log=log) as office:
                    layout_rows, layout_ratios, notes = copies.compare_layout(
                        office, model, key=key, weights=weights, tokens=tokens, users=counts, runs=runs,
                        core=cores[0], quota=quota, log=log, hooks=within)
                for row in layout_rows:
                    hooks.row(row)
                rows += layout_rows
                ratios |= layout_ratios
                settings |= {f"layout, {pcs} PCs": {
                    "pcs": f"this machine (PC 1) and {pcs - 1} more, " + (f"{quota} of a core each" if quota else
                                                                          "one core each") + ", 1 Gbit/s",
                    "users": list(counts), **notes}}
    return write_report("sim", rows, ratios, out, settings=settings)


def _links(model: str, split, rates, tokens: int, weights: str, shape, key_file: Path, key: bytes, tmp: Path, log,
           hooks: Hooks, steps: int) -> list[dict]:
    """Per link rate: deploying onto an empty PC, and a cable cut mid-reply carried on by the other PC."""
    cores = sorted(os.sched_getaffinity(0))
    alone = ChatService(LocalChain(split.folders, config=compile_config("exact")), streams=1)
    try:
        want = alone.submit(MESSAGES, tokens, ignore_eos=True).wait(600).tokens
    finally:
        alone.close()
    rows = []
    for r, rate in enumerate(rates):
        hooks.step(r + 1, steps, f"{rate:g} Mbit/s")
        specs = [NodeSpec(f"pc{i + 1}", cpus=str(cores[i]), rate_mbit=rate) for i in range(2)]
        with Office(specs, key_file=key_file, root=tmp / f"office-{r}", log=log) as office:
            rows += _measure(office, model, split, sum(p.stat().st_size for p in split.folders[1].iterdir()), rate,
                             want, shape, key, weights, tokens, log)
        for row in rows[-2:]:
            hooks.row(row)
    return rows


def _measure(office: Office, model: str, split, shard_bytes: int, rate: float, want: list[int], shape, key: bytes,
             weights: str, tokens: int, log) -> list[dict]:
    pc1, pc2 = office.nodes["pc1"], office.nodes["pc2"]
    half = split.stages[1].layers[0]
    stages = [StagePlacement(LOCAL, "CPU", 0, half), StagePlacement(pc1.agent, "CPU", half, shape.num_layers)]
    sent: list[float] = []

    def progress(event) -> None:
        if event.step == "send":
            sent.append(time.perf_counter())

    started = time.perf_counter()
    deployment, chain = deploy(model, stages, key=key, weights=weights, mode="exact", progress=progress)
    deploy_s = time.perf_counter() - started
    send_s = sent[-1] - sent[0] if len(sent) > 1 else 0.0
    rows = [{"measure": "deploy", "rate_mbit": rate, "shard_mb": round(shard_bytes / 2**20, 1),
             "send_s": round(send_s, 2), "seconds": round(deploy_s, 2),
             "send_mbit_s": round(shard_bytes * 8 / 1e6 / send_s, 1) if send_s else None}]
    log(f"{rate:g} Mbit/s: deployed in {deploy_s:.2f} s (the {shard_bytes / 2**20:.1f} MB shard in {send_s:.2f} s)")
    events: list[str] = []
    heard: list[tuple[float, str]] = []  # when each failover event came

    def on_event(text: str) -> None:
        events.append(text)
        heard.append((time.perf_counter(), text))

    failover = Failover(deployment, _profile(office, shape.to_json(), key), key=key, on_event=on_event, chain=chain)
    service = ChatService(chain, streams=1, recover=failover.recover)
    cut_at: list[float] = []
    resumed: list[float] = []
    lock = threading.Lock()

    def on_text(piece, count):
        with lock:
            if count >= CUT_AFTER and not cut_at:
                cut_at.append(time.perf_counter())
                office.partition("pc1")
            elif cut_at and not resumed and count > CUT_AFTER:
                resumed.append(time.perf_counter())

    try:
        reply = service.submit(MESSAGES, tokens, on_text=on_text, ignore_eos=True).wait(600)
    finally:
        office.reconnect("pc1")
        service.close()
        failover.deployment.stop(key)
        deployment.stop(key)
    if reply.error or not resumed:
        raise FleetError(f"the reply did not carry on after the cable was cut: {reply.error}; {events}")
    carry_on = resumed[0] - cut_at[0]
    moved = failover.deployment.stages[1].agent == pc2.agent
    log(f"{rate:g} Mbit/s: link lost to the reply carrying on: {carry_on:.2f} s "
        f"({'identical' if reply.tokens == want else 'DIFFERENT'}; {events[-1] if events else ''})")
    lost = next((t for t, e in heard if e.startswith("node pc1 lost")), None)
    placed = next((t for t, e in heard if e.startswith("placed:")), None)
    rows.append({"measure": "link loss to next token", "rate_mbit": rate, "seconds": round(carry_on, 2),
                 "lost_after_s": round(lost - cut_at[0], 2) if lost else None,
                 "placed_after_s": round(placed - cut_at[0], 2) if placed else None,
                 "rerouted": reply.rerouted, "moved_to_other_pc": moved, "identical": reply.tokens == want})
    return rows
