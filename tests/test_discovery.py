"""Node facts and mDNS discovery: TXT encoding and its hostile inputs, the fleet id, real zeroconf
traffic between processes and between network namespaces, and the checks of records against agents
that do not prove the key, or stall."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from zeroconf import DNSOutgoing, IPVersion, ServiceInfo, Zeroconf
from zeroconf.const import _FLAGS_AA, _FLAGS_QR_RESPONSE

from engine.config import FleetAccess
from engine.errors import FleetError
from engine.fleet import discovery
from engine.fleet.discovery import SERVICE, Advertiser, Browser
from engine.fleet.node import MAX_ENTRY, BadRecord, NodeInfo, local_node_info, node_id
from engine.fleetkey import fleet_id

ROOT = Path(__file__).resolve().parents[1]
WAIT = 10.0

# Advertises the NodeInfo given as JSON (on the addresses given as a JSON list, else the defaults)
# until SIGTERM, then closes the Advertiser so its goodbye goes out.
ADVERTISE = r"""
import json, signal, sys, threading
from engine.fleet.discovery import Advertiser
from engine.fleet.node import NodeInfo

stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
addresses = json.loads(sys.argv[2]) if len(sys.argv) > 2 else None
with Advertiser(NodeInfo.from_json(sys.argv[1]), addresses) as advertiser:
    print("ready", advertiser.service_name, flush=True)
    while not stop.wait(0.1):
        pass
print("closed", flush=True)
"""

# Browses until the node id in argv[1] shows up (or 15 s pass) and prints every node found as JSON.
FIND = r"""
import json, sys, time
from engine.errors import FleetError
from engine.fleet.discovery import Browser

try:
    with Browser() as browser:
        deadline = time.monotonic() + 15
        while sys.argv[1] not in browser.nodes() and time.monotonic() < deadline:
            time.sleep(0.05)
        print(json.dumps([json.loads(n.to_json()) for n in browser.nodes().values()]), flush=True)
except FleetError as exc:
    print(json.dumps({"error": str(exc)}), flush=True)
"""

# Browses with the default addresses (following the interfaces) and prints "browsing ADDRESSES",
# then a line per event ("added NODE_ID ADDRESSES", "removed NODE_ID"), until SIGTERM.
WATCH = r"""
import signal, threading
from engine.fleet.discovery import Browser

stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
show = lambda kind, info: print(kind, info.node_id, ",".join(info.addresses), flush=True)
with Browser(on_event=show) as browser:
    print("browsing", ",".join(browser.addresses), flush=True)
    while not stop.wait(0.1):
        pass
"""


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETSHARD_HOME", str(tmp_path))
    return tmp_path


def sample(fleet: str = "0123456789ab", **changes) -> NodeInfo:
    info = NodeInfo(node_id=secrets.token_hex(8), name="alice-pc", os="Windows 11",
                    cpu="Intel(R) Core(TM) Ultra 7 155H", cores=22, memory_mb=32000, available_mb=21000,
                    openvino="2026.4.1",
                    devices=[{"name": "CPU", "full_name": "Intel(R) Core(TM) Ultra 7 155H", "memory_mb": None},
                             {"name": "GPU.0", "full_name": "Intel(R) Arc(TM) Graphics (iGPU)", "memory_mb": 18000},
                             {"name": "NPU", "full_name": "", "memory_mb": None}],
                    port=7461, fleet_id=fleet, int8_dot="AVX-VNNI")
    return dataclasses.replace(info, **changes)


def as_bytes(txt: dict[str, str]) -> dict[bytes, bytes]:
    return {k.encode(): v.encode() for k, v in txt.items()}


def wait_for(predicate, seconds: float = WAIT):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    return predicate()


def test_txt_round_trip():
    info = sample(status="busy")
    txt = info.to_txt()
    assert all(len(k) + 1 + len(v.encode()) <= MAX_ENTRY for k, v in txt.items())
    assert txt["dev"] == "CPU,GPU.0:18000,NPU"
    back = NodeInfo.from_txt("alice-pc (abc)._fleetshard._tcp.local.", as_bytes(txt), ["10.0.0.5", "bogus"], 7461)
    assert back == dataclasses.replace(info, addresses=["10.0.0.5"])


def test_long_strings_are_clipped_to_fit_a_txt_entry():
    worst = sample(name="N" * 400, os="O" * 400, cpu="é" * 300, openvino="v" * 99, status="s" * 99,
                   cores=10**12 - 1, memory_mb=10**12 - 1, available_mb=10**12 - 1,
                   devices=[{"name": "GPU" + "X" * 29, "full_name": "x" * 500, "memory_mb": 10**12 - 1}] * 20)
    txt = worst.to_txt()
    assert all(len(k) + 1 + len(v.encode()) <= MAX_ENTRY for k, v in txt.items())
    back = NodeInfo.from_txt("n", as_bytes(txt), [], 1)  # the worst case we send is one we accept
    assert back.cpu == "é" * 63 and len(back.name) == 63 and len(back.devices) == 5
    assert back.devices[4] == {"name": "GPU" + "X" * 29, "full_name": "x" * 63, "memory_mb": 10**12 - 1}
    many = NodeInfo.from_txt("n", as_bytes(sample(devices=[{"name": "GPU.1", "full_name": "", "memory_mb": 8}] * 20)
                                           .to_txt()), [], 1)
    assert len(many.devices) == 8


@pytest.mark.parametrize("mutate, reason", [
    (lambda t: t.pop(b"id"), "lacks 'id'"),
    (lambda t: t.update({b"id": b"../../etc"}), "'id' is malformed"),
    (lambda t: t.update({b"fleet": b"0123"}), "'fleet' is malformed"),
    (lambda t: t.update({b"mem": b"-5"}), "'mem' is malformed"),
    (lambda t: t.update({b"cores": b"9" * 40}), "'cores' is malformed"),
    (lambda t: t.update({b"name": b"x" * 300}), "is 305 bytes (at most 255)"),
    (lambda t: t.update({b"cpu": b"\xff\xfe"}), "is not text"),
    (lambda t: t.update({b"os": b"Linux\x00"}), "control characters"),
    (lambda t: t.update({b"dev": b"CPU,GPU.0:lots"}), "device entry 'GPU.0:lots' is malformed"),
    (lambda t: t.update({b"i8": b"<b>VNNI</b>"}), "'i8' is malformed"),
    (lambda t: t.update({b"kp": b"GGML!"}), "'kp' is malformed"),
    (lambda t: t.update({b"dev": b",".join([b"CPU"] * 9)}), "9 devices"),
    (lambda t: t.update({f"x{i}".encode(): b"" for i in range(50)}), "TXT entries (at most 40)"),
    (lambda t: t.update({f"x{i}".encode(): b"y" * 200 for i in range(8)}), "TXT record is"),
])
def test_malformed_or_oversized_txt_is_refused_with_a_reason(mutate, reason):
    txt = as_bytes(sample().to_txt())
    mutate(txt)
    with pytest.raises(BadRecord, match="node 'alice-pc'") as err:
        NodeInfo.from_txt("alice-pc._fleetshard._tcp.local.", txt, [], 7461)
    assert reason in str(err.value)


def test_a_cpus_int8_dot_products_are_read_from_its_flags_and_reported():
    from engine.hostcpu import NONE, int8_dot

    def flags(*names):
        return "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 " + " ".join(names) + "\n"

    assert int8_dot(flags()) == NONE  # AVX2 alone: OpenVINO multiplies in float
    assert int8_dot(flags("avx_vnni")) == "AVX-VNNI"  # Meteor Lake's, without AVX-512
    assert int8_dot(flags("avx512f", "avx512_vnni", "amx_tile", "amx_int8")) == "AMX"
    assert int8_dot(flags("avx512f", "avx512_vnni")) == "AVX-512 VNNI"
    info = local_node_info(7461, "0123456789ab")
    assert info.int8_dot == int8_dot() and info.to_txt().get("i8", "") == info.int8_dot
    # an older node says nothing: unknown, not "none"
    older = {k: v for k, v in as_bytes(sample().to_txt()).items() if k != b"i8"}
    assert NodeInfo.from_txt("n", older, [], 1).int8_dot == ""


def test_a_node_says_which_kernels_run_its_matrices():
    """The record names the kernel path its CPU stages take (ours where the extension runs here,
    OpenVINO's own elsewhere); a CPU without int8 dot products is slow only on OpenVINO's own, or
    where an older node does not say."""
    from engine import kernels
    from engine.fleet.node import runs_slowly
    from engine.hostcpu import NONE
    from engine.runtime.stages.stage import core

    info = local_node_info(7461, "0123456789ab")
    assert info.kernels == kernels.path(core())[0] and info.to_txt()["kp"] == info.kernels
    assert NodeInfo.from_txt("n", as_bytes(info.to_txt()), [], 1).kernels == info.kernels
    older = {k: v for k, v in as_bytes(info.to_txt()).items() if k != b"kp"}
    assert NodeInfo.from_txt("n", older, [], 1).kernels == ""
    assert [runs_slowly(NONE, path) for path in (kernels.GGML, kernels.STOCK, "")] == [False, True, True]
    assert not runs_slowly("AVX-VNNI", kernels.STOCK)


def test_bad_port_and_unknown_keys():
    txt = as_bytes(sample().to_txt())
    with pytest.raises(BadRecord, match="port 0"):
        NodeInfo.from_txt("n", txt, [], 0)
    txt[b"future"] = b"something"  # a newer node's extra fields are ignored
    assert NodeInfo.from_txt("n", txt, [], 1).port == 1


def test_json_round_trip_and_type_checks():
    info = sample(addresses=["10.0.0.5"])
    assert NodeInfo.from_json(info.to_json()) == info
    bad = json.loads(info.to_json()) | {"memory_mb": "lots"}
    with pytest.raises(BadRecord, match="memory_mb"):
        NodeInfo.from_json(json.dumps(bad))
    with pytest.raises(BadRecord):
        NodeInfo.from_json(json.dumps({"node_id": "abcdef12"}))


def test_fleet_id_is_stable_short_and_hides_the_key():
    key = bytes(range(32))
    fid = fleet_id(key)
    assert fid == fleet_id(bytes(range(32))) and len(fid) == 12 and int(fid, 16) >= 0
    assert fid != fleet_id(bytes(range(1, 33)))
    assert fid not in key.hex() and key.hex()[:12] != fid


def test_node_id_is_made_once_and_kept(home, monkeypatch):
    first = node_id()
    assert (home / "config" / "node.id").read_text().strip() == first and node_id() == first
    monkeypatch.setenv("FLEETSHARD_HOME", str(home / "other"))
    assert node_id() != first


def test_local_node_info_describes_this_machine():
    info = local_node_info(7461, "0123456789ab")
    assert info.node_id == node_id() and info.name and info.cpu and info.cores >= 1
    assert 0 < info.available_mb <= info.memory_mb and info.os.split()[0] in ("Linux", "Windows", "macOS", "Darwin")
    assert info.openvino and any(d["name"] == "CPU" for d in info.devices)
    assert NodeInfo.from_txt("x", as_bytes(info.to_txt()), [], 7461) == info


def spawn(code: str, *args: str, netns: str | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-c", code, *args]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    return subprocess.Popen(cmd, cwd=ROOT, env=os.environ.copy(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def ready(proc: subprocess.Popen) -> str:
    """Waits for the advertiser's "ready" line (a child that dies or hangs instead fails the test)."""
    line = proc.stdout.readline() if select.select([proc.stdout], [], [], 30)[0] else "(silent for 30 s)"
    if not line.startswith("ready"):
        proc.kill()
        pytest.fail(f"advertiser did not start: {line!r} {proc.stderr.read()}")
    return line.split(" ", 1)[1].strip()


def stop(proc: subprocess.Popen) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=WAIT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out + err


@pytest.mark.skipif(sys.platform == "win32", reason="needs SIGTERM to reach the advertiser (POSIX only)")
def test_nodes_find_each_other_across_processes_and_other_fleets_are_ignored():
    ours, theirs = fleet_id(secrets.token_bytes(32)), fleet_id(secrets.token_bytes(32))
    node, stranger = sample(ours, name="bob-pc"), sample(theirs, name="eve-pc")
    events: list[tuple[str, str]] = []
    lock = threading.Lock()

    def record(kind: str, info: NodeInfo) -> None:
        with lock:
            events.append((kind, info.node_id))

    procs = []
    with Browser(fleet_id=ours, on_event=record) as mine, Browser() as everyone:
        try:
            procs = [spawn(ADVERTISE, node.to_json()), spawn(ADVERTISE, stranger.to_json())]
            assert ready(procs[0]).startswith("bob-pc (")
            ready(procs[1])
            seen = wait_for(lambda: mine.nodes().get(node.node_id))
            assert seen, f"not discovered within {WAIT} s; rejected: {mine.rejected()}"
            assert dataclasses.replace(seen, addresses=[]) == node
            assert "127.0.0.1" in seen.addresses and seen.addresses[-1] == "127.0.0.1"

            assert wait_for(lambda: stranger.node_id in everyone.nodes()), "the other fleet's node never showed"
            assert stranger.node_id not in mine.nodes()

            code, output = stop(procs[0])
            assert code == 0 and "closed" in output, output
            # The goodbye makes the departure immediate, far below the record's TTL.
            assert wait_for(lambda: ("removed", node.node_id) in events), events
            assert node.node_id not in mine.nodes()
            with lock:
                assert events == [("added", node.node_id), ("removed", node.node_id)]
        finally:
            for proc in procs:
                stop(proc)


def test_update_reaches_browsers():
    info = sample(fleet_id(secrets.token_bytes(32)))
    seen = []
    with Browser(fleet_id=info.fleet_id, on_event=lambda kind, i: seen.append((kind, i.status, i.available_mb))):
        with Advertiser(info) as advertiser:
            assert wait_for(lambda: ("added", "ready", 21000) in seen), seen
            advertiser.update(dataclasses.replace(info, status="busy", available_mb=1234))
            assert wait_for(lambda: ("updated", "busy", 1234) in seen), seen


def test_malformed_record_on_the_network_is_skipped_with_its_reason():
    fid = fleet_id(secrets.token_bytes(32))
    txt = sample(fid).to_txt() | {"mem": "a lot"}
    name = f"broken ({secrets.token_hex(3)}).{SERVICE}"
    zc = Zeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    try:
        with Browser(fleet_id=fid) as browser:
            zc.register_service(ServiceInfo(SERVICE, name, port=7461, properties=txt,
                                            server="broken.local.", parsed_addresses=["127.0.0.1"]))
            reason = wait_for(lambda: browser.rejected().get(name))
            assert reason and "'mem' is malformed" in reason
            assert browser.nodes() == {}
    finally:
        zc.close()


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def namespaces():
    """Two network namespaces joined by a veth pair, 10.77.0.1/24 and 10.77.0.2/24; removed afterwards."""
    tag = secrets.token_hex(3)
    names = [f"fs-{tag}-a", f"fs-{tag}-b"]
    made = []
    try:
        for ns in names:
            try:
                proc = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
            except FileNotFoundError as exc:
                pytest.skip(f"`ip netns add` failed: {exc}")
            if proc.returncode != 0:
                pytest.skip(f"`ip netns add` failed: {proc.stderr.strip() or proc.returncode}")
            made.append(ns)
        ip("link", "add", f"fsv{tag}a", "netns", names[0], "type", "veth", "peer", "name", f"fsv{tag}b",
           "netns", names[1])
        for ns, side, address in ((names[0], "a", "10.77.0.1"), (names[1], "b", "10.77.0.2")):
            dev = f"fsv{tag}{side}"
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "route", "add", "224.0.0.0/4", "dev", dev)
        yield names
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_discovery_between_network_namespaces(namespaces):
    info = sample(fleet_id(secrets.token_bytes(32)), name="carol-pc")
    advertiser = spawn(ADVERTISE, info.to_json(), netns=namespaces[0])
    try:
        ready(advertiser)
        finder = spawn(FIND, info.node_id, netns=namespaces[1])
        out, err = finder.communicate(timeout=30)
        found = {n["node_id"]: n for n in json.loads(out)}
        assert info.node_id in found, f"not found from the other namespace: {out} {err}"
        node = found[info.node_id]
        assert node["addresses"] == ["10.77.0.1", "127.0.0.1"] and node["port"] == info.port
        assert node["name"] == "carol-pc" and node["memory_mb"] == info.memory_mb
    finally:
        code, output = stop(advertiser)
    assert code == 0 and "closed" in output, output


def veth(ns: str) -> str:
    """The ``namespaces`` fixture's veth end inside ``ns`` (fs-TAG-a holds fsvTAGa)."""
    _, tag, side = ns.split("-")
    return f"fsv{tag}{side}"


def link(ns: str, state: str) -> None:
    ip("-n", ns, "link", "set", veth(ns), state)
    if state == "up":  # a link going down takes its routes along
        ip("-n", ns, "route", "replace", "224.0.0.0/4", "dev", veth(ns))


def lines(proc: subprocess.Popen, seconds: float):
    """The child's lines as they come, for ``seconds`` or until its output ends."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0 and select.select([proc.stdout], [], [], left)[0]:
        line = proc.stdout.readline()
        if not line:
            return
        yield line.strip()


def expect(proc: subprocess.Popen, start: str, seconds: float = 30) -> str:
    """The child's next line that starts with ``start`` (lines before it are passed over)."""
    seen = []
    for line in lines(proc, seconds):
        if line.startswith(start):
            return line
        seen.append(line)
    proc.kill()
    pytest.fail(f"no {start!r} line within {seconds} s; got {seen} {proc.stderr.read()}")


def test_discovery_follows_interfaces_that_come_and_go(namespaces):
    # Two laptops whose agent and fleet view start before their network is up, then join it; the
    # advertising one joins a second network that flaps, which browsers must not see; later the
    # browsing one leaves without a goodbye reaching it.
    a, b = namespaces
    for ns in namespaces:
        link(ns, "down")
    info = sample(fleet_id(secrets.token_bytes(32)), name="dave-pc")
    watcher = spawn(WATCH, netns=b)
    advertiser = spawn(ADVERTISE, info.to_json(), netns=a)
    try:
        assert expect(watcher, "browsing") == "browsing 127.0.0.1"
        ready(advertiser)
        for ns in namespaces:
            link(ns, "up")
        added = expect(watcher, f"added {info.node_id}")
        assert added.split()[2] == "10.77.0.1,127.0.0.1", added
        # The advertising laptop joins a second network, whose link then flaps: down for most of
        # each cycle but never for SETTLE_S.  Some interface check sees it down, and without the
        # settling the advertiser would say goodbye on the first network and announce again.
        second = f"{veth(a)}d"
        ip("-n", a, "link", "add", second, "type", "veth", "peer", "name", f"{veth(a)}e")
        ip("-n", a, "addr", "add", "10.78.0.1/24", "dev", second)
        ip("-n", a, "link", "set", f"{veth(a)}e", "up")
        ip("-n", a, "link", "set", second, "up")
        moved = expect(watcher, f"added {info.node_id}", discovery.WATCH_S + discovery.SETTLE_S + 10)
        assert moved.split()[2] == "10.77.0.1,10.78.0.1,127.0.0.1", moved
        for _ in range(5):
            ip("-n", a, "link", "set", second, "down")
            time.sleep(discovery.SETTLE_S * 2 / 3)
            ip("-n", a, "link", "set", second, "up")
            time.sleep(discovery.SETTLE_S / 6)
        flapped = list(lines(watcher, discovery.WATCH_S + discovery.SETTLE_S + 3))
        assert not [e for e in flapped if info.node_id in e], flapped
        link(b, "down")
        expect(watcher, f"removed {info.node_id}", discovery.WATCH_S + discovery.SETTLE_S + discovery.RECONFIRM_S + 10)
    finally:
        stop(watcher)
        code, output = stop(advertiser)
    assert code == 0 and "closed" in output, output


def test_a_host_without_multicast_gets_a_readable_error(namespaces):
    # A namespace whose only interface, lo, is down: nothing can join the mDNS group.
    lonely = namespaces[0] + "-x"
    ip("netns", "add", lonely)
    try:
        finder = spawn(FIND, "0" * 16, netns=lonely)
        out, err = finder.communicate(timeout=30)
        assert "cannot start mDNS on 127.0.0.1" in json.loads(out)["error"], out + err
    finally:
        subprocess.run(["ip", "netns", "del", lonely], capture_output=True)


def test_no_usable_interface_is_a_fleet_error():
    with pytest.raises(FleetError, match="cannot start mDNS"):
        discovery._open(["203.0.113.77"])  # not an address of this machine


# --- records that lie: a known node cannot be moved, a bogus record never fails `--nodes all`, a flood is bounded

def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def announce(zc: Zeroconf, info: NodeInfo, tag: str) -> str:
    """Registers ``info`` as a record of its own on 127.0.0.1 (as anyone on the LAN can); returns its name."""
    name = f"{tag} ({secrets.token_hex(3)}).{SERVICE}"
    zc.register_service(ServiceInfo(SERVICE, name, port=info.port, properties=info.to_txt(),
                                    server=f"{tag}-{secrets.token_hex(3)}.local.", parsed_addresses=["127.0.0.1"]))
    return name


def send_record(zc: Zeroconf, service: ServiceInfo) -> None:
    """Sends ``service``'s records unasked, at once (no probing first), as anyone on the LAN can."""
    out = DNSOutgoing(_FLAGS_QR_RESPONSE | _FLAGS_AA)
    for answer in (service.dns_pointer(), service.dns_service(), service.dns_text(), *service.dns_addresses()):
        out.add_answer_at_time(answer, 0)
    zc.send(out)


def shout(zc: Zeroconf, info: NodeInfo, tag: str) -> str:
    """``info`` as a record at 127.0.0.1 of its own, sent at once (``send_record``); returns its name."""
    name = f"{tag} ({secrets.token_hex(3)}).{SERVICE}"
    send_record(zc, ServiceInfo(SERVICE, name, port=info.port, properties=info.to_txt(),
                                server=f"{tag}-{secrets.token_hex(3)}.local.", parsed_addresses=["127.0.0.1"]))
    return name


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_a_record_whose_agent_trickles_its_answer_holds_up_no_other_record():
    """A keyless host answers a record's check a byte at a time (issue 82, finding 1): the check runs off
    zeroconf's thread, so a record heard meanwhile is handled at once; the slow check ends at its
    deadline with the reason; the browser closes at once while another such check is under way."""
    from fleet_support import Trickler

    key = secrets.token_bytes(32)
    fid = fleet_id(key)
    zc = Zeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    try:
        with Trickler() as trickler:  # a byte every 0.1 s, for 6 s
            browser = Browser(fid, addresses=["127.0.0.1"],
                              verify=discovery.prover(FleetAccess(key), timeout_s=2.0)).start()
            try:
                slow = shout(zc, sample(fid, name="slow", port=trickler.port), "slow")
                assert trickler.accepted.wait(WAIT), browser.rejected()  # its check is under way
                gone = shout(zc, sample(fid, name="gone", port=closed_port()), "gone")
                reason = wait_for(lambda: browser.rejected().get(gone), 1.5)
                assert reason and "not reachable" in reason, browser.rejected()
                assert slow not in browser.rejected()
                reason = wait_for(lambda: browser.rejected().get(slow), 3.0)
                assert reason and "the handshake did not finish within 2 s" in reason, browser.rejected()
                trickler.accepted.clear()
                shout(zc, sample(fid, name="slow again", port=trickler.port), "again")
                assert trickler.accepted.wait(WAIT)
            finally:
                start = time.monotonic()
                browser.close()
                closing = time.monotonic() - start
            assert closing < 1.0, f"closing the browser took {closing:.1f} s"
            assert not browser.nodes()
    finally:
        zc.close()


def send_name_only(zc: Zeroconf, info: NodeInfo, tag: str) -> str:
    """A name of ``info``'s without its address and text (a bare PTR: a node half gone, or anyone on the
    LAN), so a browser must ask the network to resolve it; returns the name."""
    name = f"{tag} ({secrets.token_hex(3)}).{SERVICE}"
    service = ServiceInfo(SERVICE, name, port=info.port, properties=info.to_txt(), server=f"{tag}.local.",
                          parsed_addresses=["127.0.0.1"])
    out = DNSOutgoing(_FLAGS_QR_RESPONSE | _FLAGS_AA)
    out.add_answer_at_time(service.dns_pointer(), 0)
    zc.send(out)
    return name


def test_a_name_that_does_not_resolve_holds_up_no_other_record_nor_closing():
    """A name whose resolve must ask the network is resolved on a checker thread (``RESOLVE_MS`` at most):
    a whole record heard meanwhile is believed at once, the name is skipped with its reason, and closing
    the browser does not wait for such a resolve.  The resolve used to run on zeroconf's handler
    thread, which every later record waits for and closing joins (the Fleet view closes its browser
    on the GUI thread when the fleet key changes)."""
    fid = fleet_id(secrets.token_bytes(32))
    zc = Zeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    try:
        browser = Browser(fid, addresses=["127.0.0.1"]).start()
        try:
            ghost = send_name_only(zc, sample(fid, name="ghost"), "ghost")
            time.sleep(0.3)  # its resolve under way
            shout(zc, sample(fid, name="real"), "real")
            assert wait_for(lambda: any(i.name == "real" for i in browser.nodes().values()), 1.5), \
                browser.rejected()
            reason = wait_for(lambda: browser.rejected().get(ghost), discovery.RESOLVE_MS / 1000 + 2)
            assert reason and "no answer resolving" in reason, browser.rejected()
            send_name_only(zc, sample(fid, name="ghost again"), "again")
            time.sleep(0.3)
        finally:
            start = time.monotonic()
            browser.close()
            closing = time.monotonic() - start
        assert closing < 1.0, f"closing the browser took {closing:.1f} s"
    finally:
        zc.close()


@pytest.mark.skipif(sys.platform == "win32", reason="agent processes are stopped by SIGTERM (POSIX only)")
def test_a_record_moves_a_known_node_only_once_the_agent_there_proves_the_key_and_the_id(tmp_path, caplog):
    from fleet_support import agent_process

    from engine.fleetkey import create_key, load_key

    key_file, other_key = create_key(tmp_path / "fleet.key"), create_key(tmp_path / "other.key")
    key = load_key(key_file)
    caplog.set_level("WARNING", logger="engine.fleet.discovery")
    zc = Zeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    try:
        with agent_process(key_file, tmp_path / "a", mdns=True, name="alice") as (_, address), \
                agent_process(other_key, tmp_path / "x", name="alice") as (_, keyless), \
                Browser(fleet_id(key), verify=discovery.prover(FleetAccess(key))) as browser:
            node = wait_for(lambda: next(iter(browser.nodes().values()), None), 30)
            assert node and (node.addresses[0], node.port) == ("127.0.0.1", port_of(address)), browser.rejected()

            # The same node id at a port where nothing answers, then at an agent without the fleet key.
            for tag, port, why in (("gone", closed_port(), "not reachable"), ("keyless", port_of(keyless), "key")):
                name = announce(zc, dataclasses.replace(node, port=port), tag)
                reason = wait_for(lambda: browser.rejected().get(name), 20)
                assert reason and why in reason and f"stays at 127.0.0.1 port {node.port}" in reason, reason
                assert browser.nodes()[node.node_id].port == node.port
                assert name in caplog.text

            # The node's agent restarted on another port (same home, so the same id) and its old record lingers.
            moved_home = tmp_path / "b"
            (moved_home / "config").mkdir(parents=True)
            (moved_home / "config" / "node.id").write_text((tmp_path / "a" / "config" / "node.id").read_text())
            with agent_process(key_file, moved_home, name="alice") as (_, moved):
                name = announce(zc, dataclasses.replace(node, port=port_of(moved)), "moved")
                assert wait_for(lambda: browser.nodes()[node.node_id].port == port_of(moved), 20), browser.rejected()
                assert name not in browser.rejected()
    finally:
        zc.close()


@pytest.mark.skipif(sys.platform == "win32", reason="agent processes are stopped by SIGTERM (POSIX only)")
def test_nodes_all_leaves_out_a_bogus_record_and_keeps_the_real_nodes(tmp_path, capsys):
    import argparse

    from fleet_support import agent_process

    from engine.cli.fleet import _agent_addresses
    from engine.fleetkey import create_key, load_key

    key_file = create_key(tmp_path / "fleet.key")
    key = load_key(key_file)
    bogus = sample(fleet_id(key), name="mallory", port=closed_port())
    zc = Zeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    try:
        with agent_process(key_file, tmp_path / "a", mdns=True, name="alice") as (_, address), \
                Browser(fleet_id(key)) as everyone:
            announce(zc, bogus, "mallory")
            assert wait_for(lambda: len(everyone.nodes()) == 2, 30), everyone.nodes()  # both are on the air
            agents = _agent_addresses(argparse.Namespace(nodes="all", seconds=3.0), FleetAccess(key))
        assert agents == [address]
        err = capsys.readouterr().err
        assert "left out mDNS record 'mallory (" in err and "not reachable" in err, err
    finally:
        zc.close()


def test_a_flood_of_records_keeps_a_bounded_store():
    fid = fleet_id(secrets.token_bytes(32))
    flood = {}
    for i in range(1000):
        info = sample(fid, name=f"flood-{i}")
        flood[info.node_id] = ServiceInfo(SERVICE, f"flood-{i}.{SERVICE}", port=7461, properties=info.to_txt(),
                                          server=f"flood-{i}.local.", parsed_addresses=["127.0.0.1"])
    added: set[str] = set()
    lock = threading.Lock()

    def record(kind: str, info: NodeInfo) -> None:
        with lock:
            if kind == "added":
                added.add(info.node_id)

    zc = Zeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    try:
        with Browser(fleet_id=fid, on_event=record) as browser:
            for _ in range(5):  # UDP on loopback may drop a packet of the burst: those are sent again
                with lock:
                    missing = [s for node, s in flood.items() if node not in added]
                for service in missing:
                    send_record(zc, service)
                    time.sleep(0.002)
                if wait_for(lambda: len(added) == len(flood), 20):
                    break
            assert len(added) == len(flood), f"heard {len(added)} of {len(flood)} records"
            assert len(browser.nodes()) == len(browser._names) == discovery.MAX_RECORDS < len(flood)
    finally:
        zc.close()
