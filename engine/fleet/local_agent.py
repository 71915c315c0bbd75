"""A local agent: a node agent process this process starts on loopback, with the workers it starts
for a model deployed over it (this PC's own fleet).  Not to be confused with
``engine.runtime.relay.local_workers`` (workers this process starts itself, no agent between).

``local_up`` is the embedded default that ``fleet up``, ``fleet serve`` and the app run: stage 0 in
this process, the later stages in the local agent's workers, so failover and deployment work the
same as across PCs.  The fleet they join is the caller's ``FleetAccess``: the agent is told its key
file (``--fleet-key-file``) and whether it speaks TLS (``--tls`` or ``--no-tls``, never the saved
settings the agent would read), and the chat and failover that reach them use that same access.
``own_agents`` lists the agent processes this process started and that still run (the local fleet's,
a demo fleet's): the app shows them as nodes.
"""

from __future__ import annotations

import dataclasses
import threading

from engine.config import FleetAccess, ShardOptions, paths
from engine.errors import FleetError
from engine.export.exporter import plan_split
from engine.fleet.deploy import LOCAL, deploy
from engine.fleet.span import StageSpan
from engine.launch import FleetProcess
from engine.models.catalog import resolve_source
from engine.models.checkpoint import open_checkpoint
from engine.progress import Report, quiet


@dataclasses.dataclass(frozen=True)
class OwnAgent:
    """A node agent process this process started."""

    name: str
    address: str  # its control API's HOST:PORT
    role: str  # what it is for: "local fleet", "demo"
    process: FleetProcess

    @property
    def proc(self):
        return self.process.proc


_own: list[OwnAgent] = []
_own_lock = threading.Lock()


def own_agents() -> list[OwnAgent]:
    """The node agents this process started (``start_local_agent``) that still run, oldest first."""
    with _own_lock:
        _own[:] = [a for a in _own if a.process.running]
        return list(_own)


def start_local_agent(access: FleetAccess, timeout_s: float = 60.0, *, name: str = "local", mdns: bool = False,
                      options: tuple[str, ...] = (), role: str = "local fleet") -> FleetProcess:
    """A node agent process on loopback named ``name`` (its own node), tied to this process (it exits
    when we do), ready (its control API at ``address``); ``access``: the fleet it joins, told by its
    key file (``--fleet-key-file``), which it must have, speaking TLS when the access does (a fleet's
    default), it and its workers; ``options``: more ``fleet agent`` options (a demo node's store and
    simulated device); ``role``: what ``own_agents`` says it is for."""
    if access.key_file is None:
        raise FleetError("a node agent process needs the fleet key's file: the key itself is never passed on")
    log = paths().data / "logs" / f"{name}-agent.log"
    process = FleetProcess(["agent", "--listen", "127.0.0.1:0", "--fleet-key-file", str(access.key_file),
                            "--name", name, "--tls" if access.uses_tls else "--no-tls",
                            *([] if mdns else ["--no-mdns"]), *options], log).start()
    try:
        address = process.wait_ready(timeout_s)
    except FleetError as exc:
        raise FleetError(f"the {name} node agent did not start ({exc})") from None
    with _own_lock:
        _own.append(OwnAgent(name, address, role, process))
    return process


def stop_local_agent(process: FleetProcess) -> None:
    process.stop(timeout_s=10)


class LocalAgent:
    """A local node agent process (``start_local_agent``), closed with the chat service that owns it."""

    def __init__(self, process: FleetProcess):
        self.process = process

    @property
    def proc(self):
        return self.process.proc

    def close(self) -> None:
        stop_local_agent(self.process)


def local_up(model: str, stages: int, *, access: FleetAccess, shard: ShardOptions = ShardOptions(),
             progress: Report = quiet, cancel=None):
    """``model`` as a local fleet, stage 0 in this process and the rest in a local node agent's
    workers; ``access``: the fleet they join (``fleet_access(settings, create=True)``: a local fleet
    needs no setup), for the agent (told its key file), its workers and the deployment, speaking TLS
    when it does; ``shard``: how the stages are exported and run, every stage on its device.  Returns
    (deployment, chain, agent process: a ``FleetProcess``)."""
    resolved = resolve_source(model)
    ranges = plan_split(open_checkpoint(resolved.kind, resolved.path).spec.num_layers, max(2, stages))
    agent = start_local_agent(access)
    try:
        placement = [StageSpan(LOCAL if i == 0 else agent.address, shard.device, a, b)
                     for i, (a, b) in enumerate(ranges)]
        deployment, chain = deploy(model, placement, access=access, shard=shard, progress=progress, cancel=cancel)
    except BaseException:
        stop_local_agent(agent)
        raise
    return deployment, chain, agent
