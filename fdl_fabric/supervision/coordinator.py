"""The coordinator inside the launcher: cohort membership and its messages, nothing else.

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

The parts, one concern each: the sockets and the one I/O thread (`connections`), the
accept bounds against a flood (`admission`), the membership rules and records
(`cohort`), heartbeats and silence (`heartbeats`); this module reads and writes the
messages, each kind by its handler in a table. The supervisor thread only reads a few
fields and queues requests; a lock covers those. Nothing here renders words: a
save-and-shutdown's reason is the protocol's sentence (`fdl_fabric.shutdown`).
Standard library only.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

from ..causes import cause_data
from ..events import Event, EventBus, Name, event
from ..rank import MAX_FRAME, FrameError, decode_payload, encode_frame, frame_tag, take_frame
from ..shutdown import shutdown_reason
from .admission import BUSY_REASON, PRE_AUTH_FRAME
from .cohort import CoordinatorSpec as CoordinatorSpec  # the launcher builds it
from .cohort import DeadRanks, Reason, hello_refusal
from .connections import Conn
from .connections import CoordinatorError as CoordinatorError  # the launcher catches it here
from .connections import bind_listener as bind_listener  # pre-flight's port check binds alike
from .heartbeats import Heartbeats
from .relayed import Relayed

#: Sequence numbers around the expected one tried when a tag fails, to name replays.
_DIAGNOSE_WINDOW = 16
#: Payloads above this size are not re-hashed to diagnose a bad tag (bounds the work).
_DIAGNOSE_MAX_PAYLOAD = 64 * 1024
_RANK_MESSAGES = frozenset({"hello", "heartbeat", "exiting", "ack_shutdown", "probe"})


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


class Coordinator(Relayed):
    """The launcher's coordinator; see the module docstring and docs/protocol.md."""

    def __init__(self, spec: CoordinatorSpec, events: EventBus,
                 on_join: Optional[Callable[[int], None]] = None,
                 on_dead: Optional[Callable[[int, Reason], None]] = None,
                 on_abort: Optional[Callable[[Event], None]] = None,
                 rank_hosts: Optional[Mapping[int, str]] = None) -> None:
        super().__init__(spec, events, encode_frame(
            spec.salt, spec.run_id, 0, {"type": "reject", "reason": BUSY_REASON, "retry": True}))
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
        self._resume_pending = False
        # I/O thread only.
        self._hosts: dict[int, str] = {}
        self._beats = Heartbeats()
        #: Ranks through their agents (`relayed`): which host runs each.
        self._relay_init(rank_hosts or {})

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
        return self._beats.last_progress

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

    # -- messages (I/O thread) ----------------------------------------------------------------
    def _frames(self, conn: Conn) -> None:
        """Every whole frame in ``conn.buf``, verified (its tag, its sequence number) and
        handled; a bad one drops this connection only."""
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

    def _handle(self, conn: Conn, message: dict[str, Any]) -> None:
        """One message, by its handler: before a hello only a hello or a probe is one;
        after it, every frame is a sign of life, and some say more."""
        kind = message["type"]
        if kind not in _RANK_MESSAGES:
            raise FrameError(f"unknown message type {kind!r}")
        if conn.rank is None:
            first = _BEFORE_HELLO.get(kind)
            if first is None:
                raise FrameError(f"first frame must be hello, got {kind!r}")
            first(self, conn, message)
            return
        if kind == "hello":
            raise FrameError("second hello on one connection")
        now = self._beats.heard(conn.rank)
        joined = _JOINED.get(kind)
        if joined is not None:
            joined(self, conn.rank, message, now)

    def _probe(self, conn: Conn, message: dict[str, Any]) -> None:
        """An agent's pre-flight: proves this host reaches *this* coordinator (the reply
        is keyed with the run's salt), then goes away quietly."""
        host = message.get("host")
        self.events(Name.PROBE_RECEIVED, host=host if isinstance(host, str) else None,
                    peer=conn.peer, **{"from": host})
        self._send(conn, {"type": "probe_ok"})
        self._close(conn)

    def _heartbeat(self, rank: int, message: dict[str, Any], now: float) -> None:
        self._beats.beat(rank, message, now)

    def _exiting(self, rank: int, message: dict[str, Any], now: float) -> None:
        """A clean exit announced: never counted a death."""
        with self._lock:
            fresh = rank not in self._exited
            self._exited.add(rank)
        if fresh:
            self.events(Name.RANK_EXITING, host=self._hosts[rank], rank=rank)

    def _hello(self, conn: Conn, message: dict[str, Any]) -> None:
        ws = self.spec.world_size
        reason = hello_refusal(message, ws, self._dead, self._joined,
                               self.abort_reason() is not None)
        if reason is not None:
            self._refusals.report(Name.PEER_REJECTED, conn.peer, reason)
            self._send(conn, {"type": "reject", "reason": reason})
            self._close(conn)
            return
        rank, host, pid = message["rank"], message["host"], message["pid"]
        now = time.monotonic()
        self._pending.remove(conn)
        conn.rank = rank
        self._rank_conn[rank] = conn
        self._hosts[rank] = host
        self._beats.joined(rank, now)
        with self._lock:
            self._joined.add(rank)
            formed_now = not self._formed and len(self._joined) == ws
            if formed_now:
                self._formed = True
                self._beats.formed_at = now
        self.events(Name.RANK_JOINED, host=host, rank=rank, pid=pid, peer=conn.peer)
        if self.on_join is not None:
            self.on_join(rank)
        self._send(conn, {"type": "welcome", "rank": rank, "world_size": ws,
                          "dead": self._dead.ranks(), "formed": formed_now})
        if formed_now:
            self.events(Name.COHORT_FORMED, world_size=ws)
            self._broadcast({"type": "formed", "dead": self._dead.ranks()})

    # -- the tick (I/O thread) ------------------------------------------------------------------
    def _tick(self, now: float) -> None:
        """What the agents said for their ranks, marked deaths, then staleness, then a
        wanted shutdown, then timeouts."""
        self._take_relayed(now)
        with self._lock:
            reports, self._reports = self._reports, []
            formed = self._formed
            exited = set(self._exited)
            resumed, self._resume_pending = self._resume_pending, False
            shutdown, self._shutdown_wanted = self._shutdown_wanted, None
        if resumed:
            self._beats.resume(now)
        newly = [(rank, reason) for ranks, reason in reports for rank in ranks
                 if rank not in exited and self._dead.declare_dead(rank)]
        silent = self._beats.scan(now, self.spec.heartbeat_timeout, exited, self._dead) \
            if formed else []
        for rank, reason in newly + silent:
            self._declare(rank, reason)
        if self.on_dead is not None:
            for rank, reason in silent:
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
        reason = shutdown_reason(cause)
        with self._lock:
            if self._shutdown is not None:
                return
            self._shutdown = reason
        self.events(Name.SHUTDOWN_BROADCAST, cause=cause_data(cause), reason=reason)
        self._broadcast({"type": "shutdown", "reason": reason, "save": True})

    def _check_timeouts(self, now: float, formed: bool) -> None:
        """Formation deadline (only once someone joined) and the per-connection hello deadline."""
        if not formed and self._beats.formation_overdue(now, self.spec.formation_timeout):
            with self._lock:
                missing = [r for r in range(self.spec.world_size) if r not in self._joined]
            self._aborted(event(Name.COHORT_NOT_FORMED, missing=missing,
                                formation_timeout=self.spec.formation_timeout))
        for conn, reason, again in self._pending.expired(now):
            if again:
                self._turn_away(conn, reason)
            else:
                self._drop(conn, reason)
        self._refusals.flush(now)

    def _aborted(self, reason: Event) -> None:
        """The run cannot go on; the supervisor is told once."""
        with self._lock:
            if self._abort is not None:
                return
            self._abort = reason
        if self.on_abort is not None:
            self.on_abort(reason)

    def _crashed(self, exc: Exception) -> None:
        self._aborted(event(Name.COORDINATOR_FAILED, error=repr(exc)))

    # -- sending ------------------------------------------------------------------------------
    def _send(self, conn: Conn, message: Mapping[str, Any]) -> None:
        if conn.closed:
            return
        if conn.sock is None:  # a relayed rank: its agent frames it, with its own sequence
            if conn.down is not None:
                conn.down({"rank": conn.via_rank, "msg": dict(message)})
            return
        frame = encode_frame(self.spec.salt, self.spec.run_id, conn.tx_seq, dict(message))
        conn.tx_seq += 1
        try:
            conn.sock.sendall(frame)
        except OSError as exc:
            self._lost(conn, f"send failed: {exc}")

    def _broadcast(self, message: Mapping[str, Any]) -> None:
        """To every joined rank: a socket's each, and one frame per agent for the ranks
        that speak through it (it frames the message for each of them)."""
        told: set[str] = set()
        for conn in list(self._rank_conn.values()):
            if conn.sock is None and conn.down is not None:
                if conn.source not in told:
                    told.add(conn.source)
                    conn.down({"rank": None, "msg": dict(message)})
                continue
            self._send(conn, message)

    def _lost(self, conn: Conn, detail: str) -> None:
        """The peer went away; whether its rank died is the supervisor's or staleness's call."""
        if conn.closed:
            return
        rank = conn.rank
        self._close(conn)
        if rank is None:
            # A flooder's connections close before a hello, thousands a second: one said,
            # the rest counted with the refusals (a line every few seconds), never a
            # record each, whether or not any was refused.
            self._refusals.report(Name.PEER_CLOSED, conn.peer, "closed before its hello",
                                  detail=detail)
            return
        with self._lock:
            clean = rank in self._exited
        host = self._hosts.get(rank)
        if clean or self._dead.is_dead(rank):
            self.events(Name.RANK_DISCONNECTED, host=host, rank=rank)
        else:
            self.events(Name.RANK_CONNECTION_LOST, host=host, rank=rank, detail=detail)


#: Before its hello, a connection may say only these (anything else drops it).
_BEFORE_HELLO: Mapping[str, Callable[[Coordinator, Conn, dict[str, Any]], None]] = {
    "hello": Coordinator._hello,
    "probe": Coordinator._probe,
}

#: What a joined rank's message says beyond "alive" (``ack_shutdown`` and a late
#: ``probe`` say only that).
_JOINED: Mapping[str, Callable[[Coordinator, int, dict[str, Any], float], None]] = {
    "heartbeat": Coordinator._heartbeat,
    "exiting": Coordinator._exiting,
}
