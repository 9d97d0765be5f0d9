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
  the tunnel's bound (`forward_bound`: ``TUNNEL_PER_RANK`` per rank of the host plus
  ``TUNNEL_EXTRA``) are open and the open files left under the soft limit stay above
  ``TUNNEL_FD_RESERVE``; otherwise it waits for room, oldest first, still without a socket
  (at most ``TUNNEL_WAITING_MAX`` such, for at most ``TUNNEL_WAITING_SECONDS``: sshd hands
  connections over in bursts), and beyond that it is refused: its channel closed, no
  socket, no thread. An open connection is never closed to make room.
* Every connection turned away is counted: one warning at the first, and the count when the
  tunnel closes (`Name.TUNNEL_TURNING_AWAY`, `Name.TUNNEL_TURNED_AWAY`), never a line each.
* Once the forward listens, it asks the host which addresses listen on the port (the
  listening sockets of /proc/net/tcp and tcp6): sshd with ``GatewayPorts yes`` binds every
  address whatever the launcher asked, which is worth a warning (`Name.TUNNEL_EXPOSED`).

`check_open_files` compares RLIMIT_NOFILE with what a launch needs (`open_files_needed`)
before anything starts: the soft limit is raised up to the hard one when it is too low, and
a hard limit too low is refused with exit 2.

paramiko is never imported here (only handed in by the SSH transport), so a launch with only
local workers can import this module for its open-file check.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Optional, Union

from .. import limits
from ..errors import EXIT_USAGE, FdlError
from ..events import EventBus, Name

if TYPE_CHECKING:
    from ..clusterfile import ClusterSpec, WorkerSpec
    from .base import Transport

log = logging.getLogger(__name__)

#: What a tunnel says (an event name and its data); the host is the reporter's to add.
Report = Callable[[Name, dict[str, Any]], None]

#: Ranks counted for a ``local_devices: all`` host before its agent has said (a large GPU box).
ALL_DEVICES_GUESS = 16
#: Bytes moved per read, either way.
_CHUNK = 65536
#: Bytes held for one direction of one connection before reading that side pauses (the
#: channel's window then slows the sender on the host, the socket's buffer the coordinator).
_BUFFER_MAX = 1 << 20
#: How often the mover looks at waiting connections and at the SSH connection; how often it
#: retries a channel whose window was full.
_TICK = 0.25
_STALL_TICK = 0.05
#: Seconds the GatewayPorts check may take; it asks for the listening sockets only.
_EXPOSURE_TIMEOUT = 15.0
_LISTENERS = "awk '$4 == \"0A\" {print $2}' /proc/net/tcp /proc/net/tcp6 2>/dev/null"
#: The address the forward asks sshd to listen on.
LOOPBACK = "127.0.0.1"

_WAITING, _QUEUED, _CONNECTING, _OPEN, _CLOSED = "waiting", "queued", "connecting", "open", "closed"
#: A frame's tag (`fdl_fabric.rank.TAG_BYTES`): no frame is shorter.
_TAG_BYTES = 32


# -- the bounds --------------------------------------------------------------------------------
def ranks_on(worker: WorkerSpec) -> int:
    """The ranks a worker runs, as far as the cluster file says."""
    if worker.nproc is not None:
        return worker.nproc
    if isinstance(worker.local_devices, tuple):
        return max(1, len(worker.local_devices))
    return ALL_DEVICES_GUESS


def forward_bound(worker: WorkerSpec) -> int:
    """Forwarded connections one worker's tunnel carries at once."""
    return limits.TUNNEL_PER_RANK * ranks_on(worker) + limits.TUNNEL_EXTRA


def open_files_needed(cluster: ClusterSpec) -> int:
    """Open files a launch of ``cluster`` may hold at once: the fixed part, each directly
    connected host's connection (a gateway's leaves need none here, its relay a pipe),
    each rank's connection to the coordinator and the connections the coordinator may
    hold before their hello, and each tunnel at its bound."""
    from ..planning.tree import cluster_tree

    workers = cluster.workers
    ranks = sum(ranks_on(w) for w in workers)
    tunnels = sum(limits.TUNNEL_FDS_FIXED + limits.TUNNEL_FDS_PER_CONNECTION * forward_bound(w)
                  for w in workers if w.tunnel)
    tree = cluster_tree(cluster)
    leaves = sum(len(g.leaves) for g in tree.gateways)
    return (limits.NOFILE_BASE + limits.NOFILE_PER_HOST * (len(workers) - leaves)
            + limits.NOFILE_PER_RELAY * len(tree.gateways)
            + limits.NOFILE_PER_RANK * ranks + max(limits.NOFILE_PENDING_MIN, 2 * ranks)
            + tunnels)


def check_open_files(cluster: ClusterSpec, events: EventBus) -> None:
    """Before a launch contacts anything: RLIMIT_NOFILE against `open_files_needed`. A soft
    limit below it is raised (to twice the need, never above the hard limit); a hard limit
    below it is refused with exit 2, in one line that says what to run."""
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to check
        return
    needed = open_files_needed(cluster)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise FdlError(_too_few_files(cluster, needed, soft, hard), EXIT_USAGE)
    for target in (2 * needed if hard == resource.RLIM_INFINITY else min(hard, 2 * needed),
                   needed):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):  # macOS caps the soft limit at OPEN_MAX
            continue
        events(Name.OPEN_FILES_RAISED, was=soft, now=target,
               hard=None if hard == resource.RLIM_INFINITY else hard, needed=needed)
        return
    raise FdlError(_too_few_files(cluster, needed, soft, hard), EXIT_USAGE)


def _too_few_files(cluster: ClusterSpec, needed: int, soft: int, hard: int) -> str:
    tunnels = sum(1 for w in cluster.workers if w.tunnel)
    ranks = sum(ranks_on(w) for w in cluster.workers)
    what = f"{len(cluster.workers)} host(s), {ranks} rank(s)" + (
        f", {tunnels} tunnel(s)" if tunnels else "")
    return (f"cluster launcher: this run needs about {needed} open files ({what}), but the "
            f"open-file limit (RLIMIT_NOFILE) here is {soft} and its hard limit {hard}: raise "
            f"the hard limit to at least {needed} (nofile in /etc/security/limits.conf, "
            f"LimitNOFILE= for a service, or `ulimit -Hn {needed}` as root), then run "
            f"`ulimit -n {needed}` in the shell that launches")


def _free_files() -> Optional[int]:
    """Open files this process may still open under its soft limit (None: unlimited or
    unknown)."""
    try:
        import resource
    except ImportError:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    for folder in ("/proc/self/fd", "/dev/fd"):
        with contextlib.suppress(OSError):
            return soft - (len(os.listdir(folder)) - 1)  # listdir's own descriptor
    return None


# -- what sshd listens on ------------------------------------------------------------------
def _proc_address(word: str) -> Optional[Union[ipaddress.IPv4Address, ipaddress.IPv6Address]]:
    """An address as /proc/net/tcp{,6} writes it: hex, each 32-bit word in host order
    (little-endian on every machine this runs on)."""
    try:
        raw = bytes.fromhex(word)
    except ValueError:
        return None
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])
    if len(raw) == 16:
        return ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
    return None


def exposed_listeners(text: str, port: int) -> list[str]:
    """Addresses other than loopback that listen on ``port``, from the ``local_address``
    words (``0100007F:7A69``) of /proc/net/tcp and tcp6's listening sockets."""
    found: list[str] = []
    for word in text.split():
        addr_hex, _, port_hex = word.partition(":")
        try:
            if int(port_hex, 16) != port:
                continue
        except ValueError:
            continue
        addr = _proc_address(addr_hex)
        if addr is None or addr.is_loopback:
            continue
        mapped = getattr(addr, "ipv4_mapped", None)
        if mapped is not None and mapped.is_loopback:
            continue
        if str(addr) not in found:
            found.append(str(addr))
    return found


# -- the forward ---------------------------------------------------------------------------
class _Link:
    """One forwarded connection: its channel, and its socket to the coordinator once its
    first frame is in and there is room."""

    __slots__ = ("chan", "sock", "since", "state", "to_sock", "to_chan", "chan_eof",
                 "sock_eof", "interest")

    def __init__(self, chan: Any, since: float) -> None:
        self.chan = chan
        self.sock: Optional[socket.socket] = None
        #: When it arrived; once queued, when its frame was in.
        self.since = since
        self.state = _WAITING
        self.to_sock = bytearray()
        self.to_chan = bytearray()
        self.chan_eof = False
        self.sock_eof = False
        self.interest = 0


class _ChannelSignal:
    """Set by paramiko's transport thread when a channel's buffer gets data or closes
    (`paramiko.BufferedPipe.set_event`): it only queues the connection for the mover."""

    __slots__ = ("_forward", "_link")

    def __init__(self, forward: Forward, link: _Link) -> None:
        self._forward = forward
        self._link = link

    def set(self) -> None:
        self._forward._queue_ready(self._link)

    def clear(self) -> None:
        return None

    def is_set(self) -> bool:
        return False


def first_frame(buf: Union[bytes, bytearray]) -> Optional[bool]:
    """Whether ``buf`` starts with one whole frame of the coordinator's protocol (a 4-byte
    big-endian length, then that many bytes: a 32-byte tag and the payload): True, False
    while it may still become one, None when it cannot (a length no hello has)."""
    if len(buf) < 4:
        return False
    length = int.from_bytes(buf[:4], "big")
    if not _TAG_BYTES <= length <= limits.TUNNEL_FIRST_FRAME_MAX:
        return None
    return len(buf) >= 4 + length


class Forward:
    """A remote forward of ``LOOPBACK:port`` on the host to ``target:port`` here, bounded
    (see the module docstring). `start` asks sshd to listen; `close` stops and reports."""

    def __init__(self, transport: Any, port: int, target: str, *, bound: int,
                 report: Report) -> None:
        self.transport = transport
        self.port = port
        self.target = target
        self.bound = bound
        self._report = report
        #: Connections turned away, by why (`Name.TUNNEL_TURNED_AWAY`'s data).
        self.counts = {"busy": 0, "files": 0, "silent": 0, "garbled": 0}
        self.most_open = 0
        self._warned = False
        self._short_of = "busy"
        self._lock = threading.Lock()
        self._incoming: list[Any] = []
        self._ready: dict[_Link, None] = {}  # in the order the data came
        self._woken = False
        #: Connections without their first frame, and with it waiting for room, oldest
        #: first; and those with a socket to the coordinator.
        self._waiting: dict[int, _Link] = {}
        self._queued: dict[int, _Link] = {}
        self._open: set[_Link] = set()
        self._stalled: set[_Link] = set()
        self._stop = threading.Event()
        self._sel: Optional[selectors.BaseSelector] = None
        self._wake_r: Optional[socket.socket] = None
        self._wake_w: Optional[socket.socket] = None
        self._thread: Optional[threading.Thread] = None
        self._family = socket.AF_INET
        self._address: Any = (target, port)

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Listen on the host (raises what paramiko raises when sshd refuses), then move
        bytes in a thread of its own and check what sshd actually listens on."""
        info = socket.getaddrinfo(self.target, self.port, type=socket.SOCK_STREAM)[0]
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
        threading.Thread(target=self._check_exposure, name=f"tunnel-{self.port}-listeners",
                         daemon=True).start()

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

    def _queue_ready(self, link: _Link) -> None:
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
            for key, mask in self._sel.select(_STALL_TICK if self._stalled else _TICK):
                link = key.data
                if link is None:
                    self._drain_wake()
                    continue
                if mask & selectors.EVENT_WRITE and link.state is not _CLOSED:
                    self._sock_writable(link)
                if mask & selectors.EVENT_READ and link.state is not _CLOSED:
                    self._sock_readable(link)
            with self._lock:
                self._woken = False
                incoming, self._incoming = self._incoming, []
                ready, self._ready = self._ready, {}
            now = time.monotonic()
            for chan in incoming:
                self._admit(chan, now)
            for link in ready:
                if link.state is not _CLOSED:
                    self._from_channel(link, now)
            for link in list(self._stalled):
                self._to_channel(link)
            self._expire(now)
            self._open_queued()
            self._warn_once()
            if not self.transport.is_active():
                break

    def _drain_wake(self) -> None:
        with contextlib.suppress(OSError):
            while self._wake_r is not None and self._wake_r.recv(4096):
                pass

    def _admit(self, chan: Any, now: float) -> None:
        """A new connection waits for its first frame, without a socket."""
        link = _Link(chan, now)
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

    def _hush(self, link: _Link, now: float) -> None:
        """Close a connection that has not sent its first frame, unless the rest of it is
        waiting for this very loop (it is served instead)."""
        ready = False
        with contextlib.suppress(Exception):
            ready = bool(link.chan.recv_ready())
        if ready:
            self._from_channel(link, now)
        if link.state is _WAITING:
            self._turn_away(link, "silent")

    def _room(self) -> Optional[str]:
        """Why one more open connection cannot be had (None: it can)."""
        if len(self._open) >= self.bound:
            return "busy"
        free = _free_files()
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

    @staticmethod
    def _recv(link: _Link) -> Optional[bytes]:
        """What the channel has (b"" once it ended; None: nothing yet)."""
        try:
            data: bytes = link.chan.recv(_CHUNK)
        except socket.timeout:
            return None
        except Exception:
            return b""
        return data

    def _from_channel(self, link: _Link, now: float) -> None:
        while link.state is not _CLOSED and len(link.to_sock) < _BUFFER_MAX \
                and not link.chan_eof:
            data = self._recv(link)
            if data is None:
                break
            if data:
                link.to_sock += data
            else:
                link.chan_eof = True
            if link.state is _WAITING and self._framed(link, now) is not True:
                return
        if link.state is _WAITING and link.chan_eof:
            self._close(link)  # gone before its first frame: it left, nothing to count
        elif link.state in (_CONNECTING, _OPEN):
            self._to_sock(link)

    def _framed(self, link: _Link, now: float) -> Optional[bool]:
        """A waiting connection once its first frame is in: queued for a socket (True);
        False while the frame is not whole; None when it turned out to be no frame."""
        whole = first_frame(link.to_sock)
        if whole is None:
            self._turn_away(link, "garbled")
        elif whole:
            del self._waiting[id(link)]
            link.state, link.since = _QUEUED, now
            self._queued[id(link)] = link
            self._open_queued()
            if link.state is _QUEUED and len(self._queued) > limits.TUNNEL_WAITING_MAX:
                self._turn_away(link, self._short_of)
        return whole

    def _connect(self, link: _Link) -> bool:
        """The connection's socket to the coordinator, connecting without blocking."""
        try:
            sock = socket.socket(self._family, socket.SOCK_STREAM)
        except OSError as exc:
            self._turn_away(link, "files" if exc.errno in (errno.EMFILE, errno.ENFILE)
                            else "busy")
            return False
        sock.setblocking(False)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        err = sock.connect_ex(self._address)
        if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
            sock.close()
            log.debug("tunnel %s: connecting to %s failed: %s", self.port, self._address,
                      os.strerror(err))
            self._close(link)
            return False
        link.sock = sock
        link.state = _CONNECTING
        self._open.add(link)
        self.most_open = max(self.most_open, len(self._open))
        return True

    def _to_sock(self, link: _Link) -> None:
        if link.state is _OPEN and link.to_sock:
            assert link.sock is not None
            try:
                sent = link.sock.send(link.to_sock)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._close(link)
                return
            del link.to_sock[:sent]
        if link.state is _OPEN and link.chan_eof and not link.to_sock:
            self._close(link)
            return
        self._interest(link)

    def _sock_writable(self, link: _Link) -> None:
        if link.state is _CONNECTING:
            assert link.sock is not None
            err = link.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                log.debug("tunnel %s: connecting to %s failed: %s", self.port, self._address,
                          os.strerror(err))
                self._close(link)
                return
            link.state = _OPEN
        self._to_sock(link)
        if link.state is _OPEN and len(link.to_sock) < _BUFFER_MAX and not link.chan_eof:
            self._from_channel(link, time.monotonic())  # reading may have paused on a full buffer

    def _sock_readable(self, link: _Link) -> None:
        assert link.sock is not None
        try:
            data = link.sock.recv(_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(link)
            return
        if data:
            link.to_chan += data
        else:
            link.sock_eof = True
        self._to_channel(link)

    def _to_channel(self, link: _Link) -> None:
        while link.to_chan:
            try:
                sent = link.chan.send(bytes(link.to_chan[:_CHUNK]))
            except socket.timeout:  # the channel's window is full: retried every tick
                break
            except Exception:
                self._close(link)
                return
            if not sent:
                self._close(link)
                return
            del link.to_chan[:sent]
        if link.to_chan:
            self._stalled.add(link)
        else:
            self._stalled.discard(link)
            if link.sock_eof:
                self._close(link)
                return
        self._interest(link)

    def _interest(self, link: _Link) -> None:
        """What the selector watches on the connection's socket."""
        if link.sock is None or link.state is _CLOSED or self._sel is None:
            return
        want = 0
        if link.state is _CONNECTING or (link.state is _OPEN and link.to_sock):
            want |= selectors.EVENT_WRITE
        if link.state is _OPEN and not link.sock_eof and len(link.to_chan) < _BUFFER_MAX:
            want |= selectors.EVENT_READ
        if want == link.interest:
            return
        if not link.interest:
            self._sel.register(link.sock, want, link)
        elif not want:
            self._sel.unregister(link.sock)
        else:
            self._sel.modify(link.sock, want, link)
        link.interest = want

    def _turn_away(self, link: _Link, why: str) -> None:
        self.counts[why] += 1
        self._close(link)

    def _close(self, link: _Link) -> None:
        if link.state is _CLOSED:
            return
        link.state = _CLOSED
        self._waiting.pop(id(link), None)
        self._queued.pop(id(link), None)
        self._open.discard(link)
        self._stalled.discard(link)
        if link.sock is not None:
            if link.interest and self._sel is not None:
                with contextlib.suppress(Exception):
                    self._sel.unregister(link.sock)
            link.interest = 0
            link.sock.close()
        with contextlib.suppress(Exception):
            link.chan.close()

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

    # -- GatewayPorts ----------------------------------------------------------------------
    def _check_exposure(self) -> None:
        """Warn when sshd listens on the port beyond loopback (``GatewayPorts yes``)."""
        try:
            chan = self.transport.open_session(timeout=_EXPOSURE_TIMEOUT)
            try:
                chan.settimeout(_EXPOSURE_TIMEOUT)
                chan.exec_command(_LISTENERS)
                out = bytearray()
                while len(out) < (1 << 20):
                    data = chan.recv(_CHUNK)
                    if not data:
                        break
                    out += data
            finally:
                chan.close()
        except Exception as exc:  # no answer is no warning; the tunnel works either way
            log.debug("tunnel %s: could not list the host's listeners: %s", self.port, exc)
            return
        exposed = exposed_listeners(out.decode("ascii", "replace"), self.port)
        if exposed:
            self._report(Name.TUNNEL_EXPOSED, {"port": self.port, "addresses": exposed})


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
               events: Optional[EventBus]) -> Iterator[Forward]:
    """A started `Forward` for ``worker``'s tunnel, closed on exit."""
    forward = Forward(paramiko_transport, port, target, bound=forward_bound(worker),
                      report=reporter(worker.host, events))
    forward.start()
    try:
        yield forward
    finally:
        forward.close()
