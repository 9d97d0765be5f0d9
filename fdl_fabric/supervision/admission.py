"""Accept bounds: who gets a place while the coordinator waits for hellos, and how
refusals are reported.

The port is open to anyone who can reach it (and `/proc/net/tcp` shows it to every
user of the machine), so a flood of connections must not starve the cohort (issue 22):
each turn of the I/O loop accepts at most `ACCEPT_PER_TURN`, so the ranks' frames and
the tick always get their turn; a connection whose first frame is already in
(`first_frame_in`) is judged at once; any other waits for its hello in `PendingPeers`,
which refuses the *newest* beyond `PENDING_PER_SOURCE` from one address or the global
cap, never an older one, and asks it (a keyed ``reject`` with ``retry``) to dial again.
Refusals are reported once, then counted (`Refusals`): 500 hostile peers make one line
every few seconds, not 500. Sockets and clocks stay out of `PendingPeers`, so the
admission policy is tested on its own.
"""

from __future__ import annotations

import socket
import time
from typing import Any, Generic, Optional, TypeVar

from ..events import EventBus, Name
from ..rank import PRE_AUTH_FRAME as PRE_AUTH_FRAME  # the one bound, the agent's too
from ..rank import FrameError, take_frame

#: Connections accepted per turn of the I/O loop. Under a steady stream of connects the
#: listener is always ready; past this many the next turn reads the ranks' frames first and
#: the tick keeps its place. Small, because an accept under a flood also does the kernel's
#: work for the flooder's handshakes queued on the listener: with 4 flooding threads on
#: 2 cores, heartbeat latency p99 was 56 ms with 64 a turn, 6.5 ms with 8 (bench/flood.py).
ACCEPT_PER_TURN = 8
#: Connections without a verified hello held at once from one source address. A real rank
#: sends its hello right after connecting, and one already in is judged at once without a
#: place here, so the places serve only hellos still in flight; beyond the limit the newest
#: connection is refused (and asked to dial again), never an older one.
PENDING_PER_SOURCE = 64
#: Connections without a verified hello held at once in all (at least; twice the world size
#: if larger); beyond it the newest is refused, as above.
PENDING_MAX = 256
#: While connections are being refused, a waiting connection of the refused source (of any
#: source, past the global cap) that has not said hello within this many seconds loses its
#: place: it is not a rank about to say hello in time (one does so within milliseconds).
#: Without refusals the spec's ``hello_timeout`` (10 s) holds.
HELLO_PROMPT = 1.0
#: The reason a refused or expired connection is given, in a keyed ``reject`` with
#: ``retry``: a rank dials again (`fdl_fabric.rank.join`), anyone else just goes away.
BUSY_REASON = "the coordinator is busy with other connections; dial again"
#: Refused connections are reported at once, then as one count per this many seconds.
REJECT_REPORT_INTERVAL = 5.0
#: A write to a rank that stalls this long closes that connection (the peer stopped reading).
SEND_TIMEOUT = 5.0
#: `PendingPeers` holds any hashable handle (the coordinator's `Conn`; tests use strings).
_H = TypeVar("_H")


def _seconds(value: float) -> str:
    return f"{value:g}s"


class PendingPeers(Generic[_H]):
    """Connections that have not said hello yet: oldest first, counted per source address.

    The coordinator's admission policy, kept free of sockets and clocks so it is tested
    on its own. A new connection gets a place unless its source already holds
    ``per_source`` or all sources ``cap``: then `refusal` says why, and the *newest* is
    refused, never a connection already waiting (it may be a rank about to say hello).
    A refusal marks its source (or, past the cap, every source) as pressed until the next
    `expired`; there, a pressed source's connections older than ``prompt`` seconds lose
    their place, anyone's older than ``timeout``. So an idle flooder holds its places for
    about ``prompt`` seconds, and a refused rank, which dials again, finds one free.
    """

    def __init__(self, per_source: int, cap: int, prompt: float, timeout: float) -> None:
        self.per_source, self.cap = per_source, cap
        self.prompt, self.timeout = min(prompt, timeout), timeout
        #: Connection -> (source, when it arrived); dicts keep insertion order: oldest first.
        self._since: dict[_H, tuple[str, float]] = {}
        self._count: dict[str, int] = {}
        self._pressed: set[str] = set()
        self._all_pressed = False

    def __len__(self) -> int:
        return len(self._since)

    def __contains__(self, conn: object) -> bool:
        return conn in self._since

    def from_source(self, source: str) -> int:
        return self._count.get(source, 0)

    def oldest_first(self) -> list[_H]:
        return list(self._since)

    def refusal(self, source: str) -> Optional[str]:
        """Why a new connection from ``source`` gets no place now; None when it gets one."""
        if self._count.get(source, 0) >= self.per_source:
            self._pressed.add(source)
            return (f"too many connections without a hello from one address "
                    f"(limit {self.per_source}); refused the newest")
        if len(self._since) >= self.cap:
            self._all_pressed = True
            return f"too many connections without a hello (limit {self.cap}); refused the newest"
        return None

    def add(self, conn: _H, source: str, now: float) -> None:
        """Give ``conn`` its place (after `refusal` said None); ``now`` never goes back."""
        if conn not in self._since:
            self._since[conn] = (source, now)
            self._count[source] = self._count.get(source, 0) + 1

    def remove(self, conn: _H) -> None:
        """It said hello, was judged or closed: its place is free. Unknown ones are ignored."""
        entry = self._since.pop(conn, None)
        if entry is None:
            return
        left = self._count[entry[0]] - 1
        if left:
            self._count[entry[0]] = left
        else:
            del self._count[entry[0]]

    def expired(self, now: float) -> list[tuple[_H, str, bool]]:
        """Connections whose hello deadline passed, oldest first, with the reason and
        whether to ask them to dial again (those that lost their place to pressure);
        the caller closes them (and `remove`s them). Ends the pressure of this round."""
        out: list[tuple[_H, str, bool]] = []
        for conn, (source, since) in self._since.items():
            age = now - since
            if age <= self.prompt:
                break  # the rest are younger still
            if age > self.timeout:
                out.append((conn, f"no hello within {_seconds(self.timeout)}", False))
            elif self._all_pressed or source in self._pressed:
                out.append((conn, f"no hello within {_seconds(self.prompt)} while connections "
                                  "were being refused", True))
        self._pressed.clear()
        self._all_pressed = False
        return out


class Refusals:
    """Refused and dropped connections, reported without flooding the operator: the
    first is a warning line at once; later ones within `REJECT_REPORT_INTERVAL` are
    counted and reported together. Touched only by the I/O thread."""

    def __init__(self, events: EventBus) -> None:
        self.events = events
        self._rejected_at: Optional[float] = None
        self._rejected: dict[str, int] = {}
        self._rejected_peer = ""

    def report(self, name: Name, peer: str, reason: str, **data: Any) -> None:
        """A refusal: a line at once, or counted when one was said lately."""
        now = time.monotonic()
        if self._rejected_at is None or (now - self._rejected_at >= REJECT_REPORT_INTERVAL
                                         and not self._rejected):
            self._rejected_at = now
            self.events(name, peer=peer, reason=reason, refused=1, **data)
            return
        self.count(reason, peer)

    def count(self, reason: str, peer: str) -> None:
        """One more refusal, said with the others at the next `flush`."""
        key = reason.split(" (")[0]
        self._rejected[key] = self._rejected.get(key, 0) + 1
        self._rejected_peer = peer

    def under_way(self, now: float) -> bool:
        """True while refusals are being counted (a flood is on)."""
        return self._rejected_at is not None and (
            bool(self._rejected) or now - self._rejected_at < REJECT_REPORT_INTERVAL)

    def flush(self, now: float, *, force: bool = False) -> None:
        """The refusals counted since the last line, in one line (``force``: now)."""
        if not self._rejected or self._rejected_at is None:
            return
        if not force and now - self._rejected_at < REJECT_REPORT_INTERVAL:
            return
        count = sum(self._rejected.values())
        self.events(Name.PEERS_REFUSED, refused=count, reasons=dict(self._rejected),
                    seconds=round(now - self._rejected_at, 3), last_peer=self._rejected_peer)
        self._rejected = {}
        self._rejected_at = now


def first_frame_in(sock: socket.socket) -> bool:
    """True when the peer's first frame (or what makes it invalid, or its end) is already
    in the socket, so the connection can be judged now; False while nothing whole is."""
    if sock.gettimeout():  # a default timeout set by someone: never wait here
        sock.setblocking(False)
    try:
        head = sock.recv(4 + PRE_AUTH_FRAME, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True  # reset already: the read names it
    if not head:
        return True  # closed already
    try:
        return take_frame(bytearray(head), PRE_AUTH_FRAME) is not None
    except FrameError:
        return True
