"""The protocol between the launcher and one agent: length-prefixed frames on a byte stream.

It assumes nothing but an ordered byte stream in each direction (the agent's stdin and
stdout), so the same frames can later ride an ``srun`` step's stdio or a TCP dial-in.
docs/protocol.md is the contract; this module is its only implementation, used by both
ends.

Frame::

    +-------------------------+----------+---------------------------+
    | length (u32 big-endian) | type (u8)| body (length - 1 bytes)   |
    +-------------------------+----------+---------------------------+

``length`` counts the type byte and the body, and is at most `MAX_FRAME`; a larger
value is a protocol error as soon as its four bytes arrive, so a peer can never make
the other side allocate more. Bodies are compact UTF-8 JSON objects, except `OUTPUT`,
which is binary (rank output must not pay for JSON escaping).

Before its first frame the agent writes `HANDSHAKE` (which carries the protocol
version). Anything a login shell prints before it (an rc file's banner) is skipped by
the launcher, up to `MAX_NOISE` bytes, and reported; a different version is refused.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Container, Dict, FrozenSet, List, Optional, Tuple, Type

#: Protocol version; the handshake carries it and the spec repeats it. 2: agent
#: heartbeats, targeted and INT-first stops, suspend/resume, stacks, run listing.
VERSION = 2
#: What the agent writes first. The NUL bytes keep it from ever matching rc-file text.
HANDSHAKE_PREFIX = b"\x00\x00FDL-AGENT/"
HANDSHAKE = HANDSHAKE_PREFIX + str(VERSION).encode() + b"\n"
#: Bytes of login-shell noise tolerated before the handshake.
MAX_NOISE = 64 * 1024
#: Largest frame (type + body), in either direction.
MAX_FRAME = 16 * 1024 * 1024
#: Largest piece of one output line forwarded at once; longer lines arrive in pieces.
MAX_LINE_PIECE = 1024 * 1024

_LENGTH = struct.Struct(">I")
_OUTPUT_HEAD = struct.Struct(">IBB")

# -- frame types, launcher -> agent ---------------------------------------------------------
SPEC = 1  #: the run: ranks, env, envelope, kill grace, ... (JSON)
START = 2  #: pre-flight passed everywhere: spawn the ranks
SIGNAL = 3  #: {"signal": "USR1", "rank": null | int}: forward to one rank's group or all
#: {"signal": "TERM" | "INT", "rank": null | int}: graceful stop of every rank (or one):
#: the signal now (INT: TERM `INT_GRACE` later), KILL after the kill grace
STOP = 4
KILL = 5  #: KILL every rank's group now
PROBE = 6  #: {"gpus": true}: report facts needed before the plan exists
SWEEP = 7  #: {"runs": [...], "cluster": k, "all": bool, "pattern": p}: cleanup only
PING = 8  #: {}: the launcher is alive (renews the spec's ``lease``)
SUSPEND = 9  #: {}: the launcher is suspended (Ctrl-Z): the lease waits until RESUME
RESUME = 10  #: {}: the launcher runs again: the lease counts again from now
#: {"id": n, "run": null | id}: every rank's stack (the run's, or a recorded run's)
STACKS = 11
LIST = 12  #: {"cluster": null | key}: the runs recorded on this host
#: {"path", "tree"}: does this host have the synced code's tree? Answered by SYNCED (it
#: has it) or SYNC_NEED {"manifest": true} (`fdl_fabric.agent.codestore`)
SYNC = 13
#: binary: entry u32 | flags u8 (1: last piece) | bytes: a piece of an object it asked for
SYNC_DATA = 14
#: {"command", "dir", "root", "key", "top", "timeout", "env"}: run setup: in the tree
#: (`fdl_fabric.agent.setupstep`), unless this host did it for this key
SETUP = 15
#: {"entries": [[rel, kind, mode, size, sha | link, mtime_ns], ...]}: the manifest, the
#: same frame for every host that lacks the tree; answered by SYNC_NEED with what it lacks
SYNC_MANIFEST = 16
#: {"rank": r | null, "msg": {...}} or {"rank": r, "close": true}: a coordinator message
#: for one of this host's ranks (null: every joined one), which the agent frames for it
#: on its local channel (`fdl_fabric.agent.cohortrelay`; docs/protocol.md)
COHORT_DOWN = 17

#: Seconds between the launcher's pings to each agent during a run.
PING_INTERVAL = 2.0
#: The shortest lease an agent accepts: a few pings may be late without stopping a run.
LEASE_MIN = 3 * PING_INTERVAL
#: An agent answers a ping with a heartbeat when it sent nothing else for this long (a
#: busy agent's output already says it is alive), and sends one this often inside its
#: blocking steps. The launcher calls an agent unresponsive after ``agent_timeout``
#: seconds without a frame.
HEARTBEAT_INTERVAL = 1.0
#: The shortest ``agent_timeout``: three pings may go unanswered without losing a host,
#: and the agent's longest blocking step (the pre-flight's 3 s dial) fits well inside it.
AGENT_TIMEOUT_MIN = 3 * PING_INTERVAL
#: Seconds between the SIGINT of a first Ctrl-C and the TERM that follows it (or half the
#: kill grace, if that is shorter): long enough for Python to print where each rank was.
INT_GRACE = 1.0

# -- frame types, agent -> launcher ---------------------------------------------------------
HELLO = 64  #: {"version", "pid", "python", "system", "machine"}
FACTS = 65  #: {"gpus": [int] | null, "gpu_error": str}
PREFLIGHT = 66  #: {"values": {name: value}}: raw facts; verdicts are the launcher's
SWEPT = 67  #: {"stopped": [...], "leftovers": [...], "errors": [...], "stale": n}
SPAWNED = 68  #: {"rank", "pid"}: the rank's pid, also its process group and session
OUTPUT = 69  #: binary: rank u32, stream u8 (1 out, 2 err), flags u8, then the bytes
EXITED = 70  #: {"rank", "code": int | null, "signal": int | null, "error": text?}
VERIFIED = 71  #: {"stopped": [...], "remaining": [...]}: nothing of the run is left
ERROR = 72  #: {"message", "rank": int | null}: a problem the agent reports and survives
SPAWN_FAILED = 73  #: {"rank", "reason"}: the host's ranks were not (all) started
DONE = 74  #: {}: the agent is about to exit normally
#: {"signal": "TERM", "stopping": bool, "forwarded": bool}: a signal from outside reached
#: the agent (scancel, a Slurm time limit, an operator's kill); stopping: it is stopping
#: its ranks; forwarded: it passed a USR1/USR2 on to them (not under Slurm, which
#: delivers it to every process of the step itself)
SIGNALED = 75
HEARTBEAT = 76  #: {}: the agent is alive (the answer to a ping, when it had sent nothing else)
#: {"id", "run", "ranks": {rank: {"pid", "host", "py_spy", "error", "proc"}}}
STACKS_REPORT = 77
RUNS = 78  #: {"runs": [{"run", "cluster", "host", "live", "launcher", "ranks", ...}]}
#: {"manifest": true} (send it), {"tree", "need": [entry, ...], "bytes", "free", "root"}
#: or {"error"}
SYNC_NEED = 79
#: {"tree", "dir", "received", "files", "removed"} or {"error"}: the tree is in place
SYNCED = 80
SETUP_OUTPUT = 81  #: binary: stream u8 (1 out, 2 err), then the bytes setup wrote
#: {"skipped", "code", "signal", "timed_out", "tail", "made", "seconds"} or {"error"}
SETUP_DONE = 82
#: {"rank": r, "msg": {...}} (a verified hello, exiting or ack_shutdown of the agent's rank
#: r) or {"rank": r, "closed": reason}: the agent speaks for its ranks to the coordinator
COHORT_UP = 83
#: {"ranks": {"<r>": [age, progress]}}: every joined rank's silence and progress, folded
#: into one frame per host per `HEARTBEAT_INTERVAL`
BEATS = 84

DOWN_TYPES: FrozenSet[int] = frozenset({SPEC, START, SIGNAL, STOP, KILL, PROBE, SWEEP, PING,
                                        SUSPEND, RESUME, STACKS, LIST, SYNC, SYNC_DATA,
                                        SETUP, SYNC_MANIFEST, COHORT_DOWN})
UP_TYPES: FrozenSet[int] = frozenset({HELLO, FACTS, PREFLIGHT, SWEPT, SPAWNED, OUTPUT, EXITED,
                                      VERIFIED, ERROR, SPAWN_FAILED, DONE, SIGNALED, HEARTBEAT,
                                      STACKS_REPORT, RUNS, SYNC_NEED, SYNCED, SETUP_OUTPUT,
                                      SETUP_DONE, COHORT_UP, BEATS})

STDOUT = 1
STDERR = 2
#: OUTPUT flag: the bytes do not end with a newline (a long line's piece, or a last line).
PARTIAL = 1

#: Signals a launcher may forward with SIGNAL.
SIGNALS = ("TERM", "KILL", "INT", "HUP", "USR1", "USR2")


class ProtocolError(Exception):
    """The peer broke the protocol; the stream cannot be trusted any more."""


def frame(kind: int, body: bytes = b"") -> bytes:
    """One frame of ``kind`` with ``body``."""
    size = len(body) + 1
    if size > MAX_FRAME:
        raise ProtocolError(f"frame of {size} bytes exceeds the {MAX_FRAME}-byte limit")
    return _LENGTH.pack(size) + bytes((kind,)) + body


#: Compact JSON, one encoder for every frame (``json.dumps`` with options makes one a call).
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def message(kind: int, obj: Optional[Dict[str, Any]] = None) -> bytes:
    """A frame whose body is a JSON object."""
    return frame(kind, _COMPACT(obj or {}).encode("utf-8"))


def output(rank: int, stream: int, data: bytes, partial: bool) -> bytes:
    """An OUTPUT frame: a chunk of whole lines (or one piece of a long line)."""
    head = _OUTPUT_HEAD.pack(rank, stream, PARTIAL if partial else 0)
    return frame(OUTPUT, head + data)


def parse_output(body: bytes) -> Tuple[int, int, bool, bytes]:
    """(rank, stream, partial, data) of an OUTPUT body."""
    if len(body) < _OUTPUT_HEAD.size:
        raise ProtocolError("output frame too short")
    rank, stream, flags = _OUTPUT_HEAD.unpack_from(body)
    if stream not in (STDOUT, STDERR):
        raise ProtocolError(f"output frame names stream {stream}")
    return rank, stream, bool(flags & PARTIAL), body[_OUTPUT_HEAD.size:]


def parse_json(body: bytes) -> Dict[str, Any]:
    """The JSON object of a frame body."""
    try:
        obj = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError("frame body is not UTF-8 JSON") from None
    if not isinstance(obj, dict):
        raise ProtocolError("frame body is not a JSON object")
    return obj


def parse_cohort_down(body: Dict[str, Any], ranks: Container[int]
                      ) -> Tuple[Optional[int], Optional[Dict[str, Any]]]:
    """A `COHORT_DOWN` body checked: ``(rank, msg)`` for a message to rank ``rank`` (None:
    every joined rank of the host), ``(rank, None)`` to close that rank's connections.
    ``ranks``: the ranks this host runs; any other is a protocol error."""
    rank = body.get("rank")
    if rank is not None and (type(rank) is not int or rank not in ranks):
        raise ProtocolError(f"cohort frame for rank {rank!r}, not a rank of this host")
    if "close" in body:
        if body["close"] is not True or rank is None or "msg" in body:
            raise ProtocolError(f"malformed cohort close: {body!r:.200}")
        return rank, None
    msg = body.get("msg")
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ProtocolError(f"cohort frame without a message: {body!r:.200}")
    return rank, msg


class Reader:
    """Turns the bytes of one direction into frames, with the limits enforced.

    ``handshake`` is true on the launcher's side: bytes before `HANDSHAKE` are noise
    (kept in `noise`, up to `MAX_NOISE`), and a handshake with another version is a
    `ProtocolError` that says which. ``allowed`` is the set of frame types this side
    may receive.
    """

    #: What a subclass for another framing over the same rules changes (`relay.Reader`):
    #: its error, its handshake line, its largest frame, and its name in messages.
    ERROR: Type[Exception] = ProtocolError
    PREFIX = HANDSHAKE_PREFIX
    LINE = HANDSHAKE
    LIMIT = MAX_FRAME
    WHAT = "agent handshake"
    SPEAKS = "agent speaks protocol"

    def __init__(self, allowed: FrozenSet[int], *, handshake: bool = False) -> None:
        self._buf = bytearray()
        self._allowed = allowed
        self._waiting = handshake
        self.noise = b""

    @property
    def synced(self) -> bool:
        """True once the handshake was seen (always true without one)."""
        return not self._waiting

    def feed(self, data: bytes) -> List[Tuple[int, bytes]]:
        """Add ``data``; return every complete frame, in order."""
        self._buf += data
        if self._waiting and not self._sync():
            return []
        frames: List[Tuple[int, bytes]] = []
        buf = self._buf
        start = 0
        end = len(buf)
        while end - start >= 5:
            (size,) = _LENGTH.unpack_from(buf, start)
            if size > self.LIMIT or size < 1:
                raise self.ERROR(f"frame of {size} bytes (limit {self.LIMIT})")
            kind = buf[start + 4]
            if kind not in self._allowed:
                raise self.ERROR(f"unexpected frame type {kind}")
            stop = start + 4 + size
            if stop > end:
                break
            frames.append((kind, bytes(buf[start + 5:stop])))
            start = stop
        if start:
            del buf[:start]
        return frames

    def _sync(self) -> bool:
        prefix, line_wanted = self.PREFIX, self.LINE
        at = self._buf.find(prefix)
        if at < 0:
            # Keep only what could still be the start of the prefix.
            keep = len(prefix) - 1
            if len(self._buf) > keep:
                self.noise += bytes(self._buf[:-keep])
                del self._buf[:-keep]
            if len(self.noise) > MAX_NOISE:
                raise self.ERROR(f"no {self.WHAT} within {MAX_NOISE} bytes of output "
                                 f"(the login shell printed {self.noise[:120]!r}...)")
            return False
        newline = self._buf.find(b"\n", at)
        if newline < 0:
            if len(self._buf) - at > len(line_wanted) + 16:
                raise self.ERROR(f"malformed {self.WHAT}")
            return False
        self.noise += bytes(self._buf[:at])
        line = bytes(self._buf[at:newline + 1])
        if line != line_wanted:
            got = line[len(prefix):].strip().decode("ascii", "replace")
            mine = line_wanted[len(prefix):].strip().decode("ascii", "replace")
            raise self.ERROR(f"{self.SPEAKS} version {got!r}, this launcher speaks {mine}")
        del self._buf[:newline + 1]
        self._waiting = False
        return True


def decode_envelope(text: str) -> Dict[str, Any]:
    """The spec's ``envelope`` (hex of a JSON object: the salt), or {} when there is none."""
    if not text:
        return {}
    import json

    try:
        obj = json.loads(bytes.fromhex(text).decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"the envelope is not hex JSON: {exc}") from None
    return obj if isinstance(obj, dict) else {}
