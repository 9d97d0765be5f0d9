"""The coordinator inside the launcher: cohort membership and its sockets, nothing else.

Every rank dials one TCP port and says ``hello``. Once every rank 0..W-1 has joined,
the cohort is formed (flodl spec section 5.3). The coordinator keeps who is in the
cohort: it declares a silent rank dead after the heartbeat timeout (and tells the
supervisor, whose agent then stops it), refuses a dead rank that comes back, broadcasts
membership when the supervisor marks a rank dead, broadcasts save-and-shutdown when the
supervisor says so, and notices a cohort that does not form in time. What a death
means for the run (kill-all, tolerance, ``max_failure``) and the verdict are the
failure policy's (`policy`), on the supervisor's side; the coordinator only reports.

The wire protocol is ours, not flodl's bincode frames, and docs/protocol.md is
its contract: a 4-byte big-endian length, a 32-byte HMAC-SHA256 tag keyed by
the run's salt and bound to the run id and a per-direction sequence number, then
a JSON object. Its one implementation is in `fdl_fabric.rank` (which must run
standalone on any host), imported here.

One I/O thread does everything that touches sockets (accept, read, the 50 ms
tick, broadcasts), so connection state needs no locking. The supervisor thread
only reads a few fields and queues requests; a lock covers those.
Standard library only.

The port is open to anyone who can reach it (and `/proc/net/tcp` shows it to every
user of the machine), so a flood of connections must not starve the cohort (issue 22):
each turn of the loop accepts at most `ACCEPT_PER_TURN`, so the ranks' frames and the
tick always get their turn; a connection whose first frame is already in is judged at
once; any other waits for its hello in `PendingPeers`, which refuses the *newest*
beyond `PENDING_PER_SOURCE` from one address or the global cap, never an older one,
and asks it (a keyed ``reject`` with ``retry``) to dial again.
"""

from __future__ import annotations

import contextlib
import hmac
import math
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Optional, TypeVar

from ..events import Event, EventBus, Name, event
from ..presentation.words import cause_data, render
from ..rank import MAX_FRAME, FrameError, decode_payload, encode_frame, frame_tag, take_frame

#: How often the coordinator drains reported deaths and checks heartbeats.
TICK_INTERVAL = 0.05
#: Seconds between two walks over every rank for silence, at most: a twentieth of the
#: heartbeat timeout, so detection stays within 5 % of it, while 8,192 ranks are walked
#: a few times a second rather than on every tick (4 ms a walk, 8 % of a core).
SILENCE_SCAN_MAX = 0.5
#: Selector data of the wake-up socket (connections carry a `_Conn`, the listener None).
_WAKE = object()
#: Largest frame a connection may send before its hello verified: a hello or a probe is
#: about a hundred bytes, so an unauthenticated peer can make us hold little.
PRE_AUTH_FRAME = 4096
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
#: Sequence numbers around the expected one tried when a tag fails, to name replays.
_DIAGNOSE_WINDOW = 16
#: Payloads above this size are not re-hashed to diagnose a bad tag (bounds the work).
_DIAGNOSE_MAX_PAYLOAD = 64 * 1024
_RANK_MESSAGES = frozenset({"hello", "heartbeat", "exiting", "ack_shutdown", "probe"})
_RECV_CHUNK = 65536
#: `PendingPeers` holds any hashable handle (the coordinator's `_Conn`; tests use strings).
_H = TypeVar("_H")



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


def _tag_failure(salt: bytes, run_id: str, expected: int, tag: bytes, payload: bytes) -> str:
    """Name why a tag failed: a nearby sequence number that matches means replay or reorder."""
    if len(payload) <= _DIAGNOSE_MAX_PAYLOAD:
        for seq in range(max(0, expected - _DIAGNOSE_WINDOW), expected):
            if hmac.compare_digest(frame_tag(salt, run_id, seq, payload), tag):
                return f"replayed frame (sequence {seq}, expected {expected})"
        for seq in range(expected + 1, expected + 1 + _DIAGNOSE_WINDOW):
            if hmac.compare_digest(frame_tag(salt, run_id, seq, payload), tag):
                return f"out-of-order frame (sequence {seq}, expected {expected})"
    return "bad tag"


#: Why a rank is counted dead (the data of `Name.RANK_DECLARED_DEAD`): the supervisor's
#: ``{"exit": {...}}``, or the coordinator's ``{"silent": s, "heartbeat_timeout": t}``.
Reason = Mapping[str, Any]


def _seconds(value: float) -> str:
    return f"{value:g}s"


@dataclass(frozen=True)
class CoordinatorSpec:
    """What the launcher decides about the coordinator; timeouts arrive already scaled."""

    run_id: str
    salt: bytes
    world_size: int
    bind_host: str
    port: int
    formation_timeout: float = 300.0
    heartbeat_timeout: float = 30.0
    #: A connection that has not sent a valid hello by then is dropped (spec: 10 s, scaled).
    hello_timeout: float = 10.0

    def __post_init__(self) -> None:
        """Invariants, not input checks: the cluster file and the flags validated every
        value with its key or flag named; these guard code that builds a spec by hand."""
        for name, ok, expected in (
            ("run_id", _text(self.run_id), "a non-empty string"),
            ("salt", isinstance(self.salt, bytes) and len(self.salt) == 16, "16 bytes"),
            ("world_size", _whole(self.world_size) and self.world_size >= 1, "an int >= 1"),
            ("bind_host", _text(self.bind_host), "a non-empty address"),
            ("port", _whole(self.port) and 0 <= self.port <= 65535, "in 0..65535"),
            *((t, _positive_seconds(getattr(self, t)), "a positive number of seconds")
              for t in ("formation_timeout", "heartbeat_timeout", "hello_timeout")),
        ):
            if not ok:
                raise ValueError(f"coordinator: {name} must be {expected}, "
                                 f"got {getattr(self, name)!r}")


def _text(value: object) -> bool:
    return isinstance(value, str) and bool(value)


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_seconds(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


class DeadRanks:
    """The dead-rank ledger: one flag per rank, idempotent, safe from any thread.

    Only deaths count here; a rank that exited cleanly is never in it.
    """

    def __init__(self, world_size: int) -> None:
        self._flags = [False] * max(world_size, 0)
        self._count = 0
        self._lock = threading.Lock()

    @property
    def world_size(self) -> int:
        return len(self._flags)

    def declare_dead(self, rank: int) -> bool:
        """Mark ``rank`` dead; True only the first time. Out of range is a no-op."""
        with self._lock:
            if not 0 <= rank < len(self._flags) or self._flags[rank]:
                return False
            self._flags[rank] = True
            self._count += 1
            return True

    def is_dead(self, rank: int) -> bool:
        with self._lock:
            return 0 <= rank < len(self._flags) and self._flags[rank]

    def dead_count(self) -> int:
        with self._lock:
            return self._count

    def ranks(self) -> list[int]:
        """The dead ranks, in order (nothing to walk while nobody died: every rank's
        welcome carries this list)."""
        with self._lock:
            if not self._count:
                return []
            return [r for r, dead in enumerate(self._flags) if dead]


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


@dataclass(eq=False)
class _Conn:
    """One accepted connection; touched only by the I/O thread."""

    sock: socket.socket
    peer: str
    opened: float
    #: The peer's address without its port: what `PendingPeers` counts per source.
    source: str = ""
    buf: bytearray = field(default_factory=bytearray)
    rx_seq: int = 0
    tx_seq: int = 0
    rank: Optional[int] = None
    closed: bool = False


class Coordinator:
    """The launcher's coordinator; see the module docstring and docs/protocol.md."""

    def __init__(self, spec: CoordinatorSpec, events: EventBus,
                 on_join: Optional[Callable[[int], None]] = None,
                 on_dead: Optional[Callable[[int, Reason], None]] = None,
                 on_abort: Optional[Callable[[Event], None]] = None) -> None:
        self.spec = spec
        self.events = events
        self.on_join = on_join
        #: Told of each rank declared dead for silence (its agent must stop it).
        self.on_dead = on_dead
        #: Told once why the run cannot go on (the cohort did not form; a crash here).
        self.on_abort = on_abort
        self._dead = DeadRanks(spec.world_size)
        self._lock = threading.Lock()
        # Guarded by _lock: read by the supervisor thread.
        self._joined: set[int] = set()
        self._exited: set[int] = set()
        self._formed = False
        self._abort: Optional[Event] = None
        self._shutdown: Optional[str] = None
        self._reports: list[tuple[list[int], Reason]] = []
        self._shutdown_wanted: Optional[Event] = None
        #: When any joined rank last reported progress (`fdl_fabric.rank.progress`).
        self._last_progress = 0.0
        self._resume_pending = False
        # I/O thread only.
        self._conns: set[_Conn] = set()
        self._rank_conn: dict[int, _Conn] = {}
        self._hosts: dict[int, str] = {}
        self._last_frame: dict[int, float] = {}
        #: When `_tick` next walks every rank for silence.
        self._next_scan = 0.0
        self._progress: dict[int, int] = {}
        self._first_hello: Optional[float] = None
        self._formed_at = 0.0
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
        self._rejected_at: Optional[float] = None
        self._rejected: dict[str, int] = {}
        self._rejected_peer = ""
        # Connections waiting for their hello (I/O thread only).
        self._pending: PendingPeers[_Conn] = PendingPeers(
            PENDING_PER_SOURCE, max(PENDING_MAX, 2 * spec.world_size), HELLO_PROMPT,
            spec.hello_timeout)
        #: The one frame every turned-away connection gets (sequence 0, so it is the same).
        self._busy = encode_frame(spec.salt, spec.run_id, 0,
                                  {"type": "reject", "reason": BUSY_REASON, "retry": True})

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
        self._flush_refused(time.monotonic(), force=True)
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

    # -- the supervisor's side ------------------------------------------------------------------
    @property
    def cohort_formed(self) -> bool:
        """True once every rank 0..W-1 has sent a valid hello."""
        with self._lock:
            return self._formed

    def mark_dead(self, ranks: Sequence[int], reason: Reason) -> None:
        """Ranks the supervisor found dead: out of the cohort; the next tick tells the
        others (membership) and closes their connections."""
        with self._lock:
            self._reports.append(([int(r) for r in ranks], reason))
        self._wake()

    def broadcast_shutdown(self, cause: Event) -> None:
        """The policy's call: survivors save and stop. Sent once, at the next tick."""
        with self._lock:
            if self._shutdown is None and self._shutdown_wanted is None:
                self._shutdown_wanted = cause
        self._wake()

    def abort_reason(self) -> Optional[Event]:
        """Why the run cannot go on (formation timeout, coordinator failure), else None."""
        with self._lock:
            return self._abort

    @property
    def last_progress(self) -> float:
        """When (monotonic) a joined rank last reported progress; 0 when none ever did."""
        with self._lock:
            return self._last_progress

    def resumed(self) -> None:
        """This process was stopped (Ctrl-Z): the ranks' silence was ours, not theirs, so
        the heartbeat clocks start again at the next tick."""
        with self._lock:
            self._resume_pending = True
        self._wake()

    # -- read-only views ----------------------------------------------------------------------
    @property
    def joined(self) -> set[int]:
        """Ranks that have sent a valid hello (a copy; it never shrinks)."""
        with self._lock:
            return set(self._joined)

    @property
    def exited(self) -> set[int]:
        """Ranks that announced a clean exit; they are never counted dead."""
        with self._lock:
            return set(self._exited)

    @property
    def dead(self) -> DeadRanks:
        return self._dead

    @property
    def shutdown_sent(self) -> Optional[str]:
        """The reason of the save-and-shutdown broadcast, once it has been sent."""
        with self._lock:
            return self._shutdown

    # -- I/O thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        """Accept, read and tick until stopped; a crash aborts the run rather than hang it."""
        next_tick = time.monotonic()
        try:
            while not self._stopping.is_set():
                selector = self._selector
                if selector is None:
                    return
                woken = accept = False
                strangers: list[_Conn] = []
                # The ranks' frames first, then connections without a hello, then new
                # connections (a bounded number): however many knock, a heartbeat that is
                # in waits for no more than one turn.
                for key, _ in selector.select(timeout=TICK_INTERVAL):
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
            self._aborted(event(Name.COORDINATOR_FAILED, error=repr(exc)))

    def _aborted(self, reason: Event) -> None:
        """The run cannot go on; the supervisor is told once."""
        with self._lock:
            if self._abort is not None:
                return
            self._abort = reason
        if self.on_abort is not None:
            self.on_abort(reason)

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
        conn = _Conn(sock=sock, peer=peer, opened=now, source=host)
        if _first_frame_in(sock):
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

    def _register(self, conn: _Conn) -> None:
        assert self._selector is not None
        conn.sock.settimeout(SEND_TIMEOUT)
        self._conns.add(conn)
        self._selector.register(conn.sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Conn) -> None:
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
        while not conn.closed:
            try:
                frame = take_frame(conn.buf,
                                   PRE_AUTH_FRAME if conn.rank is None else MAX_FRAME)
                if frame is None:
                    return
                tag, payload = frame
                expected = frame_tag(self.spec.salt, self.spec.run_id, conn.rx_seq, payload)
                if not hmac.compare_digest(tag, expected):
                    raise FrameError(_tag_failure(self.spec.salt, self.spec.run_id, conn.rx_seq,
                                                  tag, payload))
                conn.rx_seq += 1
                message = decode_payload(payload)
                self._handle(conn, message)
            except FrameError as exc:
                self._drop(conn, str(exc))

    def _handle(self, conn: _Conn, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind not in _RANK_MESSAGES:
            raise FrameError(f"unknown message type {kind!r}")
        if conn.rank is None:
            if kind == "probe":
                # An agent's pre-flight: proves this host reaches *this* coordinator
                # (the reply is keyed with the run's salt), then goes away quietly.
                host = message.get("host")
                self.events(Name.PROBE_RECEIVED, host=host if isinstance(host, str) else None,
                            peer=conn.peer, **{"from": host})
                self._send(conn, {"type": "probe_ok"})
                self._close(conn)
                return
            if kind != "hello":
                raise FrameError(f"first frame must be hello, got {kind!r}")
            self._hello(conn, message)
            return
        if kind == "hello":
            raise FrameError("second hello on one connection")
        rank = conn.rank
        now = self._last_frame[rank] = time.monotonic()
        if kind == "heartbeat":
            progress = message.get("progress")
            if isinstance(progress, int) and not isinstance(progress, bool) \
                    and progress != self._progress.get(rank, 0):
                self._progress[rank] = progress
                with self._lock:
                    self._last_progress = now
        if kind == "exiting":
            with self._lock:
                fresh = rank not in self._exited
                self._exited.add(rank)
            if fresh:
                self.events(Name.RANK_EXITING, host=self._hosts[rank], rank=rank)

    def _hello(self, conn: _Conn, message: dict[str, Any]) -> None:
        rank, host, pid = message.get("rank"), message.get("host"), message.get("pid")
        ws = self.spec.world_size
        reason: Optional[str] = None
        if isinstance(rank, bool) or not isinstance(rank, int):
            reason = f"rank must be an integer, got {rank!r}"
        elif not isinstance(host, str) or not host:
            reason = f"host must be a non-empty string, got {host!r}"
        elif isinstance(pid, bool) or not isinstance(pid, int):
            reason = f"pid must be an integer, got {pid!r}"
        elif not 0 <= rank < ws:
            reason = f"rank {rank} is out of range 0..{ws - 1} (world size {ws})"
        elif self._dead.is_dead(rank):
            reason = f"rank {rank} was declared dead"
        elif rank in self._joined:
            reason = f"rank {rank} already joined"
        elif self.abort_reason() is not None:
            reason = "the cohort did not form in time; the run is being aborted"
        if reason is not None:
            self._report_refused(Name.PEER_REJECTED, conn.peer, reason)
            self._send(conn, {"type": "reject", "reason": reason})
            self._close(conn)
            return
        assert isinstance(rank, int) and isinstance(host, str)
        now = time.monotonic()
        self._pending.remove(conn)
        conn.rank = rank
        self._rank_conn[rank] = conn
        self._hosts[rank] = host
        self._last_frame[rank] = now
        if self._first_hello is None:
            self._first_hello = now
        with self._lock:
            self._joined.add(rank)
            formed_now = not self._formed and len(self._joined) == ws
            if formed_now:
                self._formed = True
                self._formed_at = now
        self.events(Name.RANK_JOINED, host=host, rank=rank, pid=pid, peer=conn.peer)
        if self.on_join is not None:
            self.on_join(rank)
        self._send(conn, {"type": "welcome", "rank": rank, "world_size": ws,
                          "dead": self._dead.ranks(), "formed": formed_now})
        if formed_now:
            self.events(Name.COHORT_FORMED, world_size=ws)
            self._broadcast({"type": "formed", "dead": self._dead.ranks()})

    def _tick(self, now: float) -> None:
        """Drain marked deaths, then staleness, then a wanted shutdown, then timeouts."""
        with self._lock:
            reports, self._reports = self._reports, []
            formed = self._formed
            exited = set(self._exited)
            resumed, self._resume_pending = self._resume_pending, False
            shutdown, self._shutdown_wanted = self._shutdown_wanted, None
        if resumed:
            for rank in self._last_frame:
                self._last_frame[rank] = now
            if self._first_hello is not None:
                self._first_hello = max(self._first_hello, now - 1.0)
        newly: list[tuple[int, Reason]] = []
        silent_ranks: list[tuple[int, Reason]] = []
        for ranks, reason in reports:
            for rank in ranks:
                if rank not in exited and self._dead.declare_dead(rank):
                    newly.append((rank, reason))
        if formed and now >= self._next_scan:
            limit = self.spec.heartbeat_timeout
            self._next_scan = now + min(SILENCE_SCAN_MAX, limit / 20)
            for rank in sorted(self._last_frame):
                if rank in exited or self._dead.is_dead(rank):
                    continue
                silent = now - max(self._last_frame[rank], self._formed_at)
                if silent > limit and self._dead.declare_dead(rank):
                    silence: Reason = {"silent": round(silent, 3), "heartbeat_timeout": limit}
                    newly.append((rank, silence))
                    silent_ranks.append((rank, silence))
        for rank, reason in newly:
            self._declare(rank, reason)
        if self.on_dead is not None:
            for rank, reason in silent_ranks:
                self.on_dead(rank, reason)
        if shutdown is not None:
            self._shutdown_now(shutdown)
        self._check_timeouts(now, formed)

    def _declare(self, rank: int, reason: Reason) -> None:
        ws = self.spec.world_size
        alive = ws - self._dead.dead_count()
        host = self._hosts.get(rank)
        self.events(Name.RANK_DECLARED_DEAD, host=host, rank=rank, reason=dict(reason),
                    alive=alive, world_size=ws)
        self._broadcast({"type": "membership", "dead": self._dead.ranks()})
        conn = self._rank_conn.get(rank)
        if conn is not None:
            # A dead rank is out of the cohort even if it comes back; closing tells it so.
            self._close(conn)

    def _shutdown_now(self, cause: Event) -> None:
        """Broadcast save-and-shutdown, once; the ranks get the policy's reason in words."""
        reason = render(cause)
        with self._lock:
            if self._shutdown is not None:
                return
            self._shutdown = reason
        self.events(Name.SHUTDOWN_BROADCAST, cause=cause_data(cause), reason=reason)
        self._broadcast({"type": "shutdown", "reason": reason, "save": True})

    def _check_timeouts(self, now: float, formed: bool) -> None:
        """Formation deadline (only once someone joined) and the per-connection hello deadline."""
        if not formed and self._first_hello is not None \
                and now - self._first_hello > self.spec.formation_timeout:
            with self._lock:
                missing = [r for r in range(self.spec.world_size) if r not in self._joined]
            self._aborted(event(Name.COHORT_NOT_FORMED, missing=missing,
                                formation_timeout=self.spec.formation_timeout))
        for conn, reason, again in self._pending.expired(now):
            if again:
                self._turn_away(conn, reason)
            else:
                self._drop(conn, reason)
        self._flush_refused(now)

    # -- connection helpers -------------------------------------------------------------------
    def _send(self, conn: _Conn, message: Mapping[str, Any]) -> None:
        if conn.closed:
            return
        frame = encode_frame(self.spec.salt, self.spec.run_id, conn.tx_seq, dict(message))
        conn.tx_seq += 1
        try:
            conn.sock.sendall(frame)
        except OSError as exc:
            self._lost(conn, f"send failed: {exc}")

    def _broadcast(self, message: Mapping[str, Any]) -> None:
        for conn in list(self._rank_conn.values()):
            self._send(conn, message)

    def _turn_away(self, conn: _Conn, reason: str) -> None:
        """Refused for now: a keyed ``reject`` with ``retry`` (a rank dials again; anyone
        else learns nothing from it), then `_drop`. A plain close, not a reset, so a peer
        whose first write is still on its way is not made to fail it."""
        if conn.tx_seq == 0:
            with contextlib.suppress(OSError):
                conn.sock.send(self._busy, socket.MSG_DONTWAIT)
            conn.tx_seq = 1
        self._drop(conn, reason)

    def _drop(self, conn: _Conn, reason: str) -> None:
        """A protocol violation: one warning (rate-limited), then close only this connection."""
        if conn.closed:
            return
        self._report_refused(Name.PEER_DROPPED, conn.peer, reason)
        self._close(conn)

    def _report_refused(self, name: Name, peer: str, reason: str) -> None:
        """The first refusal is a warning line at once; later ones within
        `REJECT_REPORT_INTERVAL` are counted and reported together, so 500 hostile peers
        make one line every few seconds, not 500."""
        now = time.monotonic()
        if self._rejected_at is None or (now - self._rejected_at >= REJECT_REPORT_INTERVAL
                                         and not self._rejected):
            self._rejected_at = now
            self.events(name, peer=peer, reason=reason, refused=1)
            return
        self._count_refused(reason, peer)

    def _count_refused(self, reason: str, peer: str) -> None:
        key = reason.split(" (")[0]
        self._rejected[key] = self._rejected.get(key, 0) + 1
        self._rejected_peer = peer

    def _refusing(self, now: float) -> bool:
        """True while refusals are being counted (a flood is on)."""
        return self._rejected_at is not None and (
            bool(self._rejected) or now - self._rejected_at < REJECT_REPORT_INTERVAL)

    def _flush_refused(self, now: float, *, force: bool = False) -> None:
        if not self._rejected or self._rejected_at is None:
            return
        if not force and now - self._rejected_at < REJECT_REPORT_INTERVAL:
            return
        count = sum(self._rejected.values())
        self.events(Name.PEERS_REFUSED, refused=count, reasons=dict(self._rejected),
                    seconds=round(now - self._rejected_at, 3), last_peer=self._rejected_peer)
        self._rejected = {}
        self._rejected_at = now

    def _lost(self, conn: _Conn, detail: str) -> None:
        """The peer went away; whether its rank died is the supervisor's or staleness's call."""
        if conn.closed:
            return
        rank = conn.rank
        self._close(conn)
        if rank is None:
            if self._refusing(time.monotonic()):
                # A flooder closes what it holds: counted with the refusals, not a line each.
                self._count_refused("closed before its hello", conn.peer)
            else:
                self.events(Name.PEER_CLOSED, peer=conn.peer, detail=detail)
            return
        with self._lock:
            clean = rank in self._exited
        host = self._hosts.get(rank)
        if clean or self._dead.is_dead(rank):
            self.events(Name.RANK_DISCONNECTED, host=host, rank=rank)
        else:
            self.events(Name.RANK_CONNECTION_LOST, host=host, rank=rank, detail=detail)

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._conns.discard(conn)
        self._pending.remove(conn)
        if conn.rank is not None and self._rank_conn.get(conn.rank) is conn:
            del self._rank_conn[conn.rank]
        if self._selector is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()


def _first_frame_in(sock: socket.socket) -> bool:
    """True when the peer's first frame (or what makes it invalid, or its end) is already
    in the socket, so the connection can be judged now; False while nothing whole is."""
    if sock.gettimeout():  # a default timeout set by someone: never wait here
        sock.setblocking(False)
    try:
        head = sock.recv(4 + PRE_AUTH_FRAME, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True  # reset already: `_read` names it
    if not head:
        return True  # closed already
    try:
        return take_frame(bytearray(head), PRE_AUTH_FRAME) is not None
    except FrameError:
        return True
