"""A node inside a memory-capped cgroup with a CPU set (a simulated PC) reports the cgroup's memory and its
CPUs, not the host's: read from fake cgroup v1 and v2 trees, and, as root on cgroup v1, from a real cgroup
of 300 MB holding a real process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import limits
from engine.fleet import node
from engine.fleet.sim import netns

MB = 1 << 20


def _write(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


@pytest.fixture
def v2_tree(tmp_path, monkeypatch):
    """A cgroup v2 tree: this process in /office/pc1 (300 MB, 100 MB used of which 40 MB unmapped page
    cache), under /office (no limit) and /office's parent limit of 1 GB on the way up."""
    root = tmp_path / "cgroup"
    _write(root, {"cgroup.controllers": "cpuset memory\n"})
    _write(root / "lab", {"memory.max": str(1024 * MB), "memory.current": str(200 * MB),
                          "memory.stat": "anon 1\nfile 0\nfile_mapped 0\n"})
    _write(root / "lab" / "office", {"memory.max": "max\n", "memory.current": str(100 * MB), "memory.stat": "file 0\n"})
    _write(root / "lab" / "office" / "pc1", {"memory.max": f"{300 * MB}\n", "memory.current": str(100 * MB),
                                             "memory.stat": f"anon 5\nfile {50 * MB}\nfile_mapped {10 * MB}\n"})
    own = tmp_path / "self-cgroup"
    own.write_text("0::/lab/office/pc1\n")
    monkeypatch.setattr(limits, "CGROUP_ROOT", root)
    monkeypatch.setattr(limits, "OWN_CGROUP", own)


@pytest.fixture
def v1_tree(tmp_path, monkeypatch):
    """A cgroup v1 tree: this process's memory cgroup /box/pc2 (300 MB, 120 MB used, 20 MB of it unmapped
    page cache), /box with v1's "no limit" number; other controllers elsewhere."""
    root = tmp_path / "cgroup"
    _write(root / "memory", {"memory.limit_in_bytes": "9223372036854771712\n", "memory.usage_in_bytes": "1",
                             "memory.stat": "total_cache 0\n"})
    _write(root / "memory" / "box", {"memory.limit_in_bytes": "9223372036854771712\n",
                                     "memory.usage_in_bytes": str(500 * MB), "memory.stat": "total_cache 0\n"})
    _write(root / "memory" / "box" / "pc2", {
        "memory.limit_in_bytes": f"{300 * MB}\n", "memory.usage_in_bytes": str(120 * MB),
        "memory.stat": f"cache 1\ntotal_cache {30 * MB}\ntotal_mapped_file {10 * MB}\n"})
    own = tmp_path / "self-cgroup"
    own.write_text("9:name=systemd:/\n4:memory:/box/pc2\n3:cpuset:/\n0::/\n")
    monkeypatch.setattr(limits, "CGROUP_ROOT", root)
    monkeypatch.setattr(limits, "OWN_CGROUP", own)


def test_cgroup_v2_limits_are_read_up_the_tree(v2_tree):
    assert limits.memory_limits() == [limits.MemoryLimit(300 * MB, 240 * MB), limits.MemoryLimit(1024 * MB, 824 * MB)]
    total, available = limits.process_memory()
    assert total == 300 * MB and available == 240 * MB


def test_cgroup_v1_limits_skip_the_no_limit_number(v1_tree):
    assert limits.memory_limits() == [limits.MemoryLimit(300 * MB, 200 * MB)]
    assert limits.process_memory() == (300 * MB, 200 * MB)


def test_no_cgroup_file_means_the_machines_memory(tmp_path, monkeypatch):
    import psutil

    monkeypatch.setattr(limits, "OWN_CGROUP", tmp_path / "missing")
    assert limits.memory_limits() == []
    assert limits.process_memory()[0] == psutil.virtual_memory().total


def test_node_facts_report_the_cgroup_memory_and_the_cpus_it_may_use(v2_tree, monkeypatch):
    monkeypatch.setattr(node, "_openvino_devices", lambda: ("", []))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1})
    info = node.local_node_info(1234, "0" * 12, "pc1", node="0" * 16)
    assert (info.memory_mb, info.available_mb, info.cores) == (300, 240, 1)
    assert info.to_txt()["mem"] == "300" and info.to_txt()["avail"] == "240"
    # a demo node's simulated device caps what is available at its own memory
    small = node.SimulatedDevice("GPU", "tiny GPU", 100)
    assert node.local_node_info(1234, "0" * 12, node="0" * 16, simulated=small).available_mb == 100


PRINT_FACTS = ("from engine.fleet.node import local_node_info\n"
               "info = local_node_info(1, '0' * 12, node='0' * 16)\n"
               "print(info.memory_mb, info.available_mb, info.cores)\n")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0 or not Path("/sys/fs/cgroup/memory").is_dir()
                    or Path("/sys/fs/cgroup/cgroup.controllers").exists(),
                    reason="needs root and cgroup v1's memory controller")
def test_a_node_in_a_real_300_mb_cgroup_reports_300_mb_and_its_cpu():
    folders = netns.make_cgroup(f"fstest-limits-{os.getpid()}", 300, "0")
    try:
        out = subprocess.run([sys.executable, "-c", PRINT_FACTS], capture_output=True, text=True, timeout=120,
                             preexec_fn=netns.joiner(folders))
        assert out.returncode == 0, out.stderr[-2000:]
        memory_mb, available_mb, cores = map(int, out.stdout.split())
        assert memory_mb == 300 and 0 < available_mb < 300 and cores == 1, out.stdout
    finally:
        netns.delete_cgroup(folders)
    assert not any(folder.exists() for folder in folders)
