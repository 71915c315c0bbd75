"""Discovery without multicast (``engine.fleet.unicast``): join codes (round trip, another fleet's
refused, a mistyped one refused), real agents found by a join code, by the known-node dialler and by a
scan, each counted only once it proves the fleet key, and the diagnosis of why nothing is found."""

from __future__ import annotations

import os
import secrets
import socket
import sys

import pytest
from fleet_support import agent_process

from engine.config import FleetAccess, known_nodes
from engine.errors import FleetError
from engine.fleet import unicast
from engine.fleet.unicast import Discovery, Multicast, Reach, diagnose, join, join_code, read_join_code, scan
from engine.fleetkey import create_key, fleet_id, load_key

POSIX_ONLY = pytest.mark.skipif(sys.platform == "win32", reason="agent processes are stopped by SIGTERM (POSIX only)")


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETSHARD_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_a_join_code_round_trips_and_is_short():
    key = secrets.token_bytes(32)
    code = join_code(key, ["192.168.1.23", "10.0.0.7"], port=7391)
    assert code.startswith("FS-") and len(code) < 50
    read = read_join_code(code, key)
    assert read.fleet_id == fleet_id(key) and read.port == 7391
    assert read.agents == ["192.168.1.23:7391", "10.0.0.7:7391"]
    # as pasted from a chat: lower case, spaces, a line break
    assert read_join_code("  " + code.lower().replace("-", " - ", 2) + "\n", key) == read


def test_a_join_code_leaves_out_addresses_no_other_pc_reaches():
    key = secrets.token_bytes(32)
    code = read_join_code(join_code(key, ["127.0.0.1", "169.254.3.4", "192.168.5.6"]), key)
    assert code.addresses == ("192.168.5.6",) and code.port == unicast.AGENT_PORT
    with pytest.raises(FleetError, match="no network address another PC can reach"):
        join_code(key, ["127.0.0.1"])


def test_a_join_code_of_another_fleet_is_refused_in_plain_words(home):
    ours, theirs = secrets.token_bytes(32), secrets.token_bytes(32)
    code = join_code(theirs, ["192.168.1.23"])
    with pytest.raises(FleetError, match="that join code is for another fleet") as refused:
        read_join_code(code, ours)
    assert fleet_id(theirs) in str(refused.value) and fleet_id(ours) in str(refused.value)
    with pytest.raises(FleetError, match="another fleet"):
        join(code, FleetAccess(ours))
    assert known_nodes() == []  # nothing of it kept


@pytest.mark.parametrize("text, reason", [
    ("hello", "not a join code"),
    ("FS-!!!!!", "characters a join code does not have"),
    ("FS-AB", "cut short or mistyped"),
])
def test_text_that_is_not_a_join_code_is_refused(text, reason):
    with pytest.raises(FleetError, match=reason):
        read_join_code(text, secrets.token_bytes(32))


def test_a_mistyped_join_code_is_refused():
    key = secrets.token_bytes(32)
    code = join_code(key, ["192.168.1.23"])
    i = len(code) - 8  # an address or checksum character
    typo = code[:i] + ("A" if code[i] != "A" else "B") + code[i + 1:]
    with pytest.raises(FleetError, match="mistyped"):
        read_join_code(typo, key)


# --- real agents -----------------------------------------------------------------------------------

@POSIX_ONLY
def test_a_join_code_finds_the_agent_and_the_dialler_counts_it_once_it_proves_the_key(tmp_path, home):
    key_file = create_key(tmp_path / "fleet.key")
    other_key = create_key(tmp_path / "other.key")
    key = load_key(key_file)
    with agent_process(key_file, tmp_path / "a", name="alice", listen="0.0.0.0:0") as (_, address), \
            agent_process(other_key, tmp_path / "b", name="mallory") as (_, stranger):
        port = int(address.rpartition(":")[2])
        # the agent listens on every address: 127.0.0.2 is this PC's too, so a code may name it
        code, reached = join(_code(key, "127.0.0.2", port), FleetAccess(key))
        assert code.agents == [f"127.0.0.2:{port}"]
        assert [(r.outcome, r.name) for r in reached] == [("proved", "alice")]
        assert known_nodes() == [f"127.0.0.2:{port}"]
        # an agent of another fleet is dialled too but never counts; a dead address neither
        dead = f"127.0.0.1:{_closed_port()}"
        known = [f"127.0.0.2:{port}", f"127.0.0.3:{port}", stranger, dead]
        with Discovery(FleetAccess(key), known=lambda: known, addresses=["127.0.0.1"]) as found:
            assert found.dialer.wait_round(30)
            nodes = found.nodes()
            outcomes = {r.address: r.outcome for r in found.dialer.reaches()}
        assert [n.name for n in nodes.values()] == ["alice"]  # one node, though known at two addresses
        info = next(iter(nodes.values()))
        assert info.addresses == ["127.0.0.2"] and info.port == port and info.fleet_id == fleet_id(key)
        assert outcomes == {known[0]: "proved", known[1]: "proved", stranger: "key", dead: "refused"}


def _code(key: bytes, address: str, port: int) -> str:
    """A join code naming a loopback address (``join_code`` leaves loopback out, as no other PC reaches it)."""
    import base64
    import struct
    import zlib

    body = struct.pack("!B6sHB", unicast.CODE_VERSION, bytes.fromhex(fleet_id(key)), port, 1)
    body += socket.inet_aton(address)
    body += struct.pack("!I", zlib.crc32(body))
    return "FS-" + base64.b32encode(body).decode().rstrip("=")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@POSIX_ONLY
def test_a_scan_finds_the_agents_that_prove_the_key_and_keeps_them(tmp_path, home):
    key_file = create_key(tmp_path / "fleet.key")
    key = load_key(key_file)
    with agent_process(key_file, tmp_path / "a", name="alice", listen="127.0.0.10:0") as (_, address), \
            agent_process(create_key(tmp_path / "other.key"), tmp_path / "b", name="mallory",
                          listen=f"127.0.0.9:{address.rpartition(':')[2]}"):
        port = int(address.rpartition(":")[2])
        # 127.0.0.8/29, every address this PC's: .9 is the other fleet's agent, .10 alice, .11 to .14 nobody
        done = scan(FleetAccess(key), port=port, networks=["127.0.0.8/29"], dials=3)
    assert not done.cut_short and done.planned == done.dialled == 6
    assert [(r.name, r.address) for r in done.found] == [("alice", f"127.0.0.10:{port}")]
    assert known_nodes() == [f"127.0.0.10:{port}"]


def test_a_scan_is_bounded_to_a_24_and_by_its_deadline():
    key = secrets.token_bytes(32)
    # a /16 is not scanned at all (subnets() cuts wider ones to a /24 around this PC's address)
    assert scan(FleetAccess(key), networks=["10.99.0.0/16"], keep=False).planned == 0
    # every address of 127.0.1.0/24 reaches a listener that takes the connection and never answers:
    # each dial holds its place until its own bound, and the scan's deadline ends it
    with socket.socket() as silent:
        silent.bind(("0.0.0.0", 0))
        silent.listen(512)
        done = scan(FleetAccess(key), port=silent.getsockname()[1], networks=["127.0.1.0/24"], deadline_s=0.5, dials=4,
                    dial_s=0.2, keep=False)
    assert done.planned == 254 and done.cut_short and done.dialled < 254 and not done.found


def test_subnets_are_a_24_at_most():
    for net in unicast.subnets():
        assert net.prefixlen >= 24 and not net.is_loopback


# --- the diagnosis ---------------------------------------------------------------------------------

def test_no_multicast_at_all_points_at_this_pc():
    said = diagnose(found=0, multicast=Multicast())
    assert said.codes == ["no-multicast-here"]
    assert "not even this PC's own" in said.text and "join code" in said.text


def test_only_our_own_multicast_means_the_network_drops_it():
    said = diagnose(found=0, multicast=Multicast(own=True))
    assert said.codes == ["no-multicast"] and "No multicast seen from any other PC" in said.text


def test_known_nodes_silent_too_means_client_isolation():
    reaches = [Reach("192.168.1.5:7390", "timeout"), Reach("192.168.1.6:7390", "unreachable")]
    said = diagnose(found=0, multicast=Multicast(own=True), reaches=reaches)
    assert said.codes == ["no-multicast", "isolation"] and "client isolation" in said.text


def test_a_known_node_that_times_out_where_multicast_works_is_a_firewall():
    reaches = [Reach("192.168.1.5:7390", "timeout"), Reach("192.168.1.6:7390", "proved", node_id="x")]
    said = diagnose(found=1, multicast=Multicast(own=True, others=("192.168.1.9",)), reaches=reaches)
    assert said.codes == ["firewall"] and "192.168.1.5:7390" in said.text and "firewall" in said.text
    assert "join code" not in said.text  # something was found: no advice to share codes


def test_refused_and_wrong_key_and_records_left_out_are_each_said():
    reaches = [Reach("10.0.0.5:7390", "refused"), Reach("10.0.0.6:7390", "key")]
    said = diagnose(found=0, multicast=Multicast(own=True, others=("10.0.0.9",)), reaches=reaches,
                    rejected={"x": "it names node 1 at 10.0.0.7 port 7390, which does not answer"})
    assert said.codes == ["not-running", "other-key", "bad-records"]
    assert "no fleet agent runs there" in said.text and "does not hold this fleet's key" in said.text


def test_multicast_working_and_nothing_known_means_no_node_runs():
    said = diagnose(found=0, multicast=Multicast(own=True, others=("10.0.0.9",)))
    assert said.codes == ["none-running"] and "start the tray worker" in said.text
    assert diagnose(found=2, multicast=Multicast(own=True, others=("10.0.0.9",))).codes == []


def test_mdns_that_cannot_start_is_said():
    said = diagnose(found=0, multicast=Multicast(error="no interface"), mdns_error="cannot start mDNS")
    assert said.codes == ["mdns-off", "no-multicast-here"] and "no interface" in said.text


@pytest.mark.skipif(not unicast.shared_addresses(), reason="this machine has no network address but loopback")
@pytest.mark.skipif(os.name != "posix", reason="the mDNS port is shared with SO_REUSEPORT (POSIX)")
def test_listening_hears_this_pcs_own_query():
    heard = unicast.listen_multicast(1.0)
    assert heard.error == "" and heard.own, heard


def test_known_nodes_are_kept_once_and_fleet_nodes_remove_forgets_one(home):
    from engine.cli.main import main
    from engine.config import known_nodes, remember_nodes

    remember_nodes(["10.0.0.5:7390", "10.0.0.6:7390"])
    assert remember_nodes(["10.0.0.5:7390"]) == ["10.0.0.6:7390", "10.0.0.5:7390"]  # once, the latest last
    assert main(["nodes", "remove", "10.0.0.5:7390"]) == 0
    assert known_nodes() == ["10.0.0.6:7390"]
