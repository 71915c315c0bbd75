"""A persistent connection between fleet processes: listening (bounded handshakes), dialing,
sealed framed send/receive with timeouts, and the optional injected one-way delay (WAN simulation
on one machine).

Either side of a new connection gives its whole handshake (the dial and TLS included) at most
``HANDSHAKE_DEADLINE_S``, however the other side paces its bytes.  A listener drops a connection
that sends nothing within ``FIRST_BYTE_S``, and holds at most ``MAX_PENDING_PER_PEER`` connections
from one address (``MAX_PENDING`` from all) that have not finished their handshake: one more is
closed at once, and its dialer tries again a few times.  Refusals are logged in aggregate: a flood
of them writes a line per ``REFUSAL_LOG_S``, with their count.

The delay models latency, not a slow link: each frame is held for ``delay`` after it arrives (or
before it leaves) on its own clock, so frames of different streams overlap in flight the way they
would on a real long-haul path, instead of queueing behind one another's sleeps.
"""

from __future__ import annotations

import abc
import collections
import queue
import select
import socket
import ssl
import threading
import time

from engine.errors import FleetError
from engine.manifest import Manifest
from engine.transport import wire
from engine.transport.wire import Frame, PeerClosed, ProtocolError

FRAME_STALL_S = 10.0  # once a frame has started arriving, the rest must follow within this
HANDSHAKE_TIMEOUT_S = 5.0  # per receive, on the listening side (and for a mesh rank's acknowledgement)
HANDSHAKE_DEADLINE_S = 5.0  # for the whole handshake, on either side
FIRST_BYTE_S = 2.0  # a new connection's first byte, or it is dropped: an idle socket must not hold its slot for long
MAX_PENDING_PER_PEER = 8  # connections of one listener from one address still in their handshake
MAX_PENDING = 256  # ... from every address: bounds the listener's threads
REFUSAL_LOG_S = 10.0  # a listener's refusals after the first are logged as one line per this many seconds
DIAL_ATTEMPTS = 4  # a handshake the listener dropped unanswered (at its cap) is tried this many times in all
DIAL_BACKOFF_S = 0.1  # before the second attempt; doubled before each next
# what a dialer sees of a listener that dropped its connection unanswered
_DROPPED = (PeerClosed, ConnectionResetError, ConnectionAbortedError, BrokenPipeError, ssl.SSLEOFError)


def parse_address(text: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """(host, port) of a ``HOST:PORT`` (or a bare ``PORT`` on ``default_host``) a user or a peer gave."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    try:
        number = int(port)
    except ValueError:
        raise FleetError(f"{text!r} is not HOST:PORT") from None
    if not 0 <= number < 65536:
        raise FleetError(f"port {number} in {text!r} is out of range")
    return host.strip("[]") or default_host, number


def accept_loop(listener: socket.socket, stop: threading.Event, authenticate, session, label: str, log) -> None:
    """Accepts connections until ``stop`` is set.  Each, on its own thread, is authenticated by
    ``authenticate(conn)`` (``authenticate_peer``, returning the socket and its seal), then served
    by ``session(conn, seal, "host:port")``.  At most ``MAX_PENDING_PER_PEER`` connections from one
    address, and ``MAX_PENDING`` in all, may be in their handshake at once; refusals are logged
    through ``log`` in aggregate (``_Refusals``)."""
    pending = _Pending()
    refused = _Refusals(label, log)
    while not stop.is_set():
        try:
            conn, addr = listener.accept()
        except OSError:
            if stop.is_set():
                return
            time.sleep(0.05)
            continue
        peer, host = "%s:%d" % addr[:2], addr[0]
        full = pending.take(host)
        if full:
            refused(peer, full)
            _drop(conn)
            continue
        thread = threading.Thread(target=_serve, args=(conn, peer, host, authenticate, session, pending, refused),
                                  daemon=True, name=f"{label} {peer}")
        try:
            thread.start()
        except RuntimeError as exc:  # out of threads: this connection is lost, the listener is not
            pending.give(host)
            refused(peer, f"cannot start a thread for it ({exc})")
            _drop(conn)
            time.sleep(0.05)


def _drop(conn: socket.socket) -> None:
    try:
        conn.close()
    except OSError:
        pass


def _serve(conn: socket.socket, peer: str, host: str, authenticate, session, pending: "_Pending",
           refused: "_Refusals") -> None:
    try:
        conn, seal = authenticate(conn)
    except Exception as exc:  # noqa: BLE001 - whatever a stranger caused, it costs only its connection
        _drop(conn)
        refused(peer, str(exc))
        return
    finally:
        pending.give(host)
    session(conn, seal, peer)


class _Pending:
    """A listener's connections still in their handshake, counted per peer address: one peer's idle
    sockets fill its own share, not every peer's."""

    def __init__(self):
        self._lock = threading.Lock()
        self._hosts: collections.Counter[str] = collections.Counter()

    def take(self, host: str) -> str | None:
        """Counts one more connection from ``host``, or says why it is refused."""
        with self._lock:
            if self._hosts[host] >= MAX_PENDING_PER_PEER:
                return f"{MAX_PENDING_PER_PEER} connections from {host} are already in their handshake"
            if self._hosts.total() >= MAX_PENDING:
                return f"{MAX_PENDING} connections are already in their handshake"
            self._hosts[host] += 1
            return None

    def give(self, host: str) -> None:
        with self._lock:
            self._hosts[host] -= 1
            if not self._hosts[host]:
                del self._hosts[host]


class _Refusals:
    """Logs a listener's refusals without a line for each: the first after a quiet spell at once, then
    those of each ``REFUSAL_LOG_S`` that follows as one line with their count and the latest reason."""

    def __init__(self, label: str, log):
        self._label = label
        self._log = log
        self._lock = threading.Lock()
        self._quiet = True
        self._count = 0
        self._latest = ""

    def __call__(self, peer: str, reason: str) -> None:
        with self._lock:
            if not self._quiet:
                self._count += 1
                self._latest = f"{peer}: {reason}"
                return
            self._quiet = False
            self._later()
        self._log(f"refused connection from {peer}: {reason}")

    def _later(self) -> None:
        """Flushes the count after ``REFUSAL_LOG_S``.  Lock held."""
        timer = threading.Timer(REFUSAL_LOG_S, self._flush)
        timer.daemon = True
        try:
            timer.start()
        except RuntimeError:  # out of threads: refusals are logged one by one until there is one
            self._quiet = True

    def _flush(self) -> None:
        with self._lock:
            count, latest, self._count = self._count, self._latest, 0
            if count:
                self._later()
            else:
                self._quiet = True
        if count:
            self._log(f"refused {count} more connection{'s' if count > 1 else ''} to the {self._label} port in "
                      f"the last {REFUSAL_LOG_S:g} s, the latest from {latest}")


class _Deadlines:
    """Cuts off handshakes that outlive their deadline (shuts their socket down, which wakes the
    thread blocked on it): one thread for every handshake of the process."""

    def __init__(self):
        self._cond = threading.Condition()
        self._due: dict[int, list] = {}  # token -> [deadline, socket, cut]
        self._tokens = 0
        self._thread: threading.Thread | None = None

    def watch(self, sock: socket.socket, seconds: float) -> int:
        with self._cond:
            if self._thread is None:
                thread = threading.Thread(target=self._run, daemon=True, name="handshake deadlines")
                thread.start()
                self._thread = thread
            self._tokens += 1
            self._due[self._tokens] = [time.monotonic() + seconds, sock, False]
            self._cond.notify()
            return self._tokens

    def follow(self, token: int, sock: socket.socket) -> None:
        """The watched connection now goes through ``sock`` (its TLS wrapper)."""
        with self._cond:
            self._due[token][1] = sock

    def release(self, token: int) -> bool:
        """Stops watching; returns whether the deadline cut the connection off."""
        with self._cond:
            return self._due.pop(token)[2]

    def _run(self) -> None:
        with self._cond:
            while True:
                now, wait = time.monotonic(), None
                for entry in self._due.values():
                    if entry[2]:
                        continue
                    if entry[0] <= now:
                        entry[2] = True
                        try:  # the plain socket's shutdown: safe on a TLS socket mid-handshake on another thread
                            socket.socket.shutdown(entry[1], socket.SHUT_RDWR)
                        except OSError:
                            pass
                    else:
                        wait = entry[0] - now if wait is None else min(wait, entry[0] - now)
                self._cond.wait(wait)


_DEADLINES = _Deadlines()


class _Within:
    """One handshake under its deadline: ``with _Within(sock, seconds) as within:`` runs it, TLS
    through ``within.tls``.  On the way out, whatever failed, the socket is closed; a handshake the
    deadline cut off (or a read that timed out) raises ProtocolError naming the deadline."""

    def __init__(self, sock: socket.socket, seconds: float, nominal: float | None = None):
        self.sock = sock
        self._nominal = nominal or seconds  # the deadline named in the error
        self._token = _DEADLINES.watch(sock, seconds)
        sock.settimeout(max(seconds, 0.001))  # no read may outlast it either

    def tls(self, context: ssl.SSLContext, server_side: bool) -> socket.socket:
        self.sock = context.wrap_socket(self.sock, server_side=server_side, do_handshake_on_connect=False)
        _DEADLINES.follow(self._token, self.sock)
        self.sock.do_handshake()
        return self.sock

    def __enter__(self) -> "_Within":
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        cut = _DEADLINES.release(self._token) or isinstance(exc, socket.timeout)
        if kind is not None or cut:
            _drop(self.sock)
        if cut:
            raise ProtocolError(f"the handshake did not finish within {self._nominal:.3g} s: cut off") from None
        return False


def authenticate_peer(conn: socket.socket, key: bytes, identity: dict, tls=None,
                      deadline_s: float | None = None) -> tuple[socket.socket, wire.Seal]:
    """The listening side of a new connection: its first byte within ``FIRST_BYTE_S``, then TLS when
    the fleet uses it and the fleet-key handshake, all within ``deadline_s`` (``HANDSHAKE_DEADLINE_S``);
    returns the socket to serve and its seal (raises ProtocolError, AuthError, OSError; the socket is
    then closed)."""
    deadline_s = deadline_s or HANDSHAKE_DEADLINE_S
    tune(conn)
    with _Within(conn, deadline_s) as within:
        _first_byte(conn, min(FIRST_BYTE_S, deadline_s))
        conn.settimeout(min(HANDSHAKE_TIMEOUT_S, deadline_s))
        if tls is not None:
            conn = within.tls(tls.server, server_side=True)
        _, seal = wire.server_handshake(conn, key, identity)
    return conn, seal


def _first_byte(conn: socket.socket, seconds: float) -> None:
    """Waits for the peer's first byte (a dialer speaks first: HELLO, or TLS's ClientHello)."""
    conn.settimeout(seconds)
    try:
        if not conn.recv(1, socket.MSG_PEEK):
            raise PeerClosed("the peer closed the connection before its handshake")
    except socket.timeout:
        raise ProtocolError(f"it sent nothing within {seconds:.3g} s") from None


def handshake(address: str, key: bytes, identity: dict, tls=None,
              deadline_s: float | None = None) -> tuple[socket.socket, dict, wire.Seal]:
    """Dials ``address`` and runs the fleet-key handshake with the peer, which must match ``identity``
    (TLS first when the fleet uses it), the whole of it within ``deadline_s`` (at most, and by default,
    ``HANDSHAKE_DEADLINE_S``) however the peer paces its bytes.  A handshake the listener dropped
    unanswered (at its cap of pending handshakes) is tried again, ``DIAL_ATTEMPTS`` times in all.
    Returns the socket, the peer's WELCOME and the connection's seal.  Raises OSError when nothing
    answers at ``address`` (not up yet), AuthError when the peer refused us or the connection broke,
    ProtocolError when the peer dropped or stalled the handshake."""
    seconds = min(deadline_s, HANDSHAKE_DEADLINE_S) if deadline_s else HANDSHAKE_DEADLINE_S
    end = time.monotonic() + seconds
    attempt, backoff = 1, DIAL_BACKOFF_S
    while True:
        sock = dial(address, timeout=max(end - time.monotonic(), 0.001))
        try:
            with _Within(sock, end - time.monotonic(), seconds) as within:
                if tls is not None:
                    within.tls(tls.client, server_side=False)
                welcome, seal = wire.client_handshake(within.sock, key, identity)
            return within.sock, welcome, seal
        except _DROPPED as exc:
            if attempt == DIAL_ATTEMPTS or time.monotonic() + backoff >= end:
                raise ProtocolError(f"{address} dropped the handshake, {attempt} time{'s' if attempt > 1 else ''} "
                                    f"({exc})") from None
        except OSError as exc:
            raise wire.AuthError(f"the connection broke during the handshake ({exc})") from None
        time.sleep(backoff)
        attempt, backoff = attempt + 1, backoff * 2


def tune(sock: socket.socket) -> None:
    """Sets up a fleet connection's socket: small frames go at once, a dead peer is noticed."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # per-token frames are small: no Nagle
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


def dial(address: str, timeout: float = 5.0) -> socket.socket:
    """One connection attempt, nothing sent yet (raises OSError); ``handshake`` runs the handshake on it."""
    sock = socket.create_connection(parse_address(address), timeout=timeout)
    tune(sock)
    return sock


def successor_identity(manifest: Manifest, mode: str) -> dict:
    """What the stage after ``manifest``'s must be: same model and mode, next index, next layer."""
    return {"fingerprint": manifest.fingerprint, "stage": manifest.stage_index + 1,
            "first_layer": manifest.layers[1], "mode": mode}


def connect_peer(address: str, key: bytes, identity: dict, tls=None,
                 max_frame: int = wire.DEFAULT_MAX_FRAME) -> tuple["Link", dict]:
    """Dials and authenticates a peer that must match ``identity`` (``handshake``); returns the link
    and the peer's WELCOME.  Raises OSError when it is not up (yet), AuthError/ProtocolError when it
    answered but refused, broke off or stalled the handshake (a plain peer against TLS drops it)."""
    sock, welcome, seal = handshake(address, key, identity, tls)
    return Link(sock, address, seal, 0.0, max_frame), welcome


def connect_successor(address: str, key: bytes, manifest: Manifest, mode: str, tls=None,
                      max_frame: int = wire.DEFAULT_MAX_FRAME) -> tuple["Link", float]:
    """Dials and authenticates the next stage (``connect_peer``); returns the link and the peer's
    injected one-way delay in seconds."""
    link, welcome = connect_peer(address, key, successor_identity(manifest, mode), tls, max_frame)
    return link, float(welcome.get("delay_ms", 0.0) or 0.0) / 1e3


class Listening(abc.ABC):
    """What a process serving a port shares (a stage worker, a draft server): ``start`` its threads,
    ``serve_forever`` until ``stop``; subclasses set ``_listener`` and ``_stop`` and extend ``stop``."""

    _listener: socket.socket
    _stop: threading.Event

    @abc.abstractmethod
    def start(self):
        """Starts the threads that accept and serve connections."""

    def serve_forever(self) -> None:
        self.start()
        try:
            while not self._stop.wait(0.5):
                pass
        finally:
            self.stop()

    def stop(self) -> None:
        self._stop.set()
        try:
            self._listener.close()
        except OSError:
            pass


class Link:
    """A framed socket, every frame sealed by the handshake's ``seal`` (a frame that fails its
    check raises ProtocolError). ``send`` is thread-safe; one thread calls ``recv``."""

    def __init__(self, sock: socket.socket, peer: str, seal: wire.Seal, delay_s: float = 0.0,
                 max_frame: int = wire.DEFAULT_MAX_FRAME):
        self.sock = sock
        self.peer = peer
        self.seal = seal
        seal.peer = peer
        self.delay_s = delay_s
        self.max_frame = max_frame
        self.closed = threading.Event()
        self._send_lock = threading.Lock()
        sock.settimeout(None)
        if delay_s > 0:
            self._inbox: queue.Queue = queue.Queue()
            self._outbox: queue.Queue = queue.Queue()
            threading.Thread(target=self._reader, daemon=True, name=f"recv {peer}").start()
            threading.Thread(target=self._sender, daemon=True, name=f"send {peer}").start()

    # --- sending ---------------------------------------------------------------------------------

    def send(self, frame: Frame) -> None:
        self.send_parts(wire.encode_parts(frame))

    def send_parts(self, parts: list[bytes]) -> None:
        """Sends a frame already encoded (``wire.encode_parts``): one encoding for every link that
        sends the same frame (a stage's and its standby's, ``engine.runtime.relay.mirror``)."""
        with self._send_lock:  # frames leave in the order of their seal's counter
            data = b"".join([*parts, self.seal.tag(parts)])
            if self.delay_s > 0:
                self._outbox.put((time.monotonic() + self.delay_s, data))
                return
            self.sock.sendall(data)

    def _sender(self) -> None:
        while not self.closed.is_set():
            item = self._outbox.get()
            if item is None:
                return
            due, data = item
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                self.sock.sendall(data)
            except OSError:
                self.close()
                return

    # --- receiving -------------------------------------------------------------------------------

    def _wait_readable(self, timeout: float | None) -> bool:
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
            return True
        readable, _, _ = select.select([self.sock], [], [], timeout)
        return bool(readable)

    def _read_frame(self, timeout: float | None) -> Frame | None:
        if not self._wait_readable(timeout):
            return None
        self.sock.settimeout(FRAME_STALL_S)
        try:
            return wire.recv_frame(self.sock, self.max_frame, self.seal)
        except socket.timeout:
            raise ProtocolError(f"a frame from {self.peer} stalled halfway") from None
        finally:
            if not self.closed.is_set():
                self.sock.settimeout(None)

    def _reader(self) -> None:
        while True:
            try:
                frame = self._read_frame(None)
            except (ProtocolError, OSError, ValueError) as exc:
                self._inbox.put((0.0, exc))
                return
            self._inbox.put((time.monotonic() + self.delay_s, frame))

    def recv(self, timeout: float | None = None) -> Frame | None:
        """The next frame, or None when nothing arrived within ``timeout`` seconds.  Raises
        ProtocolError for a malformed frame and ConnectionError when the peer is gone."""
        if self.closed.is_set():
            raise ConnectionError(f"connection to {self.peer} is closed")
        try:
            if self.delay_s > 0:
                try:
                    due, item = self._inbox.get(timeout=timeout)
                except queue.Empty:
                    return None
                if isinstance(item, Exception):
                    raise item
                time.sleep(max(0.0, due - time.monotonic()))
                return item
            return self._read_frame(timeout)
        except PeerClosed:
            raise ConnectionError(f"{self.peer} closed the connection") from None
        except ProtocolError:  # the byte stream can no longer be trusted, nor even framed
            self.close()
            raise
        except (OSError, ValueError) as exc:  # ValueError: select on a socket closed under us
            if isinstance(exc, ConnectionError):
                raise
            raise ConnectionError(f"connection to {self.peer} failed: {exc}") from None

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        if self.delay_s > 0:
            self._outbox.put(None)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on this socket
        except OSError:
            pass
        self.sock.close()
