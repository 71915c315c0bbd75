"""Linux plumbing for the simulated office (``engine.fleet.sim.office``): network namespaces, a bridge,
veth pairs, tc tbf shaping, and cgroups (v1 and v2) for a memory cap and a CPU set, each made
through ``ip``, ``tc`` and the cgroup filesystem, and each removable again by name.

Everything made here carries the owner's name prefix, so what a crashed run left behind is found
by name (``owned``) and removed (``remove_all``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from engine.errors import FleetError
from engine.limits import CGROUP_ROOT

V1_CONTROLLERS = ("memory", "cpuset", "cpu")
CPU_PERIOD_US = 100_000  # the quota's accounting period
NETNS_DIR = Path("/run/netns")  # where `ip netns add` keeps its namespaces


def require_root(what: str) -> None:
    """Raises a FleetError naming ``what`` unless this process may make namespaces and cgroups."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        raise FleetError(f"{what} needs Linux network namespaces; this system has none")
    if os.geteuid() != 0:
        raise FleetError(f"{what} needs root (network namespaces, a bridge, veth pairs and cgroups): "
                         f"run it with sudo")


def run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise FleetError(f"`{' '.join(cmd)}` failed: {out.stderr.strip() or out.returncode}")
    return out


# --- namespaces and links ---------------------------------------------------------------------------

def namespaces() -> list[str]:
    out = run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def links() -> list[str]:
    out = run("ip", "-o", "link", "show", check=False).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]


def make_bridge(name: str, cidr: str | None = None) -> None:
    """A bridge, with ``cidr`` this machine's address on it (none: this machine is not on it)."""
    run("ip", "link", "add", name, "type", "bridge")
    # the bridge passes every multicast frame (mDNS) without waiting for IGMP reports
    run("ip", "link", "set", name, "type", "bridge", "mcast_snooping", "0")
    if cidr:
        run("ip", "addr", "add", cidr, "dev", name)
    run("ip", "link", "set", name, "up")


def make_namespace(name: str) -> None:
    run("ip", "netns", "add", name)
    ns(name, "ip", "link", "set", "lo", "up")


def ns(name: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return run("ip", "netns", "exec", name, *cmd, check=check)


def enter(name: str) -> list[str]:
    """The command prefix that runs a program inside namespace ``name``.  nsenter joins the network
    namespace only; ``ip netns exec`` would also mount a fresh /sys, which hides the cgroup
    filesystem (and with it the memory cap) from the program."""
    return ["nsenter", f"--net={NETNS_DIR / name}", "--"]


def plug(namespace: str, bridge: str, host_end: str, cidr: str, gateway: str | None = None,
         inner: str = "eth0") -> None:
    """A veth pair from ``bridge`` into ``namespace``, where its end is ``inner`` with ``cidr``."""
    tmp = host_end[:-1] + "x"  # the namespace's end, renamed once inside
    run("ip", "link", "add", host_end, "type", "veth", "peer", "name", tmp)
    run("ip", "link", "set", tmp, "netns", namespace)
    ns(namespace, "ip", "link", "set", tmp, "name", inner)
    ns(namespace, "ip", "addr", "add", cidr, "dev", inner)
    ns(namespace, "ip", "link", "set", inner, "up")
    run("ip", "link", "set", host_end, "master", bridge)
    run("ip", "link", "set", host_end, "up")
    if gateway:
        ns(namespace, "ip", "route", "add", "default", "via", gateway)


def set_link(name: str, up: bool) -> None:
    run("ip", "link", "set", name, "up" if up else "down")


def shape(device: str, rate_mbit: float, namespace: str | None = None) -> None:
    """Caps what ``device`` sends at ``rate_mbit`` with a token bucket (tc tbf)."""
    burst = max(16 << 10, int(rate_mbit * 1e6 / 8 / 250))  # a 4 ms bucket, at least 16 KiB
    cmd = ("tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{rate_mbit}mbit",
           "burst", str(burst), "latency", "100ms")
    if namespace:
        ns(namespace, *cmd)
    else:
        run(*cmd)


def pids_in(namespace: str) -> list[int]:
    out = run("ip", "netns", "pids", namespace, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def delete_namespace(name: str) -> None:
    end_pids(pids_in(name))
    run("ip", "netns", "del", name, check=False)


def delete_link(name: str) -> None:
    run("ip", "link", "del", name, check=False)


def end_pids(pids: list[int], timeout_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL what is left after ``timeout_s``: the processes of a run's own namespaces
    and cgroups."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout_s
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if Path(f"/proc/{p}").exists() and not _zombie(p)]
            time.sleep(0.05)
        if not pids:
            return


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


# --- cgroups --------------------------------------------------------------------------------------

def cgroup_v2() -> bool:
    return (CGROUP_ROOT / "cgroup.controllers").exists()


def _own_cgroup(controller: str) -> Path:
    """The v1 ``controller``'s folder of this process's cgroup: new cgroups go under it, so a limit
    that holds this process (a container, a service's slice) holds them too."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return CGROUP_ROOT / controller / path.lstrip("/")
    return CGROUP_ROOT / controller


def cgroup_dirs(name: str) -> list[Path]:
    """The folders cgroup ``name`` gets: one per controller on v1 (under this process's own cgroup),
    one under the root on v2 (where a cgroup with processes cannot have controlled children)."""
    if cgroup_v2():
        return [CGROUP_ROOT / name]
    return [_own_cgroup(c) / name for c in V1_CONTROLLERS]


def make_cgroup(name: str, memory_mb: int | None, cpus: str | None, cpu_quota: float | None = None) -> list[Path]:
    """A cgroup with a memory cap, a CPU set and a CPU quota (``cpu_quota`` cores' worth of time:
    0.2 is a fifth of one core); returns its folders, the memory controller's first."""
    if cgroup_v2():
        folder = CGROUP_ROOT / name
        wanted = " ".join(f"+{c}" for c in ("memory", "cpuset", "cpu") if c in
                          (CGROUP_ROOT / "cgroup.controllers").read_text().split())
        if wanted:
            (CGROUP_ROOT / "cgroup.subtree_control").write_text(wanted)
        folder.mkdir(exist_ok=True)
        if memory_mb:
            (folder / "memory.max").write_text(str(memory_mb << 20))
            if (folder / "memory.swap.max").exists():
                (folder / "memory.swap.max").write_text("0")
        if cpus:
            (folder / "cpuset.cpus").write_text(cpus)
        if cpu_quota:
            (folder / "cpu.max").write_text(f"{round(cpu_quota * CPU_PERIOD_US)} {CPU_PERIOD_US}")
        return [folder]
    memory, cpuset, cpu = cgroup_dirs(name)
    for folder in (memory, cpuset, cpu):
        folder.mkdir(exist_ok=True)
    if memory_mb:
        (memory / "memory.limit_in_bytes").write_text(str(memory_mb << 20))
    parent = cpuset.parent
    (cpuset / "cpuset.mems").write_text((parent / "cpuset.mems").read_text().strip())
    (cpuset / "cpuset.cpus").write_text(cpus or (parent / "cpuset.cpus").read_text().strip())
    if cpu_quota:
        (cpu / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
        (cpu / "cpu.cfs_quota_us").write_text(str(round(cpu_quota * CPU_PERIOD_US)))
    return [memory, cpuset, cpu]


def cpu_quota(folders: list[Path]) -> float | None:
    """The cores' worth of CPU time a cgroup made by ``make_cgroup`` may use (None: no quota)."""
    if cgroup_v2():
        quota, period = (folders[0] / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    quota = int((folders[2] / "cpu.cfs_quota_us").read_text())
    return None if quota < 0 else quota / int((folders[2] / "cpu.cfs_period_us").read_text())


def set_memory_cap(folders: list[Path], memory_mb: int) -> None:
    """Changes the memory cap of a cgroup made by ``make_cgroup`` (the PC gets or loses memory)."""
    name = "memory.max" if cgroup_v2() else "memory.limit_in_bytes"
    (folders[0] / name).write_text(str(memory_mb << 20))


def memory_used(folders: list[Path]) -> int:
    """Bytes the cgroup's processes use, not counting the page cache no process maps (as
    ``engine.limits.memory_limits`` counts)."""
    usage, cache, mapped = ("memory.current", "file", "file_mapped") if cgroup_v2() else \
        ("memory.usage_in_bytes", "total_cache", "total_mapped_file")
    stat = dict(row.split() for row in (folders[0] / "memory.stat").read_text().splitlines())
    return int((folders[0] / usage).read_text()) - int(stat.get(cache, 0)) + int(stat.get(mapped, 0))


def memory_anonymous(folders: list[Path]) -> int:
    """Bytes of the cgroup's memory no file backs: what the kernel cannot drop under the cap (no swap)."""
    stat = dict(row.split() for row in (folders[0] / "memory.stat").read_text().splitlines())
    return int(stat.get("anon" if cgroup_v2() else "total_rss", 0))


def oom_kills(folders: list[Path]) -> int:
    """Processes the kernel has killed for the cgroup's memory cap so far."""
    name = "memory.events" if cgroup_v2() else "memory.oom_control"
    rows = dict(row.split() for row in (folders[0] / name).read_text().splitlines())
    return int(rows.get("oom_kill", 0))


def move_into(folders: list[Path], pid: int) -> None:
    """Moves a running process, every thread of it, into the cgroup of ``folders`` (or back into the
    folders it came from)."""
    for folder in folders:
        (folder / "cgroup.procs").write_text(str(pid))


def cgroup_pids(folders: list[Path]) -> list[int]:
    pids: set[int] = set()
    for folder in folders:
        try:
            pids |= {int(p) for p in (folder / "cgroup.procs").read_text().split()}
        except OSError:
            pass
    return sorted(pids)


def delete_cgroup(folders: list[Path]) -> None:
    end_pids(cgroup_pids(folders))
    for folder in folders:
        for _ in range(50):  # a process just killed leaves its cgroup a moment later
            try:
                folder.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)


def cgroups(prefix: str, depth: int = 3) -> dict[str, list[Path]]:
    """The cgroups whose name starts with ``prefix``, anywhere within ``depth`` levels of each
    hierarchy's root (an earlier run may have sat in another cgroup): name -> folders."""
    found: dict[str, list[Path]] = {}
    roots = [CGROUP_ROOT] if cgroup_v2() else [CGROUP_ROOT / c for c in V1_CONTROLLERS]

    def walk(folder: Path, level: int) -> None:
        try:
            children = [p for p in folder.iterdir() if p.is_dir()]
        except OSError:
            return
        for child in children:
            if child.name.startswith(prefix):
                found.setdefault(child.name, []).append(child)
            elif level < depth:
                walk(child, level + 1)

    for root in roots:
        walk(root, 1)
    return found


def joiner(folders: list[Path]):
    """A ``preexec_fn`` that puts the new process into the cgroups of ``folders`` before it runs
    anything (so every child it starts is in them too)."""
    paths = [str(p / "cgroup.procs") for p in folders]

    def join() -> None:
        for path in paths:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, b"0")  # "0": the writing process itself
            finally:
                os.close(fd)
    return join
