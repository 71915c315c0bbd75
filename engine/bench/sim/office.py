"""The ``office`` part of ``fleet bench sim``: what a second PC adds to one, ours and llama.cpp's.

Two simulated PCs of one core each: this process, pinned to one core, is PC 1; a network namespace
held to the other core is PC 2, its link shaped by tc tbf.  Four servers of the same GGUF are up at
once and take turns, wave by wave:

- ours on one PC: the model whole in this process;
- ours split: stage 0 here, stage 1 on PC 2 (the relay keeps one group of streams per stage in
  flight, so both PCs compute at once), the boundary where both stages take the same time per
  token on this CPU (``balanced_boundary``: an even split by weight bytes, timed);
- ours as two replicas: the model whole here, and whole on PC 2, fed its token ids from here;
  each user is routed to one copy (``Replicas``);
- llama.cpp on one PC: ``llama-server`` on PC 1's core;
- llama.cpp's split: ``llama-server`` here with ``--rpc`` to ``rpc-server`` on PC 2, which holds
  the layers our stage 1 holds (and the output head, as our last stage does);
- llama.cpp as two replicas: ``llama-server`` here and another on PC 2, the users dealt to them in
  turn, as a round-robin proxy in front of them would.

A wave is one request per user at once, a different prompt each, greedy, the end of text ignored, no
prompt cache on either side; its aggregate tok/s is every reply's tokens over the wave's wall time,
its time to first token the median of the users'.  Ours are asked through the chat service, llama.cpp
through its ``/completion`` endpoint with the very token ids our chat template made.
"""

from __future__ import annotations

from pathlib import Path

from engine.config import FleetAccess, Scheduling, ShardOptions
from engine.bench.harness import NO_HOOKS, Hooks
from engine.bench.llamacpp import LlamaServer
from engine.bench.sim.shared import (DeployedWorkers, RpcServer, Sim, chat_wave, llama_wave, messages,
                                     on_pc1, wave_rows)
from engine.fleet.deploy import LOCAL, deploy
from engine.fleet.sim.office import NodeSpec, Office
from engine.fleet.span import StageSpan
from engine.runtime.decode.replicas import Replicas
from engine.runtime.decode.service import ChatService
from engine.runtime.decode.tokenizer import ChatTokenizer
from engine.runtime.stages.chain import LocalChain

OURS_ONE, OURS_SPLIT, OURS_REPLICAS = "ours, one PC", "ours split, 2 PCs", "ours, 2 replicas (2 PCs)"
LLAMA_ONE, LLAMA_SPLIT = "llama.cpp, one PC", "llama.cpp RPC split, 2 PCs"
LLAMA_REPLICAS = "llama.cpp, 2 replicas (2 PCs)"
USERS = (1, 2, 4, 8)


def run(sim: Sim, hooks: Hooks) -> tuple[list[dict], dict, dict]:
    """PC 2 on the second core at 1 Gbit/s beside this process (PC 1, the first core)."""
    users = tuple(sim.users or USERS)
    spec = NodeSpec("pc2", cpus=str(sim.cores[1]), rate_mbit=1000.0)
    with Office([spec], access=sim.access, root=sim.root / "office", log=sim.log) as office:
        rows, ratios = compare(office, sim.model, sim.gguf, sim.whole.folders, sim.split, key=sim.key,
                               weights=sim.weights, tokens=sim.tokens, users=users, runs=sim.runs, core=sim.cores[0],
                               log=sim.log, hooks=hooks)
    return rows, ratios, {"users": list(users), "runs": sim.runs, "office": "this machine is PC 1 (one core); PC 2 "
                          "one core at 1 Gbit/s; greedy, no speculation, no prompt cache"}


def compare(office: Office, model: str, gguf: Path, whole: list[Path], split, *, key: bytes, weights: str,
            tokens: int, users: tuple[int, ...], runs: int, core: int, log, hooks: Hooks = NO_HOOKS
            ) -> tuple[list[dict], dict]:
    """Rows (one per server and user count, medians over ``runs`` waves) and the ratios that say
    whether the second PC adds up.  ``whole``: the model exported whole; ``split``: its 2-stage
    export; ``core``: PC 1's CPU (PC 2's is its node's); ``hooks``: progress, and a cancel between waves."""
    pc2 = office.nodes[next(iter(office.nodes))]
    layers = split.stages[-1].layers[1]
    half = split.stages[1].layers[0]
    prompts = [ChatTokenizer(whole[0]).chat_ids(m).reshape(-1).tolist() for m in messages(max(users))]
    with on_pc1(core, log) as opened:
        def service(chain) -> ChatService:
            opened.append(ChatService(chain, scheduling=Scheduling(streams=max(users)), prefix_cache=False))
            return opened[-1]

        def deployed(start: int):
            """Layers from ``start`` on PC 2, those before here (none: the copy on PC 2 is fed from here)."""
            here = [StageSpan(LOCAL, "CPU", 0, start)] if start else []
            stages = [*here, StageSpan(pc2.agent, "CPU", start, layers)]
            deployment, chain = deploy(model, stages, access=FleetAccess(key), shard=ShardOptions(weights=weights))
            opened.append(DeployedWorkers(deployment, key))
            return chain

        ours_one = service(LocalChain(whole))
        split_chain = deployed(half)
        ours_split = service(split_chain)
        replicas = Replicas([service(LocalChain(whole)), service(deployed(0))])
        llama_one = LlamaServer(gguf, slots=max(users), threads=1, log=log)
        opened.append(llama_one)
        rpc = RpcServer(office, pc2.name, office.root)
        opened.append(rpc)
        # the last (layers - half) layers and the output head on the RPC device, the rest here
        llama_split = LlamaServer(gguf, slots=max(users), threads=1, rpc=rpc.address,
                                  gpu_layers=layers - half + 1, log=log)
        opened.append(llama_split)
        llama_pc2 = LlamaServer(gguf, slots=max(users), threads=1, host=pc2.ip, log=log,
                                launch=lambda cmd: office.spawn(pc2.name, cmd, office.root / "llama-server-pc2.log"))
        opened.append(llama_pc2)
        waves = {OURS_ONE: lambda u: chat_wave(ours_one, u, tokens),
                 OURS_SPLIT: lambda u: chat_wave(ours_split, u, tokens),
                 OURS_REPLICAS: lambda u: chat_wave(replicas, u, tokens),
                 LLAMA_ONE: lambda u: llama_wave(llama_one, prompts, u, tokens),
                 LLAMA_SPLIT: lambda u: llama_wave(llama_split, prompts, u, tokens),
                 LLAMA_REPLICAS: lambda u: llama_wave([llama_one, llama_pc2], prompts, u, tokens)}
        for name, wave in waves.items():  # warm: first compiles, first pages of the weights
            wave(2)
        rows = wave_rows(waves, users, runs, log, hooks)
    return rows, _ratios(rows, users) | {"groups in flight on the split (most)": split_chain.most_in_flight}


def _ratios(rows: list[dict], users: tuple[int, ...]) -> dict:
    tok = {(r["server"], r["users"]): r["tok_s"] for r in rows}
    ratios = {}
    for u in users:
        best = max((LLAMA_SPLIT, LLAMA_REPLICAS), key=lambda name: tok[name, u])
        for ours in (OURS_SPLIT, OURS_REPLICAS):
            ratios[f"{u} user(s): {ours} / llama.cpp RPC split"] = round(tok[ours, u] / tok[LLAMA_SPLIT, u], 3)
            ratios[f"{u} user(s): {ours} / llama.cpp's best of 2 PCs ({best})"] = round(tok[ours, u] / tok[best, u], 3)
            ratios[f"{u} user(s): {ours} / ours one PC"] = round(tok[ours, u] / tok[OURS_ONE, u], 3)
            if u % 2 == 0 and (OURS_ONE, u // 2) in tok:  # the bar: 0.85 x 2 PCs at half the users each
                ratios[f"{u} user(s): {ours} / (2 x one PC at {u // 2})"] = round(
                    tok[ours, u] / (2 * tok[OURS_ONE, u // 2]), 3)
        ratios[f"{u} user(s): ours one PC / llama.cpp one PC"] = round(tok[OURS_ONE, u] / tok[LLAMA_ONE, u], 3)
        ratios[f"{u} user(s): llama.cpp RPC split / llama.cpp one PC"] = round(tok[LLAMA_SPLIT, u] /
                                                                               tok[LLAMA_ONE, u], 3)
    return ratios
