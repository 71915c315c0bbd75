"""Surviving a lost laptop: when a stage of a deployment stops answering, find out whether its node
is gone or only its worker, move the work, and hand the chat service a new chain to carry on with.

- Every node agent of the deployment still answers (a worker died or hung): the same placement is
  deployed again; the shards are on the nodes already, so only the workers start anew.
- A node's agent does not answer: the node is marked lost, and the placement solver places its
  layers on the surviving nodes, with every surviving stage pinned where it runs (their shards are
  reused; the moved layers are exported if need be and sent).  Where the survivors cannot take
  them, a ``FleetError`` says why (memory, no node left) and what would help.
- A deployment that keeps hot standbys gets them again after a redeployment, started in the
  background on surviving nodes while the reply carries on.
- A lost node that answers again (a laptop woken from sleep: its agent and workers were stopped, not
  ended) rejoins: ``returned`` stops the workers it still runs for this deployment (they lost their
  chain while it slept), counts it a node of the fleet again and says so; the next placement, and
  the next failover, can use it.  In a deployment that keeps hot standbys, it becomes the standby
  of a stage that has none (its copies start with each stream's next reply), so the next loss of
  that stage is a switch again.  It is never pulled into a running conversation.  ``watch`` asks
  the lost nodes every so often on a thread of its own (``Settings.rejoin_check_s``), so a node
  rejoins with no restart of the app or of its agent.

``recover`` is what ``ChatService(recover=...)`` calls with the ``StageError`` that broke the chain;
the service then prefills every reply in flight again on the new chain (prompt plus the tokens
already emitted) and continues it.  What happens is told to ``on_event`` as it happens.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import Callable

from engine.config import FleetAccess, ShardOptions
from engine.errors import FleetError, StageError
from engine.export.exporter import rank_folder, stage_folder
from engine.fleet.control import AgentError, ControlClient
from engine.fleet.deploy import LOCAL, Deployment, deploy_layout, start_standbys
from engine.fleet.placement import Fleet, ModelShape, PlacementError, Pin, solve
from engine.fleet.span import StageSpan
from engine.fleet import standby
from engine.fleet.standby import Standby
from engine.fleet.survey import HERE, current_names, readable
from engine.manifest import layer_span, part_name

PROBE_TIMEOUT_S = 3.0  # a node agent silent this long counts as gone
SWITCH_TIMEOUT_S = 5.0  # a standby's chain not answering within this redeploys instead


class Failover:
    def __init__(self, deployment: Deployment, profile: dict | None = None, *, access: FleetAccess,
                 objective: str = "latency", users: int = 1, on_event: Callable[[str], None] | None = None, chain=None,
                 on_recovered: Callable[[Deployment], None] | None = None):
        """``access``: what every connection to the deployment's agents and workers goes with.
        ``profile``: the ``fleet profile`` document the deployment was planned from (its nodes, their
        measured devices and round trips); without one a stopped worker is still started again, but
        a lost node's layers cannot be moved.  ``chain``: the deployment's running chain, whose
        compiled stage 0 each recovery carries over (compiling it anew costs 10-25 MB of RSS a time).
        ``on_recovered``: told each new deployment (``LiveRecord.replace`` keeps the saved record true)."""
        if not deployment.placement:
            raise FleetError("this deployment record predates failover (it lacks its placement): deploy it again")
        self.deployment = deployment
        self.profile = profile
        self.nodes: dict = current_names(profile["nodes"]) if profile else {}
        self.access = access
        self.objective, self.users = objective, users
        self.on_event = on_event or (lambda text: None)
        self.lost: dict[str, str] = {}  # node id -> the address its agent had
        self.left: dict[str, list[dict]] = {}  # node id -> the workers it ran when lost (``Deployment.workers``)
        self._lost_lock = threading.Lock()  # ``recover`` and the watch thread both change ``lost``
        self._closed = threading.Event()
        self._watch: threading.Thread | None = None
        self.recoveries = 0
        self.chain = chain
        self.on_recovered = on_recovered or (lambda deployment: None)
        self.keeps_standbys = bool(deployment.standbys)  # deployed with hot standbys: a node back stands by

    def name(self, agent: str) -> str:
        return self.nodes.get(self.node_of(agent), {}).get("name", agent)

    def node_of(self, agent: str) -> str:
        return next((node for node, info in self.nodes.items() if info.get("address") == agent), agent)

    def _answers(self, agent: str) -> bool:
        try:
            with ControlClient(agent, self.access, timeout_s=PROBE_TIMEOUT_S) as client:
                client.status()
            return True
        except AgentError:
            return False

    def recover(self, error: StageError):
        """A new chain for the deployment after ``error`` broke it; raises FleetError when the fleet
        cannot carry on."""
        spare = self.deployment.standby_for(error.stage)
        if spare is not None:
            try:
                return self._switch(error, spare)
            except FleetError as exc:  # the standby is gone too: redeploy as without one
                self.on_event(f"the standby for {part_name(error.stage)} did not take over ({exc}); redeploying")
        placement = self.deployment.placement
        gone = [s for s in placement if s.node != LOCAL and not self._answers(s.node)]
        if gone:
            for stage in gone:
                node = self.node_of(stage.node)
                with self._lost_lock:
                    self.lost[node] = stage.node
                    self.left[node] = self.left.get(node, []) + self._ran_on(stage.node)
                standby.count_dropout(node)
                self.on_event(f"node {self.name(stage.node)} lost ({error.reason})")
            placement = self._replan(placement, gone)
        else:
            self.on_event(f"{part_name(error.stage)} stopped answering ({error.reason}); starting its worker again")
        for problem in self.deployment.stop(self.access):  # a hung worker too; the lost node's fail
            if not gone:
                self.on_event(f"warning: {problem}")
        old = self.deployment
        # the same placement runs the shards the deployment already has: the model is not opened again
        held = None if gone else _shard_folders(old)
        # deploy_layout: a copy that was whole on the lost node may come back whole on this machine
        deployment, (chain,) = deploy_layout(old.model, [placement], access=self.access,
                                             shard=ShardOptions(weights=old.weights, mode=old.mode),
                                             planned={"profile": old.profile, "objective": old.objective,
                                                      "users": old.users},
                                             local=getattr(self.chain, "local", None), folders=held)
        self.deployment, self.chain = deployment, chain
        self.recoveries += 1
        self.on_recovered(deployment)
        if self.keeps_standbys:  # a redeployment starts none: they start beside the reply, not before it
            threading.Thread(target=self._restock, args=(deployment,), daemon=True, name="failover-standbys").start()
        where = [self.name(s.node) if s.node != LOCAL else HERE for s in placement]
        self.on_event("placed: " + "; ".join(f"{part_name(i)} on {node} ({layer_span(s.start, s.end)})"
                                             for i, (node, s) in enumerate(zip(where, placement))))
        return chain

    def _switch(self, error: StageError, standby: Standby):
        """The chain with stage ``error.stage`` on its hot standby: no probe, no shard, no compile;
        the stage's old worker is looked after in the background (stopped if its node answers, its
        node counted lost if not)."""
        old = self.deployment
        i = standby.stage
        first_remote = 0 if old.fed else 1
        placement = list(old.placement)
        lost = placement[i]
        placement[i] = StageSpan(standby.agent, standby.device, lost.start, lost.end, lost.rank)
        remotes = list(old.remotes)
        remotes[i - first_remote] = standby.address
        workers = [w for w in old.workers if w["stage"] != i]
        workers.insert(i - first_remote, {"agent": standby.agent, "worker": standby.worker, "stage": i})
        deployment = dataclasses.replace(old, placement=placement, remotes=remotes, workers=workers,
                                         standbys=[s for s in old.standbys if s["stage"] != i])
        self.on_event(f"{part_name(i)} stopped answering ({error.reason}); its standby on {self.name(standby.agent)} "
                      "takes over")
        chain = self.chain
        if getattr(chain, "reroute", None) is not None:  # the streams' caches stay: the standby mirrored its stage
            chain.reroute(i, standby.address, timeout_s=SWITCH_TIMEOUT_S)
        else:
            chain = deployment.chain(self.access, connect_timeout_s=SWITCH_TIMEOUT_S,
                                     local=getattr(self.chain, "local", None))
        self.deployment, self.chain = deployment, chain
        self.recoveries += 1
        self.on_recovered(deployment)
        self.on_event(f"placed: {part_name(i)} on {self.name(standby.agent)} ({layer_span(lost.start, lost.end)})")
        gone = [w for w in old.workers if w["stage"] == i]
        threading.Thread(target=self._after_switch, args=(lost.node, gone), daemon=True,
                         name="failover-cleanup").start()
        return chain

    def _after_switch(self, agent: str, workers: list[dict]) -> None:
        """A switched-out stage's node: counted lost when its agent is silent, else its worker is
        stopped (it died, or it hangs)."""
        if not self._answers(agent):
            node = self.node_of(agent)
            with self._lost_lock:
                self.lost[node] = agent
                self.left[node] = self.left.get(node, []) + self._ran_on(agent)
            standby.count_dropout(node)
            self.on_event(f"node {self.name(agent)} lost")
            return
        for w in workers:
            self._stop_worker(agent, w["worker"])

    def _stop_worker(self, agent: str, worker: str) -> None:
        try:
            with ControlClient(agent, self.access, timeout_s=PROBE_TIMEOUT_S) as client:
                client.stop_worker(worker)
        except AgentError:
            pass  # it died with its stage: nothing left to stop

    def _ran_on(self, agent: str) -> list[dict]:
        """The workers ``agent`` runs for this deployment: its stages and its standbys."""
        return [w for w in [*self.deployment.workers, *self.deployment.standbys] if w["agent"] == agent]

    def _replan(self, placement: list[StageSpan], gone: list[StageSpan]) -> list[StageSpan]:
        names = ", ".join(self.name(s.node) for s in gone)
        moving = ", ".join(layer_span(s.start, s.end) for s in gone)
        if self.profile is None:
            raise FleetError(f"node {names} lost, and its {moving} cannot be moved: this deployment was not "
                             "planned from a fleet profile. Bring the fleet up again (`fleet up --nodes all`)")
        shape, full = ModelShape.from_json(self.profile["model"]), Fleet.from_json(self.profile["fleet"])
        with self._lost_lock:
            lost = set(self.lost)
        fleet = Fleet(devices=[d for d in full.devices if d.node not in lost],
                      rtt_ms={k: v for k, v in full.rtt_ms.items() if not lost & set(k)}, coordinator=full.coordinator)
        keep = [s for s in placement if s not in gone]
        pins = [Pin(full.coordinator if s.node == LOCAL else self.node_of(s.node), s.start, s.end, s.device)
                for s in keep]
        try:
            plan = solve(shape, fleet, objective=self.objective, users=self.users, pins=pins)
        except PlacementError as exc:
            raise FleetError(f"node {names} lost, and the surviving nodes cannot take its {moving}: "
                             f"{readable(str(exc), self.nodes)}. Start a node agent (the tray worker) on another "
                             "PC, or free memory on the others, and bring the fleet up again") from None
        stages = [s.at(self.nodes[s.node]["address"]) for s in plan.stages]
        for s in stages:
            if s.node != LOCAL and all(s.node != k.node for k in keep):
                self.on_event(f"moving {layer_span(s.start, s.end)} to node {self.name(s.node)}…")
        return stages

    @classmethod
    def of(cls, deployment: Deployment, *, access: FleetAccess, on_event=None,
           chain=None, on_recovered=None) -> "Failover":
        """The failover of a deployment record, re-planning from the profile it was planned from (if any);
        ``chain`` and ``on_recovered`` as in the constructor."""
        profile = None
        if deployment.profile:
            try:
                profile = json.loads(Path(deployment.profile).read_text())
            except (OSError, ValueError):
                profile = None  # moved or damaged: stopped workers still start again
        return cls(deployment, profile, access=access, objective=deployment.objective, users=deployment.users,
                   on_event=on_event, chain=chain, on_recovered=on_recovered)

    def returned(self) -> list[str]:
        """The lost nodes that answer again, by name: each rejoins (no longer counted lost, offered to
        the next placement) once the workers it ran for this deployment are stopped, so that it holds
        no stale stage; never pulled into a running conversation."""
        with self._lost_lock:
            lost = dict(self.lost)
        back = []
        for node, agent in lost.items():
            if not self._answers(agent) or not self._stop_left(node, agent):
                continue
            with self._lost_lock:
                self.lost.pop(node, None)
                self.left.pop(node, None)
            back.append(self.nodes.get(node, {}).get("name", node))
            stage = self._stand_by(node, agent)
            if stage is None:
                self.on_event(f"node {self.name(agent)} is back: it is available again, to the next placement "
                              "and to the next failover")
            else:
                self.on_event(f"node {self.name(agent)} is back: it stands by for {part_name(stage)}")
        return back

    def _stand_by(self, node: str, agent: str) -> int | None:
        """Starts a hot standby on ``agent`` (node ``node``, back) for the first stage on another node
        that has none, in a deployment that keeps standbys; the stage, or None when there is none to
        start (or it does not start: the node is then only offered to the next placement)."""
        deployment = self.deployment
        if not self.keeps_standbys or deployment.ranks > 1 or not deployment.remotes:
            return None
        covered = {s["stage"] for s in deployment.standbys}
        stage = next((i for i, s in enumerate(deployment.placement)
                      if s.node not in (LOCAL, agent) and i not in covered), None)
        if stage is None:
            return None
        devices = [d.device for d in Fleet.from_json(self.profile["fleet"]).devices
                   if d.node == node and d.supported] if self.profile else []
        span = deployment.placement[stage]
        folders = _shard_folders(deployment)
        try:
            started = standby.start(folders, {stage: StageSpan(agent, devices[0] if devices else "CPU", span.start,
                                                               span.end)},
                                    access=self.access, shard=deployment.shard)
        except FleetError as exc:
            self.on_event(f"warning: node {self.name(agent)} could not stand by for {part_name(stage)}: {exc}")
            return None
        return stage if self._adopt(deployment, started) else None

    def _restock(self, deployment: Deployment) -> None:
        """Hot standbys for a deployment a recovery made, placed as a deploy places them, on none of
        the lost nodes."""
        folders = _shard_folders(deployment)
        with self._lost_lock:
            lost = frozenset(self.lost)
        try:
            started = start_standbys(deployment, folders, access=self.access, shard=deployment.shard, leave_out=lost)
        except FleetError as exc:
            self.on_event(f"warning: no standby could start after the recovery: {exc}")
            return
        if self._adopt(deployment, started):
            for s in started:
                self.on_event(f"{part_name(s.stage)} has a standby again, on {self.name(s.agent)}")

    def _adopt(self, deployment: Deployment, started: list[Standby]) -> bool:
        """Records standbys ``started`` for ``deployment`` and names them to the chain (which mirrors
        from its next reply); stops them instead, and says False, when a recovery replaced the
        deployment meanwhile."""
        if self.deployment is not deployment:
            for s in started:
                self._stop_worker(s.agent, s.worker)
            return False
        self.deployment = dataclasses.replace(deployment, standbys=[*deployment.standbys,
                                                                     *(s.to_json() for s in started)])
        self.on_recovered(self.deployment)
        if getattr(self.chain, "stand_by", None) is not None:
            for s in started:
                self.chain.stand_by(s.stage, s.address)
        return bool(started)

    def _stop_left(self, node: str, agent: str) -> bool:
        """Stops the workers ``node`` ran when it was lost; whether none is left running."""
        with self._lost_lock:
            left = list(self.left.get(node, []))
        try:
            with ControlClient(agent, self.access, timeout_s=PROBE_TIMEOUT_S) as client:
                running = {w["id"] for w in client.status()["workers"]}
                for worker in left:
                    if worker["worker"] in running:
                        client.stop_worker(worker["worker"])
        except AgentError:
            return False
        return True

    def watch(self, every_s: float) -> "Failover":
        """Asks the lost nodes whether they are back (``returned``) every ``every_s`` seconds, on a
        thread of its own, until ``close``."""
        def run() -> None:
            while not self._closed.wait(every_s):
                with self._lost_lock:
                    anyone = bool(self.lost)
                if anyone:
                    try:
                        self.returned()
                    except Exception as exc:  # a watch that dies would leave every lost node out for good
                        self.on_event(f"warning: asking the lost nodes whether they are back failed: {exc}")

        if self._watch is None:
            self._watch = threading.Thread(target=run, daemon=True, name="failover rejoin watch")
            self._watch.start()
        return self

    def close(self) -> None:
        """Ends the watch (``watch``); the deployment keeps running."""
        self._closed.set()
        if self._watch is not None and self._watch is not threading.current_thread():
            self._watch.join(timeout=2 * PROBE_TIMEOUT_S + 10)


def _shard_folders(deployment: Deployment) -> list[Path]:
    """The shard folder of each of the deployment's stages (or ranks) on this machine."""
    folder = rank_folder if deployment.ranks > 1 else stage_folder
    return [folder(Path(deployment.stage0).parent, i) for i in range(len(deployment.placement))]
