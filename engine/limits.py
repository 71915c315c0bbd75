"""What this process may use of its machine: the memory its cgroup lets it have (Linux cgroups v1
or v2: a container, a service's slice, a simulated PC of ``engine.fleet.sim.office``) and the CPUs it may
run on.  A node's facts (``engine.fleet.node``) and a device's profile (``engine.fleet.profile``)
report these rather than the host's, so a capped PC is planned as the PC it is, and a paged stage
(``engine.runtime.stages.paged``) compiles a further graph only with memory to spare.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")  # where the kernel's cgroup filesystems are mounted
OWN_CGROUP = Path("/proc/self/cgroup")  # this process's cgroup in each hierarchy
NO_LIMIT = 1 << 60  # v1 says "no limit" with a huge number (the largest page-aligned int64)


@dataclasses.dataclass(frozen=True)
class MemoryLimit:
    """One memory limit over this process (its cgroup's or an ancestor's), in bytes."""

    limit: int
    headroom: int  # the limit less the usage, not counting the page cache no process maps


def memory_limits() -> list[MemoryLimit]:
    """Each memory limit of this process's cgroup and its ancestors; empty where none applies.
    The page cache no process maps (files read or written earlier) does not count as used: the
    kernel drops it under the limit."""
    try:
        lines = OWN_CGROUP.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" and (CGROUP_ROOT / "cgroup.controllers").exists():
            files = ("memory.max", "memory.current", "file", "file_mapped")
            folder = CGROUP_ROOT / path.lstrip("/")
        elif "memory" in controllers.split(","):
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache", "total_mapped_file")
            folder = CGROUP_ROOT / "memory" / path.lstrip("/")
        else:
            continue
        while folder.is_relative_to(CGROUP_ROOT):
            try:
                limit = (folder / files[0]).read_text().strip()
                if limit != "max" and int(limit) < NO_LIMIT:
                    usage = int((folder / files[1]).read_text())
                    stat = dict(row.split() for row in (folder / "memory.stat").read_text().splitlines())
                    cache = int(stat.get(files[2], 0)) - int(stat.get(files[3], 0))
                    found.append(MemoryLimit(int(limit), max(0, int(limit) - usage + cache)))
            except (OSError, ValueError):
                pass
            if folder == CGROUP_ROOT or folder.parent == folder:
                break
            folder = folder.parent
    return found


def process_memory() -> tuple[int, int]:
    """(total, available) bytes of memory for this process: the machine's, within its cgroup limits."""
    memory, limits = psutil.virtual_memory(), memory_limits()
    return (min([int(memory.total), *(m.limit for m in limits)]),
            min([int(memory.available), *(m.headroom for m in limits)]))


def process_cores() -> int:
    """Logical CPUs this process may run on (its affinity: a cpuset, taskset), else the machine's."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no sched_getaffinity on Windows and macOS
        return psutil.cpu_count() or os.cpu_count() or 1
