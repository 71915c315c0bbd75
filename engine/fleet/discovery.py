"""Finding the fleet on the LAN with mDNS/DNS-SD: each node agent advertises its ``NodeInfo`` as a
``_fleetshard._tcp`` service, and a browser keeps the live set of nodes of its fleet.

Only public facts travel: the record names the fleet by its id (a keyed hash), never by the key.
Both sides run zeroconf on its own thread, so they work the same from plain threads or asyncio code.
Given no addresses, both follow this machine's interfaces as they come and go (a laptop whose agent
starts before its Wi-Fi connects, or that moves to another network).

Anyone on the LAN can send a record, so a browser given the fleet key (``prover``) believes a record
only once the agent at its address proves the key and answers as the node the record names; the same
check guards a record that would move a node it already knows to another address or port.  A record
that fails it is skipped with a warning and the node stays where it was.  The checks run on a few
threads of their own (``CHECKS``), never on zeroconf's: an agent that stalls its answer holds up one
check until its deadline, not every other record, nor closing the browser.  So does a record whose
resolve must ask the network (its name heard without its address and text: ``RESOLVE_MS`` at most),
since closing the browser waits for zeroconf's handler thread.  At most ``MAX_RECORDS``
records are kept, the oldest heard dropped first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import logging
import queue
import re
import socket
import threading
import time
from abc import ABC, abstractmethod
from typing import Callable

import psutil
from zeroconf import IPVersion, ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf

from engine.config import FleetAccess
from engine.errors import FleetError
from engine.fleet.control import prove_node
from engine.fleet.node import BadRecord, NodeInfo

log = logging.getLogger(__name__)

SERVICE = "_fleetshard._tcp.local."
# A node that vanishes without a goodbye (power cut, crash) drops out of browsers after this many
# seconds; zeroconf's default of 75 minutes for the service records would keep it listed far too long.
TTL = 120
RESOLVE_MS = 3000  # a resolve that asks the network (on a checker thread): an mDNS answer may take 500 ms
MAX_REJECTED = 64  # reasons kept for inspection; a flood of bad records must not grow memory
MAX_RECORDS = 256  # service records kept; a flood of records (even of valid form) must not grow memory either
PROVE_S = 3.0  # how long the check of ``prover`` may take, every address the record lists included
PROVE_ADDRESSES = 4  # addresses of a record ``prover`` tries: one listing hundreds must not stall its check
CHECKS = 4  # records checked at once: each check holds a thread until its agent answers or its deadline
MAX_CHECKS = 64  # records waiting for their check or under it; more are skipped (heard again when re-announced)
WATCH_S = 3.0  # how often the interfaces are checked for changes
SETTLE_S = 3.0  # a change must hold this long before mDNS moves: a flapping link does not re-announce
RECONFIRM_S = 10.0  # after a change, a node not heard again within this is dropped


def local_addresses() -> list[str]:
    """This machine's IPv4 addresses on interfaces that are up: ordinary ones, then link-local,
    then 127.0.0.1 (so a machine alone, even offline, still finds its own agent)."""
    stats = psutil.net_if_stats()
    found = []
    for nic, addrs in psutil.net_if_addrs().items():
        if nic in stats and not stats[nic].isup:
            continue
        found += [a.address for a in addrs if a.family == socket.AF_INET]
    return sorted(set(found) | {"127.0.0.1"}, key=_preference)


def _preference(address: str) -> tuple:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback, ip.is_link_local, ip.version, int(ip)


def _open(addresses: list[str]) -> Zeroconf:
    hint = ("mDNS needs multicast to 224.0.0.251, UDP port 5353, on the local network; check the "
            "firewall, or that the network allows multicast")
    try:
        # use_asyncio=False: zeroconf otherwise binds to a running asyncio loop of the calling thread,
        # and then its blocking register/unregister calls would deadlock that loop.
        zc = Zeroconf(interfaces=addresses, ip_version=IPVersion.V4Only, use_asyncio=False)
    except (OSError, RuntimeError) as exc:
        raise FleetError(f"cannot start mDNS on {', '.join(addresses)}: {exc} ({hint})") from None
    if not zc.engine.senders:  # zeroconf skips interfaces it cannot join, silently, even all of them
        zc.close()
        raise FleetError(f"cannot start mDNS: none of {', '.join(addresses)} accepts multicast ({hint})")
    return zc


def prover(access: FleetAccess, timeout_s: float = PROVE_S) -> Callable[[NodeInfo], str]:
    """A ``Browser``'s check of a record: dials the record's addresses in turn and returns the first
    whose agent proves the fleet key (``access``'s, over its TLS) and answers as the record's node
    (``control.prove_node``), all within ``timeout_s`` (an address gets an even share of the time
    left); raises FleetError with every address's reason when none does."""

    def prove(info: NodeInfo) -> str:
        reasons = []
        addresses = info.addresses[:PROVE_ADDRESSES]
        end = time.monotonic() + timeout_s
        for i, address in enumerate(addresses):
            share = (end - time.monotonic()) / (len(addresses) - i)
            try:
                prove_node(f"{address}:{info.port}", access, info.node_id, timeout_s=share)
                return address
            except FleetError as exc:
                reasons.append(str(exc))
        raise FleetError("; ".join(reasons) or "the record gives no address")

    return prove


def _endpoint(info: NodeInfo) -> tuple[frozenset, int]:
    return frozenset(info.addresses), info.port


def _instance(info: NodeInfo) -> str:
    label = re.sub(r"[^\w\- ]+", "-", info.name).strip("- ")
    label = label.encode()[:40].decode(errors="ignore") or "node"
    return f"{label} ({info.node_id[:6]}).{SERVICE}"


class _Follower(ABC):
    """Given no addresses, every local IPv4 address (``local_addresses``), and a watch that calls
    ``_move(addresses)`` whenever they change and the change holds, from ``_follow()`` until ``_halt()``."""

    def __init__(self, addresses: list[str] | None):
        self.following = not addresses
        self.addresses = list(addresses) if addresses else local_addresses()
        self._halted = threading.Event()

    def _follow(self, name: str) -> None:
        if self.following:
            threading.Thread(target=self._watch, daemon=True, name=name).start()

    def _halt(self) -> None:
        self._halted.set()

    def _watch(self) -> None:
        while not self._halted.wait(WATCH_S):
            now = local_addresses()
            if now != self.addresses and self._settled(now):
                log.info("interfaces changed: mDNS moves from %s to %s", self.addresses, now)
                try:
                    self._move(now)
                except Exception:  # tried again at the next check
                    log.exception("mDNS could not move to %s", now)

    def _settled(self, addresses: list[str]) -> bool:
        """Whether this machine's addresses stay ``addresses`` for SETTLE_S (sampled six times)."""
        for _ in range(6):
            if self._halted.wait(SETTLE_S / 6) or local_addresses() != addresses:
                return False
        return True

    @abstractmethod
    def _move(self, addresses: list[str]) -> None:
        """Runs mDNS on ``addresses`` from now on (``self.addresses`` stays as it was if it fails)."""


class Advertiser(_Follower):
    """Announces one node until closed, on the given addresses or else on every local IPv4 address
    (``local_addresses``), moving as interfaces come and go."""

    def __init__(self, info: NodeInfo, addresses: list[str] | None = None):
        super().__init__(addresses)
        self.info = info
        self._zc: Zeroconf | None = None
        self._service: ServiceInfo | None = None
        self._lock = threading.Lock()

    def _service_info(self, info: NodeInfo, name: str, addresses: list[str] | None = None) -> ServiceInfo:
        return ServiceInfo(SERVICE, name, port=info.port, properties=info.to_txt(),
                           server=f"fleetshard-{info.node_id}.local.", parsed_addresses=addresses or self.addresses,
                           host_ttl=TTL, other_ttl=TTL)

    def start(self) -> "Advertiser":
        with self._lock:
            if self._zc is not None:
                return self
            self._zc, self._service = self._register(self.addresses)
        self._follow("mdns advertiser watch")
        return self

    def _register(self, addresses: list[str]) -> tuple[Zeroconf, ServiceInfo]:
        zc = _open(addresses)
        service = self._service_info(self.info, _instance(self.info), addresses)
        try:
            # Probes first; another node holding the name (a clone of this one's node.id) gets
            # " (2)" appended rather than a conflict.
            zc.register_service(service, allow_name_change=True)
        except Exception as exc:
            zc.close()
            raise FleetError(f"cannot advertise {service.name!r} over mDNS: {exc}") from None
        self.addresses = addresses
        return zc, service

    def _move(self, addresses: list[str]) -> None:
        """Says goodbye where the node was announced, then announces it on ``addresses`` (browsers
        see it leave and come back with its new addresses)."""
        with self._lock:
            if self._halted.is_set():
                return
            if self._zc is not None:
                _goodbye(self._zc, self._service)
                self._zc = self._service = None
            self._zc, self._service = self._register(addresses)

    @property
    def service_name(self) -> str | None:
        return self._service.name if self._service else None

    def update(self, info: NodeInfo) -> None:
        """Re-announces changed facts (status, available memory) under the same service name."""
        with self._lock:
            self.info = info
            if self._zc is None or self._service is None:
                return
            service = self._service_info(info, self._service.name)
            self._zc.update_service(service)
            self._service = service

    def close(self) -> None:
        """Sends goodbyes, so browsers drop the node at once, and stops zeroconf."""
        self._halt()
        with self._lock:
            zc, service, self._zc, self._service = self._zc, self._service, None, None
        if zc is not None:
            _goodbye(zc, service)

    def __enter__(self) -> "Advertiser":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _goodbye(zc: Zeroconf, service: ServiceInfo | None) -> None:
    try:
        if service is not None:
            zc.unregister_service(service)
    except Exception as exc:  # the network went away first: browsers drop us after TTL instead
        log.warning("mDNS goodbye for %s failed: %s", service.name if service else "?", exc)
    finally:
        zc.close()


class Browser(_Follower):
    """Keeps the nodes currently advertised, optionally of one fleet only.

    ``on_event(kind, info)`` runs on zeroconf's browser thread, or a checker's, with kind "added",
    "updated" or "removed"; it must not call ``close()``.  A record that cannot be decoded is skipped, and its reason
    kept in ``rejected()``.  Given no addresses it listens on every local IPv4 address and moves as
    interfaces come and go; after a move, the nodes not heard again within ``RECONFIRM_S`` are removed.

    ``verify`` (``prover(access)``) checks a record naming a node at addresses or a port it is not known
    at (a new node, or a known one moving) before it is believed, and returns the address that
    passed, listed first from then on; a record that fails is skipped, its reason in ``rejected()``,
    and a known node keeps its place.  Checks run on ``CHECKS`` threads of their own, and so do the
    resolves that must ask the network (a record not whole in zeroconf's cache); a record heard
    again, or removed, while its check or resolve runs makes that one's outcome moot.  Without
    ``verify``, records are believed as heard.
    """

    def __init__(self, fleet_id: str | None = None, on_event: Callable[[str, NodeInfo], None] | None = None,
                 addresses: list[str] | None = None, verify: Callable[[NodeInfo], str] | None = None):
        super().__init__(addresses)
        self.fleet_id = fleet_id
        self._on_event = on_event
        self._verify = verify
        self._lock = threading.Lock()
        self._nodes: dict[str, NodeInfo] = {}
        self._names: dict[str, str] = {}  # service name -> node id, the least recently heard first
        self._rejected: dict[str, str] = {}  # service name -> reason
        self._unconfirmed: set[str] = set()  # service names known from before the last move
        self._checks: dict[str, int] = {}  # service name -> its check waiting or under way (a ticket)
        self._tickets = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # (name, info, known, ticket), None: stop
        self._checkers = 0
        self._resolving: set[concurrent.futures.Future] = set()  # resolves asking the network, cancelled by close()
        self._moves = 0
        self._zc: Zeroconf | None = None
        self._browser: ServiceBrowser | None = None

    def start(self) -> "Browser":
        with self._lock:
            if self._zc is not None:
                return self
            self._zc = _open(self.addresses)
            self._browser = ServiceBrowser(self._zc, SERVICE, handlers=[self._on_change])
        self._follow("mdns browser watch")
        return self

    def _move(self, addresses: list[str]) -> None:
        with self._lock:
            if self._zc is None:
                return
            old_zc, old_browser = self._zc, self._browser
            self._zc = _open(addresses)
            self.addresses = addresses
            self._browser = ServiceBrowser(self._zc, SERVICE, handlers=[self._on_change])
            self._unconfirmed = set(self._names)
            self._moves += 1
            move = self._moves
        # outside the lock: cancel() waits for the old browser's thread, whose handler may need it
        old_browser.cancel()
        old_zc.close()
        timer = threading.Timer(RECONFIRM_S, self._drop_unconfirmed, [move])
        timer.daemon = True
        timer.start()

    def _drop_unconfirmed(self, move: int) -> None:
        with self._lock:
            if move != self._moves or self._zc is None:  # moved again since, or closed
                return
            events = [e for name in self._unconfirmed for e in self._unlink(name)]
            self._unconfirmed = set()
        self._emit(events)

    def nodes(self) -> dict[str, NodeInfo]:
        with self._lock:
            return dict(self._nodes)

    def rejected(self) -> dict[str, str]:
        with self._lock:
            return dict(self._rejected)

    def close(self) -> None:
        """Stops browsing at once: a check under way is left to end by itself, its outcome dropped."""
        self._halt()
        with self._lock:
            zc, browser, self._zc, self._browser = self._zc, self._browser, None, None
            self._checks.clear()
            checkers, self._checkers = self._checkers, 0
            resolving, self._resolving = self._resolving, set()
        for _ in range(checkers):
            self._queue.put(None)
        for future in resolving:  # zeroconf's close would wait for them (a second)
            future.cancel()
        if browser is not None:
            browser.cancel()
        if zc is not None:
            zc.close()

    def __enter__(self) -> "Browser":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_change(self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Removed:
            self._forget(name)
            return
        # This is zeroconf's browser thread, which closing the browser joins: nothing here waits on the
        # network.  A record whose answers came whole (the usual announcement) is read from the cache;
        # one that needs asking, and a check (which dials an agent), go to a checker thread.
        service = ServiceInfo(service_type, name)
        if not service.load_from_cache(zeroconf):
            self._queue_work(name, ("resolve", name, service, zeroconf), None)
            return
        self._heard(name, service)

    def _heard(self, name: str, service: ServiceInfo, ticket: int | None = None) -> None:
        """A resolved record (``ticket``: resolved on a checker thread, unless moot since)."""
        addresses = sorted(service.parsed_addresses(IPVersion.V4Only), key=_preference)
        try:
            info = NodeInfo.from_txt(name, service.properties, addresses, service.port or 0)
        except BadRecord as exc:
            self._reject(name, str(exc), ticket)
            return
        if self.fleet_id is not None and info.fleet_id != self.fleet_id:
            log.debug("ignoring %s of fleet %s", name, info.fleet_id)
            self._forget(name, ticket)
            return
        if self._verify is not None:
            with self._lock:
                known = self._nodes.get(info.node_id)
            if known is None or _endpoint(known) != _endpoint(info):
                self._check(name, info, known)  # the agent is dialled before the record is believed
                return
            info.addresses = list(known.addresses)  # new facts at the same place: the address that passed stays first
        self._believe(name, info, ticket)

    def _check(self, name: str, info: NodeInfo, known: NodeInfo | None) -> None:
        """Queues ``verify``'s check of a record for the checker threads."""
        self._queue_work(name, ("check", name, info, known), known)

    def _queue_work(self, name: str, work: tuple, known: NodeInfo | None) -> None:
        """Queues a check or a resolve of a record for the checker threads (started as needed, ``CHECKS``);
        its ticket makes any earlier one of the same record moot."""
        with self._lock:
            if self._zc is None:
                return
            if name not in self._checks and len(self._checks) >= MAX_CHECKS:
                full = True
            else:
                full = False
                self._tickets += 1
                self._checks[name] = ticket = self._tickets
                start = self._checkers < CHECKS
                self._checkers += int(start)
        if full:
            self._refuse(name, f"{MAX_CHECKS} records are already waiting for their check", known)
            return
        if start:
            threading.Thread(target=self._checker, daemon=True, name="mdns check").start()
        self._queue.put((work, ticket))

    def _checker(self) -> None:
        while (item := self._queue.get()) is not None:
            work, ticket = item
            name = work[1]
            with self._lock:
                if self._checks.get(name) != ticket:  # heard again, removed, or closed meanwhile
                    continue
            if work[0] == "resolve":
                self._resolve(*work[1:], ticket)
                continue
            _, name, info, known = work
            try:
                proven = self._verify(info)
            except FleetError as exc:
                where = f"{','.join(info.addresses) or '?'} port {info.port}"
                self._refuse(name, f"it names node {info.node_id} at {where}, which does not answer as "
                                   f"that node with the fleet key ({exc})", known, ticket)
                continue
            except Exception:  # a checker thread must outlive a broken check
                log.exception("checking mDNS service %s failed", name)
                continue
            info.addresses = [proven] + [a for a in info.addresses if a != proven]
            self._believe(name, info, ticket)

    def _resolve(self, name: str, service: ServiceInfo, zeroconf: Zeroconf, ticket: int) -> None:
        """Asks the network for a record's missing answers (``RESOLVE_MS`` at most), on a checker thread."""
        try:
            future = asyncio.run_coroutine_threadsafe(service.async_request(zeroconf, RESOLVE_MS), zeroconf.loop)
        except Exception as exc:  # the browser moved meanwhile: that zeroconf is gone
            log.debug("resolving %s failed: %s", name, exc)
            return
        with self._lock:
            if self._zc is None:  # closed meanwhile
                future.cancel()
                return
            self._resolving.add(future)
        try:
            resolved = future.result(RESOLVE_MS / 1000 + 1)
        except concurrent.futures.CancelledError:  # closed
            return
        except Exception as exc:  # the browser moved meanwhile, or zeroconf's own deadline
            log.debug("resolving %s failed: %s", name, exc)
            resolved = False
        finally:
            with self._lock:
                self._resolving.discard(future)
        if not resolved:
            self._reject(name, f"no answer resolving {name!r} within {RESOLVE_MS} ms", ticket)
            return
        try:
            self._heard(name, service, ticket)
        except Exception:  # a checker thread must outlive a broken record
            log.exception("reading mDNS service %s failed", name)

    def _believe(self, name: str, info: NodeInfo, ticket: int | None = None) -> None:
        """Takes a record as heard (``ticket``: as its check passed, unless moot since)."""
        events = []
        with self._lock:
            if not self._settle(name, ticket):
                return
            self._rejected.pop(name, None)
            self._unconfirmed.discard(name)
            before = self._names.get(name)
            if before is not None and before != info.node_id:
                events += self._unlink(name)
            self._names.pop(name, None)
            previous = self._nodes.get(info.node_id)
            self._names[name] = info.node_id  # last in the order: heard most recently
            self._nodes[info.node_id] = info
            if previous != info:
                events.append(("added" if previous is None else "updated", info))
            while len(self._names) > MAX_RECORDS:
                oldest = next(iter(self._names))
                log.warning("dropping mDNS service %s: more than %d records heard", oldest, MAX_RECORDS)
                events += self._unlink(oldest)
        self._emit(events)

    def _settle(self, name: str, ticket: int | None) -> bool:
        """Whether a record's outcome still counts: always for one heard now (a check of the record under
        way becomes moot), only while current for a check's (``ticket``).  Lock held."""
        if ticket is None:
            self._checks.pop(name, None)
            return True
        if self._checks.get(name) != ticket:
            return False
        del self._checks[name]
        return True

    def _refuse(self, name: str, reason: str, known: NodeInfo | None, ticket: int | None = None) -> None:
        """Skips a record that failed ``verify``; unlike a malformed one, it does not take the node it
        names away (a record cannot unseat a node that proved itself)."""
        if known is not None:
            reason += f"; the node stays at {','.join(known.addresses)} port {known.port}"
        with self._lock:
            if not self._settle(name, ticket):
                return
            self._rejected.pop(name, None)
            self._rejected[name] = reason
            while len(self._rejected) > MAX_REJECTED:
                del self._rejected[next(iter(self._rejected))]
        log.warning("skipping mDNS service %s: %s", name, reason)

    def _reject(self, name: str, reason: str, ticket: int | None = None) -> None:
        """Skips a malformed record (or one that did not resolve): its node goes (``ticket`` as ``_settle``)."""
        with self._lock:
            if not self._settle(name, ticket):
                return
            self._rejected[name] = reason
            while len(self._rejected) > MAX_REJECTED:
                del self._rejected[next(iter(self._rejected))]
            events = self._unlink(name)
        log.warning("skipping mDNS service %s: %s", name, reason)
        self._emit(events)

    def _forget(self, name: str, ticket: int | None = None) -> None:
        with self._lock:
            if not self._settle(name, ticket):
                return
            self._rejected.pop(name, None)
            events = self._unlink(name)
        self._emit(events)

    def _unlink(self, name: str) -> list[tuple[str, NodeInfo]]:
        """Drops a service name; its node goes too unless another name still carries it.  Lock held."""
        node = self._names.pop(name, None)
        if node is None or node in self._names.values():
            return []
        return [("removed", self._nodes.pop(node))]

    def _emit(self, events: list[tuple[str, NodeInfo]]) -> None:
        if self._on_event is None:
            return
        for kind, info in events:
            try:
                self._on_event(kind, info)
            except Exception:
                log.exception("discovery callback failed on %s of %s", kind, info.name)


def browse(seconds: float, fleet_id: str | None = None, addresses: list[str] | None = None,
           verify: Callable[[NodeInfo], str] | None = None) -> list[NodeInfo]:
    """The nodes heard within ``seconds`` (with ``verify``, those whose records passed it)."""
    with Browser(fleet_id, addresses=addresses, verify=verify) as browser:
        time.sleep(seconds)
        return list(browser.nodes().values())
