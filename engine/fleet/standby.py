"""Hot standbys: a second PC for a part of the model, holding that part's shard loaded and compiled,
so that losing the PC that runs it costs a switch, not a redeployment, and no prefill: the stage's
input is copied to it as it goes (``engine.runtime.relay.mirror``).

``place`` chooses where standbys go (a pure function of the plan, the fleet's memory and how often
each PC has dropped out); ``start`` ships each standby its stage's shard and starts its worker,
which then applies the copies of its stage's input until a coordinator routes to it.  Failover
(``engine.fleet.failover``) switches a broken stage to its standby: the coordinator re-routes its
chain to the standby, the stage before it redials, and the replies in flight are carried on from
the caches the standby kept.  While nothing fails, a standby holds its stage's
memory and computes its stage along with it, on its own PC.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

from engine.config import FleetAccess, ShardOptions, paths
from engine.errors import FleetError
from engine.files import write_json
from engine.fleet.control import AgentError, ControlClient, worker_address
from engine.fleet.placement import Fleet, ModelShape, stage_memory
from engine.fleet.span import StageSpan
from engine.progress import Report, deploying, quiet


@dataclasses.dataclass(frozen=True)
class Standby:
    """A started standby for stage ``stage``: the worker ``worker`` of the node agent at ``agent``,
    serving at ``address`` once routed to."""

    stage: int
    agent: str
    worker: str
    address: str
    device: str = "CPU"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Standby":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


def place(model: ModelShape, fleet: Fleet, stages: list[StageSpan], dropouts: dict[str, int] | None = None,
          local: str = "local") -> dict[int, StageSpan]:
    """Where each stage run on a node (not ``local``, this machine) keeps its standby: a node of
    ``fleet`` (by node id, as the plan's stages name them) other than the stage's own, with the
    memory left for the stage's shard once its own stage and any standby already given to it are
    counted.  Nodes that run no stage of the plan go first (a standby computes its stage along with
    it: on a busy node that slows the chain), then those that dropped out least often
    (``dropouts``: node id -> times), then the ones with the most memory left.  A stage without such
    a node has none (it fails over as a redeployment does)."""
    dropouts = dropouts or {}
    memory = stage_memory(model)
    last = max((s.end for s in stages), default=0)
    used: dict[tuple[str, str], float] = {}
    for s in stages:
        if s.node != local:
            used[(s.node, s.device)] = used.get((s.node, s.device), 0) + memory.at(s.end - s.start, s.start == 0,
                                                                                    s.end == last)
    busy = {s.node for s in stages} | {fleet.coordinator}
    chosen: dict[int, StageSpan] = {}
    for i, s in enumerate(stages):
        if s.node == local or s.rank is not None:
            continue
        need = memory.at(s.end - s.start, s.start == 0, s.end == last)
        room = [(d.node in busy, dropouts.get(d.node, 0), -(d.memory_bytes - used.get((d.node, d.device), 0)), d.node,
                 d.device)
                for d in fleet.devices
                if d.supported and d.node not in (s.node, fleet.coordinator)
                and d.memory_bytes - used.get((d.node, d.device), 0) >= need]
        if room:
            *_, node, device = min(room)
            used[(node, device)] = used.get((node, device), 0) + need
            chosen[i] = StageSpan(node, device, s.start, s.end)
    return chosen


def start(folders: list[Path], where: dict[int, StageSpan], *, access: FleetAccess,
          shard: ShardOptions = ShardOptions(), progress: Report = quiet,
          worker_timeout_s: float = 180.0) -> list[Standby]:
    """Ships stage i's shard (``folders[i]``) to the agent of ``where[i].node`` (an address) and
    starts a worker there, for each i, compiled as ``shard`` says on ``where[i]``'s device (its
    weights go unused: the shards are exported); returns the standbys started.  One that cannot
    start is left out (the stage then fails over by redeploying) and said through ``progress``'s
    log of problems: raises FleetError only when none could start and some were asked for."""
    started, problems = [], []
    for i, span in sorted(where.items()):
        try:
            with ControlClient(span.node, access) as agent:
                digest, _ = agent.send_shard(folders[i])
                progress(deploying(i, "start", 0.0))
                info = agent.start_worker(digest, shard=shard.on(span.device),
                                          timeout_s=worker_timeout_s)
        except AgentError as exc:
            problems.append(f"no standby for stage {i} on {span.node}: {exc}")
            continue
        started.append(Standby(i, span.node, info["id"], worker_address(span.node, info["port"]), span.device))
    if problems and not started:
        raise FleetError("; ".join(problems))
    return started



_counting = threading.Lock()


def dropouts(path: Path | None = None) -> dict[str, int]:
    """How often each node (by node id) has been lost from a deployment on this machine: ``place``
    puts standbys on the steadier nodes first."""
    path = path or paths().data / "dropouts.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in raw.items() if isinstance(k, str) and isinstance(v, int)} if isinstance(raw, dict) else {}


def count_dropout(node: str, path: Path | None = None) -> None:
    """Counts one more loss of ``node`` (a node id)."""
    path = path or paths().data / "dropouts.json"
    with _counting:
        counts = dropouts(path)
        counts[node] = counts.get(node, 0) + 1
        write_json(path, counts)
