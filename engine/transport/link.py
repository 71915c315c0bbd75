"""A persistent connection between neighbouring stages: dialing, framed send/receive with
timeouts, and the optional injected one-way delay (WAN simulation on one machine).

The delay models latency, not a slow link: each frame is held for ``delay`` after it arrives (or
before it leaves) on its own clock, so frames of different streams overlap in flight the way they
would on a real long-haul path, instead of queueing behind one another's sleeps.
"""

from __future__ import annotations

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
HANDSHAKE_TIMEOUT_S = 5.0


def parse_address(text: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
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


def accept_loop(listener: socket.socket, stop: threading.Event, session, label: str) -> None:
    """Accepts connections until ``stop`` is set, each served by ``session(conn, "host:port")`` on
    its own thread."""
    while not stop.is_set():
        try:
            conn, addr = listener.accept()
        except OSError:
            if stop.is_set():
                return
            time.sleep(0.05)
            continue
        peer = "%s:%d" % addr[:2]
        threading.Thread(target=session, args=(conn, peer), daemon=True, name=f"{label} {peer}").start()


def authenticate_peer(conn: socket.socket, key: bytes, identity: dict, tls=None) -> socket.socket:
    """The listening side of a new connection: TLS when the fleet uses it, then the fleet-key
    handshake; returns the socket to serve (raises ProtocolError, AuthError, OSError)."""
    tune(conn)
    conn.settimeout(HANDSHAKE_TIMEOUT_S)
    if tls is not None:
        conn = tls.server.wrap_socket(conn, server_side=True)
    wire.server_handshake(conn, key, identity)
    return conn


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # per-token frames are small: no Nagle
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


def dial(address: str, tls=None, timeout: float = 5.0) -> socket.socket:
    """One connection attempt (raises OSError); the caller retries."""
    sock = socket.create_connection(parse_address(address), timeout=timeout)
    tune(sock)
    if tls is not None:
        sock = tls.client.wrap_socket(sock, server_hostname=None)
    return sock


def successor_identity(manifest: Manifest, mode: str) -> dict:
    """What the stage after ``manifest``'s must be: same model and mode, next index, next layer."""
    return {"fingerprint": manifest.fingerprint, "stage": manifest.stage_index + 1,
            "first_layer": manifest.layers[1], "mode": mode}


def connect_successor(address: str, key: bytes, manifest: Manifest, mode: str, tls=None,
                      max_frame: int = wire.DEFAULT_MAX_FRAME) -> tuple["Link", float]:
    """Dials and authenticates the next stage; returns the link and the peer's injected one-way
    delay in seconds.  Raises OSError when it is not up (yet), AuthError/ProtocolError when it
    answered but refused or broke off the handshake (a plain peer against TLS drops it)."""
    sock = dial(address, tls)
    try:
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        welcome = wire.client_handshake(sock, key, successor_identity(manifest, mode))
    except OSError as exc:
        sock.close()
        raise wire.AuthError(f"the connection broke during the handshake ({exc})") from None
    except BaseException:
        sock.close()
        raise
    return Link(sock, address, 0.0, max_frame), float(welcome.get("delay_ms", 0.0) or 0.0) / 1e3


class Link:
    """A framed socket. ``send`` is thread-safe; one thread calls ``recv``."""

    def __init__(self, sock: socket.socket, peer: str, delay_s: float = 0.0,
                 max_frame: int = wire.DEFAULT_MAX_FRAME):
        self.sock = sock
        self.peer = peer
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
        data = wire.encode(frame)
        if self.delay_s > 0:
            self._outbox.put((time.monotonic() + self.delay_s, data))
            return
        with self._send_lock:
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
            return wire.recv_frame(self.sock, self.max_frame)
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
