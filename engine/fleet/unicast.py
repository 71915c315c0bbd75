"""Finding the fleet where multicast does not pass (office Wi-Fi that isolates clients, switches that
drop it), alongside mDNS (``engine.fleet.discovery``):

- a join code the admin shares: the fleet's id (``fleetkey.fleet_id``, a keyed hash of the key) and this
  PC's addresses and agent port in one short string.  Pasting it on another PC adds those addresses to
  the settings' ``known_nodes``; a code of another fleet is refused.
- a bounded probe of the local subnet's agent port (a /24 at most, a few dials at once, one overall
  deadline); the agents that prove the key join ``known_nodes`` too.
- ``Dialer``: the known nodes dialled directly, every ``DIAL_EVERY_S``; one counts only while its agent
  proves the fleet key (the handshake of ``engine.transport.link``), once however many of its
  addresses are known.
- ``diagnose``: why nothing is found, in plain words, from what was seen: no multicast at all (not
  even this PC's own query coming back), none from other PCs, known nodes that refuse or time out.
- ``Discovery``: mDNS and the known nodes together, merged by node id, and its diagnosis.
"""

from __future__ import annotations

import base64
import binascii
import concurrent.futures
import dataclasses
import errno
import ipaddress
import logging
import select
import socket
import struct
import threading
import time
import zlib
from typing import Callable

import psutil

from engine.config import FleetAccess, known_nodes, remember_nodes
from engine.errors import FleetError
from engine.fleet.control import ROLE, AgentError, ControlClient
from engine.fleet.discovery import CHECKS, PROVE_S, Browser, local_addresses, prover
from engine.fleet.node import BadRecord, NodeInfo
from engine.fleetkey import fleet_id
from engine.transport.link import handshake, parse_address
from engine.transport.wire import AuthError, ProtocolError

log = logging.getLogger(__name__)

AGENT_PORT = 7390  # the port a node agent listens on unless told (``fleet agent --listen``, the tray worker)
CODE_VERSION = 1
CODE_PREFIX = "FS"
CODE_ADDRESSES = 6  # addresses a join code carries at most (a PC's Ethernet, Wi-Fi, VPN...)
SCAN_PREFIX = 24  # the widest subnet a scan probes: a /24, 254 addresses
SCAN_DIALS = 32  # dials under way at once during a scan
SCAN_DIAL_S = 1.5  # one address's dial and handshake
SCAN_DEADLINE_S = 30.0  # the whole scan
DIAL_EVERY_S = 10.0  # how often the known nodes are dialled
MAX_DIALLED = 64  # known addresses dialled in a round (the most recently added)
LISTEN_S = 3.0  # how long the diagnosis listens for multicast after its query
LISTEN_STEP_S = 0.2  # how often listening checks whether it is cancelled
MDNS_GROUP, MDNS_PORT = "224.0.0.251", 5353


# --- the join code ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class JoinCode:
    fleet_id: str
    addresses: tuple[str, ...]
    port: int

    @property
    def agents(self) -> list[str]:
        """HOST:PORT of each address."""
        return [f"{a}:{self.port}" for a in self.addresses]


def shared_addresses(addresses: list[str] | None = None) -> list[str]:
    """This PC's addresses another PC can reach: IPv4, neither loopback nor link-local."""
    usable = []
    for a in addresses if addresses is not None else local_addresses():
        ip = ipaddress.ip_address(a)
        if ip.version == 4 and not (ip.is_loopback or ip.is_link_local or ip.is_unspecified):
            usable.append(a)
    return usable[:CODE_ADDRESSES]


def join_code(key: bytes, addresses: list[str] | None = None, port: int = AGENT_PORT) -> str:
    """This fleet's join code for the agent at ``port`` on ``addresses`` (default: this PC's,
    ``shared_addresses``): "FS" and base32 of version, fleet id, port, addresses and a checksum,
    in groups of five."""
    addresses = shared_addresses(addresses)
    if not addresses:
        raise FleetError("this PC has no network address another PC can reach: connect it to the office "
                         "network first")
    body = struct.pack("!B6sHB", CODE_VERSION, bytes.fromhex(fleet_id(key)), port, len(addresses))
    body += b"".join(socket.inet_aton(a) for a in addresses)
    body += struct.pack("!I", zlib.crc32(body))
    text = base64.b32encode(body).decode().rstrip("=")
    return CODE_PREFIX + "-" + "-".join(text[i:i + 5] for i in range(0, len(text), 5))


def read_join_code(text: str, key: bytes) -> JoinCode:
    """The addresses a join code names; FleetError, in plain words, for text that is not a join code,
    one that was mistyped, or one of another fleet (a fleet id that is not this key's)."""
    cleaned = "".join(text.split()).replace("-", "").upper()
    if not cleaned.startswith(CODE_PREFIX) or len(cleaned) > 80:
        raise FleetError("that is not a join code: a join code starts with FS- (copy it from the Fleet view, "
                         "or `fleet nodes join-code`, on a PC of the fleet)")
    payload = cleaned[len(CODE_PREFIX):]
    try:
        body = base64.b32decode(payload + "=" * (-len(payload) % 8))
    except (binascii.Error, ValueError):
        raise FleetError("that join code holds characters a join code does not have: copy it again") from None
    if len(body) < 10 or body[0] != CODE_VERSION:
        if body and body[0] > CODE_VERSION:
            raise FleetError("that join code comes from a newer fleetshard: update this PC first")
        raise FleetError("that join code is cut short or mistyped: copy it again")
    count = body[9]
    if len(body) != 10 + 4 * count + 4 or zlib.crc32(body[:-4]) != struct.unpack("!I", body[-4:])[0]:
        raise FleetError("that join code is cut short or mistyped: copy it again")
    fid, port = body[1:7].hex(), struct.unpack("!H", body[7:9])[0]
    if fid != fleet_id(key):
        raise FleetError(f"that join code is for another fleet (fleet {fid}; this PC's key is of fleet "
                         f"{fleet_id(key)}): use the fleet key file of the fleet you join, or a code from one "
                         "of this fleet's PCs")
    addresses = tuple(socket.inet_ntoa(body[10 + 4 * i:14 + 4 * i]) for i in range(count))
    return JoinCode(fid, addresses, port)


# --- dialling one address -----------------------------------------------------------------------------

@dataclasses.dataclass
class Reach:
    """What dialling an agent's address gave: ``outcome`` is "proved" (its agent proved the fleet key;
    ``node_id`` and ``name`` are what it says of itself), "refused" (nothing listens there), "timeout"
    (no answer: a firewall, a PC that is off, or client isolation), "unreachable" (no route), "key"
    (the agent does not hold this fleet's key) or "stalled" (it did not finish the handshake)."""

    address: str
    outcome: str
    reason: str = ""
    node_id: str = ""
    name: str = ""

    @property
    def proved(self) -> bool:
        return self.outcome == "proved"


def reach(address: str, access: FleetAccess, timeout_s: float = PROVE_S) -> Reach:
    """Dials ``address`` and runs the fleet-key handshake (``access``'s key, over its TLS), all within
    ``timeout_s``."""
    try:
        sock, welcome, _ = handshake(address, access.key, ROLE, access.tls, deadline_s=timeout_s)
    except ConnectionRefusedError as exc:
        return Reach(address, "refused", str(exc.strerror or exc))
    except (socket.timeout, TimeoutError) as exc:
        return Reach(address, "timeout", str(exc) or "timed out")
    except OSError as exc:
        unreachable = exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRNOTAVAIL)
        return Reach(address, "unreachable" if unreachable else "timeout", str(exc.strerror or exc))
    except AuthError as exc:
        return Reach(address, "key", str(exc))
    except (ProtocolError, FleetError) as exc:
        return Reach(address, "stalled", str(exc))
    try:
        sock.close()
    except OSError:
        pass
    node = welcome.get("node") if isinstance(welcome.get("node"), dict) else {}
    return Reach(address, "proved", node_id=str(node.get("id", ""))[:64], name=str(node.get("name", ""))[:64])


def join(text: str, access: FleetAccess, timeout_s: float = PROVE_S) -> tuple[JoinCode, list[Reach]]:
    """Reads a join code, adds its addresses to the known nodes (a PC that is off now counts once it
    answers) and dials each once, off the caller's thread (a few at once): what each gave."""
    code = read_join_code(text, access.key)
    remember_nodes(code.agents)
    return code, _dial_all(code.agents, access, timeout_s)


def _dial_all(addresses: list[str], access: FleetAccess, timeout_s: float, workers: int = CHECKS) -> list[Reach]:
    if not addresses:
        return []
    with concurrent.futures.ThreadPoolExecutor(min(workers, len(addresses)), thread_name_prefix="dial") as pool:
        return list(pool.map(lambda a: reach(a, access, timeout_s), addresses))


# --- scanning the subnet ------------------------------------------------------------------------------

def subnets(addresses: list[str] | None = None) -> list[ipaddress.IPv4Network]:
    """The local subnets a scan probes: each interface's (IPv4, neither loopback nor link-local), cut to
    the /24 around this PC's address when it is wider."""
    wanted = set(shared_addresses(addresses) if addresses is not None else shared_addresses())
    found = []
    for nic in psutil.net_if_addrs().values():
        for a in nic:
            if a.family != socket.AF_INET or a.address not in wanted:
                continue
            net = ipaddress.ip_interface(f"{a.address}/{a.netmask or '255.255.255.0'}").network
            if net.prefixlen < SCAN_PREFIX:
                net = ipaddress.ip_interface(f"{a.address}/{SCAN_PREFIX}").network
            if net not in found:
                found.append(net)
    return found


@dataclasses.dataclass
class Scan:
    """A scan's outcome: the agents that proved the key, how many addresses were dialled of how many,
    and whether it ran out of time."""

    found: list[Reach]
    dialled: int
    planned: int
    networks: list[str]

    @property
    def cut_short(self) -> bool:
        return self.dialled < self.planned


def scan(access: FleetAccess, *, port: int = AGENT_PORT, networks: list | None = None,
         deadline_s: float = SCAN_DEADLINE_S, dials: int = SCAN_DIALS, dial_s: float = SCAN_DIAL_S,
         cancel: Callable[[], bool] = lambda: False, keep: bool = True) -> Scan:
    """Dials ``port`` on every address of ``networks`` (default: ``subnets()``) but this PC's own, at
    most ``dials`` at once and within ``deadline_s`` in all (or until ``cancel()``); with ``keep``, the
    agents that prove the key join the known nodes.  Blocks: run it off any GUI thread."""
    nets = [ipaddress.ip_network(n) for n in networks] if networks is not None else subnets()
    own = set(local_addresses())
    targets = [f"{ip}:{port}" for net in nets if net.prefixlen >= SCAN_PREFIX
               for ip in net.hosts() if str(ip) not in own]
    end = time.monotonic() + deadline_s
    found, dialled = [], 0
    pool = concurrent.futures.ThreadPoolExecutor(max(1, dials), thread_name_prefix="scan")
    try:
        pending = set()
        queue = iter(targets)
        while True:
            while len(pending) < dials and time.monotonic() < end and not cancel():
                address = next(queue, None)
                if address is None:
                    break
                left = end - time.monotonic()
                pending.add(pool.submit(reach, address, access, max(0.05, min(dial_s, left))))
            if not pending:
                break
            done, pending = concurrent.futures.wait(pending, timeout=max(0.0, end - time.monotonic()) + dial_s,
                                                    return_when=concurrent.futures.FIRST_COMPLETED)
            if not done:  # past the deadline and no dial has ended within its own bound: give up on them
                break
            for future in done:
                dialled += 1
                got = future.result()
                if got.proved and all(f.node_id != got.node_id for f in found):  # one node, two addresses
                    found.append(got)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    if keep and found:
        remember_nodes([r.address for r in found])
    return Scan(found, dialled, len(targets), [str(n) for n in nets])


# --- the known nodes, dialled -------------------------------------------------------------------------

def known_addresses() -> list[str]:
    """The settings' known nodes from join codes and scans, the most recently added first (``MAX_DIALLED``
    of them); those added by hand are polled instead (``fleet nodes``, the Fleet view)."""
    try:
        return list(reversed(known_nodes(by_hand=False)))[:MAX_DIALLED]
    except FleetError:
        return []


def _node_info(node: dict, address: str) -> NodeInfo:
    """A node's facts from its agent's status, checked as an mDNS record's are (raises BadRecord)."""
    fields = {f.name for f in dataclasses.fields(NodeInfo)}
    try:
        info = NodeInfo(**{k: v for k, v in node.items() if k in fields})
        txt = {k.encode(): v.encode() for k, v in info.to_txt().items()}
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        raise BadRecord(f"the agent at {address} describes itself wrongly ({exc})") from None
    host, port = parse_address(address)
    return NodeInfo.from_txt(info.name, txt, [host], port)


class Dialer:
    """Keeps the nodes known by address (``known()``, default ``known_addresses``) whose agents prove the
    fleet key: dials them all every ``every_s`` on ``CHECKS`` threads, each within
    ``timeout_s``.  ``on_event(kind, info)`` as a ``discovery.Browser``'s, from the dialler's thread.  A
    node reached at several known addresses is one node, at the first of them that answers."""

    def __init__(self, access: FleetAccess, on_event: Callable[[str, NodeInfo], None] | None = None,
                 known: Callable[[], list[str]] = known_addresses, every_s: float = DIAL_EVERY_S,
                 timeout_s: float = PROVE_S):
        self.access, self._on_event, self._known = access, on_event, known
        self.every_s, self.timeout_s = every_s, timeout_s
        self._lock = threading.Lock()
        self._nodes: dict[str, NodeInfo] = {}
        self._reaches: dict[str, Reach] = {}
        self._stop = threading.Event()
        self._poke = threading.Event()
        self._rounds = 0
        self._round_done = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None

    def start(self) -> "Dialer":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="known nodes")
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._poke.set()

    def poke(self) -> None:
        """Dials now (the known nodes changed) rather than at the next round."""
        self._poke.set()

    def nodes(self) -> dict[str, NodeInfo]:
        with self._lock:
            return dict(self._nodes)

    def reaches(self) -> list[Reach]:
        """What the last round's dial of each known address gave."""
        with self._lock:
            return list(self._reaches.values())

    def wait_round(self, timeout_s: float) -> bool:
        """Whether a whole round has been dialled, waiting up to ``timeout_s`` for the first."""
        with self._round_done:
            return self._round_done.wait_for(lambda: self._rounds > 0 or self._stop.is_set(), timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._poke.clear()
            try:
                self._round()
            except Exception:  # the next round tries again
                log.exception("dialling the known nodes failed")
            self._poke.wait(self.every_s)

    def _round(self) -> None:
        addresses = list(dict.fromkeys(self._known()))
        got = _dial_all(addresses, self.access, self.timeout_s)
        nodes: dict[str, NodeInfo] = {}
        for r in got:
            if self._stop.is_set():
                return
            if not r.proved or r.node_id in nodes:
                continue
            try:
                with ControlClient(r.address, self.access, timeout_s=self.timeout_s) as agent:
                    info = _node_info(agent.status().get("node", {}), r.address)
            except (AgentError, BadRecord) as exc:
                r.outcome, r.reason = "stalled", str(exc)
                continue
            if info.node_id != r.node_id:
                r.outcome, r.reason = "key", f"it proved the key as node {r.node_id}, then named {info.node_id}"
                continue
            nodes[info.node_id] = info
        events = []
        with self._lock:
            if self._stop.is_set():
                return
            for node_id, info in nodes.items():
                before = self._nodes.get(node_id)
                if before != info:
                    events.append(("added" if before is None else "updated", info))
            events += [("removed", info) for node_id, info in self._nodes.items() if node_id not in nodes]
            self._nodes = nodes
            self._reaches = {r.address: r for r in got}
            self._rounds += 1
            self._round_done.notify_all()
        for kind, info in events:
            if self._on_event is not None:
                try:
                    self._on_event(kind, info)
                except Exception:
                    log.exception("discovery callback failed on %s of %s", kind, info.name)


# --- why nothing is found -----------------------------------------------------------------------------

@dataclasses.dataclass
class Multicast:
    """What listening for mDNS traffic heard: this PC's own query coming back, other PCs' traffic
    (their addresses), or why it could not listen."""

    own: bool = False
    others: tuple[str, ...] = ()
    error: str = ""


def _query() -> bytes:
    """An mDNS query for every service type on the network (DNS-SD's enumeration): any mDNS responder
    answers it, fleetshard's or not, by multicast."""
    name = b"".join(bytes([len(p)]) + p for p in (b"_services", b"_dns-sd", b"_udp", b"local")) + b"\0"
    return struct.pack("!6H", 0, 0, 1, 0, 0, 0) + name + struct.pack("!2H", 12, 1)


def listen_multicast(seconds: float = LISTEN_S, addresses: list[str] | None = None,
                     cancel: Callable[[], bool] = lambda: False) -> Multicast:
    """Sends one mDNS query on each of this PC's interfaces and listens ``seconds`` for mDNS traffic
    (or until ``cancel()``, checked every ``LISTEN_STEP_S``).  Blocks: run it off any GUI thread."""
    addresses = shared_addresses(addresses) if addresses is not None else shared_addresses()
    if not addresses:
        return Multicast(error="this PC has no network address")
    own = set(local_addresses()) | set(addresses)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):  # zeroconf, in this process or another, holds the port too
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("", MDNS_PORT))
        joined = []
        for a in addresses:
            try:
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                                socket.inet_aton(MDNS_GROUP) + socket.inet_aton(a))
                joined.append(a)
            except OSError:
                continue
        if not joined:
            return Multicast(error=f"no interface of this PC ({', '.join(addresses)}) joins the mDNS group")
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 255)
        for a in joined:
            try:
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(a))
                sock.sendto(_query(), (MDNS_GROUP, MDNS_PORT))
            except OSError:
                continue
        seen_own, others = False, set()
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0 and not cancel():
            if not select.select([sock], [], [], min(left, LISTEN_STEP_S))[0]:
                continue
            _, (source, _) = sock.recvfrom(9000)
            if source in own:
                seen_own = True
            else:
                others.add(source)
        return Multicast(seen_own, tuple(sorted(others)))
    except OSError as exc:
        return Multicast(error=f"cannot listen on UDP port {MDNS_PORT} ({exc.strerror or exc})")
    finally:
        sock.close()


@dataclasses.dataclass
class Diagnosis:
    """Why discovery finds what it finds: a code per finding ("no-multicast-here", "no-multicast",
    "isolation", "firewall", "not-running", "other-key", "stalled", "mdns-off", "bad-records",
    "none-running") and the same in plain words, one sentence each; ``found``: the nodes found meanwhile."""

    codes: list[str]
    lines: list[str]
    found: int = 0

    @property
    def text(self) -> str:
        return " ".join(self.lines)


def diagnose(*, found: int, multicast: Multicast | None, reaches: list[Reach] = (), mdns_error: str = "",
             rejected: dict[str, str] | None = None) -> Diagnosis:
    """Says why: ``found`` nodes of this fleet found so far (any way), what listening for multicast
    heard, what dialling each known node gave, why mDNS could not start, and the records left out."""
    codes, lines = [], []

    def say(code: str, line: str) -> None:
        codes.append(code)
        lines.append(line)

    if mdns_error:
        say("mdns-off", f"mDNS could not start on this PC ({mdns_error}).")
    no_multicast = False
    if multicast is not None:
        if multicast.error or not (multicast.own or multicast.others):
            no_multicast = True
            say("no-multicast-here", "No multicast seen, not even this PC's own query coming back"
                + (f" ({multicast.error})" if multicast.error else "")
                + ": a firewall on this PC may block UDP port 5353, or its network adapter drops multicast.")
        elif not multicast.others:
            no_multicast = True
            say("no-multicast", "No multicast seen from any other PC (this PC's own comes back): the network "
                "drops multicast, as office Wi-Fi and some switches do, so mDNS cannot find the other PCs.")
    failed = [r for r in reaches if not r.proved]
    silent = [r for r in failed if r.outcome in ("timeout", "unreachable")]
    if no_multicast and reaches and len(silent) == len(reaches):
        say("isolation", "The known nodes do not answer either: client isolation is likely (the network keeps "
            "PCs from reaching each other, as guest Wi-Fi does). Ask IT to allow traffic between the PCs, or "
            "connect them by cable.")
    else:
        for r in silent:
            say("firewall", f"{r.address} does not answer (no reply on its port): a firewall on that PC likely "
                "blocks the port, or the PC is off. Allow fleetshard through its firewall.")
    for r in failed:
        if r.outcome == "refused":
            say("not-running", f"{r.address} refuses the connection: no fleet agent runs there. Start the tray "
                "worker or `fleet agent` on that PC.")
        elif r.outcome == "key":
            say("other-key", f"{r.address} answers but does not hold this fleet's key: copy the fleet key file "
                "to that PC.")
        elif r.outcome == "stalled":
            say("stalled", f"{r.address} answers but does not finish the fleet handshake ({r.reason}).")
    if rejected:
        first = next(iter(rejected.values()))
        say("bad-records", f"{len(rejected)} mDNS record(s) of this fleet were left out: {first}")
    if not found and multicast is not None and multicast.others and not failed and not rejected:
        say("none-running", "Multicast works here (other PCs' mDNS traffic arrives), but no node of this fleet "
            "answers: start the tray worker or `fleet agent`, with this fleet's key, on the other PCs.")
    if not found and (no_multicast or mdns_error):
        lines.append("Paste this fleet's join code on the other PCs, or scan this PC's subnet.")
    return Diagnosis(codes, lines, found)


# --- every way together -------------------------------------------------------------------------------

class Discovery:
    """This fleet's nodes, found every way: mDNS records whose agents prove the key (``Browser`` with
    ``prover``) and the known nodes dialled directly (``Dialer``), merged by node id (an mDNS record's
    facts first).  ``on_event`` as a ``Browser``'s.  mDNS that cannot start (no multicast interface) is
    not an error here: the known nodes are still dialled, and ``diagnose`` says why."""

    def __init__(self, access: FleetAccess, on_event: Callable[[str, NodeInfo], None] | None = None,
                 addresses: list[str] | None = None, known: Callable[[], list[str]] = known_addresses,
                 every_s: float = DIAL_EVERY_S):
        self.access, self.fleet_id = access, fleet_id(access.key)
        self._on_event = on_event
        self._lock = threading.Lock()
        self._found: dict[str, dict[str, NodeInfo]] = {}  # node id -> source ("mdns", "known") -> facts
        self.mdns_error = ""
        self.browser = Browser(self.fleet_id, on_event=lambda k, i: self._event("mdns", k, i), addresses=addresses,
                               verify=prover(access))
        self.dialer = Dialer(access, on_event=lambda k, i: self._event("known", k, i), known=known,
                             every_s=every_s)

    def start(self) -> "Discovery":
        try:
            self.browser.start()
        except FleetError as exc:
            self.mdns_error = str(exc)
            log.warning("%s; dialling the known nodes only", exc)
        self.dialer.start()
        return self

    def close(self) -> None:
        self.dialer.close()
        self.browser.close()

    def __enter__(self) -> "Discovery":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _event(self, source: str, kind: str, info: NodeInfo) -> None:
        with self._lock:
            sources = self._found.setdefault(info.node_id, {})
            before = _best(sources)
            if kind == "removed":
                sources.pop(source, None)
            else:
                sources[source] = info
            after = _best(sources)
            if not sources:
                del self._found[info.node_id]
        if after is None:
            event = ("removed", before) if before is not None else None
        else:
            event = ("added" if before is None else "updated", after) if after != before else None
        if event is not None and self._on_event is not None:
            try:
                self._on_event(*event)
            except Exception:
                log.exception("discovery callback failed on %s of %s", event[0], event[1].name)

    def nodes(self) -> dict[str, NodeInfo]:
        with self._lock:
            return {node: _best(sources) for node, sources in self._found.items()}

    def sources(self) -> dict[str, list[str]]:
        """How each node was found: "mdns", "known" or both."""
        with self._lock:
            return {node: sorted(sources) for node, sources in self._found.items()}

    def rejected(self) -> dict[str, str]:
        return self.browser.rejected()

    def wait(self, seconds: float) -> None:
        """Listens ``seconds``, then until the known nodes have been dialled once (their own deadline)."""
        time.sleep(seconds)
        self.dialer.wait_round(PROVE_S * 2)

    def diagnose(self, listen_s: float = LISTEN_S, cancel: Callable[[], bool] = lambda: False) -> Diagnosis:
        """Why this discovery finds what it finds, counting the nodes of other PCs only (this PC's own
        agent is found even where nothing passes); listens ``listen_s`` for multicast (or until
        ``cancel()``): blocks."""
        multicast = listen_multicast(listen_s, cancel=cancel)
        own = set(local_addresses())
        others = [n for n in self.nodes().values() if not own.intersection(n.addresses)]
        return diagnose(found=len(others), multicast=multicast, reaches=self.dialer.reaches(),
                        mdns_error=self.mdns_error, rejected=self.rejected())


def _best(sources: dict[str, NodeInfo]) -> NodeInfo | None:
    return sources.get("mdns") or sources.get("known")
