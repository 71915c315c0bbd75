"""The one wire protocol between fleet processes: framing, tensors, and the authenticated handshake.

A frame is a fixed little-endian header followed by its payload::

    header  <2s B B I I H H Q>  magic b"FS", version, message type, stream id, sequence number,
                                 tensor count, flags (``Flag``), payload length in bytes
    payload per tensor: <B B H 4I> dtype code, ndim (0..4), reserved (0), dims (unused dims 0),
                        then the tensor's raw little-endian bytes

Nothing is unpickled or evaluated: control messages carry JSON as a uint8 tensor.  Every length is
checked before anything is allocated or read, so a hostile or truncated frame costs a
``ProtocolError`` and the connection, never the process.

The handshake proves on both sides that the peer knows the fleet key (HMAC-SHA256 over fresh
nonces; the key never crosses the wire) and that both hold the same model and protocol version.
It also yields the connection's ``Seal``: from WELCOME on, every frame is followed by a 16-byte
tag, HMAC-SHA256 (truncated) under a key of its direction over an implicit 64-bit frame counter,
the header and the payload.  The keys come from the fleet key, both nonces and the HELLO sent, so a
peer without the fleet key can relay a handshake but can neither inject, alter, replay, reorder
nor drop a frame after it unnoticed.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import json
import math
import os
import socket
import struct

import numpy as np

from engine.errors import FleetError

MAGIC = b"FS"
VERSION = 2  # 2: frames after the handshake carry a tag (``Seal``)
HEADER = struct.Struct("<2sBBIIHHQ")
TENSOR_HEADER = struct.Struct("<BBH4I")
MAX_DIMS = 4
DEFAULT_MAX_FRAME = 256 << 20  # a [1, 8192, 8192] f32 activation fits; anything larger is refused
FIRST_BUFFER = 1 << 20  # a frame's payload is read into this much, then twice as much, ... (``_recv_exact``)


class ProtocolError(FleetError):
    """A peer sent something that is not a valid frame; the connection must be closed."""


class PeerClosed(ProtocolError):
    """The peer closed the connection cleanly, between frames."""


class AuthError(FleetError):
    """The handshake failed: wrong fleet key, another model, or another protocol version."""


class Msg(enum.IntEnum):
    """Message types.  The relay's frames are built and read only by their functions below:
    ``forward_frame``, ``packed_frame``, ``result_frame``, ``keep_frame``, ``sync_frame``, ``drafts_frame``,
    ``share_frame``."""

    HELLO = 1
    CHALLENGE = 2
    PROOF = 3
    WELCOME = 4
    REFUSE = 5
    FORWARD = 10  # one stream's activations (and their attention mask, positions) towards the next stage
    RESULT = 11  # what the last stage sends back: token ids, probabilities or logits (``result_frame``)
    RESET = 12  # drop a stream's KV state
    ERROR = 13
    PING = 14
    PONG = 15
    BYE = 16
    ALIVE = 17  # heartbeat upstream while a request is outstanding (deadlines, not keep-alive)
    KEEP = 18  # keep only these physical KV slots of a stream (``keep_frame``): rewind and compaction
    PACKED = 19  # FORWARD for many streams in one frame, between paged stages (``packed_frame``)
    CALL = 20  # a node agent's control API: [JSON {"op": ..., ...}] plus an optional raw uint8 payload
    REPLY = 21  # the agent's answer to a CALL: [JSON] plus an optional raw uint8 payload
    SYNC = 22  # to a draft server: a stream's text is now what it was told up to a point, then these tokens
    DRAFTS = 23  # from a draft server: tokens it drafted, from a position of a stream's text on
    SHARE = 24  # between tensor-parallel ranks: a partial sum or vocabulary slice (``share_frame``)
    MIRROR = 25  # opens a stage's hot standby's copy of the stage's input: what follows is applied, never answered


# The frames that change a stage's KV caches: a hot standby is sent a copy of each (``MIRROR``)
MIRRORED = frozenset({Msg.FORWARD, Msg.PACKED, Msg.RESET, Msg.KEEP})


class Flag(enum.IntFlag):
    """What a FORWARD asks the final stage to return; echoed on the RESULT."""

    NONE = 0
    ALL_POSITIONS = 1  # a result for every new position (speculative verify), not just the last
    PROBS = 2  # the probability of each top-1 token
    LOGITS = 4  # full logits (only where a feature needs them: they are vocabulary-sized)
    CANDIDATES = 8  # the top candidates' ids and logits per position, for sampling (``engine.runtime.decode.sampling``)


_ALL_FLAGS = int(Flag.ALL_POSITIONS | Flag.PROBS | Flag.LOGITS | Flag.CANDIDATES)
# A RESULT for a request that samples (``Flag.CANDIDATES``) carries this many candidates (ids and
# logits) per position, instead of vocabulary-sized logits: sampling draws from the most likely tokens.
CANDIDATE_COUNT = 256
MAX_PARTS = 64  # streams in one PACKED frame


def forward_frame(stream: int, seq: int, x: np.ndarray, mask: np.ndarray, positions: np.ndarray,
                  stage_ms: np.ndarray, flags: Flag = Flag.NONE) -> Frame:
    """A FORWARD, which takes one stream's new rows to the next stage: ``[x, mask (u8 [1, slots]),
    positions (i64 [1, q]), stage_ms (f32)]``, with ``x`` token ids (i64 [1, q], to the stage
    holding layer 0) or hidden states (f32 [1, q, hidden]), ``mask`` over every KV slot the stream
    holds once these rows are in, and the compute time of each stage so far.  ``flags`` say what
    the last stage answers with (``result_frame``)."""
    return Frame(Msg.FORWARD, stream, seq, [x, mask, positions, stage_ms], flags)


def unpack_forward(frame: Frame) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A FORWARD's ``x, mask, positions, stage_ms``, checked against one another; whether ``x``
    fits the stage and the mask its cache is the stage's to check."""
    if len(frame.tensors) != 4:
        raise ProtocolError(f"FORWARD carries {len(frame.tensors)} tensors, expected 4")
    x, mask, positions, stage_ms = frame.tensors
    q = x.shape[1] if x.ndim in (2, 3) and x.shape[0] == 1 else 0
    if q == 0:
        raise ProtocolError(f"FORWARD activations of shape {x.shape} {x.dtype}: expected [1, q] or [1, q, hidden] "
                            f"with q >= 1")
    if positions.dtype != np.int64 or positions.shape != (1, q):
        raise ProtocolError(f"position_ids {positions.shape} {positions.dtype} do not match {q} new tokens")
    if mask.dtype != np.uint8 or mask.ndim != 2 or mask.shape[0] != 1:
        raise ProtocolError(f"attention mask {mask.shape} {mask.dtype}: expected [1, slots] uint8")
    _check_stage_ms(frame, stage_ms)
    return x, mask, positions, stage_ms


@dataclasses.dataclass(frozen=True)
class PartHeader:
    """One stream's rows in a PACKED frame: ``q`` new positions after its first ``start`` cached
    ones, the sequence number its RESULT answers to, and the flags that RESULT answers."""

    stream: int
    seq: int
    start: int
    q: int
    flags: Flag


def packed_frame(x: np.ndarray, parts: list[PartHeader], positions: np.ndarray, stage_ms: np.ndarray) -> Frame:
    """A PACKED frame, which takes several streams' rows to the next stage at once: ``[x, parts
    (i64 [n, 5]: stream, seq, start, q, flags), position_ids (i64 [rows]), stage_ms (f32)]``, with
    ``x`` every part's rows one after another (token ids ``[rows]`` or hidden states ``[rows,
    hidden]``).  The last stage answers each part with its own RESULT."""
    table = np.array([[p.stream, p.seq, p.start, p.q, int(p.flags)] for p in parts], np.int64).reshape(-1, 5)
    return Frame(Msg.PACKED, parts[0].stream, parts[0].seq, [x, table, positions, stage_ms])


def unpack_packed(frame: Frame) -> tuple[np.ndarray, list[PartHeader], np.ndarray, np.ndarray]:
    """A PACKED frame's contents, its table checked for consistency with the rows it describes."""
    if len(frame.tensors) != 4:
        raise ProtocolError(f"PACKED carries {len(frame.tensors)} tensors, expected 4")
    x, table, positions, stage_ms = frame.tensors
    if table.dtype != np.int64 or table.ndim != 2 or table.shape[1] != 5 or not 1 <= table.shape[0] <= MAX_PARTS:
        raise ProtocolError(f"PACKED parts table of shape {table.shape} {table.dtype}: "
                            f"expected [1..{MAX_PARTS}, 5] int64")
    stream, seq, start, q, flags = table.T
    if (stream.min() < 0 or stream.max() > 0xFFFFFFFF or seq.min() < 0 or seq.max() > 0xFFFFFFFF
            or start.min() < 0 or q.min() < 1 or np.any(flags & ~_ALL_FLAGS) or flags.min() < 0):
        raise ProtocolError("PACKED parts table holds out-of-range values")
    if len(set(stream.tolist())) != len(stream):
        raise ProtocolError("PACKED frame carries a stream more than once")
    if x.ndim not in (1, 2) or q.max() > x.shape[0]:
        raise ProtocolError(f"PACKED rows {x.shape} cannot hold parts of up to {q.max()} positions")
    rows = int(q.sum())  # at most MAX_PARTS times the rows: no overflow
    if x.shape[0] != rows or positions.dtype != np.int64 or positions.shape != (rows,):
        raise ProtocolError(f"PACKED rows {x.shape} and positions {positions.shape} do not match the table's {rows}")
    _check_stage_ms(frame, stage_ms)
    parts = [PartHeader(int(a), int(b), int(c), int(d), Flag(int(e))) for a, b, c, d, e in table.tolist()]
    return x, parts, positions, stage_ms


def _check_stage_ms(frame: Frame, stage_ms: np.ndarray) -> None:
    if stage_ms.dtype != np.float32 or stage_ms.ndim != 1 or stage_ms.shape[0] > 64:
        raise ProtocolError(f"{frame.type.name} frame carries malformed stage timings")


def result_frame(stream: int, seq: int, flags: Flag, tokens: np.ndarray, stage_ms: np.ndarray,
                 probs: np.ndarray | None = None, logits: np.ndarray | None = None,
                 candidates: tuple[np.ndarray, np.ndarray] | None = None) -> Frame:
    """A RESULT, the last stage's answer to one stream's FORWARD (or part of a PACKED frame), its
    ``flags`` echoed: ``[tokens (i64 [positions]), probs, logits, candidate ids, candidate logits,
    stage_ms (f32)]``, where probs (f32 [positions]) are there only under ``Flag.PROBS``, logits
    (f32 [1, positions, vocab]) under ``Flag.LOGITS`` and the candidates (i64 and f32 [positions,
    CANDIDATE_COUNT]) under ``Flag.CANDIDATES``."""
    tensors = [tokens]
    if flags & Flag.PROBS:
        tensors.append(probs)
    if flags & Flag.LOGITS:
        tensors.append(logits)
    if flags & Flag.CANDIDATES:
        tensors += candidates
    return Frame(Msg.RESULT, stream, seq, [*tensors, stage_ms], flags)


def unpack_result(frame: Frame, flags: Flag) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None,
                                                      tuple[np.ndarray, np.ndarray] | None, np.ndarray]:
    """A RESULT's ``tokens, probs, logits, candidates, stage_ms``, checked to answer a request
    with ``flags``; what the request did not ask for is None."""
    tensors = frame.tensors
    want = 2 + bool(flags & Flag.PROBS) + bool(flags & Flag.LOGITS) + 2 * bool(flags & Flag.CANDIDATES)
    if frame.flags != flags or len(tensors) != want or tensors[0].dtype != np.int64:
        raise ProtocolError(f"RESULT of {len(tensors)} tensors does not answer the request")
    rest = iter(tensors[1:-1])
    probs = next(rest) if flags & Flag.PROBS else None
    logits = next(rest) if flags & Flag.LOGITS else None
    candidates = (next(rest), next(rest)) if flags & Flag.CANDIDATES else None
    return tensors[0], probs, logits, candidates, tensors[-1]


def keep_frame(stream: int, slots: np.ndarray) -> Frame:
    """A KEEP: ``[slots (i32 [n])]``, the physical KV slots of ``stream`` every stage keeps (a rewind
    after rejected draft tokens, a compaction), in increasing order.  It is ordered before the stream's
    next FORWARD, so nothing answers it."""
    return Frame(Msg.KEEP, stream, 0, [np.asarray(slots, np.int32)])


def unpack_keep(frame: Frame, past: int) -> np.ndarray:
    """A KEEP's slots, checked to be increasing indices below the ``past`` positions the stream holds."""
    slots = frame.tensors[0] if frame.type == Msg.KEEP and len(frame.tensors) == 1 else None
    if (slots is None or slots.dtype != np.int32 or slots.ndim != 1 or len(slots) > past
            or (len(slots) and (slots.min() < 0 or slots.max() >= past or np.any(np.diff(slots) <= 0)))):
        raise ProtocolError(f"KEEP needs increasing slot indices below the {past} cached positions")
    return slots


def share_frame(seq: int, part: np.ndarray, needs: Flag = Flag.NONE) -> Frame:
    """A SHARE, one tensor-parallel rank's part of an exchange for another rank: ``[part (f32)]``, a
    partial sum, a vocabulary slice, or a slice's top candidates (their logits, then their indices in
    the slice); ``seq`` counts the exchanges.  Rank 0's carry the flags of the forward under way
    (``needs``), so the other ranks know what to share back."""
    return Frame(Msg.SHARE, 0, seq, [part], needs)


def unpack_share(frame: Frame, seq: int, shape: tuple) -> np.ndarray:
    """A SHARE's part, checked to be exchange ``seq``'s and an f32 tensor of ``shape``; what its
    values mean (a candidate's index within the slice) is the mesh's to check."""
    part = frame.tensors[0] if frame.type == Msg.SHARE and len(frame.tensors) == 1 else None
    if part is None or frame.seq != seq or part.dtype != np.float32 or part.shape != tuple(shape):
        raise ProtocolError(f"expected its part {seq} {tuple(shape)}, got {frame.type.name} {frame.seq}"
                            f"{'' if part is None else ' ' + str(part.shape)}")
    return part


def sync_frame(stream: int, epoch: int, start: int, lead: int, fresh: bool, tokens: list[int]) -> Frame:
    """A SYNC: ``[i64 [start, lead, fresh], tokens (i64)]``: stream ``stream``'s text is the first
    ``start`` tokens of what the draft server was told, then ``tokens``; it may draft ``lead``
    tokens beyond, and drops what it drafted before when ``fresh`` (a new generation).  ``epoch``
    (the frame's seq) numbers the SYNCs of a stream."""
    return Frame(Msg.SYNC, stream, epoch, [np.array([start, lead, int(fresh)], np.int64),
                                            np.asarray(tokens, np.int64)])


def drafts_frame(stream: int, epoch: int, position: int, tokens: list[int]) -> Frame:
    """A DRAFTS: ``[i64 [position], tokens (i64)]``: the server's text holds ``tokens`` from
    ``position`` on, drafted after the SYNC numbered ``epoch``."""
    return Frame(Msg.DRAFTS, stream, epoch, [np.array([position], np.int64), np.asarray(tokens, np.int64)])


def unpack_tokens(frame: Frame, header: int, max_tokens: int) -> tuple[list[int], list[int]]:
    """A SYNC's or DRAFTS' header values (``header`` of them, each at least 0) and its tokens."""
    if len(frame.tensors) != 2:
        raise ProtocolError(f"{frame.type.name} carries {len(frame.tensors)} tensors, expected 2")
    head, tokens = frame.tensors
    if head.dtype != np.int64 or head.shape != (header,) or head.min() < 0:
        raise ProtocolError(f"{frame.type.name} header of shape {head.shape} {head.dtype}: "
                            f"expected [{header}] int64 >= 0")
    if tokens.dtype != np.int64 or tokens.ndim != 1 or tokens.shape[0] > max_tokens:
        raise ProtocolError(f"{frame.type.name} tokens of shape {tokens.shape} {tokens.dtype}: "
                            f"expected at most {max_tokens} int64")
    return head.tolist(), tokens.tolist()


DTYPES = {1: np.dtype("<f4"), 2: np.dtype("<f2"), 3: np.dtype("<i8"), 4: np.dtype("<i4"), 5: np.dtype("u1"),
          6: np.dtype("<u2")}
_DTYPE_CODES = {dt: code for code, dt in DTYPES.items()}


@dataclasses.dataclass
class Frame:
    """One message as it travels: its type, the stream and request it belongs to, its tensors and flags."""

    type: Msg
    stream: int = 0
    seq: int = 0
    tensors: list[np.ndarray] = dataclasses.field(default_factory=list)
    flags: Flag = Flag.NONE

    def json(self) -> dict:
        """The JSON document a control frame carries in its first tensor."""
        if not self.tensors or self.tensors[0].dtype != np.uint8:
            raise ProtocolError(f"{self.type.name} frame carries no JSON document")
        try:
            doc = json.loads(self.tensors[0].tobytes().decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ProtocolError(f"{self.type.name} frame carries malformed JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise ProtocolError(f"{self.type.name} frame's JSON is not an object")
        return doc


def control(kind: Msg, doc: dict, stream: int = 0, seq: int = 0) -> Frame:
    """A control frame (PING, PONG, ERROR, CALL, ...): its JSON document as a uint8 tensor (``Frame.json``)."""
    return Frame(kind, stream, seq, [np.frombuffer(json.dumps(doc).encode(), dtype=np.uint8)])


def encode(frame: Frame, seal: "Seal | None" = None) -> bytes:
    """A frame's bytes, followed by its tag when ``seal`` (the connection's) is given."""
    parts = encode_parts(frame)
    if seal is not None:
        parts.append(seal.tag(parts))
    return b"".join(parts)


def encode_parts(frame: Frame) -> list[bytes]:
    """A frame's bytes in pieces (header first), for a tag computed over them without a copy."""
    parts = [b""]  # the frame header goes first, once the payload length is known
    for t in frame.tensors:
        arr = np.asarray(t)  # (ascontiguousarray would turn a 0-d scalar into shape (1,))
        code = _DTYPE_CODES.get(arr.dtype.newbyteorder("<"))
        if code is None or arr.ndim > MAX_DIMS:
            raise ProtocolError(f"cannot send a {arr.dtype} tensor of {arr.ndim} dims")
        dims = list(arr.shape) + [0] * (MAX_DIMS - arr.ndim)
        parts.append(TENSOR_HEADER.pack(code, arr.ndim, 0, *dims))
        parts.append(arr.astype(DTYPES[code], copy=False).tobytes())
    parts[0] = HEADER.pack(MAGIC, VERSION, int(frame.type), frame.stream, frame.seq, len(frame.tensors),
                           int(frame.flags), sum(len(part) for part in parts))
    return parts


def parse_header(raw: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> tuple[Msg, int, int, int, Flag, int]:
    """A frame header's (type, stream, seq, tensor count, flags, payload length), refused before the
    payload is read when it is not ours or announces more than ``max_frame`` bytes."""
    magic, version, kind, stream, seq, count, flags, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"not a fleetshard frame (magic {magic!r})")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} is not supported (this side speaks {VERSION})")
    try:
        kind = Msg(kind)
    except ValueError:
        raise ProtocolError(f"unknown message type {kind}") from None
    if flags & ~_ALL_FLAGS:
        raise ProtocolError(f"unknown flags {flags:#x}")
    if length > max_frame:
        raise ProtocolError(f"frame of {length} bytes exceeds the limit of {max_frame}")
    if length < count * TENSOR_HEADER.size:
        raise ProtocolError(f"frame of {length} bytes cannot hold {count} tensors")
    return kind, stream, seq, count, Flag(flags), length


def parse_payload(count: int, payload: bytes | memoryview) -> list[np.ndarray]:
    """A payload's ``count`` tensors, as views of it; every tensor header is checked against the bytes left."""
    tensors, pos, view = [], 0, memoryview(payload)
    for _ in range(count):
        if pos + TENSOR_HEADER.size > len(view):
            raise ProtocolError("tensor header runs past the end of the frame")
        code, ndim, reserved, *dims = TENSOR_HEADER.unpack_from(view, pos)
        pos += TENSOR_HEADER.size
        dtype = DTYPES.get(code)
        if dtype is None:
            raise ProtocolError(f"unknown dtype code {code}")
        if ndim > MAX_DIMS or reserved or any(dims[ndim:]):
            raise ProtocolError(f"malformed tensor header (ndim {ndim}, dims {dims})")
        shape = tuple(dims[:ndim])
        nbytes = math.prod(shape) * dtype.itemsize  # exact: a fixed-width product can wrap around to 0
        if nbytes > len(view) - pos:
            raise ProtocolError(f"tensor of shape {shape} {dtype} needs {nbytes} bytes, frame has {len(view) - pos}")
        if math.prod(d for d in shape if d) * dtype.itemsize >= 1 << 62:  # empty, yet no array can be that shape
            raise ProtocolError(f"tensor of shape {shape} {dtype} is impossibly large")
        tensors.append(np.frombuffer(view, dtype=dtype, count=nbytes // dtype.itemsize, offset=pos).reshape(shape))
        pos += nbytes
    if pos != len(view):
        raise ProtocolError(f"frame has {len(view) - pos} bytes beyond its tensors")
    return tensors


def decode(data: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> Frame:
    """Decodes one complete frame held in memory."""
    if len(data) < HEADER.size:
        raise ProtocolError("truncated frame header")
    kind, stream, seq, count, flags, length = parse_header(data[: HEADER.size], max_frame)
    if len(data) != HEADER.size + length:
        raise ProtocolError(f"frame announces {length} payload bytes, has {len(data) - HEADER.size}")
    return Frame(kind, stream, seq, parse_payload(count, data[HEADER.size:]), flags)


def _recv_exact(sock: socket.socket, n: int, boundary: bool = False) -> bytearray:
    """``n`` bytes.  The buffer grows as they arrive (doubling from ``FIRST_BUFFER``): a header's
    length is not yet authenticated, so a forged one must not make this process hold more memory
    than was actually sent."""
    buf = bytearray(min(n, FIRST_BUFFER))
    got = 0
    while got < n:
        if got == len(buf):
            buf += bytearray(min(n, 2 * got) - got)
        with memoryview(buf) as view:
            k = sock.recv_into(view[got:], len(buf) - got)
        if k == 0:
            if boundary and not got:
                raise PeerClosed("connection closed")
            raise ProtocolError(f"truncated frame: connection closed after {got} of {n} bytes")
        got += k
    return buf


def recv_frame(sock: socket.socket, max_frame: int = DEFAULT_MAX_FRAME, seal: "Seal | None" = None,
               unsealed: frozenset = frozenset()) -> Frame:
    """Reads one frame; the payload is read only after the header proved it acceptable, and parsed
    only after its tag proved it authentic when the connection has a ``seal``.  Frames of a type in
    ``unsealed`` come without a tag (only a REFUSE, during the handshake)."""
    header = bytes(_recv_exact(sock, HEADER.size, True))
    try:
        kind, stream, seq, count, flags, length = parse_header(header, max_frame)
    except ProtocolError as exc:
        if seal is None:
            raise
        raise seal.refusal(str(exc)) from None
    payload = _recv_exact(sock, length) if length else bytearray()
    if seal is not None and kind not in unsealed:
        seal.check(header, payload, _recv_exact(sock, TAG_BYTES))
    return Frame(kind, stream, seq, parse_payload(count, payload), flags)


def send_frame(sock: socket.socket, frame: Frame, seal: "Seal | None" = None) -> None:
    """Sends one frame on a plain socket (the handshake; a connection's later frames go through ``Link``)."""
    sock.sendall(encode(frame, seal))


# --- frame authentication -------------------------------------------------------------------------

TAG_BYTES = 16
_COUNTER = struct.Struct("<Q")


class Seal:
    """One connection's frame keys (one per direction) and frame counters.  ``tag`` and ``check``
    each count the frames of their direction, so the caller keeps sends in order (``Link`` sends
    under a lock) and one thread receives."""

    def __init__(self, send_key: bytes, recv_key: bytes, peer: str = "the peer"):
        self._send = hmac.new(send_key, digestmod=hashlib.sha256)  # copied per frame: pads computed once
        self._recv = hmac.new(recv_key, digestmod=hashlib.sha256)
        self.sent = 0
        self.received = 0
        self.peer = peer  # named in the refusal; ``Link`` sets the peer's address

    def tag(self, parts: list) -> bytes:
        mac = self._send.copy()
        mac.update(_COUNTER.pack(self.sent))
        for part in parts:
            mac.update(part)
        self.sent += 1
        return mac.digest()[:TAG_BYTES]

    def check(self, header: bytes, payload, tag) -> None:
        mac = self._recv.copy()
        mac.update(_COUNTER.pack(self.received))
        mac.update(header)
        mac.update(payload)
        if not hmac.compare_digest(mac.digest()[:TAG_BYTES], bytes(tag)):
            raise self.refusal()
        self.received += 1

    def refusal(self, detail: str = "") -> ProtocolError:
        return ProtocolError(f"frame {self.received} from {self.peer} failed its authentication: altered, replayed "
                             f"or not from the fleet" + (f" ({detail})" if detail else ""))


def _frame_keys(key: bytes, client_nonce: bytes, server_nonce: bytes, hello: bytes) -> tuple[bytes, bytes]:
    """(client-to-server, server-to-client) frame keys: HKDF (RFC 5869) extract and expand, one
    block each, bound to the HELLO the client sent so that one altered on its way fails WELCOME."""
    prk = hmac.new(b"fleetshard-v1|frames", key + client_nonce + server_nonce + hashlib.sha256(hello).digest(),
                   hashlib.sha256).digest()
    return (hmac.new(prk, b"client to server\x01", hashlib.sha256).digest(),
            hmac.new(prk, b"server to client\x01", hashlib.sha256).digest())


# --- handshake ------------------------------------------------------------------------------------

def _mac(key: bytes, role: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"fleetshard-v1|" + role + b"|" + b"|".join(parts), hashlib.sha256).digest()


def client_handshake(sock: socket.socket, key: bytes, identity: dict) -> tuple[dict, Seal]:
    """Dials side. ``identity`` names what we expect of the peer (model fingerprint, stage);
    returns the peer's WELCOME document and the connection's ``Seal``, or raises AuthError with
    the reason."""
    nonce = os.urandom(32)
    hello = json.dumps({**identity, "version": VERSION, "nonce": nonce.hex()}).encode()
    send_frame(sock, Frame(Msg.HELLO, tensors=[np.frombuffer(hello, dtype=np.uint8)]))
    reply = recv_frame(sock, max_frame=1 << 16)
    if reply.type == Msg.REFUSE:
        raise AuthError(f"peer refused the connection: {reply.json().get('reason', 'no reason given')}")
    if reply.type != Msg.CHALLENGE:
        raise AuthError(f"peer answered HELLO with {reply.type.name}")
    doc = reply.json()
    try:
        server_nonce = bytes.fromhex(doc["nonce"])
        server_proof = bytes.fromhex(doc["proof"])
    except (KeyError, ValueError, TypeError):
        raise AuthError("peer sent a malformed challenge") from None
    fp = str(identity.get("fingerprint", "")).encode()
    if not hmac.compare_digest(server_proof, _mac(key, b"server", nonce, server_nonce, fp)):
        send_frame(sock, control(Msg.REFUSE, {"reason": "you did not prove the fleet key"}))
        raise AuthError("peer does not know the fleet key")
    send_frame(sock, control(Msg.PROOF, {"proof": _mac(key, b"client", server_nonce, nonce, fp).hex()}))
    seal = Seal(*_frame_keys(key, nonce, server_nonce, hello))
    try:
        final = recv_frame(sock, max_frame=1 << 16, seal=seal, unsealed=frozenset({Msg.REFUSE}))
    except PeerClosed:
        raise
    except ProtocolError as exc:
        raise AuthError(f"the handshake was altered on its way ({exc})") from None
    if final.type != Msg.WELCOME:
        reason = final.json().get("reason", "") if final.type == Msg.REFUSE else final.type.name
        raise AuthError(f"peer refused the connection: {reason}")
    return final.json(), seal


def server_handshake(sock: socket.socket, key: bytes, identity: dict) -> tuple[dict, Seal]:
    """Listening side: checks the version, proves the key, verifies the client's proof, then checks
    that the client wants what this node serves (model, stage, ...): only a peer that proved the key
    learns what that is.  Returns the client's HELLO document and the connection's ``Seal`` (WELCOME
    already went out under it); refuses (and raises AuthError) otherwise."""
    hello = recv_frame(sock, max_frame=1 << 16)
    if hello.type != Msg.HELLO:
        raise AuthError(f"expected HELLO, got {hello.type.name}")
    doc = hello.json()

    def refuse(reason: str):
        send_frame(sock, control(Msg.REFUSE, {"reason": reason}))
        raise AuthError(reason)

    if doc.get("version") != VERSION:
        refuse(f"protocol version {doc.get('version')} is not {VERSION}")
    try:
        client_nonce = bytes.fromhex(doc["nonce"])
    except (KeyError, ValueError, TypeError):
        refuse("malformed HELLO")
    nonce = os.urandom(32)
    fp = str(doc.get("fingerprint", "")).encode()
    send_frame(sock, control(Msg.CHALLENGE, {"nonce": nonce.hex(),
                                             "proof": _mac(key, b"server", client_nonce, nonce, fp).hex()}))
    proof = recv_frame(sock, max_frame=1 << 16)
    if proof.type == Msg.REFUSE:
        raise AuthError(f"peer refused: {proof.json().get('reason', '')}")
    try:
        given = bytes.fromhex(proof.json()["proof"]) if proof.type == Msg.PROOF else b""
    except (KeyError, ValueError, TypeError):
        given = b""
    if not hmac.compare_digest(given, _mac(key, b"client", nonce, client_nonce, fp)):
        refuse("the peer does not know the fleet key")
    for field in ("role", "fingerprint", "stage", "first_layer", "mode"):
        if field in doc and field in identity and doc[field] != identity[field]:
            refuse(f"{field} mismatch: peer expects {doc[field]!r}, this node serves {identity[field]!r}")
    to_server, to_client = _frame_keys(key, client_nonce, nonce, hello.tensors[0].tobytes())
    seal = Seal(to_client, to_server)
    send_frame(sock, control(Msg.WELCOME, identity), seal)
    return doc, seal
