"""The agent's cohort relay: its ranks reach the coordinator through it (issue 35).

At 1,024 hosts × 8 ranks, a TCP connection and a heartbeat a second per rank cost the
launcher an eighth of a core and more open files than a default box allows. So a rank
started by an agent dials its agent instead (`rank.ENV_AGENT_SOCKET`), and the agent
speaks for all of them on the session it already has: their hellos, exits and shutdown
acks go up as `wire.COHORT_UP`, their heartbeats are folded into one `wire.BEATS` frame
per ``beats_every`` (the spec's: a tenth of the timeouts, 1 to 3 s), and what
the coordinator says comes down as `wire.COHORT_DOWN`, which this module frames for the
rank. docs/protocol.md ("Which path a rank takes") is the contract; to the rank, the
agent *is* the coordinator: the frames on the socket are the coordinator's own
(`rank.encode_frame`, with each connection's own sequence numbers in each direction).

Why a Unix socket in the agent's private run folder: the folder's 0700 keeps every
other local user from connecting at all, and ``SO_PEERCRED`` names the peer's pid, so a
connection is accepted only from a process in the process group of one of this
agent's ranks (each rank leads its own), and is bound to that rank before a byte is
read. A hello naming another rank, or speaking another library version, is refused.

The flood bounds of the coordinator hold here too: at most `MAX_PER_RANK` connections a
rank, a first frame of at most `rank.PRE_AUTH_FRAME` bytes within `HELLO_TIMEOUT`, a
bounded number of accepts and reads per turn, and at most `OUT_LIMIT` bytes waiting for
a rank that does not read. Everything is non-blocking on the agent's one selector
(`hostloop`): the agent forks, so there are no threads, and it wakes for the next beat
through its `deadlines`, never by polling.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import selectors
import shutil
import socket
import stat
import struct
import tempfile
import time
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Set

from fdl_fabric.agent import procs, registry, wire
from fdl_fabric.rank import (
    HEARTBEAT_INTERVAL,
    MAX_FRAME,
    PRE_AUTH_FRAME,
    PROTOCOL,
    FrameError,
    decode_payload,
    encode_frame,
    frame_tag,
    take_frame,
)

#: Seconds a connection has for its hello (the coordinator's own bound).
HELLO_TIMEOUT = 10.0
#: Open connections per rank: a rank dials once (twice across a retry); more is a flood.
MAX_PER_RANK = 2
#: Connections accepted per wake-up: a burst of connects cannot starve the loop.
ACCEPTS_PER_TURN = 8
#: Reads of one connection per wake-up, and bytes per read.
READS_PER_TURN = 4
RECV_SIZE = 64 * 1024
#: Bytes waiting for a rank that does not read before its connection is closed.
OUT_LIMIT = 1 << 20
#: Seconds a refused connection has to take its reject before it is closed anyway.
REJECT_GRACE = 5.0
#: Seconds the listener rests after an accept failed (out of files): no busy loop.
ACCEPT_REST = 0.5
#: The longest socket path ``sun_path`` takes (108 bytes with its NUL).
SUN_PATH_MAX = 107
SOCKET_NAME = "agent.sock"
#: What refuses a hello of another rank library (docs/protocol.md).
LIB_REFUSAL = ("rank library protocol {got}, agent speaks {mine}: the rank imported another "
               "fdl-fabric than the agent's (install the same version on every host)")
#: ``struct ucred``: pid, uid, gid.
_UCRED = struct.Struct("3i")

#: A connection's states: no hello yet; its hello went up (the coordinator's answer is
#: awaited); welcomed; refused by the coordinator (its reject is being written).
NEW, AWAITING, JOINED, ENDING = "new", "awaiting", "joined", "ending"

#: What goes up for the agent (`main.Agent.send`): a frame type and its JSON body.
Send = Callable[[int, Optional[Dict[str, Any]]], None]


class _Conn:
    """One rank's connection to the agent."""

    def __init__(self, sock: socket.socket, rank: int, now: float) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.rank = rank
        self.state = NEW
        self.open = True
        #: When it is closed whatever happens (its hello, or its reject, is overdue).
        self.deadline: Optional[float] = now + HELLO_TIMEOUT
        self.inbuf = bytearray()
        self.out = bytearray()
        self.events = selectors.EVENT_READ
        #: The next sequence number of each direction (rank → agent, agent → rank).
        self.rx = 0
        self.tx = 0
        #: When its hello went up: the coordinator answers hellos in order.
        self.order = 0
        #: The message types forwarded once (exiting, ack_shutdown): bounded up traffic.
        self.told: Set[str] = set()


class CohortRelay:
    """The agent's listening socket for its ranks, their connections and their beats.

    ``send`` puts a frame on the agent's session; ``running`` is rank -> pid of the
    agent's running ranks (each pid is also the rank's process group); ``sel`` is the
    agent's selector."""

    def __init__(self, send: Send, sel: selectors.BaseSelector,
                 running: Callable[[], Dict[int, int]]) -> None:
        self.send = send
        self.sel = sel
        self.running = running
        self.listener: Optional[socket.socket] = None
        self.path: Optional[str] = None
        #: A folder of our own under the temp dir, when the run folder's path is too long.
        self.tempdir: Optional[str] = None
        self.salt = b""
        self.run_id = ""
        self.ranks: FrozenSet[int] = frozenset()
        self.conns: Dict[int, _Conn] = {}
        #: Per rank: when the agent last had a frame from it, and its last progress.
        self.last_frame: Dict[int, float] = {}
        self.progress: Dict[int, int] = {}
        self.next_beat: Optional[float] = None
        #: Seconds between two `wire.BEATS` (the spec's ``beats_every``).
        self.beat_every = HEARTBEAT_INTERVAL
        self.accept_at: Optional[float] = None
        self.hellos = 0
        #: Per rank: rejects delivered whose ``close`` has not come yet (`on_down`).
        self.refused: Dict[int, int] = {}

    # -- the socket -----------------------------------------------------------------------
    def open(self, spec: Dict[str, Any], attempt: int,
             folder: Optional[str] = None) -> Optional[str]:
        """Listen for the spec's ranks; the socket's path, for their environment. None
        when the spec has no envelope (no rank can join) or no socket could be made:
        then the ranks dial the coordinator's TCP port, as a rank started by hand does
        (said once, as an `wire.ERROR` the agent survives)."""
        self.ranks = frozenset(int(e["rank"]) for e in spec["ranks"])
        self.beat_every = beats_every_of(spec.get("beats_every"))
        envelope = wire.decode_envelope(str(spec.get("envelope") or ""))
        if not envelope or not hasattr(socket, "SO_PEERCRED"):
            return None
        try:
            self.salt = bytes.fromhex(str(envelope.get("salt", "00" * 16)))
        except ValueError:
            raise wire.ProtocolError("the envelope's salt is not hex") from None
        self.run_id = str(spec["run_id"])
        try:
            place = os.path.join(procs._run_folder(self.run_id, str(spec["host"]), folder),
                                 f"attempt_{attempt}")
            self.path = self._listen(place)
        except (OSError, ValueError) as exc:
            self.close()
            self.send(wire.ERROR, {"message": f"cannot open the ranks' socket ({exc}): they "
                                              "dial the coordinator directly", "rank": None})
            return None
        return self.path

    def _listen(self, place: str) -> str:
        """Bind the socket in ``place`` (made 0700), or in a fresh 0700 folder of the temp
        dir when that path is too long for ``sun_path``."""
        path = os.path.join(place, SOCKET_NAME)
        if len(os.fsencode(path)) <= SUN_PATH_MAX:
            registry.make_private(place)
        else:
            self.tempdir = tempfile.mkdtemp(prefix="fdlr-")  # 0700
            path = os.path.join(self.tempdir, SOCKET_NAME)
            if len(os.fsencode(path)) > SUN_PATH_MAX:
                raise ValueError(f"no folder with a path short enough for a socket ({path})")
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)  # a killed agent's of this attempt: nobody accepts there
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener = listener
        listener.bind(path)
        self.path = path
        os.chmod(path, 0o600)  # the folder keeps others out; this says so too
        listener.listen(64)
        listener.setblocking(False)
        self.sel.register(listener, selectors.EVENT_READ, self._on_accept)
        return path

    def close(self) -> None:
        """The agent's end: every connection and the listener closed, the socket (and a
        temp folder of ours) removed. Nothing goes up: the ranks' exits say the rest.
        Safe to call again."""
        for conn in list(self.conns.values()):
            self._close(conn, "", report=False)
        self.next_beat = None
        if self.listener is not None:
            self._rest_listener()
            self.listener.close()
            self.listener = None
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            self.path = None
        if self.tempdir is not None:
            shutil.rmtree(self.tempdir, ignore_errors=True)
            self.tempdir = None

    def _rest_listener(self) -> None:
        if self.listener is not None and self.listener.fileno() in self.sel.get_map():
            self.sel.unregister(self.listener)

    # -- connections ----------------------------------------------------------------------
    def _on_accept(self, fd: int = -1, events: int = 0) -> None:
        listener = self.listener
        for _ in range(ACCEPTS_PER_TURN):
            if listener is None:
                return
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                return
            except OSError:  # out of files: rest rather than spin on a ready listener
                self._rest_listener()
                self.accept_at = time.monotonic() + ACCEPT_REST
                return
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        """Keep a connection from a process of one of this agent's ranks (bound to that
        rank), within `MAX_PER_RANK`; close any other at once, unread."""
        rank = self._rank_of_peer(sock)
        if rank is None or sum(c.rank == rank for c in self.conns.values()) >= MAX_PER_RANK:
            sock.close()
            return
        sock.setblocking(False)
        conn = _Conn(sock, rank, time.monotonic())
        self.conns[conn.fd] = conn
        self.sel.register(sock, selectors.EVENT_READ, self._on_conn)

    def _rank_of_peer(self, sock: socket.socket) -> Optional[int]:
        """The rank whose process group the peer is in, if it is this user's; else None."""
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            pid, uid, _gid = _UCRED.unpack(raw)
            if pid <= 0 or uid != os.getuid():  # 0: a pid of another namespace
                return None
            group = os.getpgid(pid)
        except (OSError, struct.error):  # the peer is gone already
            return None
        for rank, leader in self.running().items():
            if leader == group:
                return rank
        return None

    def _on_conn(self, fd: int, events: int) -> None:
        conn = self.conns.get(fd)
        if conn is None:
            return
        if events & selectors.EVENT_WRITE:
            self._flush(conn)
        if conn.open and events & selectors.EVENT_READ:
            self._read(conn)

    def _read(self, conn: _Conn) -> None:
        for _ in range(READS_PER_TURN):
            try:
                data = conn.sock.recv(RECV_SIZE)
            except BlockingIOError:
                return
            except OSError as exc:
                self._close(conn, f"read failed ({exc.strerror or exc})")
                return
            if not data:
                self._close(conn, "the rank closed its connection")
                return
            conn.inbuf += data
            try:
                self._frames(conn)
            except FrameError as exc:
                self._close(conn, str(exc))
            if not conn.open or conn.state == ENDING:
                return

    def _frames(self, conn: _Conn) -> None:
        """Each complete frame of ``conn``, verified (tag, sequence), to its handler."""
        while conn.open and conn.state != ENDING:
            frame = take_frame(conn.inbuf, PRE_AUTH_FRAME if conn.state == NEW else MAX_FRAME)
            if frame is None:
                return
            tag, payload = frame
            if not hmac.compare_digest(tag, frame_tag(self.salt, self.run_id, conn.rx,
                                                      payload)):
                raise FrameError("bad tag")
            conn.rx += 1
            message = decode_payload(payload)
            kind = message["type"]
            handler = _FROM_RANK.get(kind)
            if handler is None:
                raise FrameError(f"unknown message type {kind!r}")
            if conn.state == NEW and kind != "hello":
                raise FrameError(f"first frame must be hello, got {kind!r}")
            if conn.state != NEW:
                self.last_frame[conn.rank] = time.monotonic()
            handler(self, conn, message)

    def _hello(self, conn: _Conn, message: Dict[str, Any]) -> None:
        """A hello of this library's version, naming the rank of its process, goes up;
        the coordinator's answer comes down (`on_down`)."""
        if conn.state != NEW:
            raise FrameError("second hello on one connection")
        lib, rank = message.get("lib"), message.get("rank")
        if type(lib) is not int or lib != PROTOCOL:
            self._refuse(conn, LIB_REFUSAL.format(got=_shown(lib), mine=PROTOCOL))
        elif type(rank) is not int or rank != conn.rank:
            self._refuse(conn, f"rank {_shown(rank)} is not the rank of this process "
                               f"(rank {conn.rank})")
        else:
            conn.state, conn.deadline = AWAITING, None
            self.hellos += 1
            conn.order = self.hellos
            self.last_frame[rank] = time.monotonic()
            self.send(wire.COHORT_UP, {"rank": rank, "msg": message})

    def _heartbeat(self, conn: _Conn, message: Dict[str, Any]) -> None:
        """Not forwarded: its time and progress go into the next `wire.BEATS`."""
        progress = message.get("progress")
        if type(progress) is int:
            self.progress[conn.rank] = progress

    def _forward(self, conn: _Conn, message: Dict[str, Any]) -> None:
        """``exiting`` and ``ack_shutdown`` go up, each once per connection."""
        if message["type"] not in conn.told:
            conn.told.add(message["type"])
            self.send(wire.COHORT_UP, {"rank": conn.rank, "msg": message})

    def _refuse(self, conn: _Conn, reason: str) -> None:
        """The agent's own refusal of a hello: ``reject`` (it fits an empty socket
        buffer, so it is written at once), then close."""
        with contextlib.suppress(OSError):
            conn.sock.send(encode_frame(self.salt, self.run_id, conn.tx,
                                        {"type": "reject", "reason": reason}))
        self._close(conn, reason)

    def _close(self, conn: _Conn, reason: str, report: bool = True) -> None:
        """Close ``conn``; a connection the coordinator knows of (its hello went up and was
        not refused) is reported closed, once."""
        if not conn.open:
            return
        conn.open = False
        del self.conns[conn.fd]
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn.sock)
        conn.sock.close()
        if report and conn.state in (AWAITING, JOINED):
            self.send(wire.COHORT_UP, {"rank": conn.rank, "closed": reason})

    # -- down: what the coordinator says ---------------------------------------------------
    def on_down(self, body: Dict[str, Any]) -> None:
        """A `wire.COHORT_DOWN` frame: a message for one rank (``welcome`` and ``reject``
        answer its oldest hello awaiting one; others go to its joined connection), for
        every joined rank (``rank`` null), or ``close`` of a rank's connections."""
        rank, msg = wire.parse_cohort_down(body, self.ranks)
        if msg is None:
            assert rank is not None
            self._close_rank(rank)
            return
        for conn in self._addressees(rank, msg["type"]):
            self._deliver(conn, msg)

    def _close_rank(self, rank: int) -> None:
        """The coordinator closes rank ``rank``'s connection: after a reject, the refused
        one, which closes once its reject is written (a second hello of a joined rank
        must not cut the first connection); otherwise every one (a rank declared dead)."""
        if self.refused.get(rank):
            self.refused[rank] -= 1
            return
        for conn in [c for c in self.conns.values() if c.rank == rank]:
            self._close(conn, "closed by the coordinator")

    def _addressees(self, rank: Optional[int], kind: str) -> List[_Conn]:
        if rank is not None and kind in ("welcome", "reject"):
            waiting = [c for c in self.conns.values() if c.rank == rank and c.state == AWAITING]
            return [min(waiting, key=lambda c: c.order)] if waiting else []
        return [c for c in self.conns.values()
                if c.state == JOINED and (rank is None or c.rank == rank)]

    def _deliver(self, conn: _Conn, msg: Dict[str, Any]) -> None:
        """Frame ``msg`` with the connection's own sequence and write what the socket
        takes now; the rest waits, bounded (`OUT_LIMIT`)."""
        try:
            conn.out += encode_frame(self.salt, self.run_id, conn.tx, msg)
        except ValueError as exc:  # over rank.MAX_FRAME
            raise wire.ProtocolError(f"cohort message for rank {conn.rank}: {exc}") from None
        conn.tx += 1
        if msg["type"] == "welcome":
            conn.state = JOINED
            if self.next_beat is None:
                self.next_beat = next_beat_at(time.monotonic(), self.beat_every)
        elif msg["type"] == "reject":
            conn.state, conn.deadline = ENDING, time.monotonic() + REJECT_GRACE
            self.refused[conn.rank] = self.refused.get(conn.rank, 0) + 1
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        while conn.out:
            try:
                sent = conn.sock.send(conn.out[:RECV_SIZE * 4])
            except BlockingIOError:
                break
            except OSError as exc:
                self._close(conn, f"write failed ({exc.strerror or exc})")
                return
            del conn.out[:sent]
        if conn.state == ENDING and not conn.out:
            self._close(conn, "refused by the coordinator")
        elif len(conn.out) > OUT_LIMIT:
            self._close(conn, f"the rank left over {OUT_LIMIT} bytes unread")
        else:
            want = (0 if conn.state == ENDING else selectors.EVENT_READ) | \
                (selectors.EVENT_WRITE if conn.out else 0)
            if want != conn.events:
                conn.events = want
                self.sel.modify(conn.sock, want, self._on_conn)

    # -- time: hello bounds, the folded beats ----------------------------------------------
    @property
    def beating(self) -> bool:
        """The beats go up (some rank joined): a frame at least every 1.1 x
        ``beats_every`` (at most 3.3 s, within the smallest ``agent_timeout``, 6 s), so
        the agent's answers to the launcher's pings would say nothing more."""
        return self.next_beat is not None

    def deadlines(self) -> List[float]:
        """Moments the agent's loop must wake for."""
        due = [c.deadline for c in self.conns.values() if c.deadline is not None]
        for more in (self.next_beat, self.accept_at):
            if more is not None:
                due.append(more)
        return due

    def on_time(self, now: float) -> None:
        """Close what is overdue, listen again after a rest, and send the beats when due."""
        for conn in list(self.conns.values()):
            if conn.deadline is not None and now >= conn.deadline:
                self._close(conn, f"no hello within {HELLO_TIMEOUT:g}s" if conn.state == NEW
                            else "the rank did not take its reject")
        if self.accept_at is not None and now >= self.accept_at:
            self.accept_at = None
            if self.listener is not None:
                self.sel.register(self.listener, selectors.EVENT_READ, self._on_accept)
        if self.next_beat is not None and now >= self.next_beat:
            self._beats(now)

    def _beats(self, now: float) -> None:
        """One `wire.BEATS` for every joined rank with an open connection: the seconds
        since its last frame, and its last progress. None joined: the beats stop."""
        joined = sorted({c.rank for c in self.conns.values() if c.state == JOINED})
        if not joined:
            self.next_beat = None
            return
        self.send(wire.BEATS, {"ranks": {
            str(r): [round(max(0.0, now - self.last_frame.get(r, now)), 3),
                     self.progress.get(r, 0)] for r in joined}})
        self.next_beat = next_beat_at(now, self.beat_every)


def next_beat_at(now: float, every: float) -> float:
    """The monotonic moment of the next multiple of ``every`` on the wall clock, at
    least a tenth of ``every`` away. Why the wall clock's grid: every agent of a
    gateway then sends its beats in the same instant (hosts' clocks agree to
    milliseconds under NTP), so the gateway's relay batches them into one packet to the
    launcher, not one per host at scattered moments: at 1,024 hosts the launcher wakes
    32 times per ``every``, not 1,024 (issue 35's idle). A late loop skips to the next
    point: no burst to catch up. Ages stay exact, whatever the clock says: each rank's
    is measured on this host's monotonic clock when the frame is made."""
    wall = time.time()
    ahead = every - wall % every
    if ahead < every / 10:
        ahead += every
    return now + ahead


def beats_every_of(value: Any) -> float:
    """The spec's ``beats_every`` (the launcher derives it from ``heartbeat_timeout``),
    within [a rank's own beat, 10 s]; a rank's beat when absent."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return min(10.0, max(HEARTBEAT_INTERVAL, float(value)))
    return HEARTBEAT_INTERVAL


def _shown(value: Any) -> str:
    """A value a rank sent, as a refusal quotes it (``none`` when absent)."""
    return "none" if value is None else str(value)[:40]


#: What a rank may send, by type (any other closes its connection).
_FROM_RANK: Dict[str, Callable[[CohortRelay, _Conn, Dict[str, Any]], None]] = {
    "hello": CohortRelay._hello, "heartbeat": CohortRelay._heartbeat,
    "exiting": CohortRelay._forward, "ack_shutdown": CohortRelay._forward,
}


__all__ = ["HELLO_TIMEOUT", "LIB_REFUSAL", "MAX_PER_RANK", "OUT_LIMIT", "CohortRelay",
           "next_beat_at"]
