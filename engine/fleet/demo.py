"""A demo fleet on one PC: two or three node agents started here as separate processes, each its own
node with a simulated device, so the whole flow (nodes, profiles, layer ranges placed by hand, a
deployment, a chat, a node lost and its layers moved) can be tried without a second PC.

Each demo node is a ``fleet agent`` on loopback (``engine.fleet.local_agent.start_local_agent``) with its
own name (so its own node id), shard store and ``--simulate`` device: it reports that device and its
memory and scales its measured costs by the device's speed, while its stages really run on this
PC's CPU.  Whatever shows a demo node marks it simulated.  ``demo_up`` brings a model up over this
machine and the demo nodes (``fleet up --demo``): the survey, the layers split evenly over this
machine and every demo node but the last (the placement a user then redraws), the deployment with
its profile.  The last node is kept spare: failover keeps every surviving stage where it runs, so a
stopped demo node's layers move to the spare one.  The demo nodes, their workers and whatever
reaches them join the fleet of the caller's ``FleetAccess`` and speak TLS when it does, as the local
fleet does.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from engine.config import FleetAccess, ShardOptions, paths
from engine.errors import FleetError
from engine.files import write_json
from engine.export.exporter import plan_split
from engine.fleet.deploy import LOCAL, deploy
from engine.fleet.local_agent import start_local_agent
from engine.fleet.node import SimulatedDevice, node_id
from engine.fleet.span import StageSpan
from engine.fleet.survey import survey
from engine.launch import FleetProcess, stop_all
from engine.progress import Report, quiet

# (name, device): the first ``count`` of these are started
DEMO_NODES = (
    ("demo-laptop", SimulatedDevice("CPU", "laptop CPU", 4096, speed=1.0)),
    ("demo-gpu", SimulatedDevice("GPU", "integrated GPU", 3072, speed=2.0)),
    ("demo-mini-pc", SimulatedDevice("CPU", "mini PC CPU", 2048, speed=0.7)),
)
MAX_NODES = len(DEMO_NODES)
PROFILE_NAME = "demo-profile.json"


@dataclasses.dataclass
class DemoNode:
    name: str
    device: SimulatedDevice
    process: FleetProcess  # its agent

    @property
    def address(self) -> str:
        """Its agent's HOST:PORT."""
        return self.process.address

    @property
    def proc(self):
        return self.process.proc

    @property
    def running(self) -> bool:
        return self.process.running


class DemoFleet:
    """The demo nodes started by ``start_demo_fleet``; ``close`` (or leaving this process) ends them."""

    def __init__(self, nodes: list[DemoNode]):
        self.nodes = nodes

    @property
    def addresses(self) -> list[str]:
        return [n.address for n in self.nodes if n.running]

    def node(self, which: str) -> DemoNode:
        """A demo node by name or address."""
        for n in self.nodes:
            if which in (n.name, n.address):
                return n
        raise FleetError(f"no demo node {which!r}; the demo fleet has {', '.join(n.name for n in self.nodes)}")

    def stop(self, which: str) -> DemoNode:
        """Stops one demo node's agent and its workers, as if that PC were switched off."""
        node = self.node(which)
        node.process.stop(timeout_s=10)
        return node

    def close(self) -> None:
        stop_all([n.process for n in self.nodes], timeout_s=10)

    def __enter__(self) -> "DemoFleet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_demo_fleet(access: FleetAccess, count: int = 2, *, mdns: bool = False,
                     log: Callable[[str], None] = lambda line: None) -> DemoFleet:
    """``count`` demo nodes (2 or 3) on loopback; ``access``: the fleet they join, told by its key file
    (``fleet_access(settings, create=True)``: the default key made if missing, as for the local
    fleet), speaking TLS when it does; ``mdns``: advertise them too (to this machine only: they listen
    on loopback)."""
    if not 1 <= count <= MAX_NODES:
        raise FleetError(f"a demo fleet has 1 to {MAX_NODES} nodes, not {count}")
    nodes: list[DemoNode] = []
    try:
        for i, (name, device) in enumerate(DEMO_NODES[:count]):
            log(f"starting demo node {name} ({i + 1} of {count}): a simulated {device.full_name}, "
                f"{device.memory_mb / 1024:.0f} GB, running on this PC's CPU")
            store = paths().data / "demo" / name
            agent = start_local_agent(access, name=name, mdns=mdns, role="demo",
                                      options=("--store", str(store), "--simulate", device.to_json()))
            nodes.append(DemoNode(name, device, agent))
    except BaseException:
        stop_all([n.process for n in nodes], timeout_s=10)
        raise
    return DemoFleet(nodes)


def even_placement(num_layers: int, fleet: DemoFleet, device: str = "CPU", spare: int = 1) -> list[StageSpan]:
    """The layers split evenly over this machine (stage 0, on ``device``) and the running demo nodes
    but the last ``spare`` (at least one node is used)."""
    nodes = [n for n in fleet.nodes if n.running]
    nodes = nodes[:max(1, len(nodes) - spare)]
    where = [(LOCAL, device)] + [(n.address, n.device.name) for n in nodes]
    ranges = plan_split(num_layers, min(len(where), num_layers))
    return [StageSpan(agent, dev, a, b) for (agent, dev), (a, b) in zip(where, ranges)]


def demo_profile() -> Path:
    return paths().data / PROFILE_NAME


def demo_up(model: str, count: int = 2, *, access: FleetAccess, shard: ShardOptions = ShardOptions(),
            progress: Report = quiet, log: Callable[[str], None] = lambda line: None, cancel=None):
    """``model`` over this machine and ``count`` new demo nodes: survey, even split, deployment
    (planned from the survey, saved in ``demo_profile()``); ``progress`` tells the survey's and the
    deployment's steps, ``log`` the demo nodes' lines; ``access``: the fleet they join
    (``fleet_access(settings, create=True)``), for the demo nodes (told its key file), speaking TLS
    when it does, and every connection to them; ``shard``: how the stages are exported and run (this
    machine's on the first of its devices).  Returns (DemoFleet, deployment, chain, survey
    document); the caller closes the chain and the fleet."""
    device = shard.device.split(",")[0].strip()
    fleet = start_demo_fleet(access, count, log=log)
    try:
        log(f"profiling this PC and the demo nodes for {model} (its three profiling shards are exported "
            "first, once)")
        doc = survey(model, fleet.addresses, access=access, local_node=node_id(),
                     local_devices=[device], weights=shard.weights, progress=progress, cancel=cancel)
        path = write_json(demo_profile(), doc)
        stages = even_placement(int(doc["model"]["num_layers"]), fleet, device)
        deployment, chain = deploy(model, stages, access=access, shard=shard, progress=progress, cancel=cancel,
                                   planned={"profile": str(path), "objective": "latency", "users": 1})
    except BaseException:
        fleet.close()
        raise
    return fleet, deployment, chain, doc
