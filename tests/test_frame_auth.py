"""Frames after the handshake are authenticated, and both sides bound their handshakes.

A keyless relay in the middle of a real agent's control connection and of a real worker's relay
link passes the handshake through, then injects, alters, drops, reorders or replays a frame: each
time the receiving side refuses the connection with a line naming the frame and the peer, and an
injected CALL is not obeyed.  A client trickling its HELLO is cut off at the handshake deadline, and
so is a dial (relay, control, draft) whose listener trickles its answer; a dialer tries again when a
listener drops its handshake unanswered.  A listener holding its cap of unauthenticated connections
closes one more at once and serves a real client afterwards; the cap is counted per peer address,
so one address's idle sockets leave another's handshake free; a connection that sends nothing is
dropped at the first-byte deadline; a burst of refusals is logged as one line with their count; a
failed thread start costs one connection, not the listener; before the peer proves the key, a
listener names nothing it serves; with TLS on, a client without the fleet certificate is refused."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import ssl
import sys
import threading
import time

import numpy as np
import pytest
from fleet_support import Trickler

from engine.config import FleetAccess
from engine.errors import FleetError, StageError
from engine.fleet.agent import Agent
from engine.fleet.control import AgentError, ControlClient, call_frame
from engine.fleetkey import TLS, access_of, create_certificate, create_key, load_key, tls_file
from engine.runtime.decode.generate import Generator
from engine.runtime.decode.remotedraft import DraftLink
from engine.runtime.relay.remote import RemoteChain
from engine.runtime.relay.worker import Worker
from engine.runtime.stages.stage import core
from engine.transport import link as link_module
from engine.transport import wire
from engine.transport.wire import HEADER, TAG_BYTES, Msg

core()  # before any test starts a thread: creating an OpenVINO Core forks a child that hangs if threads run

AUTH_FAILED = "failed its authentication: altered, replayed or not from the fleet"
IDLE = 70  # idle sockets from one address: more than every peer together could hold before (64)
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="dials from 127.0.0.2, a second loopback address (Linux)")
FAKE_TAG = b"\0" * TAG_BYTES  # what a peer without the key can put where a frame's tag goes


class Relay:
    """A man in the middle without the fleet key: relays whole frames between each client and
    ``target``, through ``tamper[direction](index, raw) -> [raw frames to pass on]`` when set.
    ``direction`` is "up" (client to server) or "down"; ``index`` counts that direction's frames
    (the handshake's untagged HELLO, PROOF up and CHALLENGE down come first)."""

    UNTAGGED = {"up": 2, "down": 1}

    def __init__(self, target: str):
        self.target = target
        self.tamper: dict = {"up": None, "down": None}
        self.seen: dict[str, list[bytes]] = {"up": [], "down": []}
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self._listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="relay accept").start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            host, port = link_module.parse_address(self.target)
            server = socket.create_connection((host, port))
            self._socks += [client, server]
            for src, dst, direction in ((client, server, "up"), (server, client, "down")):
                threading.Thread(target=self._pump, args=(src, dst, direction), daemon=True).start()

    @staticmethod
    def _exact(sock: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError
            data += chunk
        return data

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        index = 0
        try:
            while True:
                header = self._exact(src, HEADER.size)
                length = HEADER.unpack(header)[-1]
                raw = header + self._exact(src, length + (TAG_BYTES if index >= self.UNTAGGED[direction] else 0))
                self.seen[direction].append(raw)
                hook = self.tamper[direction]
                for out in (hook(index, raw) if hook else [raw]):
                    dst.sendall(out)
                index += 1
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._listener.close()
        for sock in self._socks:
            sock.close()


def _kind(raw: bytes) -> Msg:
    return Msg(HEADER.unpack(raw[:HEADER.size])[2])


def _wait_for(predicate, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.fixture
def key_file(tmp_path):
    return create_key(tmp_path / "fleet.key")


@pytest.fixture
def agent(tmp_path, key_file):
    """A real agent in this process, whose prune is counted rather than done."""
    logs: list[str] = []
    node = Agent("127.0.0.1:0", access=access_of(key_file), store=tmp_path / "store", advertise=False, log=logs.append)
    node.pruned = []
    node.prune = lambda: node.pruned.append(1) or {"dropped": []}
    node.logs = logs
    node.start()
    yield node
    node.stop()


def _address(agent: Agent) -> str:
    return f"127.0.0.1:{agent.port}"


def _idle(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` connections from ``host`` to the loopback ``port`` that send nothing (non-blocking)."""
    socks = [socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(host, 0)) for _ in range(count)]
    for sock in socks:
        sock.setblocking(False)
    return socks


def _closed(sock: socket.socket) -> bool:
    """Whether the other end closed ``sock``, a non-blocking socket."""
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def _refused_for_auth(agent: Agent) -> bool:
    return _wait_for(lambda: any(AUTH_FAILED in line and "127.0.0.1:" in line for line in agent.logs))


# --- a keyless relay on a control connection ----------------------------------------------------------

def test_an_injected_call_is_refused_and_not_obeyed(agent, key_file):
    relay = Relay(_address(agent))
    injected = wire.encode(call_frame("prune")) + FAKE_TAG
    relay.tamper["up"] = lambda i, raw: [injected, raw] if i == 2 else [raw]  # before the client's first CALL
    try:
        # the relayed handshake succeeds
        client = ControlClient(relay.address, FleetAccess(load_key(key_file)), timeout_s=10)
        with pytest.raises(AgentError):
            client.status()
        client.close()
        assert _refused_for_auth(agent), agent.logs
        assert "frame 0 from 127.0.0.1:" in "\n".join(agent.logs)
        assert agent.pruned == []
    finally:
        relay.close()


def test_an_altered_call_is_refused_and_not_obeyed(agent, key_file):
    relay = Relay(_address(agent))
    # the same length, the tag kept: {"op": "status"} becomes {"op": "prune" }
    relay.tamper["up"] = lambda i, raw: [raw.replace(b'"status"', b'"prune" ')]
    try:
        client = ControlClient(relay.address, FleetAccess(load_key(key_file)), timeout_s=10)
        with pytest.raises(AgentError):
            client.status()
        client.close()
        assert _refused_for_auth(agent), agent.logs
        assert agent.pruned == []
    finally:
        relay.close()


def test_a_replayed_call_is_refused_and_not_obeyed_again(agent, key_file):
    relay = Relay(_address(agent))
    relay.tamper["up"] = lambda i, raw: [relay.seen["up"][2]] if i == 3 else [raw]  # the prune again, for the ping
    try:
        client = ControlClient(relay.address, FleetAccess(load_key(key_file)), timeout_s=10)
        client.call("prune")
        assert agent.pruned == [1]
        with pytest.raises(AgentError):
            client.call("ping")
        client.close()
        assert _refused_for_auth(agent), agent.logs
        assert agent.pruned == [1]
    finally:
        relay.close()


@pytest.mark.parametrize("attack", ["drop", "reorder"])
def test_a_dropped_or_reordered_call_is_refused(agent, key_file, attack):
    relay = Relay(_address(agent))
    held: list[bytes] = []

    def tamper(i, raw):
        if i == 2:  # the first CALL: dropped, or held back to follow the second
            held.append(raw)
            return []
        return [raw] + (held if attack == "reorder" else [])

    relay.tamper["up"] = tamper
    try:
        client = ControlClient(relay.address, FleetAccess(load_key(key_file)), timeout_s=10)
        client._link.send(call_frame("pause", {"paused": True}))
        client._link.send(call_frame("ping"))
        assert _refused_for_auth(agent), agent.logs
        assert not agent.paused
        client.close()
    finally:
        relay.close()


def test_an_altered_reply_is_refused_by_the_client(agent, key_file):
    relay = Relay(_address(agent))
    relay.tamper["down"] = lambda i, raw: [_flip(raw, -TAG_BYTES - 2)] if i >= 2 else [raw]  # in the JSON
    try:
        client = ControlClient(relay.address, FleetAccess(load_key(key_file)), timeout_s=10)
        with pytest.raises(AgentError, match=AUTH_FAILED):
            client.status()
        client.close()
    finally:
        relay.close()


def test_an_altered_hello_fails_the_handshake(agent, key_file):
    """The HELLO is bound into the frame keys: a relay that edits what the client asked for
    (here: drops the role it expects) breaks the WELCOME's tag, so the client refuses."""
    relay = Relay(_address(agent))
    relay.tamper["up"] = lambda i, raw: [_rewrite_json(raw, lambda doc: {k: v for k, v in doc.items() if k != "role"})
                                         ] if i == 0 else [raw]
    try:
        with pytest.raises(AgentError, match="altered"):
            ControlClient(relay.address, FleetAccess(load_key(key_file)), timeout_s=10)
    finally:
        relay.close()


def _flip(raw: bytes, at: int) -> bytes:
    data = bytearray(raw)
    data[at] ^= 1
    return bytes(data)


def _rewrite_json(raw: bytes, edit) -> bytes:
    frame = wire.decode(raw)
    return wire.encode(wire.control(frame.type, edit(frame.json()), frame.stream, frame.seq))


# --- a keyless relay on a worker's relay link ---------------------------------------------------------

@pytest.fixture
def worker_behind_relay(tiny_exports):
    folders = tiny_exports["llama", "2"].folders
    key = b"k" * 32
    logs: list[str] = []
    worker = Worker(folders[1], "127.0.0.1:0", access=FleetAccess(key), log=logs.append).start()
    relay = Relay(worker.address)
    chain = RemoteChain(folders[0], [relay.address], access=FleetAccess(key), connect_timeout_s=30)
    yield chain, relay, logs
    chain.close()
    relay.close()
    worker.stop()


def _generate(chain) -> list[int]:
    ids = np.array([[1, 5, 9, 13]], np.int64)
    return Generator(chain, max_length=64).generate(ids, 4, ignore_eos=True).tokens


def test_a_rewritten_result_is_refused_by_the_coordinator(worker_behind_relay):
    chain, relay, _ = worker_behind_relay

    def tamper(i, raw):
        if _kind(raw) != Msg.RESULT:
            return [raw]
        return [_flip(raw, HEADER.size + wire.TENSOR_HEADER.size)]  # the first token id

    relay.tamper["down"] = tamper
    with pytest.raises(StageError, match=AUTH_FAILED):
        _generate(chain)


def test_a_replayed_forward_is_refused_by_the_worker(worker_behind_relay):
    chain, relay, logs = worker_behind_relay
    relay.tamper["up"] = lambda i, raw: [raw, raw] if _kind(raw) in (Msg.FORWARD, Msg.PACKED) else [raw]
    with pytest.raises(StageError):
        _generate(chain)
    assert _wait_for(lambda: any("closing upstream" in line and AUTH_FAILED in line for line in logs)), logs


# --- dial bounds --------------------------------------------------------------------------------------

@pytest.mark.parametrize("client", ["relay", "control", "draft"])
def test_a_dial_whose_peer_trickles_its_answer_ends_at_the_deadline(client, monkeypatch):
    monkeypatch.setattr(link_module, "HANDSHAKE_DEADLINE_S", 1.0)
    key = os.urandom(32)
    dials = {"relay": lambda address: link_module.connect_peer(address, key, {"role": "stage"}),
             "control": lambda address: ControlClient(address, FleetAccess(key), timeout_s=30),
             "draft": lambda address: DraftLink(address, FleetAccess(key))}
    outcome: dict = {}

    def dial(address: str) -> None:
        start = time.monotonic()
        try:
            dials[client](address)
        except FleetError as exc:
            outcome["error"] = str(exc)
        outcome["seconds"] = time.monotonic() - start

    with Trickler() as trickler:  # a byte every 0.1 s, for 6 s
        thread = threading.Thread(target=dial, args=(trickler.address,), daemon=True)
        thread.start()
        thread.join(3.0)
        assert not thread.is_alive(), "the dial outlived its deadline"
    assert outcome["seconds"] < 2.0, outcome
    assert "the handshake did not finish within 1 s" in outcome.get("error", ""), outcome


def test_a_dialer_tries_again_when_the_listener_drops_its_handshake_unanswered():
    key = os.urandom(32)
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def serve() -> None:
        while True:
            conn, _ = listener.accept()
            accepted.append(conn)
            if len(accepted) <= 2:
                conn.close()  # what a listener at its cap of pending handshakes does
                continue
            link_module.authenticate_peer(conn, key, {"role": "agent", "node": {"id": "n1"}})
            return

    threading.Thread(target=serve, daemon=True).start()
    try:
        link, welcome = link_module.connect_peer("127.0.0.1:%d" % listener.getsockname()[1], key, {"role": "agent"})
        link.close()
    finally:
        listener.close()
        for conn in accepted:
            conn.close()
    assert welcome["node"] == {"id": "n1"} and len(accepted) == 3


# --- listener bounds ----------------------------------------------------------------------------------

def test_a_trickling_handshake_is_cut_off_at_the_deadline(agent, monkeypatch):
    monkeypatch.setattr(link_module, "HANDSHAKE_DEADLINE_S", 1.5)
    hello = wire.encode(wire.control(Msg.HELLO, {"role": "agent", "version": wire.VERSION, "nonce": "00" * 32}))
    with socket.create_connection(("127.0.0.1", agent.port), timeout=10) as sock:
        sock.settimeout(0.25)  # a byte every 0.25 s: well inside the per-read timeout
        cut = False
        for byte in hello:
            try:
                sock.sendall(bytes([byte]))
                if sock.recv(1) == b"":
                    cut = True
                    break
            except socket.timeout:
                continue
            except OSError:
                cut = True
                break
        assert cut, "the listener let a trickling client hold its handshake open"
    assert _wait_for(lambda: any("did not finish within 1.5 s" in line for line in agent.logs)), agent.logs


def test_the_cap_on_unauthenticated_connections_holds_and_the_listener_keeps_serving(
        tmp_path, key_file, monkeypatch):
    monkeypatch.setattr(link_module, "MAX_PENDING", 4)
    monkeypatch.setattr(link_module, "HANDSHAKE_DEADLINE_S", 60.0)
    logs: list[str] = []
    node = Agent("127.0.0.1:0", access=access_of(key_file), store=tmp_path / "store", advertise=False,
                 log=logs.append).start()
    idle = [socket.create_connection(("127.0.0.1", node.port), timeout=10) for _ in range(4)]
    try:
        with socket.create_connection(("127.0.0.1", node.port), timeout=10) as extra:
            try:
                closed = extra.recv(1) == b""
            except ConnectionResetError:
                closed = True
            assert closed
        assert any("4 connections are already in their handshake" in line for line in logs), logs
        for sock in idle:
            sock.close()
        idle = []

        def serves() -> bool:
            try:
                with ControlClient(_address(node), FleetAccess(load_key(key_file)), timeout_s=5) as client:
                    return client.call("ping") == {}
            except AgentError:
                return False
        assert _wait_for(serves)
    finally:
        for sock in idle:
            sock.close()
        node.stop()


def test_a_failed_thread_start_does_not_stop_the_listener(agent, key_file, monkeypatch):
    real_start = threading.Thread.start
    failed: list[str] = []

    def start(self):
        if self.name.startswith("control ") and not failed:
            failed.append(self.name)
            raise RuntimeError("can't start new thread")
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    # its second try gets through
    with ControlClient(_address(agent), FleetAccess(load_key(key_file)), timeout_s=10) as client:
        assert client.call("ping") == {}
    assert failed
    assert any("cannot start a thread" in line for line in agent.logs), agent.logs


@linux_only
def test_idle_sockets_from_one_address_leave_another_peers_handshake_free(agent, key_file, monkeypatch):
    monkeypatch.setattr(link_module, "FIRST_BYTE_S", 30.0)
    monkeypatch.setattr(link_module, "HANDSHAKE_DEADLINE_S", 30.0)
    idle = _idle("127.0.0.2", agent.port, IDLE)
    try:
        with ControlClient(_address(agent), FleetAccess(load_key(key_file)), timeout_s=5) as client:
            assert client.call("ping") == {}
        cap = link_module.MAX_PENDING_PER_PEER
        assert _wait_for(lambda: sum(map(_closed, idle)) == IDLE - cap), "the ones over the cap are closed at once"
        time.sleep(0.2)
        assert sum(map(_closed, idle)) == IDLE - cap, "the ones within the cap wait for their first byte"
    finally:
        for sock in idle:
            sock.close()


def test_a_connection_that_sends_nothing_is_dropped_at_the_first_byte_deadline(agent, monkeypatch):
    monkeypatch.setattr(link_module, "FIRST_BYTE_S", 0.5)
    monkeypatch.setattr(link_module, "HANDSHAKE_DEADLINE_S", 30.0)
    with socket.create_connection(("127.0.0.1", agent.port), timeout=5) as sock:
        start = time.monotonic()
        sock.settimeout(3.0)
        try:
            got = sock.recv(1)
        except ConnectionResetError:
            got = b""
        except socket.timeout:
            got = None
        waited = time.monotonic() - start
    assert got == b"" and 0.4 <= waited < 2.0, (got, waited)
    assert _wait_for(lambda: any("sent nothing within 0.5 s" in line for line in agent.logs)), agent.logs


def test_a_burst_of_refusals_is_logged_as_one_line_with_their_count(agent, monkeypatch):
    monkeypatch.setattr(link_module, "REFUSAL_LOG_S", 0.5)
    monkeypatch.setattr(link_module, "FIRST_BYTE_S", 30.0)
    monkeypatch.setattr(link_module, "HANDSHAKE_DEADLINE_S", 30.0)

    def counted() -> int:  # refusals the log accounts for
        found = [re.match(r"refused (\d+) more", line) for line in refusals()]
        return sum(int(match.group(1)) if match else 1 for match in found)

    def refusals() -> list[str]:
        return [line for line in agent.logs if line.startswith("refused")]

    idle = _idle("127.0.0.1", agent.port, IDLE)
    try:
        assert _wait_for(lambda: any(map(_closed, idle)))
        time.sleep(0.2)  # every connection is accepted, and each over the cap closed
        closed = sum(map(_closed, idle))
        assert _wait_for(lambda: counted() == closed), (closed, refusals())
        lines = refusals()
    finally:
        for sock in idle:
            sock.close()
    assert len(lines) == 2, lines
    assert lines[0].startswith("refused connection from 127.0.0.1:"), lines
    assert re.fullmatch(rf"refused {closed - 1} more connections to the control port in the last 0\.5 s, the latest "
                        r"from 127\.0\.0\.1:\d+: \d+ connections from 127\.0\.0\.1 are already in their handshake",
                        lines[1]), lines


SERVED = {"role": "stage", "fingerprint": "model-fp-4f2a", "stage": 7, "first_layer": 11, "mode": "exact"}


@contextlib.contextmanager
def _listening(key: bytes, identity: dict):
    """A real listener (``accept_loop``, ``authenticate_peer``) serving ``identity``; yields its port."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    threading.Thread(target=link_module.accept_loop, daemon=True,
                     args=(listener, stop, lambda conn: link_module.authenticate_peer(conn, key, identity),
                           lambda conn, seal, peer: conn.close(), "stage", lambda line: None)).start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()


def test_before_the_proof_a_listener_names_nothing_it_serves():
    key = os.urandom(32)
    wanted = {"role": "stage", "fingerprint": "another-model", "stage": 3, "first_layer": 5, "mode": "fast"}
    with _listening(key, SERVED) as port:
        said = []  # every document the listener sends a peer without the key
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            wire.send_frame(sock, wire.control(Msg.HELLO, {**wanted, "version": wire.VERSION, "nonce": "00" * 32}))
            with contextlib.suppress(wire.PeerClosed, OSError):
                while True:
                    frame = wire.recv_frame(sock, max_frame=1 << 16)
                    said.append(frame.json())
                    if frame.type == Msg.CHALLENGE:  # without the key, a proof is a guess
                        wire.send_frame(sock, wire.control(Msg.PROOF, {"proof": "00" * 32}))
        assert said and said[-1] == {"reason": "the peer does not know the fleet key"}, said
        assert all(set(doc) <= {"nonce", "proof", "reason"} for doc in said), said
        assert "model-fp-4f2a" not in json.dumps(said) and "mismatch" not in json.dumps(said), said
        # a peer that proves the key still learns why it is refused
        with pytest.raises(wire.AuthError, match="fingerprint mismatch: .* this node serves 'model-fp-4f2a'"):
            link_module.connect_peer(f"127.0.0.1:{port}", key, wanted)


# --- mutual TLS ---------------------------------------------------------------------------------------

def test_tls_refuses_a_client_without_the_fleet_certificate(tmp_path, key_file):
    pem = create_certificate(tls_file(key_file))
    logs: list[str] = []
    node = Agent("127.0.0.1:0", access=FleetAccess(load_key(key_file), TLS(pem), key_file=key_file),
                 store=tmp_path / "store", advertise=False, log=logs.append).start()
    try:
        with ControlClient(_address(node), FleetAccess(load_key(key_file), TLS(pem)), timeout_s=10) as client:
            assert client.call("ping") == {}
        anonymous = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # trusts the server's certificate, presents none
        anonymous.check_hostname = False
        anonymous.load_verify_locations(pem)
        raw = socket.create_connection(("127.0.0.1", node.port), timeout=10)
        with pytest.raises((ssl.SSLError, OSError, wire.ProtocolError, wire.AuthError)):
            with anonymous.wrap_socket(raw) as sock:
                sock.settimeout(10)
                wire.client_handshake(sock, load_key(key_file), {"role": "agent"})
        assert _wait_for(lambda: any("refused connection" in line and "CERTIFICATE" in line.upper()
                                     for line in logs)), logs
    finally:
        node.stop()
