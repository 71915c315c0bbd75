"""The ``ranks`` part of ``fleet bench sim``: two PCs compute every layer of one user's token
together, each reading half the weights.

This process, pinned to one core, is PC 1 and holds rank 0 of a 2-rank export (``fleet export
--ranks 2``); PC 2 (the other core, its link at 1 Gbit/s) runs rank 1 as a ``fleet worker``.
Each layer's partial sums cross the link twice a token (``engine.transport.mesh``).  Against
it, PC 1 alone in each configuration the ``draft`` part measures (no speculation, prompt lookup, the draft
model, the hybrid), the best of which is the bar, and PC 1 alone with the ranks' own weight format.
The ranks run plain and with the hybrid drafter, and beside them runs what the fleet itself deploys
for one user (``_fleets_choice``: surveyed, placed by the solver, started through PC 2's agent),
plain.  The ranks take the one PC's format where its blocks split (``rankcut``).  All are the chat
service; they take turns wave by
wave (64 greedy tokens a user, a different prompt each, no prompt cache) with llama.cpp on the same
GGUF, whole on PC 1 and split over both PCs by RPC as in the office comparison (``office``), and
whole on PC 1 with the draft model's GGUF drafting (``-md``, llama.cpp's own speculative decoding),
as ours has its draft: the faster of llama.cpp's two on one PC is its best.
"""

from __future__ import annotations

from pathlib import Path

from engine.config import FleetAccess, Scheduling, ShardOptions
from engine.bench.harness import NO_HOOKS, Hooks
from engine.bench.llamacpp import LlamaCppUnavailable, LlamaServer
from engine.bench.parity import llamacpp_gguf
from engine.bench.sim.draft import ONE_PC
from engine.bench.sim.office import LLAMA_ONE, LLAMA_SPLIT
from engine.bench.sim.shared import (TLS, DeployedWorkers, RpcServer, Sim, chat_wave, llama_wave, messages,
                                     on_pc1, wave_rows)
from engine.export.exporter import export_model, rank_folder
from engine.export.rankcut import ranks_problem
from engine.fleet.deploy import deploy_layout
from engine.fleet.layout import fastest_for_one
from engine.fleet.placement import Fleet, ModelShape, solve
from engine.fleet.plans import layout_stages
from engine.fleet.sim.office import NodeSpec, Office
from engine.fleet.survey import readable, survey
from engine.launch import fleet_command
from engine.manifest import load_manifest
from engine.runtime.decode.service import ChatService
from engine.runtime.decode.speculative import draft_format
from engine.runtime.decode.tokenizer import ChatTokenizer
from engine.runtime.relay.ranks import RankChain
from engine.runtime.stages.chain import LocalChain
from engine.session import drafter_factory

USERS = (1,)
PORT = 7312  # rank 1's worker for the plain chain; the next port its worker for the hybrid one
RANKS = "ours, 2 PCs as tensor-parallel ranks"
RANKS_HYBRID = "ours, 2 PCs as tensor-parallel ranks, hybrid draft"
FLEET = "ours, the fleet's own choice for one user"
LLAMA_ONE_DRAFT = "llama.cpp, one PC, its draft model"
COORDINATOR = "coordinator"


def check(sim: Sim) -> None:
    if sim.gguf is None:
        sim.log(f"the ranks run without llama.cpp's rows: {sim.gguf_missing}")


def run(sim: Sim, hooks: Hooks) -> tuple[list[dict], dict, dict]:
    """PC 2 on the second core at 1 Gbit/s beside this process (PC 1, the first core)."""
    users = tuple(sim.users or USERS)
    spec = NodeSpec("pc2", cpus=str(sim.cores[1]), rate_mbit=1000.0)
    with Office([spec], access=sim.access, root=sim.root / "ranks", log=sim.log) as office:
        rows, ratios, notes = compare_ranks(office, sim.model, sim.draft, key=sim.key, weights=sim.weights,
                                            tokens=sim.tokens, users=users, runs=sim.runs, core=sim.cores[0],
                                            log=sim.log, hooks=hooks, gguf=sim.gguf)
    return rows, ratios, {"ranks": {"draft_model": sim.draft, "users": list(users), **notes}}


def ranks_format(spec, weights: str) -> str:
    """The format the ranks take: the one PC's own where its blocks split (``rankcut``), else int4."""
    return weights if ranks_problem(spec, 2, weights) is None else "int4"


def compare_ranks(office: Office, model: str, draft_model: str, *, key: bytes, weights: str, tokens: int,
                  users: tuple[int, ...] = USERS, runs: int, core: int, log, hooks: Hooks = NO_HOOKS,
                  gguf: Path | None = None) -> tuple[list[dict], dict, dict]:
    """Rows per configuration and user count (medians over ``runs`` waves), the ratios of the ranks
    to the best configuration of PC 1 alone, to PC 1 in the ranks' format and (``gguf``: the model's
    GGUF) to llama.cpp's split, and what was run."""
    pc2 = office.nodes[next(iter(office.nodes))]
    whole = export_model(model, stages=1, weights=weights).folders
    manifest = load_manifest(whole[0])
    whole_format, same_format = manifest.weights, ranks_format(manifest.spec, manifest.weights)
    ranks = export_model(model, weights=same_format, ranks=2).out
    draft = export_model(draft_model, stages=1, **draft_format(weights)).folders
    alike = f"ours, one PC, no speculation, {same_format}"
    with on_pc1(core, log) as opened:
        def service(chain, factory) -> ChatService:
            opened.append(ChatService(chain, scheduling=Scheduling(streams=max(users), k="auto"),
                                      drafters=factory(chain), prefix_cache=False))
            return opened[-1]

        services = {name: service(LocalChain(whole), lambda chain, kind=kind: drafter_factory(kind, chain, draft))
                    for kind, name in ONE_PC.items()}
        if same_format != whole_format:
            alone = export_model(model, stages=1, weights=same_format).folders
            services[alike] = service(LocalChain(alone), lambda chain: drafter_factory("none", chain))
        for i, (name, kind) in enumerate(((RANKS, "none"), (RANKS_HYBRID, "hybrid"))):
            office.spawn(pc2.spec.name, fleet_command(
                "worker", "--shard", str(rank_folder(ranks, 1)), "--listen", f"0.0.0.0:{PORT + i}",
                "--device", "CPU", "--tls" if TLS else "--no-tls", "--fleet-key-file", str(office.key_file)),
                office.root / f"rank1-{kind}.log")
            chain = RankChain(rank_folder(ranks, 0), [f"{pc2.ip}:{PORT + i}"], access=FleetAccess(key),
                              connect_timeout_s=300)
            opened.append(chain)
            services[name] = service(chain, lambda c, kind=kind: drafter_factory(kind, c, draft))
        chain, chosen = _fleets_choice(office, model, key=key, weights=weights, opened=opened, log=log)
        services[FLEET] = service(chain, lambda c: drafter_factory("none", c))
        waves = {name: lambda u, svc=svc: chat_wave(svc, u, tokens) for name, svc in services.items()}
        if gguf is not None:
            prompts = [ChatTokenizer(whole[0]).chat_ids(m).reshape(-1).tolist() for m in messages(max(users))]
            layers = load_manifest(whole[0]).spec.num_layers
            opened.append(LlamaServer(gguf, slots=max(users), threads=1, log=log))
            waves[LLAMA_ONE] = lambda u, server=opened[-1]: llama_wave(server, prompts, u, tokens)
            try:  # on PC 1's core as the one above, its draft on the same thread
                opened.append(LlamaServer(gguf, slots=max(users), threads=1, draft=llamacpp_gguf(draft_model),
                                          log=log))
                waves[LLAMA_ONE_DRAFT] = lambda u, server=opened[-1]: llama_wave(server, prompts, u, tokens)
            except LlamaCppUnavailable as exc:
                log(f"the ranks run without {LLAMA_ONE_DRAFT!r}: {exc}")
            rpc = RpcServer(office, pc2.spec.name, office.root)
            opened.append(rpc)
            # the second half of the layers and the output head on PC 2, as the office splits them
            opened.append(LlamaServer(gguf, slots=max(users), threads=1, rpc=rpc.address,
                                      gpu_layers=layers - layers // 2 + 1, log=log))
            waves[LLAMA_SPLIT] = lambda u, server=opened[-1]: llama_wave(server, prompts, u, tokens)
        for wave in waves.values():  # warm: first compiles, first shapes
            wave(1)
        rows = wave_rows(waves, users, runs, log, hooks)
    tok = {(r["server"], r["users"]): r["tok_s"] for r in rows}
    ratios = {}
    for u in users:
        best = max(ONE_PC.values(), key=lambda name: tok[name, u])
        for name in (RANKS, RANKS_HYBRID, FLEET):
            ratios[f"{u} user(s): {name} / the best of one PC ({best})"] = round(tok[name, u] / tok[best, u], 3)
        plain = alike if (alike, u) in tok else ONE_PC["none"]
        ratios[f"{u} user(s): {RANKS} / {plain}"] = round(tok[RANKS, u] / tok[plain, u], 3)
        for peer in (LLAMA_SPLIT, LLAMA_ONE):
            if (peer, u) in tok:
                ratios[f"{u} user(s): {RANKS} / {peer}"] = round(tok[RANKS, u] / tok[peer, u], 3)
        llama = [peer for peer in (LLAMA_ONE, LLAMA_ONE_DRAFT) if (peer, u) in tok]
        if len(llama) == 2:  # llama.cpp's best of one PC: with its draft model or without
            peer = max(llama, key=lambda name: tok[name, u])
            for name in (RANKS, RANKS_HYBRID, FLEET, best):
                ratios[f"{u} user(s): {name} / llama.cpp's best of one PC ({peer})"] = round(
                    tok[name, u] / tok[peer, u], 3)
    notes = {"one_pc_weights": whole_format, "rank_weights": same_format, "fleet_choice": chosen,
             "pcs": "this machine (PC 1, one core) holds rank 0 and runs every one-PC configuration; PC 2 "
                    "(one core, 1 Gbit/s) rank 1"}
    return rows, ratios, notes


def _fleets_choice(office: Office, model: str, *, key: bytes, weights: str, opened: list, log):
    """What the fleet itself deploys for one user, as ``fleet up --nodes`` does: this PC and PC 2
    surveyed, the solver's fastest plan for one user (``layout.fastest_for_one``: a chain, the model
    whole here, or two ranks), deployed through PC 2's agent.  Its chain (closed with ``opened``),
    and the plan in words."""
    doc = survey(model, [node.agent for node in office.nodes.values()], access=FleetAccess(key), local_node=COORDINATOR,
                 weights=weights, progress=lambda p: log(p.text))
    shape, fleet = ModelShape.from_json(doc["model"]), Fleet.from_json(doc["fleet"])
    plan = fastest_for_one(shape, fleet, solve(shape, fleet, objective="latency"))
    chosen = readable(plan.explain(), doc["nodes"]).splitlines()
    for line in chosen:
        log(line)
    deployment, (chain,) = deploy_layout(model, layout_stages({"plan": plan.to_json(), "nodes": doc["nodes"]}),
                                         access=FleetAccess(key), shard=ShardOptions(weights=weights))
    opened.extend([DeployedWorkers(deployment, key), chain])
    return chain, chosen

