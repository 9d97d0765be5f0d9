"""The relay's side of the mux on the host loop (`hostloop`): what a gateway's relay
(`relay`) and the bench's emulated relay share. Its handshake and HELLO, the launcher's
frames handed to their handlers by type (a frame for a leaf, to that leaf), and what
the leaves wrote batched up to the launcher.

Batched, because at 1,024 hosts one frame up per leaf write was most of the launcher's
work: every `mux.BATCH_INTERVAL` (50 ms) one ``BATCH`` frame carries the bytes every
leaf wrote meanwhile, each leaf's bytes in their order and exactly as written; a leaf
agent's frame that matters at once (an exit, a spawn failure, an error, a signal, its
end: `URGENT`) is followed at once by a flush. Nothing is batched while more than
`UP_HIGH` waits for the launcher. Standard library only, like the rest of the agent.
"""

from __future__ import annotations

import os
import signal
import struct
import sys
import time
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple, Type

from fdl_fabric.agent import mux, wire
from fdl_fabric.agent.hostloop import EXIT_PROTOCOL, READ_SIZE, HostLoop
from fdl_fabric.agent.mux import BATCH_INTERVAL, ENTRY_HEAD, STDERR, STDOUT, batch_frame

#: Agent frames flushed at once: what the supervisor acts on.
URGENT: FrozenSet[int] = frozenset({wire.EXITED, wire.SPAWN_FAILED, wire.ERROR,
                                    wire.SIGNALED, wire.DONE, wire.VERIFIED})
#: Agent frames that may wait `LAZY_INTERVAL`: a heartbeat only says "alive", and the
#: launcher gives an agent at least `wire.AGENT_TIMEOUT_MIN` to say it. At 1,024 hosts
#: the heartbeats alone made every relay send 20 batches a second.
LAZY: FrozenSet[int] = frozenset({wire.HEARTBEAT})
#: Seconds bytes that are only `LAZY` frames may wait to be batched.
LAZY_INTERVAL = 0.5
#: Bytes waiting for the launcher beyond which nothing more is batched.
UP_HIGH = 4 * 1024 * 1024
#: A leaf stream's share of one batch round.
ENTRY_MAX = 256 * 1024
#: Body bytes of one BATCH frame, about (one more entry may end it).
BATCH_MAX = 1024 * 1024

_LENGTH = struct.Struct(">I")


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
                    body += len(chunk) + ENTRY_HEAD
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


class RelayLoop(HostLoop):
    """The host loop of a relay: the mux's HELLO first; the launcher's frames by type
    (`whole` handlers, and `per_leaf` ones that get the leaf a frame names); the leaves'
    bytes batched up; EOF, EPIPE, TERM, HUP or INT let go of the upstream
    (`upstream_gone`), and the loop ends once no leaf is left. ``leaves`` is the
    subclass's: leaf id -> its leaf, each with an ``id``."""

    READER = mux.Reader
    INPUT_ERRORS: Tuple[Type[BaseException], ...] = (mux.MuxError, KeyError, TypeError,
                                                     ValueError)
    DRAIN_INPUT = False
    INPUT_READ = 4 * READ_SIZE
    FLUSH_BOUND = 5.0

    def __init__(self, rfd: int = 0, wfd: int = 1) -> None:
        super().__init__(rfd, wfd, mux.DOWN_TYPES)
        self.batch = Batcher()
        self.leaves: Dict[int, Any] = {}
        self.upstream = True
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            self.signal_handlers[sig] = self._let_go

    def whole(self, table: Dict[int, Callable[[bytes], None]]) -> None:
        """Frames that are not a leaf's (the payload, a kept frame, an OPEN)."""
        self.frame_handlers.update(table)

    def per_leaf(self, table: Dict[int, Callable[[Any, bytes], None]]) -> None:
        """Frames for one leaf: each handler gets the leaf and the rest of the body, while
        the leaf is open (one that ended already gets nothing: its CLOSED is on its way)."""
        for kind, handler in table.items():
            self.frame_handlers[kind] = self._to_open_leaf(handler)

    def _to_open_leaf(self, handler: Callable[[Any, bytes], None]) -> Callable[[bytes], None]:
        def handle(body: bytes) -> None:
            lid, rest = mux.parse_leaf(body)
            leaf = self.open_leaf(lid)
            if leaf is not None:
                handler(leaf, rest)
        return handle

    def open_leaf(self, lid: int) -> Any:
        return self.leaves.get(lid)

    # -- the host loop's hooks -----------------------------------------------------------
    def hello(self) -> None:
        self.out += mux.HANDSHAKE + mux.frame(mux.HELLO, mux.json_body({
            "version": mux.VERSION, "pid": os.getpid(),
            "python": "{}.{}.{}".format(*sys.version_info[:3])}))

    def done(self) -> bool:
        return not (self.upstream or self.leaves)

    def crashed(self, trace: str) -> None:
        self.out += mux.frame(mux.ERROR, mux.json_body({"message": "relay crashed: " + trace}))

    def protocol_error(self, reason: str) -> None:
        self.exit_code = EXIT_PROTOCOL
        self.out += mux.frame(mux.ERROR, mux.json_body({"message": f"protocol error: {reason}"}))
        self.upstream_gone()

    def input_ended(self) -> None:
        self.upstream_gone()

    def output_lost(self) -> None:
        self.batch.clear()
        self.upstream_gone()

    def closing(self) -> None:
        if self.output_open:
            self.batch.take(self.out)

    def _let_go(self, signum: int) -> None:
        self.upstream_gone()

    def upstream_gone(self) -> None:
        """The launcher is gone (or let go): no more input, and the subclass lets its
        leaves go (`let_go`)."""
        if not self.upstream:
            return
        self.upstream = False
        self.stop_input()
        self.let_go(time.monotonic())

    def let_go(self, now: float) -> None:
        """Every leaf's input ends (its agent's leash); they get a bound to end."""

    # -- up -------------------------------------------------------------------------------
    def flush_due(self) -> Optional[float]:
        """When the batch must go, while the launcher keeps up (None: no need to wake)."""
        flush = self.batch.wake_at()
        return flush if flush is not None and len(self.out) < UP_HIGH else None

    def flush(self, now: float) -> None:
        """Batch what the leaves wrote, when it is due and the launcher keeps up."""
        if self.batch.due(now) and len(self.out) < UP_HIGH:
            self.batch.take(self.out, UP_HIGH)

    def forget(self, lid: int) -> None:
        del self.leaves[lid]
        self.batch.drop(lid)

    def report_closed(self, lid: int, status: int, error: str = "") -> None:
        """CLOSED for a leaf whose "ssh" ended with ``status`` (negative: a signal)."""
        code, sig = (None, -status) if status < 0 else (status, None)
        if self.output_open:
            self.out += mux.closed_frame(lid, code, sig, error)


__all__ = ["BATCH_MAX", "Batcher", "ENTRY_MAX", "FrameWatch", "LAZY", "LAZY_INTERVAL",
           "RelayLoop", "UP_HIGH", "URGENT"]
