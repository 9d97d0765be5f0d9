"""The relay: one process on a gateway host that carries many leaf agents over its own
stdin and stdout (the gateway tree, `fdl_fabric.planning.tree`).

The launcher starts it as a second session on the gateway's SSH connection, with the
same bundle as an agent (``bundle.remote_command("relay")``). For each leaf the launcher
sends ``OPEN`` with the leaf's ``ssh ... <target> <agent command>`` argv; the relay
spawns it with pipes, writes to its stdin what the launcher sends for it (``DATA``,
``PAYLOAD``), closes that stdin on ``EOF`` (the leaf agent's leash) and kills it on
``KILL``. What the leaves write comes back batched: every `BATCH_INTERVAL` (50 ms) one
``BATCH`` frame carries the bytes every leaf wrote meanwhile, each leaf's bytes in their
order and exactly as written; a leaf agent's frame that matters at once (an exit, a
spawn failure, an error, a signal, its end: `URGENT`) is followed at once by a flush.
``CLOSED`` says a leaf's ssh ended, with its status, after the last of its bytes.

Bounded everywhere: a leaf whose bytes waiting to go up pass `LEAF_HIGH` is not read
until they went (its agent then slows its ranks, as a slow launcher does), nothing is
batched while more than `UP_HIGH` waits for the launcher, and a leaf that does not read
its stdin while more than `DOWN_MAX` waits for it is killed.

The leash, one level up: when the relay's stdin reaches EOF (the launcher is gone, the
connection dropped, or the launcher closed it), or it gets TERM, HUP or INT, it closes
every leaf's stdin (each leaf agent then stops its ranks, as on a dropped connection),
and exits once every ssh has ended, sending them TERM after `DRAIN_BOUND` seconds and
KILL after `KILL_AFTER` more. If the relay itself is SIGKILLed, its pipes close with it:
every leaf's ssh sees EOF on its stdin just the same.

The mux framing (docs/protocol.md, "Relay") is this module's, used by both ends:
standard library only, like the rest of the agent, so the launcher imports it too.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import struct
import subprocess
import sys
import time
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

from fdl_fabric.agent import wire
from fdl_fabric.agent.feeder import FEED_LOW, Feeder, FrameCut, objects_of

#: Version of the mux protocol, carried by the handshake.
VERSION = 1
#: What the relay writes first (after any login-shell noise); the NULs never match text.
HANDSHAKE_PREFIX = b"\x00\x00FDL-RELAY/"
HANDSHAKE = HANDSHAKE_PREFIX + str(VERSION).encode() + b"\n"
#: Largest mux frame (type + body) in either direction: an agent payload or an agent
#: frame fits with room to spare.
MAX_FRAME = 2 * wire.MAX_FRAME
#: What the launcher puts in one DATA frame at most.
DATA_CHUNK = 1024 * 1024

# -- frame types, launcher -> relay ----------------------------------------------------------
OPEN = 1  #: leaf u32 | {"argv": [...]}: spawn the leaf's ssh with pipes
DATA = 2  #: leaf u32 | bytes: to the leaf's stdin
EOF = 3  #: leaf u32: close the leaf's stdin once what came before it is written (the leash)
KILL = 4  #: leaf u32: SIGKILL the leaf's ssh (and its process group)
BLOB = 5  #: bytes: the agent payload, kept for PAYLOAD (sent once per relay)
PAYLOAD = 6  #: leaf u32: write the kept payload to the leaf's stdin
#: leaf u32 | {"root", "need": [entry, ...]}: feed the leaf a sync's objects (entries of
#: the kept manifest) from this host's store at root (`fdl_fabric.agent.feeder`)
SERVE = 7
KEEP = 8  #: bytes: an agent frame many leaves get the same (a sync's manifest), kept
REPLAY = 9  #: leaf u32: write the kept agent frame to the leaf's stdin

# -- frame types, relay -> launcher ----------------------------------------------------------
HELLO = 64  #: {"version", "pid", "python"}: the relay runs
BATCH = 65  #: entries, each leaf u32 | stream u8 (1 stdout, 2 stderr) | length u32 | bytes
CLOSED = 66  #: leaf u32 | {"code": int|null, "signal": int|null, "error": str}
ERROR = 67  #: {"message"}: what the relay has to say before it exits (a protocol error)

DOWN_TYPES: FrozenSet[int] = frozenset({OPEN, DATA, EOF, KILL, BLOB, PAYLOAD, SERVE, KEEP,
                                        REPLAY})
UP_TYPES: FrozenSet[int] = frozenset({HELLO, BATCH, CLOSED, ERROR})

STDOUT = 1
STDERR = 2

#: Seconds a leaf's bytes may wait to be batched with the others'.
BATCH_INTERVAL = 0.05
#: Agent frames flushed at once: what the supervisor acts on.
URGENT: FrozenSet[int] = frozenset({wire.EXITED, wire.SPAWN_FAILED, wire.ERROR,
                                    wire.SIGNALED, wire.DONE, wire.VERIFIED})
#: Agent frames that may wait `LAZY_INTERVAL`: a heartbeat only says "alive", and the
#: launcher gives an agent at least `wire.AGENT_TIMEOUT_MIN` to say it. At 1,024 hosts
#: the heartbeats alone made every relay send 20 batches a second.
LAZY: FrozenSet[int] = frozenset({wire.HEARTBEAT})
#: Seconds bytes that are only `LAZY` frames may wait to be batched.
LAZY_INTERVAL = 0.5
#: A leaf's bytes waiting to go up beyond which it is not read.
LEAF_HIGH = 1024 * 1024
#: Bytes waiting for the launcher beyond which nothing more is batched.
UP_HIGH = 4 * 1024 * 1024
#: Bytes waiting for a leaf's stdin beyond which the leaf is killed (it does not read).
DOWN_MAX = wire.MAX_FRAME + 4 * 1024 * 1024
#: Bytes read from a pipe at once, and a leaf stream's share of one batch round.
READ_SIZE = 64 * 1024
ENTRY_MAX = 256 * 1024
#: Body bytes of one BATCH frame, about (one more entry may end it).
BATCH_MAX = 1024 * 1024
#: Bytes written to the launcher per write call.
WRITE_SIZE = 256 * 1024
#: After the relay's upstream is gone: seconds the leaves get to end, then TERM, then KILL.
DRAIN_BOUND = 10.0
KILL_AFTER = 2.0

EXIT_OK = 0
EXIT_PROTOCOL = 3
EXIT_INTERNAL = 4

_LENGTH = struct.Struct(">I")
_LEAF = struct.Struct(">I")
_ENTRY = struct.Struct(">IBI")


class MuxError(Exception):
    """The peer broke the mux protocol."""


# -- framing (both ends) -----------------------------------------------------------------------
def frame(kind: int, body: bytes = b"") -> bytes:
    size = len(body) + 1
    if size > MAX_FRAME:
        raise MuxError(f"mux frame of {size} bytes exceeds the {MAX_FRAME}-byte limit")
    return _LENGTH.pack(size) + bytes((kind,)) + body


def leaf_frame(kind: int, leaf: int, body: bytes = b"") -> bytes:
    return frame(kind, _LEAF.pack(leaf) + body)


def json_body(obj: Dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def open_frame(leaf: int, argv: List[str]) -> bytes:
    return leaf_frame(OPEN, leaf, json_body({"argv": list(argv)}))


def data_frames(leaf: int, data: bytes) -> List[bytes]:
    """DATA frames for ``data``, at most `DATA_CHUNK` bytes each."""
    view = memoryview(data)
    return [leaf_frame(DATA, leaf, bytes(view[i:i + DATA_CHUNK]))
            for i in range(0, len(data), DATA_CHUNK)]


def closed_frame(leaf: int, code: Optional[int], sig: Optional[int], error: str = "") -> bytes:
    return leaf_frame(CLOSED, leaf, json_body({"code": code, "signal": sig, "error": error}))


def batch_frame(entries: List[Tuple[int, int, bytes]]) -> bytes:
    parts = []
    for leaf, stream, data in entries:
        parts.append(_ENTRY.pack(leaf, stream, len(data)))
        parts.append(data)
    return frame(BATCH, b"".join(parts))


def parse_leaf(body: bytes) -> Tuple[int, bytes]:
    """(leaf, the rest) of a frame addressed to a leaf."""
    if len(body) < _LEAF.size:
        raise MuxError("frame too short for a leaf id")
    return _LEAF.unpack_from(body)[0], body[_LEAF.size:]


def parse_batch(body: bytes) -> List[Tuple[int, int, bytes]]:
    """The (leaf, stream, bytes) entries of a BATCH body, in order."""
    out: List[Tuple[int, int, bytes]] = []
    at, end = 0, len(body)
    while at < end:
        if end - at < _ENTRY.size:
            raise MuxError("batch entry cut short")
        leaf, stream, size = _ENTRY.unpack_from(body, at)
        at += _ENTRY.size
        if stream not in (STDOUT, STDERR) or at + size > end:
            raise MuxError(f"bad batch entry (stream {stream}, {size} bytes)")
        out.append((leaf, stream, body[at:at + size]))
        at += size
    return out


def parse_json(body: bytes) -> Dict[str, Any]:
    try:
        obj = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise MuxError("frame body is not UTF-8 JSON") from None
    if not isinstance(obj, dict):
        raise MuxError("frame body is not a JSON object")
    return obj


class Reader(wire.Reader):
    """Mux frames from a byte stream, with `wire.Reader`'s rules and limits. With
    ``handshake`` (the launcher's side), bytes before `HANDSHAKE` are noise, up to
    `wire.MAX_NOISE`, kept in ``noise``."""

    ERROR = MuxError
    PREFIX = HANDSHAKE_PREFIX
    LINE = HANDSHAKE
    LIMIT = MAX_FRAME
    WHAT = "relay handshake"
    SPEAKS = "relay speaks mux"


class FrameWatch:
    """Follows a leaf agent's stdout without changing a byte: skips to the agent's
    handshake, then tracks frame boundaries by their headers (`wire`'s format), and says
    when a frame of an `URGENT` type has completed. A stream that breaks the format is
    no longer followed (the launcher will say what is wrong with it)."""

    def __init__(self) -> None:
        self.synced = False
        self.broken = False
        self._tail = b""
        self._head = bytearray()
        self._kind = -1  # the frame whose body is being skipped; -1 while in a header
        self._need = 0
        #: Whether the bytes of the last `feed` all belonged to `LAZY` frames.
        self.lazy = False

    def feed(self, data: bytes) -> bool:
        """Follow ``data``; True when an urgent frame ended in it."""
        self.lazy = False
        if self.broken:
            return False
        if not self.synced:
            buf = self._tail + data
            at = buf.find(wire.HANDSHAKE)
            if at < 0:
                self._tail = buf[-(len(wire.HANDSHAKE) - 1):]
                return False
            self.synced = True
            self._tail = b""
            data = buf[at + len(wire.HANDSHAKE):]
        urgent = False
        lazy = bool(data) and (self._kind < 0 or self._kind in LAZY)
        i, n = 0, len(data)
        while i < n:
            if self._kind < 0:
                take = min(5 - len(self._head), n - i)
                self._head += data[i:i + take]
                i += take
                if len(self._head) < 5:
                    break
                (size,) = _LENGTH.unpack_from(self._head)
                kind = self._head[4]
                self._head.clear()
                if size < 1 or size > wire.MAX_FRAME:
                    self.broken = True
                    return True  # flush what there is: the launcher will see the fault
                self._kind, self._need = kind, size - 1
                lazy = lazy and kind in LAZY
            take = min(self._need, n - i)
            i += take
            self._need -= take
            if self._need == 0:
                urgent = urgent or self._kind in URGENT
                self._kind = -1
        self.lazy = lazy and not urgent
        return urgent


class Batcher:
    """What the leaves wrote, waiting to go up: each leaf's streams in order, exactly as
    read. Due `BATCH_INTERVAL` after its oldest byte, or at once (`urgent`) when a leaf
    agent's frame in `URGENT` completed or a leaf's stream ended; `take` then turns
    everything pending into BATCH frames, one entry per leaf and stream that has bytes."""

    def __init__(self, interval: float = BATCH_INTERVAL) -> None:
        self.interval = interval
        self.queues: Dict[int, Dict[int, bytearray]] = {}
        self.watches: Dict[int, FrameWatch] = {}
        self.size = 0
        self.flush_at: Optional[float] = None
        self.urgent = False

    def open(self, leaf: int) -> None:
        self.queues[leaf] = {STDOUT: bytearray(), STDERR: bytearray()}
        self.watches[leaf] = FrameWatch()

    def drop(self, leaf: int) -> None:
        queues = self.queues.pop(leaf, None)
        self.watches.pop(leaf, None)
        if queues is not None:
            self.size -= sum(len(q) for q in queues.values())

    def add(self, leaf: int, stream: int, data: bytes, now: float) -> None:
        watch = self.watches[leaf]
        if stream == STDOUT and watch.feed(data):
            self.urgent = True
        self.queues[leaf][stream] += data
        self.size += len(data)
        due = now + (LAZY_INTERVAL if stream == STDOUT and watch.lazy else self.interval)
        if self.flush_at is None or due < self.flush_at:
            self.flush_at = due

    def hurry(self) -> None:
        """Flush at once what there is (a leaf's last bytes)."""
        if self.size:
            self.urgent = True

    def backlog(self, leaf: int) -> int:
        queues = self.queues.get(leaf)
        return 0 if queues is None else len(queues[STDOUT]) + len(queues[STDERR])

    def wake_at(self) -> Optional[float]:
        """When the next flush is due (None: nothing pending)."""
        if not self.size:
            return None
        if self.urgent or self.flush_at is None:
            return 0.0
        return self.flush_at

    def due(self, now: float) -> bool:
        at = self.wake_at()
        return at is not None and now >= at

    def take(self, up: bytearray, limit: Optional[int] = None) -> None:
        """BATCH frames onto ``up`` while anything is pending and ``up`` is under ``limit``;
        each round takes at most `ENTRY_MAX` of each leaf stream, so one busy leaf never
        holds the others' bytes back, and a frame's body stays near `BATCH_MAX`."""
        while self.size and (limit is None or len(up) < limit):
            entries: List[Tuple[int, int, bytes]] = []
            body = 0
            for leaf, queues in self.queues.items():
                for stream in (STDOUT, STDERR):
                    buf = queues[stream]
                    if not buf:
                        continue
                    chunk = bytes(buf[:ENTRY_MAX])
                    del buf[:len(chunk)]
                    self.size -= len(chunk)
                    entries.append((leaf, stream, chunk))
                    body += len(chunk) + _ENTRY.size
                    if body >= BATCH_MAX:
                        up += batch_frame(entries)
                        entries, body = [], 0
            if entries:
                up += batch_frame(entries)
        if not self.size:
            self.flush_at, self.urgent = None, False

    def clear(self) -> None:
        for queues in self.queues.values():
            for q in queues.values():
                q.clear()
        self.size = 0
        self.flush_at, self.urgent = None, False


# -- the relay process ---------------------------------------------------------------------------
class Leaf:
    """One leaf's ssh and what waits for it, or from it."""

    def __init__(self, lid: int, proc: subprocess.Popen[bytes]) -> None:
        self.id = lid
        self.proc = proc
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        self.files: Dict[int, Any] = {}
        self.stdin: Optional[int] = proc.stdin.fileno()
        self.streams: Dict[int, int] = {proc.stdout.fileno(): STDOUT,
                                        proc.stderr.fileno(): STDERR}
        for f in (proc.stdin, proc.stdout, proc.stderr):
            self.files[f.fileno()] = f
            os.set_blocking(f.fileno(), False)
        self.down = bytearray()
        #: Where the launcher's agent frames end, and a sync being fed from this host.
        self.cut = FrameCut()
        self.feed: Optional[Feeder] = None
        self.eof = False
        self.status: Optional[int] = None
        self.error = ""

    @property
    def finished(self) -> bool:
        return self.status is not None and not self.streams


def _noop(signum: int, frame_: Any) -> None:
    return None


class Relay:
    """The relay's select loop; `run` returns its exit status. Single-threaded, like the
    agent: one ``select`` over its input, its output, every leaf's pipes and a signal
    wake-up pipe (SIGCHLD reaps leaves, TERM/HUP/INT act as EOF)."""

    def __init__(self, rfd: int = 0, wfd: int = 1) -> None:
        self.rfd = rfd
        self.wfd = wfd
        self.reader = Reader(DOWN_TYPES)
        self.sel = selectors.DefaultSelector()
        self.leaves: Dict[int, Leaf] = {}
        self.blob: Optional[bytes] = None
        self.kept: Optional[bytes] = None
        self.up = bytearray()
        self.upstream = True
        self.output_open = True
        self.batch = Batcher()
        self.children_exited = False
        self.term_at: Optional[float] = None
        self.kill_at: Optional[float] = None
        self.give_up_at: Optional[float] = None
        self.exit_code = EXIT_OK
        self._wake_r, self._wake_w = os.pipe()

    # -- setup and loop ------------------------------------------------------------------------
    def _install(self) -> None:
        for fd in (self.rfd, self.wfd, self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in (signal.SIGCHLD, signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _noop)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)

    def run(self) -> int:
        self._install()
        self.up += HANDSHAKE + frame(HELLO, json_body({
            "version": VERSION, "pid": os.getpid(),
            "python": "{}.{}.{}".format(*sys.version_info[:3])}))
        try:
            while self.upstream or self.leaves:
                self.step()
        except Exception:
            import traceback

            self.exit_code = EXIT_INTERNAL
            self.up += frame(ERROR, json_body(
                {"message": "relay crashed: " + traceback.format_exc(limit=5).strip()}))
        self._flush_all()
        self._write_blocking(5.0)
        return self.exit_code

    def step(self) -> None:
        self._register()
        for key, _ in self.sel.select(self._timeout()):
            self._dispatch(key)
        now = time.monotonic()
        if self.children_exited:
            self.children_exited = False
            self._reap()
        self._deadlines(now)
        self._flush(now)
        self._close_finished()
        if self.up and self.output_open:
            self._write_up()

    def _timeout(self) -> Optional[float]:
        now = time.monotonic()
        due: List[float] = [t for t in (self.term_at, self.kill_at, self.give_up_at)
                            if t is not None]
        flush = self.batch.wake_at()
        if flush is not None and len(self.up) < UP_HIGH:
            due.append(flush)
        return max(0.0, min(due) - now) if due else None

    def _register(self) -> None:
        """What the loop waits for, in step with each leaf's state."""
        want: Dict[int, Tuple[int, Any]] = {self._wake_r: (selectors.EVENT_READ, "wake")}
        if self.upstream:
            want[self.rfd] = (selectors.EVENT_READ, "in")
        if self.up and self.output_open:
            want[self.wfd] = (selectors.EVENT_WRITE, "out")
        for leaf in self.leaves.values():
            self._top_up(leaf)
            if leaf.stdin is not None and leaf.down:
                want[leaf.stdin] = (selectors.EVENT_WRITE, leaf)
            if self.batch.backlog(leaf.id) < LEAF_HIGH:
                for fd in leaf.streams:
                    want[fd] = (selectors.EVENT_READ, leaf)
        current = self.sel.get_map()
        for key in [k for k in current.values() if k.fd not in want]:
            self.sel.unregister(key.fd)
        for wanted, (events, data) in want.items():
            if wanted not in current:
                self.sel.register(wanted, events, data)

    def _dispatch(self, key: selectors.SelectorKey) -> None:
        what = key.data
        if what == "in":
            self._read_input()
        elif what == "out":
            self._write_up()
        elif what == "wake":
            self._read_signals()
        elif isinstance(what, Leaf):
            if key.fd == what.stdin:
                self._write_leaf(what)
            elif key.fd in what.streams:
                self._read_leaf(what, key.fd)

    def _close(self, leaf: Leaf, fd: int) -> None:
        """Close one of a leaf's pipes (unregistered first: its number may be reused)."""
        if fd in self.sel.get_map():
            self.sel.unregister(fd)
        f = leaf.files.pop(fd, None)
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()
        if fd == leaf.stdin:
            leaf.stdin = None
            leaf.down.clear()
        leaf.streams.pop(fd, None)

    # -- from the launcher -----------------------------------------------------------------------
    def _read_input(self) -> None:
        try:
            data = os.read(self.rfd, READ_SIZE * 4)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._upstream_gone()
            return
        try:
            for kind, body in self.reader.feed(data):
                self._down(kind, body)
        except (MuxError, KeyError, TypeError, ValueError) as exc:
            self.exit_code = EXIT_PROTOCOL
            self.up += frame(ERROR, json_body({"message": f"protocol error: {exc}"}))
            self._upstream_gone()

    def _down(self, kind: int, body: bytes) -> None:
        if kind == BLOB:
            self.blob = body
            return
        if kind == KEEP:
            self.kept = body
            return
        lid, rest = parse_leaf(body)
        if kind == OPEN:
            if lid in self.leaves:
                raise MuxError(f"leaf {lid} is already open")
            argv = parse_json(rest)["argv"]
            if not isinstance(argv, list) or not argv or \
                    not all(isinstance(a, str) for a in argv):
                raise MuxError("OPEN needs a non-empty argv of strings")
            self._open(lid, argv)
            return
        leaf = self.leaves.get(lid)
        if leaf is None:
            return  # it ended already; its CLOSED is on its way
        if kind == DATA:
            leaf.cut.advance(rest)
            self._to_leaf(leaf, rest)
        elif kind == SERVE:
            serve = parse_json(rest)
            leaf.feed = Feeder(objects_of(self.kept, str(serve["root"]),
                                          [int(i) for i in serve["need"]]))
        elif kind == REPLAY:
            if self.kept is None:
                raise MuxError("REPLAY before any KEEP")
            leaf.cut.advance(self.kept)
            self._to_leaf(leaf, self.kept)
        elif kind == PAYLOAD:
            if self.blob is None:
                raise MuxError("PAYLOAD before any BLOB")
            self._to_leaf(leaf, self.blob)
        elif kind == EOF:
            leaf.eof = True
            if not leaf.down and leaf.stdin is not None:
                self._close(leaf, leaf.stdin)
        elif kind == KILL:
            self._kill(leaf, signal.SIGKILL)

    def _open(self, lid: int, argv: List[str]) -> None:
        if not self.upstream:
            return
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, bufsize=0,
                                    start_new_session=True)
        except (OSError, ValueError) as exc:
            self.up += closed_frame(lid, None, None, f"cannot start {argv[0]}: {exc}")
            return
        self.leaves[lid] = Leaf(lid, proc)
        self.batch.open(lid)

    def _top_up(self, leaf: Leaf) -> None:
        """A sync being fed: its next frames, while little waits for the leaf."""
        feed = leaf.feed
        if feed is None:
            return
        while not feed.done and leaf.stdin is not None and not leaf.eof and \
                leaf.cut.between and len(leaf.down) < FEED_LOW:
            leaf.down += feed.next_frame()
        if feed.done or leaf.stdin is None:
            leaf.feed = None

    def _to_leaf(self, leaf: Leaf, data: bytes) -> None:
        if leaf.stdin is None or leaf.eof:
            return
        leaf.down += data
        if len(leaf.down) > DOWN_MAX:
            leaf.error = (f"relay: the leaf's ssh did not read its stdin ({len(leaf.down)} "
                          "bytes waiting); killed")
            self._kill(leaf, signal.SIGKILL)

    def _write_leaf(self, leaf: Leaf) -> None:
        fd = leaf.stdin
        while fd is not None and leaf.down:
            try:
                n = os.write(fd, leaf.down[:WRITE_SIZE])
            except BlockingIOError:
                return
            except OSError:  # its ssh is gone: nothing more reaches that leaf
                self._close(leaf, fd)
                return
            del leaf.down[:n]
        if fd is not None and leaf.eof and not leaf.down:
            self._close(leaf, fd)

    def _kill(self, leaf: Leaf, sig: int) -> None:
        if leaf.stdin is not None:
            self._close(leaf, leaf.stdin)
        if leaf.status is not None:
            return
        try:
            os.killpg(leaf.proc.pid, sig)  # ssh leads its own group (start_new_session)
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(OSError):
                leaf.proc.send_signal(sig)

    def _upstream_gone(self) -> None:
        """The launcher is gone (or let go): every leaf's stdin closes once what came
        for it is written; the leaves get `DRAIN_BOUND` seconds to end."""
        if not self.upstream:
            return
        self.upstream = False
        for leaf in self.leaves.values():
            leaf.eof = True
            if not leaf.down and leaf.stdin is not None:
                self._close(leaf, leaf.stdin)
        self.term_at = time.monotonic() + DRAIN_BOUND

    def _read_signals(self) -> None:
        try:
            data = os.read(self._wake_r, 512)
        except OSError:
            return
        for signum in data:
            if signum == signal.SIGCHLD:
                self.children_exited = True
            elif signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
                self._upstream_gone()

    # -- from the leaves ---------------------------------------------------------------------------
    def _read_leaf(self, leaf: Leaf, fd: int) -> None:
        try:
            data = os.read(fd, READ_SIZE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        stream = leaf.streams[fd]
        if not data:
            self._close(leaf, fd)
            if not leaf.streams:
                self.batch.hurry()  # its last bytes go now
                self._reap_one(leaf)
            return
        if not self.output_open:
            return  # nobody to tell; keep reading so the ssh never blocks
        self.batch.add(leaf.id, stream, data, time.monotonic())

    def _reap(self) -> None:
        for leaf in self.leaves.values():
            self._reap_one(leaf)

    def _reap_one(self, leaf: Leaf) -> None:
        if leaf.status is None:
            leaf.status = leaf.proc.poll()

    def _close_finished(self) -> None:
        """CLOSED for each leaf whose ssh ended and whose bytes all went up."""
        for leaf in [x for x in self.leaves.values()
                     if x.finished and not self.batch.backlog(x.id)]:
            del self.leaves[leaf.id]
            self.batch.drop(leaf.id)
            if leaf.stdin is not None:
                self._close(leaf, leaf.stdin)
            status = leaf.status if leaf.status is not None else -1
            code, sig = (None, -status) if status < 0 else (status, None)
            if self.output_open:
                self.up += closed_frame(leaf.id, code, sig, leaf.error)

    def _deadlines(self, now: float) -> None:
        if self.term_at is not None and now >= self.term_at:
            self.term_at = None
            for leaf in self.leaves.values():
                self._kill(leaf, signal.SIGTERM)
            self.kill_at = now + KILL_AFTER
        if self.kill_at is not None and now >= self.kill_at:
            self.kill_at = None
            for leaf in self.leaves.values():
                self._kill(leaf, signal.SIGKILL)
            self.give_up_at = now + KILL_AFTER
        if self.give_up_at is not None and now >= self.give_up_at:
            self.give_up_at = None
            for leaf in list(self.leaves.values()):
                for fd in list(leaf.files):
                    self._close(leaf, fd)
                del self.leaves[leaf.id]
                self.batch.drop(leaf.id)

    # -- to the launcher ---------------------------------------------------------------------------
    def _flush(self, now: float) -> None:
        """Batch what the leaves wrote, when it is due and the launcher keeps up."""
        if self.batch.due(now) and len(self.up) < UP_HIGH:
            self.batch.take(self.up, UP_HIGH)

    def _flush_all(self) -> None:
        if self.output_open:
            self.batch.take(self.up)

    def _write_up(self) -> None:
        while self.up and self.output_open:
            try:
                n = os.write(self.wfd, self.up[:WRITE_SIZE])
            except BlockingIOError:
                return
            except OSError:  # the launcher's end is gone (EPIPE)
                self.output_open = False
                self.up.clear()
                self.batch.clear()
                self._upstream_gone()
                return
            del self.up[:n]

    def _write_blocking(self, bound: float) -> None:
        deadline = time.monotonic() + bound
        while self.up and self.output_open and time.monotonic() < deadline:
            self._write_up()
            if self.up:
                time.sleep(0.01)


def main() -> int:
    """The relay on a gateway: the mux on stdin and stdout (the bundle runs this for
    ``relay`` mode)."""
    return Relay().run()
