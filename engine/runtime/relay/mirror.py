"""Keeping a hot standby warm: a copy of every frame that changes a stage's caches, sent to the
PC that stands by for it, so that a switch to the standby (``engine.fleet.failover``) finds each
stream's KV cache there already and the reply carries on from its next token, not from a prefill.

The sender of a stage's input (the coordinator for its first remote stage, a worker for the next
one) keeps a ``Mirror`` of its successor's standby.  The copies go on a connection of their own,
opened with a ``MIRROR`` frame, from a thread of their own: sending never waits for the standby,
and a standby that falls behind (its queue full) or cannot be reached loses its copies (the
connection closes without a BYE, and the standby forgets every stream it held: a stream missing a
frame is never taken over) and is dialled again; a stream is mirrored from its next RESET on.  The
standby applies what it is sent and answers nothing (``Worker``, mirror sessions).  ``handover``
ends the copies with a BYE once they are all sent: the standby then keeps its streams for the
sender's own connection, which follows.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable


from engine.config import FleetAccess
from engine.manifest import Manifest
from engine.transport import wire
from engine.transport.link import Link, connect_successor
from engine.transport.wire import AuthError, Frame, Msg, ProtocolError

QUEUE_FRAMES = 256  # copies waiting to go; one more and the standby has fallen behind
REDIAL_S = 2.0  # how long a mirror whose standby could not be reached waits before dialling again
HANDOVER_S = 2.0  # how long a handover waits for the copies still queued to leave


class Mirror:
    """Copies of the frames sent to a stage, for its hot standby at ``address`` (the module's docstring)."""

    def __init__(self, address: str, *, access: FleetAccess, manifest: Manifest, mode: str,
                 max_frame: int = wire.DEFAULT_MAX_FRAME, log: Callable[[str], None] | None = None):
        """``access``: the fleet key and TLS the copies' connection goes with (the sender's own);
        ``manifest``: the sender's own stage's (the standby is checked to be its successor, as the
        stage itself is)."""
        self.address = address
        self._dial = lambda: connect_successor(address, access.key, manifest, mode, access.tls, max_frame)[0]
        self.log = log or (lambda text: None)
        self._queue: queue.Queue = queue.Queue(QUEUE_FRAMES)
        self._closed = threading.Event()
        self._link: Link | None = None
        self._broken = threading.Event()  # copies are dropped until the standby is dialled again
        self._sent = threading.Event()  # the handover's BYE left
        self.drops = 0  # times the copies were given up (the standby fell behind or was lost)
        self._said = False  # a lost standby is told once, not at every redial
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"mirror {address}")
        self._thread.start()

    def send(self, frame: Frame, parts: list[bytes] | None = None) -> None:
        """Queues ``frame`` for the standby if it changes the stage's caches; never waits.  ``parts``:
        the frame as the sender encoded it for the stage (``wire.encode_parts``: bytes of their own,
        which the sender's next forward does not overwrite)."""
        if frame.type not in wire.MIRRORED or self._broken.is_set() or self._closed.is_set():
            return
        try:
            self._queue.put_nowait(parts if parts is not None else wire.encode_parts(frame))
        except queue.Full:
            self._give_up("fell behind")

    def handover(self) -> bool:
        """Sends what is queued, then a BYE, and stops: the standby keeps the streams it mirrored,
        for the connection that takes over the stage.  Whether the copies all left in time."""
        if self._closed.is_set():
            return False
        try:
            self._queue.put(None, timeout=HANDOVER_S)
        except queue.Full:
            self.close()
            return False
        handed = self._sent.wait(HANDOVER_S)
        self.close()
        return handed and not self._broken.is_set()

    def close(self) -> None:
        """Stops without a BYE: the standby forgets the streams it mirrored."""
        self._closed.set()
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        link = self._link
        if link is not None:
            link.close()

    def _give_up(self, reason: str) -> None:
        if not self._broken.is_set():
            self.drops += 1
            if not self._said:
                self.log(f"standby {self.address} {reason}: its copies start again at each stream's next reset")
            self._said = True
        self._broken.set()
        link = self._link
        if link is not None:
            link.close()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                self._link = self._dial()
                self._link.send(Frame(Msg.MIRROR))
                self._said = False
            except (OSError, AuthError, ProtocolError) as exc:
                self._give_up(f"not reachable ({exc})")
                self._drain()
                self._closed.wait(REDIAL_S)
                self._broken.clear()
                continue
            self._serve(self._link)
            self._link.close()
            self._drain()
            if not self._closed.is_set():
                self._closed.wait(REDIAL_S)
                self._broken.clear()

    def _serve(self, link: Link) -> None:
        """Sends the queued copies until the handover, a close or a failure."""
        while True:
            parts = self._queue.get()
            if self._broken.is_set():
                return
            if parts is None:
                if not self._closed.is_set():  # the handover's
                    try:
                        link.send(Frame(Msg.BYE))
                        self._sent.set()
                    except OSError:
                        self._give_up("lost")
                    self._closed.set()
                return
            try:
                link.send_parts(parts)
            except OSError as exc:
                self._give_up(f"lost ({exc})")
                return

    def _drain(self) -> None:
        """Drops the copies that were queued for a connection that ended (and the handover's mark)."""
        while True:
            try:
                parts = self._queue.get_nowait()
            except queue.Empty:
                return
            if parts is None and not self._closed.is_set():
                self._closed.set()  # a handover asked while the standby was out of reach
