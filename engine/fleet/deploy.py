"""Deployment: from a placement to a running chain of stage workers on the fleet's node agents.

``deploy`` exports the shards a placement needs (reusing the cache), ships each to its node's agent
(chunked, resumable, verified, skipped when the node already holds it), starts the workers in chain
order and connects the coordinator, which runs stage 0 itself, or, when every stage is on a node
(a copy of the model whole on one, ``engine.fleet.layout``), only feeds the first its token ids.
If anything fails on the way (a node lost, a worker that does not start, a chain that does not
answer) every worker already started is stopped again: a failed deployment leaves no half-started
chain.  A ``Deployment`` is saved as JSON
so ``fleet generate --deployment`` and the app reuse a running chain.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import uuid
from pathlib import Path

from engine.config import DEFAULT_WEIGHTS, FleetAccess, ShardOptions, paths
from engine.errors import FleetError
from engine.files import write_json
from engine.fleet.control import AgentError, ControlClient, worker_address
from engine.fleet.span import StageSpan
from engine.fleet import standby
from engine.fleet.placement import Fleet, ModelShape
from engine.fleet.standby import Standby
from engine.manifest import layer_span, load_manifest, part_name
from engine.progress import Report, deploying, quiet
from engine.runtime.relay.ranks import RankChain
from engine.runtime.relay.remote import RemoteChain
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.stage import compile_config
from engine.runtime.stages.turns import compute_turns, machine_turns_file

LOCAL = "local"  # the coordinator's own stage in a placement's address list
AGENT = "agent"  # the key of a stage's node (its agent's address) in a deployment record


@dataclasses.dataclass
class Deployment:
    model: str
    stage0: str  # shard folder the coordinator runs (fed: where it reads the manifest and tokenizer)
    device: str  # stage 0's device
    remotes: list[str]  # worker addresses of the stages on nodes (1.., or 0.. when fed)
    workers: list[dict]  # {"agent": HOST:PORT, "worker": id, "stage": k}
    mode: str = "fast"
    weights: str = DEFAULT_WEIGHTS
    placement: list[StageSpan] = dataclasses.field(default_factory=list)  # every stage at its agent, stage 0 too
    profile: str | None = None  # the fleet profile it was planned from: failover re-plans with it
    objective: str = "latency"
    users: int = 1
    draft: dict | None = None  # a draft server on a node (``deploy_draft``): agent, worker, address, model
    replicas: list[dict] = dataclasses.field(default_factory=list)  # the other copies' records (``deploy_layout``)
    standbys: list[dict] = dataclasses.field(default_factory=list)  # ``engine.fleet.standby.Standby`` records
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)  # kept through failovers (``current``)

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "placement": [s.to_json(AGENT) for s in self.placement]}

    @classmethod
    def from_json(cls, raw: dict) -> "Deployment":
        raw = {**raw, "placement": [StageSpan.from_json(s, AGENT) for s in raw.get("placement", [])]}
        fields = dataclasses.fields(cls)
        required = [f.name for f in fields
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        return cls(**{name: raw[name] for name in required}, **{f.name: raw[f.name] for f in fields
                                                                 if f.name in raw and f.name not in required})

    @property
    def shard(self) -> ShardOptions:
        """How its shards were exported and are compiled, as far as the record keeps it: the weights, the
        mode and stage 0's device (each other stage runs on its placement's device; no precision hint
        is kept)."""
        return ShardOptions(self.weights, self.mode, device=self.device)

    @property
    def ranks(self) -> int:
        """How many tensor-parallel ranks the stages are (1: a chain of stages)."""
        return rank_count(self.placement)

    @property
    def fed(self) -> bool:
        """Whether every stage runs on a node: this machine only feeds stage 0 its token ids."""
        return bool(self.placement) and self.placement[0].node != LOCAL

    @property
    def copies(self) -> list["Deployment"]:
        """Each copy of the model on its own: this one (without the replicas and draft server it
        records) and the other replicas deployed with it.  What a copy's failover restarts."""
        return [dataclasses.replace(self, replicas=[], draft=None), *(Deployment.from_json(r) for r in self.replicas)]

    def standby_for(self, stage: int) -> Standby | None:
        """Stage ``stage``'s hot standby (``engine.fleet.standby``), if it has one."""
        return next((s for s in map(Standby.from_json, self.standbys) if s.stage == stage), None)

    @property
    def standby_addresses(self) -> list[str | None]:
        """Each remote stage's hot standby's worker address (None where it has none), in the order of
        ``remotes``: where the chain copies each stage's input (``engine.runtime.relay.mirror``)."""
        first = 0 if self.fed else 1
        spares = {s.stage: s.address for s in map(Standby.from_json, self.standbys)}
        return [spares.get(first + i) for i in range(len(self.remotes))]

    def with_copy(self, index: int, copy: "Deployment") -> "Deployment":
        """This deployment with copy ``index`` (as ``copies`` numbers them) replaced by ``copy``, a
        copy's failover's new deployment."""
        copies = self.copies
        copies[index] = dataclasses.replace(copy, replicas=[], draft=None, id=copies[index].id)
        return dataclasses.replace(copies[0], replicas=[c.to_json() for c in copies[1:]], draft=self.draft, id=self.id)

    def current(self, path: Path | None = None) -> "Deployment":
        """The record saved at ``path`` when it is this deployment's (a failover may have moved or
        restarted its workers since, see ``LiveRecord``), else this one: what to stop."""
        try:
            saved = Deployment.load(path)
        except FleetError:
            return self
        return saved if saved.id == self.id else self

    def save(self, path: Path | None = None) -> Path:
        return write_json(Path(path or default_record()), self.to_json())

    @classmethod
    def load(cls, path: Path | None = None) -> "Deployment":
        path = Path(path or default_record())
        if not path.exists():
            raise FleetError(f"no deployment recorded at {path}: run `fleet deploy` or `fleet up` first")
        try:
            return cls.from_json(json.loads(path.read_text()))
        except (KeyError, TypeError, ValueError) as exc:
            raise FleetError(f"{path} is not a deployment record ({exc})") from None

    def chain(self, access: FleetAccess, *, connect_timeout_s: float = 30.0, **kw):
        """The coordinator's chain, reaching the workers with ``access``; its stage 0 (and a draft model
        beside it) takes this computer's compute turns, with any stage worker a node agent runs here
        (``engine.runtime.stages.turns``)."""
        kw.setdefault("turns", compute_turns(machine_turns_file()))
        if not self.remotes:  # a copy whole on this machine (``deploy_layout``)
            return LocalChain([self.stage0], device=self.device, config=compile_config(self.mode),
                              isolate=kw.get("isolate", False), turns=kw["turns"])
        if self.ranks > 1:
            return RankChain(self.stage0, self.remotes, access=access, shard=self.shard,
                             connect_timeout_s=connect_timeout_s)
        return RemoteChain(self.stage0, self.remotes, access=access, shard=self.shard,
                           connect_timeout_s=connect_timeout_s, fed=self.fed,
                           standbys=self.standby_addresses, **kw)

    def stop(self, access: FleetAccess) -> list[str]:
        """Stops every worker of the deployment (its replicas' and its draft server's too); returns
        the problems met (unreachable agents)."""
        workers = [w for copy in self.copies for w in copy.workers + copy.standbys]
        return _stop_workers(workers + ([self.draft] if self.draft else []), access)


class LiveRecord:
    """A deployment being served, which its copies' failovers change: ``replace`` puts a recovered
    copy in and saves the whole record again where it was loaded from, so that whatever stops the
    deployment later (`fleet deploy --stop`, `fleet up` ending, the app) stops the workers running
    now, not the ones a failover replaced."""

    def __init__(self, deployment: Deployment, path: Path | None = None):
        self.deployment, self.path = deployment, path
        self._lock = threading.Lock()  # each copy's failover runs on its own service's thread

    def replace(self, index: int, copy: Deployment) -> None:
        with self._lock:
            self.deployment = self.deployment.with_copy(index, copy)
            if self.path is not None:
                self.deployment.save(self.path)


def _phase_of(stage: int, phase: str, progress: Report) -> Report:
    """``progress`` for an export's or a transfer's events, told as the deployment's ``phase`` of ``stage``."""
    return lambda p: progress(deploying(stage, phase, p.fraction, p.bytes_done, p.bytes_total))


def deploy_draft(draft_model: str, agent: str, *, access: FleetAccess, weights: str = DEFAULT_WEIGHTS,
                 device: str = "CPU", delay_ms: float = 0.0, progress: Report = quiet, cancel=None,
                 worker_timeout_s: float = 180.0) -> dict:
    """Exports the draft model whole, sends it to the node ``agent`` and starts a draft server there
    (``engine.runtime.decode.draftserver``): what ``Deployment.draft`` records (agent, worker, address, model).
    ``progress`` tells its phases as stage 0's."""
    from engine.export.exporter import export_model  # deferred, as in ``deploy``
    from engine.runtime.decode.speculative import draft_format

    folder = export_model(draft_model, stages=1, **draft_format(weights), cancel=cancel,
                          progress=_phase_of(0, "export", progress)).folders[0]
    try:
        with ControlClient(agent, access) as client:
            digest, _ = client.send_shard(folder, progress=_phase_of(0, "send", progress), cancel=cancel)
            progress(deploying(0, "start", 0.0))
            info = client.start_worker(digest, shard=ShardOptions(device=device), delay_ms=delay_ms,
                                       timeout_s=worker_timeout_s, role="draft")
    except AgentError as exc:
        raise FleetError(f"the draft server was not started on {agent}: {exc}") from None
    progress(deploying(0, "start", 1.0))
    return {"agent": agent, "worker": info["id"], "address": worker_address(agent, info["port"]),
            "model": draft_model}


def default_record() -> Path:
    return paths().data / "deployment.json"


def _stop_workers(workers: list[dict], access: FleetAccess) -> list[str]:
    problems = []
    for w in reversed(workers):
        try:
            with ControlClient(w["agent"], access, timeout_s=10) as agent:
                agent.stop_worker(w["worker"])
        except AgentError as exc:
            problems.append(str(exc))
    return problems


def check_placement(stages: list[StageSpan]) -> None:
    """Raises FleetError, saying why, unless ``deploy`` can run this placement: stage 0 on this machine
    (the coordinator) and every later stage on a node agent, at least one of them, or every stage on
    a node agent (this machine feeds them); the stages covering the layers from 0 once, in order (the
    model's layer count is checked at export)."""
    if not stages:
        raise FleetError("a placement needs at least one part")
    if any(s.rank is not None for s in stages):
        _check_ranks(stages)
        return
    if len(stages) < 2 and stages[0].node == LOCAL:
        raise FleetError("a deployment needs at least one part on a node agent")
    here = [f"{part_name(i)} ({layer_span(s.start, s.end)})" for i, s in enumerate(stages[1:], start=1)
            if s.node == LOCAL]
    if here:
        raise FleetError(f"{', '.join(here)} {'is' if len(here) == 1 else 'are'} on this PC: only {part_name(0)} "
                         f"runs in the coordinator, later parts need a node agent's address")
    if stages[0].start != 0:
        raise FleetError(f"the first part starts at layer {stages[0].start}, not 0")
    for s in stages:
        if s.end <= s.start:
            raise FleetError(f"the part from layer {s.start} holds no layers")
    for a, b in zip(stages, stages[1:]):
        if b.start != a.end:
            raise FleetError(f"the parts of {layer_span(a.start, a.end)} and {layer_span(b.start, b.end)} "
                             f"are not contiguous")


def rank_count(stages: list[StageSpan]) -> int:
    """How many tensor-parallel ranks ``stages`` are (1: a chain of stages)."""
    return len(stages) if stages and stages[0].rank is not None else 1


def _check_ranks(stages: list[StageSpan]) -> None:
    if [s.rank for s in stages] != list(range(len(stages))) or len(stages) < 2:
        raise FleetError(f"tensor-parallel ranks are numbered 0 to {len(stages) - 1} in order, at least 2, "
                         f"not {[s.rank for s in stages]}")
    if stages[0].node != LOCAL or any(s.node == LOCAL for s in stages[1:]):
        raise FleetError("rank 0 runs in the coordinator and every other rank on a node agent")
    if any((s.start, s.end) != (0, stages[0].end) or s.end <= 0 for s in stages):
        raise FleetError("every tensor-parallel rank holds its share of every layer, from layer 0")


def placement_problem(stages: list[StageSpan]) -> str | None:
    """What stops ``deploy`` from running this placement, in words, or None: ``check_placement``'s reason."""
    try:
        check_placement(stages)
    except FleetError as exc:
        return str(exc)
    return None


def deploy(model: str, stages: list[StageSpan], *, access: FleetAccess, shard: ShardOptions = ShardOptions(),
           delay_ms: float = 0.0, progress: Report = quiet, cancel=None, worker_timeout_s: float = 180.0,
           planned: dict | None = None, local=None, folders: list[Path] | None = None,
           standbys: bool = False):
    """Returns the ``Deployment`` and its connected chain (a ``RemoteChain``; the caller closes it); every
    connection to the agents and the workers goes with ``access``, every stage is exported and runs as
    ``shard`` says (its weights, mode and precision; each stage on its span's device).
    ``progress`` tells each stage's phases (``engine.progress.deploying``): export, send, start, connect.
    ``planned``: how the placement was chosen (``profile`` path, ``objective``, ``users``), kept in
    the record for failover; ``local``: a compiled stage 0 to reuse if it is still this placement's;
    ``folders``: this split's exported stages, already at hand (failover redeploying a placement),
    so the model is not opened again to find them.  ``standbys``: also start a hot standby of each
    stage where the fleet profile in ``planned`` has a node with room (``engine.fleet.standby``)."""
    # deferred: only deploying exports; a `fleet worker` process imports this module (engine.cli.args)
    from engine.export.exporter import export_model

    check_placement(stages)
    ranks = rank_count(stages)
    split = [] if ranks > 1 else [s.end for s in stages[:-1]]
    on_nodes = [i for i, s in enumerate(stages) if s.node != LOCAL]  # all but a stage 0 run here
    for address in dict.fromkeys(stages[i].node for i in on_nodes):  # all up before minutes of export
        try:
            with ControlClient(address, access) as agent:
                agent.status()
        except AgentError as exc:
            raise FleetError(f"deployment not started: {exc}") from None

    if folders is None:
        export = export_model(model, split=split, weights=shard.weights, ranks=ranks, cancel=cancel,
                              progress=lambda p: progress(deploying(p.stage, "export", p.fraction)))
        if stages[-1].end != export.stages[-1].layers[1]:
            raise FleetError(f"the placement holds {layer_span(0, stages[-1].end)}, the model has "
                             f"{export.stages[-1].layers[1]} layers")
        folders = export.folders
    digests = {}
    for i in on_nodes:
        stage, folder = stages[i], folders[i]
        try:
            with ControlClient(stage.node, access) as agent:
                digests[i], _ = agent.send_shard(folder, progress=_phase_of(i, "send", progress), cancel=cancel)
        except AgentError as exc:
            raise FleetError(f"deployment stopped while sending {part_name(i, len(stages))}: {exc}") from None
    started: list[dict] = []
    remotes: list[str] = []
    try:
        for i in on_nodes:
            stage = stages[i]
            progress(deploying(i, "start", 0.0))
            try:
                with ControlClient(stage.node, access) as agent:
                    info = agent.start_worker(digests[i], shard=shard.on(stage.device),
                                              delay_ms=delay_ms, timeout_s=worker_timeout_s)
            except AgentError as exc:
                raise FleetError(f"deployment stopped while starting {part_name(i, len(stages))}: {exc}") from None
            started.append({"agent": stage.node, "worker": info["id"], "stage": i})
            remotes.append(worker_address(stage.node, info["port"]))
            progress(deploying(i, "start", 1.0))
        deployment = Deployment(model=model, stage0=str(folders[0]), device=stages[0].device,
                                remotes=remotes, workers=started, mode=shard.mode,
                                weights=load_manifest(folders[0]).weights,  # "auto" as exported
                                placement=list(stages), **(planned or {}))
        progress(deploying(0, "connect", 0.0))
        chain = deployment.chain(access, local=local)  # the whole route answers
        progress(deploying(0, "connect", 1.0))
        if standbys and ranks == 1:
            try:
                deployment.standbys = [s.to_json() for s in start_standbys(deployment, folders, access=access,
                                                                            shard=shard, progress=progress)]
            except BaseException:
                chain.close()
                raise
            if getattr(chain, "stand_by", None) is not None:  # the chain came up first: it mirrors from its next reply
                for spare in map(Standby.from_json, deployment.standbys):
                    chain.stand_by(spare.stage, spare.address)
        return deployment, chain
    except BaseException:
        _stop_workers(started, access)
        raise


def start_standbys(deployment: Deployment, folders: list[Path], *, access: FleetAccess, shard: ShardOptions,
                   progress: Report = quiet, leave_out: frozenset[str] = frozenset()) -> list[Standby]:
    """Hot standbys for ``deployment``'s stages, compiled as ``shard`` says (the deployment's own
    options, ``deploy``'s or the record's ``Deployment.shard``) on the devices they are placed on,
    placed from the fleet profile it was planned from (none without one), on none of the nodes
    ``leave_out`` names (node ids: lost ones); a standby that does not start is left out."""
    try:
        profile = json.loads(Path(deployment.profile).read_text()) if deployment.profile else None
    except (OSError, ValueError):
        profile = None
    if not profile:
        return []
    nodes = profile["nodes"]
    node_of = {info.get("address"): node for node, info in nodes.items()}
    spans = [s.at(node_of.get(s.node, s.node)) if s.node != LOCAL else s for s in deployment.placement]
    fleet = Fleet.from_json(profile["fleet"])
    fleet = dataclasses.replace(fleet, devices=[d for d in fleet.devices if d.node not in leave_out])
    where = standby.place(ModelShape.from_json(profile["model"]), fleet, spans, standby.dropouts(), local=LOCAL)
    where = {i: s.at(nodes[s.node]["address"]) for i, s in where.items() if nodes.get(s.node, {}).get("address")}
    return standby.start(folders, where, access=access, shard=shard, progress=progress)


def deploy_layout(model: str, copies: list[list[StageSpan]], *, access: FleetAccess,
                  shard: ShardOptions = ShardOptions(), progress: Report = quiet,
                  planned: dict | None = None, cancel=None, **kw):
    """Deploys replicas (``engine.fleet.layout``): each placement of ``copies`` as ``deploy`` does,
    or, for a single stage here, the model exported whole for this machine.  Returns the first
    copy's ``Deployment``, holding the others in ``replicas``, and every copy's chain (the caller
    closes them).  A copy that fails stops the ones already running.  Hot standbys (``standbys``) go
    with a single copy only: the solver's memory for replicas does not count a standby beside them."""
    if len(copies) > 1:
        kw["standbys"] = False
    done: list[tuple[Deployment, object]] = []
    try:
        for stages in copies:
            if len(stages) == 1 and stages[0].node == LOCAL:
                copy = _whole_here(model, stages[0], weights=shard.weights, mode=shard.mode, progress=progress,
                                   planned=planned, cancel=cancel)
                done.append((copy, copy.chain(access)))
            else:
                done.append(deploy(model, stages, access=access, shard=shard, progress=progress, planned=planned,
                                   cancel=cancel, **kw))
    except BaseException:
        for copy, chain in done:
            chain.close()
            copy.stop(access)
        raise
    first = done[0][0]
    first.replicas = [copy.to_json() for copy, _ in done[1:]]
    return first, [chain for _, chain in done]


def _whole_here(model: str, stage: StageSpan, *, weights: str, mode: str, progress: Report,
                planned: dict | None, cancel=None) -> Deployment:
    """A copy of the model whole on this machine: exported (or found in the cache), nothing sent."""
    from engine.export.exporter import export_model  # deferred, as in ``deploy``

    folder = export_model(model, stages=1, weights=weights, cancel=cancel,
                          progress=_phase_of(0, "export", progress)).folders[0]
    manifest = load_manifest(folder)
    if (stage.start, stage.end) != tuple(manifest.layers):
        raise FleetError(f"a copy on this PC holds the whole model, {layer_span(*manifest.layers)}, not "
                         f"{layer_span(stage.start, stage.end)}")
    return Deployment(model=model, stage0=str(folder), device=stage.device, remotes=[], workers=[], mode=mode,
                      weights=manifest.weights, placement=[stage], **(planned or {}))
