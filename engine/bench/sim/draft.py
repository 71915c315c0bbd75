"""The ``draft`` part of ``fleet bench sim``: a second PC makes one user faster by drafting for the
first.

This process, pinned to one core, is PC 1 and holds the target whole.  PC 2 (the other core, its link
at 1 Gbit/s) runs a draft server with the draft model (``fleet worker --role draft``), which drafts
ahead while PC 1 verifies (``engine.runtime.decode.remotedraft``).  Against it, PC 1 alone in each of
its configurations: no speculation, prompt lookup, the draft model here, and the hybrid of both (K
auto each), the best of which is the bar.  All are the chat service on their own copy of the target;
they take turns wave by wave (64 greedy tokens a user, a different prompt each, no prompt cache).
"""

from __future__ import annotations

import time
from pathlib import Path

from engine.bench.harness import NO_HOOKS, Hooks
from engine.bench.sim.shared import TLS, Sim, chat_wave, on_pc1, wave_rows
from engine.config import Scheduling
from engine.errors import FleetError
from engine.export.exporter import export_model
from engine.fleet.sim.office import NodeSpec, Office
from engine.launch import fleet_command
from engine.runtime.decode.remotedraft import DraftLink
from engine.runtime.decode.service import ChatService
from engine.runtime.decode.speculative import draft_format
from engine.runtime.stages.chain import LocalChain
from engine.session import drafter_factory

USERS = (1, 2, 4)
PORT = 7311
DRAFTING_PC = "ours, 2 PCs (PC 2 drafts)"
ONE_PC = {"none": "ours, one PC, no speculation", "lookup": "ours, one PC, prompt lookup",
          "model": "ours, one PC, draft model here", "hybrid": "ours, one PC, hybrid draft here"}


def run(sim: Sim, hooks: Hooks) -> tuple[list[dict], dict, dict]:
    """PC 2 on the second core at 1 Gbit/s beside this process (PC 1, the first core)."""
    users = tuple(sim.users or USERS)
    spec = NodeSpec("pc2", cpus=str(sim.cores[1]), rate_mbit=1000.0)
    with Office([spec], access=sim.access, root=sim.root / "draft", log=sim.log) as office:
        rows, ratios = compare_draft(office, sim.model, sim.draft, weights=sim.weights, tokens=sim.tokens,
                                     users=users, runs=sim.runs, core=sim.cores[0], log=sim.log, hooks=hooks)
    return rows, ratios, {"draft": {"draft_model": sim.draft, "users": list(users),
                                    "pcs": "this machine (PC 1, one core) holds the target; PC 2 (one core, "
                                           "1 Gbit/s) the draft model"}}


def open_draft_server(office: Office, pc: str, folder: Path, target, log,
                      wait_s: float = 120.0) -> DraftLink:
    """Starts a draft server for ``folder`` on the simulated PC ``pc``; the link to it, once it answers."""
    node = office.nodes[pc]
    log_file = office.root / f"draft-server-{pc}.log"
    proc = office.spawn(pc, fleet_command("worker", "--role", "draft", "--shard", str(folder), "--listen",
                                          f"0.0.0.0:{PORT}", "--device", "CPU", "--tls" if TLS else "--no-tls",
                                          "--fleet-key-file", str(office.key_file)), log_file)
    deadline = time.monotonic() + wait_s
    while True:
        if proc.poll() is not None:
            raise FleetError(f"the draft server on {pc} exited (code {proc.returncode}): {log_file.read_text()[-500:]}")
        try:
            return DraftLink(f"{node.ip}:{PORT}", office.access, target)
        except FleetError as exc:
            if time.monotonic() > deadline:
                raise FleetError(f"the draft server on {pc} did not answer in {wait_s:.0f} s: {exc}") from None
            time.sleep(0.5)


def compare_draft(office: Office, model: str, draft_model: str, *, weights: str, tokens: int,
                  users: tuple[int, ...] = USERS, runs: int, core: int, log, hooks: Hooks = NO_HOOKS
                  ) -> tuple[list[dict], dict]:
    """Rows per configuration and user count (medians over ``runs`` waves), and each user count's
    ratio of the drafting PC to the best configuration of PC 1 alone."""
    pc2 = next(iter(office.nodes))
    target = export_model(model, stages=1, weights=weights).folders
    draft = export_model(draft_model, stages=1, **draft_format(weights)).folders
    with on_pc1(core, log) as opened:
        def service(factory) -> ChatService:
            chain = LocalChain(target)
            opened.append(ChatService(chain, scheduling=Scheduling(streams=max(users), k="auto"),
                                      drafters=factory(chain), prefix_cache=False))
            return opened[-1]

        link = open_draft_server(office, pc2, draft[0], LocalChain(target).manifest, log)
        opened.append(link)
        services = {name: service(lambda chain, kind=kind: drafter_factory(kind, chain, draft))
                    for kind, name in ONE_PC.items()}
        services[DRAFTING_PC] = service(lambda chain: drafter_factory("remote", chain, remote=link))
        for svc in services.values():  # warm: first compiles, first shapes
            chat_wave(svc, 1, 16)
        rows = wave_rows({name: lambda u, svc=svc: chat_wave(svc, u, tokens) for name, svc in services.items()},
                         users, runs, log, hooks)
    tok = {(r["server"], r["users"]): r["tok_s"] for r in rows}
    ratios = {}
    for u in users:
        best = max(ONE_PC.values(), key=lambda name: tok[name, u])
        ratios[f"{u} user(s): {DRAFTING_PC} / the best of one PC ({best})"] = round(
            tok[DRAFTING_PC, u] / tok[best, u], 3)
    return rows, ratios
