"""An office whose network drops multicast (as Wi-Fi with client isolation, or a switch, does): two
PCs, each a network namespace, the desk (where the admin runs ``fleet``) and pc1 (running its node
agent), on a bridge whose ports flood no multicast (``bridge link set ... mcast_flood off``).  This
machine is not on that bridge, so nothing it sends reaches them.  mDNS, which finds the other PC
before the drop, finds nothing after it; the join code and the subnet scan (``fleet nodes join``,
``fleet nodes scan``, run on the desk as its user would) both find it, and ``fleet nodes why`` says
no multicast is seen from other PCs.  Needs root; everything it makes is named like a simulated
office's (``fsim<pid>…``) and removed afterwards, also after a failure (or by the next office, were
this process killed)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from engine.fleet.sim import netns
from engine.fleet.sim.office import PREFIX, clean_leftovers
from engine.fleetkey import create_key
from engine.launch import FleetProcess, fleet_command, stop_all

pytestmark = pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0,
                                reason="an office of network namespaces needs root")

PCS = ("desk", "pc1")
SUBNET = "10.214.77"  # the bridge is private to the namespaces: no route of this machine leads to it
PORT = 7390


class QuietOffice:
    """Two namespaces on a bridge this machine has no address on, pc1 running ``fleet agent``."""

    def __init__(self, root: Path, key_file: Path):
        self.root, self.key_file = root, key_file
        self.tag = f"{PREFIX}{os.getpid()}Q"
        self.bridge = f"{self.tag}a"
        self.ports = [f"{self.tag}h{i}" for i in range(len(PCS))]
        self.ips = {name: f"{SUBNET}.{i + 1}" for i, name in enumerate(PCS)}
        self.agents: list[FleetProcess] = []

    def namespace(self, name: str) -> str:
        return f"{self.tag}-{name}"

    def __enter__(self) -> "QuietOffice":
        clean_leftovers()
        try:
            netns.make_bridge(self.bridge)  # no address: this machine is not on it
            for i, name in enumerate(PCS):
                netns.make_namespace(self.namespace(name))
                netns.plug(self.namespace(name), self.bridge, self.ports[i], f"{self.ips[name]}/24")
            for name in PCS[1:]:  # the desk runs no agent: what it finds is the other PC's
                agent = FleetProcess(["agent", "--listen", f"0.0.0.0:{PORT}", "--name", name, "--fleet-key-file",
                                      str(self.key_file)], self.root / name / "agent.log",
                                     prefix=netns.enter(self.namespace(name)), env=self.env(name))
                self.agents.append(agent.start())
            for agent in self.agents:
                agent.wait_ready(90)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        stop_all(self.agents, timeout_s=15)
        for name in [n for n in netns.namespaces() if n.startswith(self.tag + "-")]:
            netns.delete_namespace(name)
        for name in [n for n in netns.links() if n.startswith(self.tag)]:
            netns.delete_link(name)

    def drop_multicast(self) -> None:
        """The bridge floods no multicast to its ports from now on (mDNS's 224.0.0.251 included)."""
        for port in self.ports:
            netns.run("bridge", "link", "set", "dev", port, "mcast_flood", "off")

    def env(self, name: str, home: str = "home") -> dict:
        return {**os.environ, "FLEETSHARD_HOME": str(self.root / name / home)}

    def fleet(self, name: str, *args: str, home: str = "home", timeout_s: float = 120) -> subprocess.CompletedProcess:
        """``fleet ARGS`` run on PC ``name`` (its namespace, its settings in ``home``), with the fleet key."""
        command, *rest = args
        return subprocess.run([*netns.enter(self.namespace(name)),
                               *fleet_command(command, "--fleet-key-file", str(self.key_file), *rest)],
                              capture_output=True, text=True, timeout=timeout_s, env=self.env(name, home))


def nodes(office: QuietOffice, home: str = "cli") -> list[dict]:
    out = office.fleet("desk", "nodes", "--json", "--seconds", "5", home=home)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_where_the_network_drops_multicast_the_join_code_and_the_scan_find_the_pc_and_why_says_so(tmp_path):
    key_file = create_key(tmp_path / "fleet.key")
    with QuietOffice(tmp_path, key_file) as office:
        # before the drop, mDNS across the bridge finds the other PC: the drop is what stops it
        assert [(n["name"], n["source"]) for n in nodes(office)] == [("pc1", "mdns")]
        office.drop_multicast()
        assert nodes(office) == [], "mDNS still finds the other PC: the bridge passes multicast"

        why = office.fleet("desk", "nodes", "--seconds", "5", "why", "--json", home="cli")
        said = json.loads(why.stdout)
        assert said["found"] == 0 and "no-multicast" in said["codes"], said
        assert "No multicast seen from any other PC" in " ".join(said["lines"])

        # the join code: copied on pc1, pasted on the desk
        code = office.fleet("pc1", "nodes", "join-code", "--port", str(PORT))
        assert code.returncode == 0 and code.stdout.startswith("FS-"), code.stderr
        joined = office.fleet("desk", "nodes", "join", code.stdout.strip(), home="cli")
        assert joined.returncode == 0 and f"{office.ips['pc1']}:{PORT}: pc1 (" in joined.stderr, joined.stderr
        found = nodes(office)
        assert [(n["name"], n["source"], n["addresses"]) for n in found] == [("pc1", "known", [office.ips["pc1"]])]

        # the scan, from settings that know no node: the desk's /24, its own address left out
        scanned = office.fleet("desk", "nodes", "scan", "--port", str(PORT), home="scan")
        assert scanned.returncode == 0, scanned.stderr
        assert f"{office.ips['pc1']}:{PORT}: pc1 (" in scanned.stderr and "1 node(s) found" in scanned.stderr, \
            scanned.stderr
        assert [n["name"] for n in nodes(office, home="scan")] == ["pc1"]

        # found now, and still no multicast seen
        why = office.fleet("desk", "nodes", "--seconds", "5", "why", "--json", home="scan")
        said = json.loads(why.stdout)
        assert said["found"] == 1 and "no-multicast" in said["codes"], said
    assert not [n for n in netns.namespaces() + netns.links() if n.startswith(office.tag)]
