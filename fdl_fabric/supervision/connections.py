"""The coordinator's sockets: the listener, every connection, and the one I/O thread.

One I/O thread does everything that touches sockets (accept, read, the 50 ms tick,
broadcasts), so connection state needs no locking; other threads wake it through a
socket pair, so a death is declared, and a run ends, without waiting for a tick. Each
turn reads the ranks' frames first, then connections without a hello, then accepts a
bounded number of new ones (`admission`): however many knock, a heartbeat that is in
waits for no more than one turn. A crash of the loop becomes a visible abort of the run,
never a silent hang.

What the frames mean is the coordinator's (`coordinator.Coordinator`, which builds on
this class): it gives the hooks `_frames` (bytes arrived), `_tick`, `_lost` and
`_crashed`. Standard library only.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from ..events import EventBus, Name
from . import timing
from .admission import (
    ACCEPT_PER_TURN,
    HELLO_PROMPT,
    PENDING_MAX,
    PENDING_PER_SOURCE,
    SEND_TIMEOUT,
    PendingPeers,
    Refusals,
    first_frame_in,
)
from .cohort import CoordinatorSpec

#: How often the coordinator drains reported deaths and checks heartbeats while things
#: happen (a report, a death and a stop wake it at once, whatever its wait).
TICK_INTERVAL = 0.05
#: Selector data of the wake-up socket (connections carry a `Conn`, the listener None).
_WAKE = object()
_RECV_CHUNK = 65536


def bind_listener(host: str, port: int, backlog: int = socket.SOMAXCONN) -> socket.socket:
    """Listen on ``host:port`` as the coordinator does (SO_REUSEADDR, so a TIME_WAIT
    socket does not block a rebind, but a live listener does). Pre-flight's port check
    binds the same way, so "free" means what the coordinator will find."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


class CoordinatorError(RuntimeError):
    """The coordinator could not start; the message names the address and the cause."""


@dataclass(eq=False)
class Conn:
    """One rank's connection (or one not yet judged); touched only by the I/O thread.
    Either an accepted socket (``sock``), or a rank that reaches the coordinator through
    its host's agent (``down``: how a message reaches it; `relayed`)."""

    sock: Optional[socket.socket]
    peer: str
    opened: float
    #: The peer's address without its port: what `PendingPeers` counts per source.
    source: str = ""
    buf: bytearray = field(default_factory=bytearray)
    rx_seq: int = 0
    tx_seq: int = 0
    rank: Optional[int] = None
    closed: bool = False
    #: A relayed rank: its host's agent's sender of COHORT_DOWN bodies, and its rank
    #: number as the agent bound it (before its hello, too).
    down: Optional[Callable[[dict[str, Any]], None]] = None
    via_rank: int = -1


class Connections:
    """The listener, the connections (by rank once joined) and the I/O loop."""

    def __init__(self, spec: CoordinatorSpec, events: EventBus, busy: bytes) -> None:
        self.spec = spec
        self.events = events
        # I/O thread only.
        self._conns: set[Conn] = set()
        self._rank_conn: dict[int, Conn] = {}
        self._listener: Optional[socket.socket] = None
        self._selector: Optional[selectors.BaseSelector] = None
        self._thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()
        # Written by other threads (stop, mark_dead) so the I/O thread acts at once
        # instead of at its next tick: a death is declared, and a run ends, without waiting.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._port = spec.port
        # Refused connections since the last report (I/O thread only).
        self._refusals = Refusals(events)
        # Connections waiting for their hello (I/O thread only).
        self._pending: PendingPeers[Conn] = PendingPeers(
            PENDING_PER_SOURCE,
            max(PENDING_MAX, 2 * (spec.world_size if spec.direct_ranks is None
                                  else spec.direct_ranks)), HELLO_PROMPT,
            spec.hello_timeout)
        #: The one frame every turned-away connection gets (sequence 0, so it is the same).
        self._busy = busy

    # -- the hooks of the coordinator -----------------------------------------------------------
    def _frames(self, conn: Conn) -> None:
        """Bytes arrived in ``conn.buf``: take and act on every whole frame."""
        raise NotImplementedError

    def _tick(self, now: float) -> None:
        """The periodic work (deaths, silence, deadlines)."""
        raise NotImplementedError

    def _lost(self, conn: Conn, detail: str) -> None:
        """The peer went away (or a send to it failed)."""
        raise NotImplementedError

    def _crashed(self, exc: Exception) -> None:
        """The I/O loop raised: the run cannot go on."""
        raise NotImplementedError

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Bind the port and start the I/O thread; a bind failure is a `CoordinatorError`."""
        if self._thread is not None:
            raise CoordinatorError("cluster launcher: coordinator already started")
        host, port = self.spec.bind_host, self.spec.port
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            listener = bind_listener(host, port, max(socket.SOMAXCONN, self.spec.world_size))
            listener.setblocking(False)
        except OSError as exc:
            raise CoordinatorError(
                f"cluster launcher: coordinator could not bind {address}: {exc}") from None
        self._listener = listener
        self._port = int(listener.getsockname()[1])
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._thread = threading.Thread(target=self._run, name="fdl-coordinator", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        """The bound port (the ephemeral one when the spec asked for port 0)."""
        return self._port

    def stop(self) -> None:
        """Close every connection and the port, and join the I/O thread. Idempotent."""
        self._stopping.set()
        self._wake()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=SEND_TIMEOUT + 5.0)
        for conn in list(self._conns):
            self._close(conn)
        self._refusals.flush(time.monotonic(), force=True)
        if self._selector is not None:
            self._selector.close()
            self._selector = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for end in (self._wake_r, self._wake_w):
            end.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (already woken) or closed (stopped)
            self._wake_w.send(b"\0")

    # -- I/O thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        """Accept, read and tick until stopped; a crash aborts the run rather than hang it."""
        next_tick = time.monotonic()
        wait = TICK_INTERVAL
        try:
            while not self._stopping.is_set():
                selector = self._selector
                if selector is None:
                    return
                woken, accept, busy = self._turn(selector, wait)
                # Quiet turns sleep longer (a silent rank is then found at most 0.25 s
                # later); anything read, or a wake, shortens the wait again.
                wait = timing.next_wait(wait, TICK_INTERVAL, busy)
                if accept:
                    self._accept()
                if self._stopping.is_set():
                    return
                now = time.monotonic()
                if now >= next_tick or woken:
                    self._tick(now)
                    next_tick = now + TICK_INTERVAL
        except Exception as exc:  # any bug becomes a visible abort, not a silent hang
            if self._stopping.is_set():
                return
            self._crashed(exc)

    def _turn(self, selector: selectors.BaseSelector, wait: float) -> tuple[bool, bool, bool]:
        """One wait on the sockets, at most ``wait`` s: the ranks' frames first, then
        connections without a hello; returns whether it was woken, whether the listener
        is ready, and whether anything at all was."""
        woken = accept = False
        strangers: list[Conn] = []
        ready = selector.select(timeout=wait)
        for key, _ in ready:
            if key.data is None:
                accept = True
            elif key.data is _WAKE:
                woken = True
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
            elif key.data.rank is None:
                strangers.append(key.data)
            else:
                self._read(key.data)
        for conn in strangers:
            self._read(conn)
        return woken, accept, bool(ready)

    def _accept(self) -> None:
        """At most `ACCEPT_PER_TURN` connections; the listener stays ready for the next
        turn, so a stream of connects never keeps the loop from the ranks and the tick."""
        assert self._listener is not None
        for _ in range(ACCEPT_PER_TURN):
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.events(Name.ACCEPT_FAILED, error=str(exc))
                return
            self._admit(sock, addr)

    def _admit(self, sock: socket.socket, addr: Any) -> None:
        """Judge a connection whose first frame is in; give another a place or refuse it."""
        host, port = str(addr[0]), int(addr[1])
        peer = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        now = time.monotonic()
        conn = Conn(sock=sock, peer=peer, opened=now, source=host)
        if first_frame_in(sock):
            # A rank sends its hello right after connecting, so under a flood (accepted
            # late) its hello is usually here already: judged now, it needs no place.
            self._register(conn)
            self._read(conn)
            if not conn.closed and conn.rank is None:  # not expected: keep the books right
                self._pending.add(conn, host, now)
            return
        refusal = self._pending.refusal(host)
        if refusal is not None:
            self._turn_away(conn, refusal)
            return
        self._pending.add(conn, host, now)
        self._register(conn)

    def _register(self, conn: Conn) -> None:
        assert self._selector is not None and conn.sock is not None
        conn.sock.settimeout(SEND_TIMEOUT)
        self._conns.add(conn)
        self._selector.register(conn.sock, selectors.EVENT_READ, conn)

    def _read(self, conn: Conn) -> None:
        assert conn.sock is not None  # a relayed rank's messages come another way
        try:
            data = conn.sock.recv(_RECV_CHUNK)
        except (BlockingIOError, InterruptedError, socket.timeout):
            return
        except OSError as exc:
            self._lost(conn, str(exc))
            return
        if not data:
            self._lost(conn, "connection closed")
            return
        conn.buf += data
        self._frames(conn)

    # -- connection helpers -------------------------------------------------------------------
    def _turn_away(self, conn: Conn, reason: str) -> None:
        """Refused for now: a keyed ``reject`` with ``retry`` (a rank dials again; anyone
        else learns nothing from it), then `_drop`. A plain close, not a reset, so a peer
        whose first write is still on its way is not made to fail it."""
        if conn.tx_seq == 0 and conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.send(self._busy, socket.MSG_DONTWAIT)
            conn.tx_seq = 1
        self._drop(conn, reason)

    def _drop(self, conn: Conn, reason: str) -> None:
        """A protocol violation: one warning (rate-limited), then close only this connection."""
        if conn.closed:
            return
        self._refusals.report(Name.PEER_DROPPED, conn.peer, reason)
        self._close(conn)

    def _close(self, conn: Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._conns.discard(conn)
        self._pending.remove(conn)
        if conn.rank is not None and self._rank_conn.get(conn.rank) is conn:
            del self._rank_conn[conn.rank]
        if conn.sock is None:  # a relayed rank: its agent closes the rank's end
            if conn.down is not None:
                conn.down({"rank": conn.via_rank, "close": True})
            return
        if self._selector is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()
