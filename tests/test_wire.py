"""The wire protocol: round trips, hostile and truncated frames, and the fleet-key handshake."""

from __future__ import annotations

import socket
import struct
import threading

import numpy as np
import pytest

from engine.transport import wire
from engine.transport.wire import AuthError, Frame, Msg, ProtocolError


def test_tensors_round_trip_bit_exact():
    rng = np.random.default_rng(0)
    tensors = [rng.standard_normal((1, 3, 576)).astype(np.float32), rng.integers(0, 9, (1, 7)),
               np.array([0], np.int32), rng.standard_normal((2, 2)).astype(np.float16),
               np.arange(5, dtype=np.uint8), np.array(3.5, np.float32), np.zeros((1, 0, 4), np.float32)]
    frame = wire.decode(wire.encode(Frame(Msg.FORWARD, stream=7, seq=42, tensors=tensors)))
    assert (frame.type, frame.stream, frame.seq) == (Msg.FORWARD, 7, 42)
    for got, want in zip(frame.tensors, tensors):
        assert got.dtype == want.dtype.newbyteorder("<") and got.shape == want.shape
        assert got.tobytes() == want.tobytes()


def test_control_frames_carry_json():
    frame = wire.decode(wire.encode(wire.control(Msg.ERROR, {"stage": 2, "reason": "boom"})))
    assert frame.json() == {"stage": 2, "reason": "boom"}


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b"XX" + b[2:], "magic"),
    (lambda b: b[:2] + bytes([9]) + b[3:], "version 9"),
    (lambda b: b[:3] + bytes([200]) + b[4:], "unknown message type 200"),
    (lambda b: b[:-1], "announces"),
    (lambda b: b + b"\0", "announces"),
    (lambda b: b[:10], "truncated frame header"),
    (lambda b: b[:14] + struct.pack("<H", 0x80) + b[16:], "unknown flags 0x80"),
    (lambda b: b[:24] + bytes([77]) + b[25:], "unknown dtype code 77"),
    (lambda b: b[:25] + bytes([5]) + b[26:], "malformed tensor header"),
    (lambda b: b[:28] + struct.pack("<I", 1000) + b[32:], "needs"),
])
def test_malformed_frames_are_refused_with_a_reason(mutate, message):
    good = wire.encode(Frame(Msg.FORWARD, tensors=[np.ones((1, 2, 8), np.float32)]))
    with pytest.raises(ProtocolError, match=message):
        wire.decode(mutate(good))


def test_oversized_frame_is_refused_before_reading_it():
    header = wire.HEADER.pack(wire.MAGIC, wire.VERSION, int(Msg.FORWARD), 0, 0, 1, 0, 1 << 40)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(header)  # no payload follows: reading it would hang
        with pytest.raises(ProtocolError, match="exceeds the limit"):
            wire.recv_frame(b, max_frame=1 << 20)


def test_a_forged_length_costs_only_the_bytes_actually_sent():
    """A header's length is not authenticated until its tag: claiming the largest frame and then
    sending little must not make the receiver hold the claimed size (nor a large frame arrive
    other than whole)."""
    import tracemalloc

    claimed, sent = wire.DEFAULT_MAX_FRAME, 3 * wire.FIRST_BUFFER + 5
    header = wire.HEADER.pack(wire.MAGIC, wire.VERSION, int(Msg.FORWARD), 0, 0, 1, 0, claimed)
    data = header + b"x" * sent
    a, b = socket.socketpair()
    with a, b:
        writer = threading.Thread(target=lambda: (a.sendall(data), a.shutdown(socket.SHUT_WR)))
        tracemalloc.start()
        try:
            writer.start()
            with pytest.raises(ProtocolError, match=f"connection closed after {sent} of {claimed} bytes"):
                wire.recv_frame(b)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            writer.join()
    assert peak < 4 * sent < claimed / 8
    frame = Frame(Msg.FORWARD, 1, 2, [np.arange(3 * wire.FIRST_BUFFER // 4 + 7, dtype=np.float32)])
    a, b = socket.socketpair()  # a real frame larger than the first buffer still arrives whole
    with a, b:
        writer = threading.Thread(target=a.sendall, args=(wire.encode(frame),))
        writer.start()
        got = wire.recv_frame(b)
        writer.join()
    assert np.array_equal(got.tensors[0], frame.tensors[0])


def test_thousands_of_random_frames_never_escape_as_other_errors():
    rng = np.random.default_rng(1)
    good = wire.encode(Frame(Msg.FORWARD, 1, 2, [rng.standard_normal((1, 4, 16)).astype(np.float32),
                                                 np.ones((1, 9), np.int64)]))
    outcomes = {"refused": 0, "accepted": 0}
    for i in range(3000):
        data = bytearray(good)
        for _ in range(rng.integers(1, 6)):
            data[rng.integers(0, len(data))] = rng.integers(0, 256)
        if i % 3 == 0:
            data = data[: rng.integers(0, len(data))]
        if i % 7 == 0:
            data = bytearray(rng.integers(0, 256, rng.integers(0, 200), dtype=np.uint8).tobytes())
        try:
            wire.decode(bytes(data), max_frame=1 << 20)
            outcomes["accepted"] += 1  # a flip inside tensor data is still a valid frame
        except ProtocolError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 1000 and outcomes["accepted"] > 0


def _pair(server_key, client_key, server_id, client_id):
    a, b = socket.socketpair()
    result = {}

    def serve():
        try:
            result["server"], result["server_seal"] = wire.server_handshake(b, server_key, server_id)
        except AuthError as exc:
            result["server_error"] = str(exc)

    t = threading.Thread(target=serve)
    t.start()
    try:
        result["client"], result["client_seal"] = wire.client_handshake(a, client_key, client_id)
    except AuthError as exc:
        result["client_error"] = str(exc)
    t.join(5)
    a.close()
    b.close()
    return result


def test_handshake_with_the_fleet_key_succeeds():
    r = _pair(b"k" * 32, b"k" * 32, {"fingerprint": "abc", "stage": 1}, {"fingerprint": "abc", "stage": 1})
    assert r["client"] == {"fingerprint": "abc", "stage": 1} and r["server"]["fingerprint"] == "abc"


def test_wrong_key_is_refused_on_both_sides():
    r = _pair(b"server-key", b"other-key", {"fingerprint": "abc"}, {"fingerprint": "abc"})
    assert "fleet key" in r["client_error"] and "fleet key" in r["server_error"]


def test_other_model_is_refused_on_both_sides():
    r = _pair(b"k", b"k", {"fingerprint": "abc", "stage": 1}, {"fingerprint": "xyz", "stage": 1})
    assert "fingerprint mismatch" in r["client_error"] and "fingerprint mismatch" in r["server_error"]


def test_a_tensor_whose_size_wraps_a_64_bit_count_is_refused():
    """2**16 four times is 2**64 elements: a fixed-width product wraps to 0 and once let such a frame
    through to a reshape (found by the fuzzer, ``engine.bench.fuzz``)."""
    body = wire.TENSOR_HEADER.pack(1, 4, 0, 2**16, 2**16, 2**16, 2**16)
    data = wire.HEADER.pack(wire.MAGIC, wire.VERSION, int(wire.Msg.FORWARD), 0, 0, 1, 0, len(body)) + body
    with pytest.raises(wire.ProtocolError, match="needs"):
        wire.decode(data)


def test_an_empty_tensor_of_impossible_shape_is_refused():
    """[0, 2**32-1, 2**32-1, 2**32-1] holds no bytes, yet no array can have that shape (found by the fuzzer)."""
    body = wire.TENSOR_HEADER.pack(1, 4, 0, 0, 2**32 - 1, 2**32 - 1, 2**32 - 1)
    data = wire.HEADER.pack(wire.MAGIC, wire.VERSION, int(wire.Msg.FORWARD), 0, 0, 1, 0, len(body)) + body
    with pytest.raises(wire.ProtocolError, match="impossibly large"):
        wire.decode(data)
    empty = wire.decode(wire.encode(wire.Frame(wire.Msg.KEEP, tensors=[np.zeros((1, 0, 576), np.float32)])))
    assert empty.tensors[0].shape == (1, 0, 576)


def test_frames_after_the_handshake_are_sealed_per_direction_and_in_order():
    r = _pair(b"k" * 32, b"k" * 32, {"fingerprint": "abc"}, {"fingerprint": "abc"})
    client, server = r["client_seal"], r["server_seal"]
    frames = [wire.encode(wire.control(Msg.CALL, {"op": "ping", "n": i}), client) for i in range(3)]
    a, b = socket.socketpair()
    with a, b:
        a.sendall(frames[0])
        assert wire.recv_frame(b, seal=server).json() == {"op": "ping", "n": 0}
        a.sendall(frames[2])  # frame 1 dropped on its way
        with pytest.raises(ProtocolError, match="frame 1 from the peer failed its authentication"):
            wire.recv_frame(b, seal=server)
    reflected = wire.encode(wire.control(Msg.REPLY, {}), server)  # the server's own frame, sent back to it
    a, b = socket.socketpair()
    with a, b:
        a.sendall(reflected)
        with pytest.raises(ProtocolError, match="failed its authentication"):
            wire.recv_frame(b, seal=server)
    assert r["client"] == {"fingerprint": "abc"}


def test_keep_frames_round_trip_and_refuse_slots_a_stream_does_not_hold():
    sent = wire.keep_frame(7, [0, 2, 5])
    got = wire.decode(wire.encode(sent))
    assert (got.type, got.stream) == (Msg.KEEP, 7)
    assert wire.unpack_keep(got, past=6).tolist() == [0, 2, 5] and wire.unpack_keep(got, 6).dtype == np.int32
    assert wire.unpack_keep(wire.decode(wire.encode(wire.keep_frame(7, []))), past=0).tolist() == []
    for hostile, past in ((wire.keep_frame(7, [0, 2, 5]), 5),  # slot 5 of 5 cached positions
                          (wire.keep_frame(7, [2, 2]), 6),  # not increasing
                          (wire.keep_frame(7, [-1, 2]), 6),
                          (wire.keep_frame(7, [0, 1, 2, 3]), 3),  # more slots than positions
                          (Frame(Msg.KEEP, 7, 0, [np.array([0, 1], np.int64)]), 6),  # another dtype
                          (Frame(Msg.KEEP, 7, 0, [np.array([[0, 1]], np.int32)]), 6),
                          (Frame(Msg.KEEP, 7), 6),  # no slots
                          (Frame(Msg.RESET, 7, 0, [np.array([0], np.int32)]), 6)):
        with pytest.raises(ProtocolError, match="KEEP needs increasing slot indices"):
            wire.unpack_keep(wire.decode(wire.encode(hostile)), past)


def test_share_frames_round_trip_and_refuse_parts_out_of_step():
    part = np.arange(8, dtype=np.float32).reshape(1, 2, 4)
    got = wire.decode(wire.encode(wire.share_frame(3, part, wire.Flag.PROBS)))
    assert (got.type, got.seq, got.flags) == (Msg.SHARE, 3, wire.Flag.PROBS)
    assert np.array_equal(wire.unpack_share(got, 3, (1, 2, 4)), part)
    for hostile, why in ((wire.share_frame(4, part), "part 3 .* got SHARE 4"),  # another exchange
                         (wire.share_frame(3, part[:, :1]), r"got SHARE 3 \(1, 1, 4\)"),
                         (wire.share_frame(3, part.astype(np.float16)), "got SHARE 3"),
                         (Frame(Msg.SHARE, 0, 3, [part, part]), "got SHARE 3$"),
                         (Frame(Msg.FORWARD, 0, 3, [part]), "got FORWARD 3$")):
        with pytest.raises(ProtocolError, match=why):
            wire.unpack_share(wire.decode(wire.encode(hostile)), 3, (1, 2, 4))
    data = wire.encode(wire.share_frame(3, part))
    for cut in (1, wire.HEADER.size, len(data) - 1):  # truncated on its way
        with pytest.raises(ProtocolError):
            wire.decode(data[:cut])
