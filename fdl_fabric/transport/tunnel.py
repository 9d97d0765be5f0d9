"""The tunnel of a ``tunnel: true`` worker, bounded; and the open files a launch needs.

The ranks of a tunneled worker dial 127.0.0.1:<controller.port> on their host, where sshd
listens and opens a ``forwarded-tcpip`` channel to the launcher for every connection it
accepts, whoever makes it: any user of that host can connect (issue 22). Fabric's
``forward_remote`` gives every channel a socket, an OS pipe and a thread, with no bound; a
flood of idle connections from another user ran a launcher out of open files, its SSH
sessions dropped and the run was lost.

`Forward` carries the same traffic within bounds (`limits`, "the launcher's own resources"):

* One thread per tunnel moves the bytes of every connection: a selector over the sockets to
  the coordinator, and paramiko's channel buffer telling it (through the buffer's event)
  when a channel has data or ended. A connection costs no thread and no pipe.
* A connection has no socket until its first frame is in. The coordinator's protocol has
  the rank speak first (a hello, or the agent's probe: a length, a tag and a payload of a
  few hundred bytes, sent at once), so a connection that says nothing, or half a frame,
  never reaches the coordinator and costs no open file. At most ``TUNNEL_WAITING_MAX``
  wait; beyond that the one that has waited longest is closed (a rank's frame is in within
  a round trip; an idle flood's never is), and so is one that waited
  ``TUNNEL_WAITING_SECONDS``. A first length no hello has is turned away at once.
* A connection whose first frame is in gets its socket to the coordinator when fewer than
  the tunnel's bound (`forward_bound`: ``TUNNEL_CONNECTIONS``, whatever the host's
  ranks, which speak through their agent) are open and the open files left under the
  soft limit stay above ``TUNNEL_FD_RESERVE``; otherwise it waits for room, oldest
  first, still without a socket (at most ``TUNNEL_WAITING_MAX`` such, for at most
  ``TUNNEL_WAITING_SECONDS``: sshd hands connections over in bursts), and beyond that
  it is refused: its channel closed, no socket, no thread. An open connection is never
  closed to make room.
* Every connection turned away is counted: one warning at the first, and the count when the
  tunnel closes (`Name.TUNNEL_TURNING_AWAY`, `Name.TUNNEL_TURNED_AWAY`), never a line each.
* Once the forward listens, it asks the host which addresses listen on the port (the
  listening sockets of /proc/net/tcp and tcp6): sshd with ``GatewayPorts yes`` binds every
  address whatever the launcher asked, which is worth a warning (`Name.TUNNEL_EXPOSED`).

How the bytes of one connection move is `tunnellinks`'s; what sshd listens on,
`listeners`'s; the open files a launch needs (`openfiles`),
`openfiles`'s (the two are also importable from here, as they were).

paramiko is never imported here (only handed in by the SSH transport), so a launch with only
local workers can import this module for its open-file check.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Optional

from .. import limits
from ..events import EventBus, Name
from .listeners import check_exposure, exposed_listeners
from .openfiles import forward_bound, free_files
from .tunnellinks import CLOSED, QUEUED, WAITING, Link, LinkMover, first_frame

if TYPE_CHECKING:
    from ..clusterfile import WorkerSpec
    from .base import Transport

log = logging.getLogger(__name__)

#: What a tunnel says (an event name and its data); the host is the reporter's to add.
Report = Callable[[Name, dict[str, Any]], None]

#: How often the mover looks at waiting connections and at the SSH connection; how often it
#: retries a channel whose window was full.
_TICK = 0.25
_STALL_TICK = 0.05
#: The address the forward asks sshd to listen on.
LOOPBACK = "127.0.0.1"

__all__ = ["LOOPBACK", "Forward", "exposed_listeners", "first_frame", "forward_bound",
           "forwarding", "open_tunnel", "reporter"]


# -- the forward ---------------------------------------------------------------------------
class _ChannelSignal:
    """Set by paramiko's transport thread when a channel's buffer gets data or closes
    (`paramiko.BufferedPipe.set_event`): it only queues the connection for the mover."""

    __slots__ = ("_forward", "_link")

    def __init__(self, forward: Forward, link: Link) -> None:
        self._forward = forward
        self._link = link

    def set(self) -> None:
        self._forward._queue_ready(self._link)

    def clear(self) -> None:
        return None

    def is_set(self) -> bool:
        return False


class Forward(LinkMover):
    """A remote forward of ``LOOPBACK:port`` on the host to ``target:port`` here, bounded
    (see the module docstring). `start` asks sshd to listen; `close` stops and reports."""

    def __init__(self, transport: Any, port: int, target: str, *, bound: int,
                 report: Report, local_port: Optional[int] = None) -> None:
        super().__init__(port, target)
        #: Where connections go here: ``target:port``, or a stand-in port of this machine
        #: (a pre-flight whose configured port another process holds).
        self.local_port = local_port or port
        self.transport = transport
        self.bound = bound
        self._report = report
        self._warned = False
        self._short_of = "busy"
        self._lock = threading.Lock()
        self._incoming: list[Any] = []
        self._ready: dict[Link, None] = {}  # in the order the data came
        self._woken = False
        self._stop = threading.Event()
        self._wake_r: Optional[socket.socket] = None
        self._wake_w: Optional[socket.socket] = None
        self._thread: Optional[threading.Thread] = None

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Listen on the host (raises what paramiko raises when sshd refuses), then move
        bytes in a thread of its own and check what sshd actually listens on."""
        info = socket.getaddrinfo(self.target, self.local_port, type=socket.SOCK_STREAM)[0]
        self._family, self._address = info[0], info[4]
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        try:
            self._wake_r.setblocking(False)
            self._wake_w.setblocking(False)
            self._sel.register(self._wake_r, selectors.EVENT_READ, None)
            self.transport.request_port_forward(LOOPBACK, self.port, handler=self._on_channel)
        except BaseException:
            self._release()
            raise
        self._thread = threading.Thread(target=self._run, name=f"tunnel-{self.port}",
                                        daemon=True)
        self._thread.start()
        threading.Thread(target=check_exposure, args=(self.transport, self.port, self._report),
                         name=f"tunnel-{self.port}-listeners", daemon=True).start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop forwarding (sshd is asked to stop listening, without waiting for its
        answer), close every connection, and report what was turned away."""
        # paramiko's cancel_port_forward waits for sshd's answer without a timeout; a wedged
        # connection must not wedge the launcher's teardown. Without a handler, paramiko
        # itself refuses any channel sshd still opens.
        self.transport._tcp_handler = None
        with contextlib.suppress(Exception):
            if self.transport.is_active():
                self.transport.global_request("cancel-tcpip-forward", (LOOPBACK, self.port),
                                              wait=False)
        self._stop.set()
        with contextlib.suppress(OSError, AttributeError):
            self._wake_w.send(b"\0")  # type: ignore[union-attr]
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def turned_away(self) -> int:
        return sum(self.counts.values())

    # -- paramiko's transport thread: queue and wake, nothing else ------------------------
    def _on_channel(self, chan: Any, origin: Any, server: Any) -> None:
        """A connection sshd accepted. Closing a channel here could wait for a key
        exchange this very thread must finish, so the mover decides."""
        with self._lock:
            self._incoming.append(chan)
        self._wake()

    def _queue_ready(self, link: Link) -> None:
        with self._lock:
            self._ready[link] = None
        self._wake()

    def _wake(self) -> None:
        with self._lock:
            if self._woken:
                return
            self._woken = True
        with contextlib.suppress(OSError, AttributeError):
            self._wake_w.send(b"\0")  # type: ignore[union-attr]

    # -- the mover ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except Exception:  # a bug here must not take the launcher down; it ends the tunnel
            log.exception("tunnel %s: the forward stopped", self.port)
        finally:
            self._shutdown()

    def _loop(self) -> None:
        assert self._sel is not None
        while not self._stop.is_set():
            self._serve_sockets(self._sel.select(_STALL_TICK if self._stalled else _TICK))
            with self._lock:
                self._woken = False
                incoming, self._incoming = self._incoming, []
                ready, self._ready = self._ready, {}
            now = time.monotonic()
            for chan in incoming:
                self._admit(chan, now)
            for link in ready:
                if link.state is not CLOSED:
                    self._from_channel(link, now)
            for link in list(self._stalled):
                self._to_channel(link)
            self._expire(now)
            self._open_queued()
            self._warn_once()
            if not self.transport.is_active():
                break

    def _serve_sockets(self, ready: list[tuple[selectors.SelectorKey, int]]) -> None:
        """The sockets the selector found ready (and the wake-up pipe)."""
        for key, mask in ready:
            link = key.data
            if link is None:
                self._drain_wake()
                continue
            if mask & selectors.EVENT_WRITE and link.state is not CLOSED:
                self._sock_writable(link)
            if mask & selectors.EVENT_READ and link.state is not CLOSED:
                self._sock_readable(link)

    def _drain_wake(self) -> None:
        with contextlib.suppress(OSError):
            while self._wake_r is not None and self._wake_r.recv(4096):
                pass

    def _admit(self, chan: Any, now: float) -> None:
        """A new connection waits for its first frame, without a socket."""
        link = Link(chan, now)
        self._waiting[id(link)] = link
        try:
            chan.settimeout(0.0)
            chan.in_buffer.set_event(_ChannelSignal(self, link))
        except Exception:
            self._close(link)
        while len(self._waiting) > limits.TUNNEL_WAITING_MAX:
            self._hush(next(iter(self._waiting.values())), now)

    def _expire(self, now: float) -> None:
        while self._waiting:
            oldest = next(iter(self._waiting.values()))
            if now - oldest.since < limits.TUNNEL_WAITING_SECONDS:
                break
            self._hush(oldest, now)
        while self._queued:
            oldest = next(iter(self._queued.values()))
            if now - oldest.since < limits.TUNNEL_WAITING_SECONDS:
                break
            self._turn_away(oldest, self._short_of)

    def _hush(self, link: Link, now: float) -> None:
        """Close a connection that has not sent its first frame, unless the rest of it is
        waiting for this very loop (it is served instead)."""
        ready = False
        with contextlib.suppress(Exception):
            ready = bool(link.chan.recv_ready())
        if ready:
            self._from_channel(link, now)
        if link.state is WAITING:
            self._turn_away(link, "silent")

    def _room(self) -> Optional[str]:
        """Why one more open connection cannot be had (None: it can)."""
        if len(self._open) >= self.bound:
            return "busy"
        free = free_files()
        if free is not None and free < limits.TUNNEL_FDS_PER_CONNECTION + \
                limits.TUNNEL_FD_RESERVE:
            return "files"
        return None

    def _open_queued(self) -> None:
        """Sockets for the connections whose first frame is in, oldest first, while there
        is room."""
        while self._queued:
            why = self._room()
            if why is not None:
                self._short_of = why
                return
            link = next(iter(self._queued.values()))
            del self._queued[id(link)]
            if self._connect(link):
                self._interest(link)

    def _framed(self, link: Link, now: float) -> Optional[bool]:
        """A waiting connection once its first frame is in: queued for a socket (True);
        False while the frame is not whole; None when it turned out to be no frame."""
        whole = first_frame(link.to_sock)
        if whole is None:
            self._turn_away(link, "garbled")
        elif whole:
            del self._waiting[id(link)]
            link.state, link.since = QUEUED, now
            self._queued[id(link)] = link
            self._open_queued()
            if link.state is QUEUED and len(self._queued) > limits.TUNNEL_WAITING_MAX:
                self._turn_away(link, self._short_of)
        return whole

    def _facts(self) -> dict[str, Any]:
        return {"port": self.port, "limit": self.bound,
                "waiting_max": limits.TUNNEL_WAITING_MAX,
                "waiting_seconds": limits.TUNNEL_WAITING_SECONDS}

    def _warn_once(self) -> None:
        if self._warned or not self.turned_away:
            return
        self._warned = True
        why = next(w for w, n in self.counts.items() if n)
        self._report(Name.TUNNEL_TURNING_AWAY, {**self._facts(), "why": why})

    def _shutdown(self) -> None:
        with self._lock:
            incoming, self._incoming = self._incoming, []
        for chan in incoming:
            with contextlib.suppress(Exception):
                chan.close()
        for link in [*self._waiting.values(), *self._queued.values(), *self._open]:
            self._close(link)
        self._release()
        if self.turned_away:
            self._report(Name.TUNNEL_TURNED_AWAY, {**self._facts(), **self.counts,
                                                   "turned_away": self.turned_away})

    def _release(self) -> None:
        for closable in (self._sel, self._wake_r, self._wake_w):
            if closable is not None:
                with contextlib.suppress(Exception):
                    closable.close()


# -- for the launch --------------------------------------------------------------------------
def reporter(host: str, events: Optional[EventBus]) -> Report:
    """How a tunnel of ``host`` says things: as events, or (no bus: a Fabric task) as log
    records."""
    if events is None:
        def to_log(name: Name, data: dict[str, Any]) -> None:
            log.warning("tunnel of %s: %s %s", host, name.value, data)
        return to_log
    bus = events

    def to_events(name: Name, data: dict[str, Any]) -> None:
        bus(name, host=host, **data)
    return to_events


def open_tunnel(transport: Transport, port: int, target: str,
                events: EventBus) -> ContextManager[None]:
    """``transport.tunnel(port, target)``, with what the tunnel has to say (turned-away
    connections, an exposed port) as events, for a transport whose tunnel reports (SSH's)."""
    reporting = getattr(transport, "reporting_tunnel", None)
    if callable(reporting):
        forward: ContextManager[None] = reporting(port, target, events)
        return forward
    return transport.tunnel(port, target)


@contextlib.contextmanager
def forwarding(paramiko_transport: Any, worker: WorkerSpec, port: int, target: str,
               events: Optional[EventBus], *,
               local_port: Optional[int] = None) -> Iterator[Forward]:
    """A started `Forward` for ``worker``'s tunnel, closed on exit."""
    forward = Forward(paramiko_transport, port, target, bound=forward_bound(worker),
                      report=reporter(worker.host, events), local_port=local_port)
    forward.start()
    try:
        yield forward
    finally:
        forward.close()
