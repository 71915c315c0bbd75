"""A simulated office on this Linux machine (``fleet sim``, and the tests' fixture): N PCs, each a
network namespace on a shared bridge with its own address, its own node agent (a real ``fleet
agent`` process inside the namespace, advertising over real mDNS under its own node id, kept in its
own home folder), a memory cap and a CPU set (cgroups v1 or v2), optional bandwidth shaping
(tc tbf on both ends of its link) and an optional link delay (tc netem is missing on some kernels, so
the PC's agent has every worker it starts hold its frames: the relay's own delay, one PC at a time).
This machine's own namespace is the coordinator's PC on the same bridge.  A node may sit on another
subnet, behind a router namespace: reached by address, while mDNS (link-local multicast) does not
cross.

Everything is named ``fsim<owner pid><letter>…``: ``Office.close`` removes what it made, and every new
office first removes what an office whose owner died left behind (``clean_leftovers``).  Needs root.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import itertools
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Callable

from engine.config import FleetAccess
from engine.errors import FleetError
from engine.fleet.sim import netns
from engine.launch import FleetProcess, end_processes, stop_all

PREFIX = "fsim"
AGENT_PORT = 7390  # every simulated PC has its own ports, so each agent takes the default one
SUBNETS = ipaddress.ip_network("10.213.0.0/16")  # the office subnets are /24s of it, one pair per office
MAX_PCS = 99
_OWNER = re.compile(rf"^{PREFIX}(\d+)")
_OFFICES = itertools.cycle("abcdefghijklmnopqrstuvwxyz")


@dataclasses.dataclass
class NodeSpec:
    """One simulated PC: its name, memory cap (MB), CPU set ("0", "0-1"), CPU quota (cores' worth of
    time: 0.6 is 60% of one core, so that three PCs fit two cores), link rate (Mbit/s), whether it
    sits on the other subnet, behind the router, and its link's one-way delay (ms) that the frames
    its workers take and send are held for."""
    name: str
    memory_mb: int | None = None
    cpus: str | None = None
    cpu_quota: float | None = None
    rate_mbit: float | None = None
    remote: bool = False
    delay_ms: float | None = None


@dataclasses.dataclass
class SimNode:
    spec: NodeSpec
    namespace: str
    link: str  # the bridge's end of its veth pair: down is a silent partition
    ip: str
    port: int
    home: Path
    cgroup: list[Path]  # its folders (one per controller on cgroups v1)
    process: FleetProcess | None = None  # its agent
    spawned: list[subprocess.Popen] = dataclasses.field(default_factory=list)  # further processes run on it

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def agent(self) -> str:
        return f"{self.ip}:{self.port}"

    @property
    def proc(self) -> subprocess.Popen | None:
        """Its agent's process."""
        return self.process.proc if self.process is not None else None


def owner_alive(name: str) -> bool:
    match = _OWNER.match(name)
    return bool(match) and Path(f"/proc/{match.group(1)}").exists()


def clean_leftovers(log: Callable[[str], None] = lambda m: None, *, everything: bool = False) -> list[str]:
    """Removes the namespaces, links and cgroups of offices whose owner process is gone (``everything``:
    of every office); returns their names."""
    stale = (lambda name: name.startswith(PREFIX)) if everything else \
        (lambda name: name.startswith(PREFIX) and not owner_alive(name))
    removed = []
    for name in [n for n in netns.namespaces() if stale(n)]:
        netns.delete_namespace(name)
        removed.append(name)
    for name in [n for n in netns.links() if stale(n)]:
        netns.delete_link(name)
        removed.append(name)
    for name, folders in netns.cgroups(PREFIX).items():
        if stale(name):
            netns.delete_cgroup(folders)
            removed.append(name)
    if removed:
        log(f"removed what an earlier simulated office left: {', '.join(removed)}")
    return removed


def _free_subnets() -> tuple[ipaddress.IPv4Network, ipaddress.IPv4Network]:
    """Two /24s of SUBNETS that no route of this machine uses yet."""
    used = netns.run("ip", "-4", "route", "show", check=False).stdout
    nets = list(SUBNETS.subnets(new_prefix=24))
    start = (os.getpid() % (len(nets) // 2)) * 2
    for i in range(0, len(nets), 2):
        a, b = nets[(start + i) % len(nets)], nets[(start + i + 1) % len(nets)]
        if str(a) not in used and str(b) not in used:
            return a, b
    raise FleetError(f"no free pair of /24 subnets left in {SUBNETS} for a simulated office")


class Office:
    """``Office(specs, access=..., root=...)`` as a context manager: the PCs are up and their agents
    answer inside the block, and everything is removed after it, also after an error.  ``access``: the
    fleet's, read from its key file (``engine.fleetkey.access_of``): every agent is told that file, and
    the agents and their workers speak TLS when it does, whatever their homes' settings say."""

    def __init__(self, specs: list[NodeSpec], *, access: FleetAccess, root: Path, port: int = AGENT_PORT,
                 agent_args: tuple[str, ...] = (), log: Callable[[str], None] = lambda m: None):
        names = [s.name for s in specs]
        if len(set(names)) != len(names) or not all(re.fullmatch(r"[a-z0-9]{1,12}", n) for n in names):
            raise FleetError(f"simulated PCs need distinct names of 1-12 lower-case letters and digits, not {names}")
        if not 1 <= len(specs) <= MAX_PCS:  # a /24 each side, and interface names of 15 characters at most
            raise FleetError(f"a simulated office has 1 to {MAX_PCS} PCs, not {len(specs)}")
        if access.key_file is None:
            raise FleetError("a simulated office's agents need the fleet key's file: a fleet access read from one "
                             "(engine.fleetkey.access_of)")
        self.specs, self.access, self.root, self.port = specs, access, Path(root), port
        self.key_file = Path(access.key_file)  # what its agents, and the processes started on its PCs, are told
        self.agent_args, self.log = agent_args, log
        self.tag = f"{PREFIX}{os.getpid()}{next(_OFFICES)}"  # a letter: several offices in one process
        self.bridge, self.far_bridge, self.router = f"{self.tag}a", f"{self.tag}b", f"{self.tag}-router"
        self.nodes: dict[str, SimNode] = {}
        self.coordinator_ip = ""
        self._made = False

    # --- life cycle ----------------------------------------------------------------------------------

    def __enter__(self) -> "Office":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, wait_s: float = 90.0) -> "Office":
        netns.require_root("a simulated office")
        clean_leftovers(self.log)
        self._made = True
        try:
            self._network()
            for node in self.nodes.values():
                self.start_agent(node.name, wait_s)
        except BaseException:
            self.close()
            raise
        return self

    def _network(self) -> None:
        near, far = _free_subnets()
        hosts, far_hosts = list(near.hosts()), list(far.hosts())
        self.coordinator_ip = str(hosts[0])
        netns.make_bridge(self.bridge, f"{hosts[0]}/24")
        remote = [s for s in self.specs if s.remote]
        if remote:  # the router: .254 on the office subnet, .1 on the far one, forwarding between them
            netns.make_bridge(self.far_bridge)  # this machine reaches it through the router only
            netns.make_namespace(self.router)
            netns.ns(self.router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            netns.plug(self.router, self.bridge, f"{self.tag}r0", f"{hosts[-1]}/24", inner="eth0")
            netns.plug(self.router, self.far_bridge, f"{self.tag}r1", f"{far_hosts[0]}/24", inner="eth1")
            netns.run("ip", "route", "add", str(far), "via", str(hosts[-1]))
        for i, spec in enumerate(self.specs):
            namespace, link = f"{self.tag}-{spec.name}", f"{self.tag}h{i}"
            ip = str((far_hosts if spec.remote else hosts)[i + 1])
            gateway = str(far_hosts[0]) if spec.remote else str(hosts[-1]) if remote else None
            netns.make_namespace(namespace)
            netns.plug(namespace, self.far_bridge if spec.remote else self.bridge, link, f"{ip}/24", gateway)
            if spec.rate_mbit:
                netns.shape(link, spec.rate_mbit)  # towards the PC
                netns.shape("eth0", spec.rate_mbit, namespace)  # from it
            cgroup = netns.make_cgroup(f"{self.tag}-{spec.name}", spec.memory_mb, spec.cpus, spec.cpu_quota)
            self.nodes[spec.name] = SimNode(spec, namespace, link, ip, self.port, self.root / spec.name, cgroup)

    def start_agent(self, name: str, wait_s: float = 90.0) -> SimNode:
        """Starts (or starts again) the PC's node agent inside its namespace and cgroups."""
        node = self.nodes[name]
        if node.process is not None and node.process.running:
            raise FleetError(f"simulated PC {name}'s agent is running already")
        node.home.mkdir(parents=True, exist_ok=True)
        log = node.home / "agent.log"
        # its own home: its own node id, shard store and compute turns, as on its own PC
        env = {**os.environ, "FLEETSHARD_HOME": str(node.home)}
        args = ["agent", "--listen", f"0.0.0.0:{node.port}", "--name", name, "--fleet-key-file", str(self.key_file),
                "--tls" if self.access.uses_tls else "--no-tls", *self.agent_args,
                *(["--link-delay-ms", str(node.spec.delay_ms)] if node.spec.delay_ms else [])]
        node.process = FleetProcess(args, log, prefix=netns.enter(node.namespace), env=env,
                                    preexec_fn=netns.joiner(node.cgroup)).start()
        node.process.wait_ready(wait_s)
        self.log(f"{name}: {node.agent} in namespace {node.namespace}")
        return node

    def spawn(self, name: str, cmd: list[str], log: Path, *, home: bool = False) -> subprocess.Popen:
        """Runs ``cmd`` on the PC (in its namespace and cgroups), its output in ``log``; it is ended
        with the office at the latest.  ``home``: a ``fleet`` command that keeps its files (cache,
        keys, settings) in the PC's home, as its agent does."""
        node = self.nodes[name]
        log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "FLEETSHARD_HOME": str(node.home)} if home else None
        with open(log, "w") as out:
            proc = subprocess.Popen([*netns.enter(node.namespace), *cmd], stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=env, preexec_fn=netns.joiner(node.cgroup))
        node.spawned.append(proc)
        return proc

    def stop_agent(self, name: str) -> None:
        node = self.nodes[name]
        if node.process is not None:
            node.process.stop(timeout_s=15)
            node.process = None

    def close(self) -> None:
        """Stops every agent and removes every namespace, link, route and cgroup the office made."""
        if not self._made:
            return
        self._made = False
        stop_all([n.process for n in self.nodes.values() if n.process is not None], timeout_s=15)
        end_processes([p for n in self.nodes.values() for p in n.spawned], timeout_s=15)
        for node in self.nodes.values():
            node.process = None
            node.spawned.clear()
        for name in [n for n in netns.namespaces() if n.startswith(self.tag + "-")]:
            netns.delete_namespace(name)
        for name in [n for n in netns.links() if n.startswith(self.tag)]:
            netns.delete_link(name)  # the bridges (their routes go with them) and any veth end left
        for folders in netns.cgroups(self.tag + "-").values():
            netns.delete_cgroup(folders)

    # --- the network ---------------------------------------------------------------------------------

    def partition(self, name: str) -> None:
        """Cuts the PC's cable: its packets vanish, nobody hears a reset."""
        netns.set_link(self.nodes[name].link, False)

    def reconnect(self, name: str) -> None:
        netns.set_link(self.nodes[name].link, True)

    # --- the PC itself -------------------------------------------------------------------------------

    def sleep(self, name: str) -> None:
        """Closes the PC's lid: every process on it (its agent and the workers it started) stopped with
        SIGSTOP, as a laptop gone to sleep.  Its link stays up, so a peer's connection is accepted and
        then hears nothing.  ``wake`` opens the lid again."""
        self._signal(name, signal.SIGSTOP)

    def wake(self, name: str) -> None:
        """Opens the PC's lid: its processes carry on (SIGCONT) where they stopped."""
        self._signal(name, signal.SIGCONT)

    def _signal(self, name: str, sig: int) -> None:
        for pid in netns.cgroup_pids(self.nodes[name].cgroup):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:  # it ended meanwhile
                pass

    def set_memory(self, name: str, memory_mb: int) -> None:
        """Gives the PC another memory cap (its processes keep running)."""
        node = self.nodes[name]
        netns.set_memory_cap(node.cgroup, memory_mb)
        node.spec = dataclasses.replace(node.spec, memory_mb=memory_mb)

    def set_delay(self, name: str, delay_ms: float | None, wait_s: float = 90.0) -> SimNode:
        """Gives the PC another link delay: its agent starts again (same home, same node id), so the
        workers it ran stop and those it starts from now on hold their frames by ``delay_ms``."""
        node = self.nodes[name]
        self.stop_agent(name)
        node.spec = dataclasses.replace(node.spec, delay_ms=delay_ms)
        return self.start_agent(name, wait_s)

    def memory_used(self, name: str) -> int:
        """Bytes the PC's agent and workers use."""
        return netns.memory_used(self.nodes[name].cgroup)

    def table(self) -> list[str]:
        rows = [f"{'name':<10} {'agent':<20} {'namespace':<22} {'memory':>8} {'cpus':<6} {'quota':<6} {'link':<10} "
                f"{'delay':<8} subnet"]
        for n in self.nodes.values():
            s = n.spec
            rows.append(f"{n.name:<10} {n.agent:<20} {n.namespace:<22} "
                        f"{f'{s.memory_mb} MB' if s.memory_mb else '-':>8} {s.cpus or 'all':<6} "
                        f"{f'{s.cpu_quota:g}' if s.cpu_quota else '-':<6} "
                        f"{f'{s.rate_mbit:g} Mbit/s' if s.rate_mbit else '-':<10} "
                        f"{f'{s.delay_ms:g} ms' if s.delay_ms else '-':<8} "
                        f"{'other (routed)' if s.remote else 'office'}")
        return rows
