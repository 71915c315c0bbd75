"""The engine calls the app makes: open a chat service, export, benchmark, and the fleet's calls
(node status, round trips, survey, deploy).  Every method blocks and is meant for a worker thread
(``fleetgui.workers``); none touches Qt.  The window takes a backend as a parameter, so tests can
hand it another one.

Chats open through ``engine.session``, like ``fleet serve`` and ``fleet generate``: by default the
embedded local fleet (stage 0 in the app, the other stages in workers of a node agent process on
loopback, which the chat service owns and stops when it closes).  Progress comes as the engine's
events (``engine.progress``).
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from engine import session
from engine.bench.registry import BENCHES
from engine.config import FleetAccess, ShardOptions
from engine.errors import FleetError
from engine.fleet.control import AgentError, ControlClient
from engine.fleet.demo import start_demo_fleet
from engine.fleet.deploy import LOCAL, default_record, deploy_layout
from engine.fleet.local_agent import own_agents
from engine.fleet.node import local_node_info, node_id
from engine.fleet.survey import survey
from engine.progress import Progress, Report, quiet
from engine.session import Launch
from fleetgui import keystore

APP_BENCHES = {name: bench for name, bench in BENCHES.items() if bench.plot}  # those the Benchmarks view offers


class EngineBackend:
    def __init__(self):
        self.on_fleet_event: Callable[[str], None] = lambda text: None  # a chat's fleet lost a node, moved layers...
        self.on_recovered: Callable[[object], None] = lambda deployment: None  # the deployment failover left
        self._lock = threading.Lock()
        self._clients: dict[str, tuple[bytes, object]] = {}  # agent address -> (key, open ControlClient)

    def pull(self, source: str, progress: Report = quiet, cancel=None) -> None:
        """Downloads a catalog model unless cached (a no-op for paths)."""
        session.pull_model(source, progress, cancel)

    def export(self, source: str, progress: Report = quiet, cancel=None, **options):
        """Pulls a catalog model when needed (reporting its progress), then exports it."""
        return session.export(source, progress=progress, cancel=cancel, **options)

    def resolve_shards(self, settings, progress: Report = quiet, cancel=None) -> list[Path]:
        """The shard set the settings name: an exported folder as it is, or the default model
        exported (or found in the cache) with the configured stages and weights."""
        return session.resolve_shards(settings.default_model, stages=settings.stages, weights=settings.weights,
                                      progress=progress, cancel=cancel)

    def open_chat(self, settings, progress: Report = quiet, cancel=None):
        """A chat service over the configured model (``engine.session.chain_kind``); None when cancelled."""
        if session.chain_kind(settings, Launch()) == "local-fleet":
            self.key_file(settings, create=True)  # through the keystore: the OS keyring keeps a copy
        return self._open(settings, Launch(), progress, cancel)

    def open_deployment(self, settings, deployment, progress: Report = quiet, cancel=None):
        """A chat service over a running deployment (``engine.fleet.deploy.Deployment``): stage 0
        here, the later stages on the fleet's workers."""
        return self._open(settings, Launch(deployment=deployment, record=default_record()), progress, cancel)

    def _open(self, settings, launch: Launch, progress: Report, cancel):
        keystore.materialise(keystore.key_path(settings), default=not settings.fleet_key_file)
        return session.open_service(settings.engine(), launch, progress, cancel,
                                    on_event=lambda text: self.on_fleet_event(text),
                                    on_recovered=lambda deployment: self.on_recovered(deployment))

    # --- the fleet -----------------------------------------------------------------------------------

    @staticmethod
    def key_file(settings, create: bool = False) -> Path:
        """The fleet key file in force; with ``create`` a missing default key is made."""
        path = keystore.key_path(settings)
        if create and not path.exists() and not settings.fleet_key_file:
            keystore.create(path)
        return path

    def node_status(self, addresses: list[str], settings, timeout_s: float = 4.0) -> dict[str, dict]:
        """Each agent's status (``ControlClient.status``), or ``{"error": reason}``; asked in parallel.
        The connections stay open between calls (a poll every few seconds would otherwise cost a
        handshake each time); a broken one is replaced once before the node counts as unreachable."""
        access = keystore.access(settings)

        def ask(address: str) -> dict:
            with self._lock:
                kept = self._clients.pop(address, None)
            if kept is not None and kept[0] != access.key:
                kept[1].close()
                kept = None
            for attempt in range(2):
                try:
                    client = kept[1] if kept is not None else ControlClient(address, access, timeout_s=timeout_s)
                    status = client.status()
                except AgentError as exc:
                    if kept is not None:
                        kept[1].close()
                        kept = None
                        continue
                    return {"error": str(exc)}
                with self._lock:
                    self._clients[address] = (access.key, client)
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

    @staticmethod
    def this_machine() -> dict:
        """This machine's facts (``engine.fleet.node.local_node_info``): the Fleet view's own row."""
        return dataclasses.asdict(local_node_info(0, "0" * 12))

    @staticmethod
    def own_agents() -> list:
        """The node agents this app started that still run (``engine.fleet.local_agent.own_agents``)."""
        return own_agents()

    def start_demo(self, settings, count: int, progress: Report = quiet):
        """``count`` demo nodes on this PC (``engine.fleet.demo``) under the fleet key in force (the
        default one made if missing); returns the ``DemoFleet``."""
        self.key_file(settings, create=True)
        return start_demo_fleet(keystore.access(settings), count, log=lambda line: progress(Progress(line)))

    def prune(self, address: str, settings) -> dict:
        """Removes the shards the node's workers do not serve (its agent's "prune")."""
        with ControlClient(address, keystore.access(settings)) as agent:
            return agent.call("prune")

    def round_trips(self, addresses: list[str], settings) -> dict[tuple[str, str], float | None]:
        """Measured round trips in ms: this machine (``"local"``) to each agent, and each agent to the
        others (its "rtt" operation); None where a pair could not reach each other."""
        access = keystore.access(settings)
        out: dict[tuple[str, str], float | None] = {}
        for address in addresses:
            peers = [a for a in addresses if a != address]
            try:
                with ControlClient(address, access, timeout_s=10) as agent:
                    out[LOCAL, address] = agent.round_trip_ms()
                    measured = agent.call("rtt", timeout_s=60, peers=peers)["rtt_ms"] if peers else {}
            except AgentError:
                out[LOCAL, address] = None
                measured = {}
            for peer in peers:
                value = measured.get(peer)
                out[address, peer] = None if value is None else float(value)
        return out

    def survey(self, model: str, agents: list[str], settings, progress: Report = quiet, cancel=None) -> dict:
        """Profiles this machine and ``agents`` for ``model`` (``engine.fleet.survey``); the document
        records the model source and weights, so a plan made from it can be deployed."""
        self.pull(model, progress, cancel)
        # no agents: no connection needs the key
        access = keystore.access(settings) if agents else FleetAccess(b"")
        devices = [d.strip() for d in settings.device.split(",") if d.strip()]
        return survey(model, agents, access=access, local_node=node_id(),
                      local_devices=list(dict.fromkeys(devices)) or ["CPU"], weights=settings.weights,
                      progress=progress, cancel=cancel)

    def deploy(self, model: str, stages: list, settings, progress: Report = quiet, cancel=None,
               planned: dict | None = None, copies: list[list] = ()):
        """Ships and starts a placement (``engine.fleet.deploy``), and the other ``copies`` of the
        model the solver chose beside it (``deploy_layout``); returns the saved ``Deployment`` (its
        chains closed: the chat opens its own).  ``planned``: its profile, objective and users."""
        deployment, chains = deploy_layout(model, [stages, *copies], access=keystore.access(settings),
                                           shard=ShardOptions.of(settings), cancel=cancel, planned=planned,
                                           progress=progress, standbys=settings.standbys)
        for chain in chains:
            chain.close()
        deployment.save()
        return deployment

    def stop_deployment(self, deployment, settings) -> list[str]:
        # a failover in the chat may have restarted or moved workers since: the record names them
        return deployment.current().stop(keystore.access(settings))

    def bench(self, name: str, settings, options: dict, hooks, log: Callable[[str], None] = print,
              service=None, deployment=None) -> dict:
        """Runs benchmark ``name`` of the app's (``APP_BENCHES``) on the current shard set; ``options``: the
        Benchmarks view's (tokens, runs, delays, draft_kind, users), of which it takes those it has.  A
        benchmark of what the chat runs on (``Bench.current``) measures ``service``, the chat's (None:
        one opened here as the chat would, and closed after), against ``deployment``'s model (None:
        the settings') on this PC alone."""
        bench = APP_BENCHES.get(name)
        if bench is None:
            raise FleetError(f"unknown benchmark {name!r}; choose one of {', '.join(APP_BENCHES)}")

        def said(progress: Progress) -> None:
            if not progress.step:
                log(progress.text)

        extra, opened = {}, None
        if bench.current and deployment is not None:  # this PC alone runs the deployed model whole
            shards, model, weights = None, deployment.model, deployment.weights
        else:
            shards, model, weights = self.resolve_shards(settings, said, hooks.cancel), settings.default_model, \
                settings.weights
        if bench.current:
            if service is None:
                service = opened = self.open_chat(settings, said, hooks.cancel)
            extra = {"service": service, "settings": settings.engine()}
        values = {"model": model, "draft": settings.draft_model or None, "weights": weights,
                  "device": settings.device.split(",")[0], "shards": shards,
                  "k": settings.k_value if settings.k_value != 0 else "auto", **options}
        if options.get("delays"):  # a benchmark with one hop delay takes the first
            values["delay_ms"] = options["delays"][0]
        try:
            return bench.run(**bench.keywords(values), **bench.app, **extra, log=log, hooks=hooks)
        finally:
            if opened is not None:
                opened.close()
