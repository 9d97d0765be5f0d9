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

The mux framing (docs/protocol.md, "Relay") is `mux`'s, the batching and the loop
`relayloop`'s (on `hostloop`, the agent's loop too); their names are re-exported here,
where the launcher's side (`fdl_fabric.transport.gateway`) has always found them.
"""


from __future__ import annotations

import contextlib
import functools
import os
import selectors
import signal
import subprocess
import time
from typing import Any, Dict, List, Optional, Tuple

from fdl_fabric.agent import wire
from fdl_fabric.agent.feeder import FEED_LOW, Feeder, FrameCut, objects_of
from fdl_fabric.agent.hostloop import (
    EXIT_INTERNAL,
    EXIT_OK,
    EXIT_PROTOCOL,
    READ_SIZE,
    WRITE_SIZE,
    Handler,
    read_ready,
)
from fdl_fabric.agent.mux import (
    BATCH,
    BATCH_INTERVAL,
    BLOB,
    CLOSED,
    DATA,
    DATA_CHUNK,
    DOWN_TYPES,
    EOF,
    ERROR,
    HANDSHAKE,
    HANDSHAKE_PREFIX,
    HELLO,
    KEEP,
    KILL,
    MAX_FRAME,
    OPEN,
    PAYLOAD,
    REPLAY,
    SERVE,
    STDERR,
    STDOUT,
    UP_TYPES,
    VERSION,
    MuxError,
    Reader,
    batch_frame,
    closed_frame,
    data_frames,
    frame,
    json_body,
    leaf_frame,
    open_frame,
    parse_batch,
    parse_json,
    parse_leaf,
)
from fdl_fabric.agent.relayloop import (
    BATCH_MAX,
    ENTRY_MAX,
    LAZY,
    LAZY_INTERVAL,
    UP_HIGH,
    URGENT,
    Batcher,
    FrameWatch,
    RelayLoop,
)

#: A leaf's bytes waiting to go up beyond which it is not read.
LEAF_HIGH = 1024 * 1024
#: Bytes waiting for a leaf's stdin beyond which the leaf is killed (it does not read).
DOWN_MAX = wire.MAX_FRAME + 4 * 1024 * 1024
#: After the relay's upstream is gone: seconds the leaves get to end, then TERM, then KILL.
DRAIN_BOUND = 10.0
KILL_AFTER = 2.0


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
        #: Where the loop hands this leaf's ready pipes (set by the relay).
        self.ready: Optional[Handler] = None

    @property
    def finished(self) -> bool:
        return self.status is not None and not self.streams



class Relay(RelayLoop):
    """The relay's select loop (`hostloop`); `run` returns its exit status. One
    ``select`` over its input, its output, every leaf's pipes and a signal wake-up pipe
    (SIGCHLD reaps leaves, TERM/HUP/INT act as EOF)."""

    def __init__(self, rfd: int = 0, wfd: int = 1) -> None:
        super().__init__(rfd, wfd)
        self.leaves: Dict[int, Leaf] = {}
        self.blob: Optional[bytes] = None
        self.kept: Optional[bytes] = None
        self.children_exited = False
        self.term_at: Optional[float] = None
        self.kill_at: Optional[float] = None
        self.give_up_at: Optional[float] = None
        self.signal_handlers[signal.SIGCHLD] = self._child_exited
        self.whole({BLOB: self._on_blob, KEEP: self._on_keep, OPEN: self._on_open})
        self.per_leaf({DATA: self._on_data, SERVE: self._on_serve, REPLAY: self._on_replay,
                       PAYLOAD: self._on_payload, EOF: self._on_eof, KILL: self._on_kill})

    # -- the loop ------------------------------------------------------------------------------
    def after(self, now: float) -> None:
        if self.children_exited:
            self.children_exited = False
            self._reap()
        self._on_deadlines(now)
        self.flush(now)
        self._close_finished()

    def deadlines(self) -> List[float]:
        due: List[float] = [t for t in (self.term_at, self.kill_at, self.give_up_at)
                            if t is not None]
        flush = self.flush_due()
        if flush is not None:
            due.append(flush)
        return due

    def prepare(self) -> None:
        """What the loop waits for, in step with each leaf's state."""
        want: Dict[int, Tuple[int, Any]] = {self._wake_r: (selectors.EVENT_READ, self.on_wake)}
        if self.upstream:
            want[self.rfd] = (selectors.EVENT_READ, self.on_input)
        if self.out and self.output_open:
            want[self.wfd] = (selectors.EVENT_WRITE, self.on_output)
        for leaf in self.leaves.values():
            self._top_up(leaf)
            if leaf.stdin is not None and leaf.down:
                want[leaf.stdin] = (selectors.EVENT_WRITE, leaf.ready)
            if self.batch.backlog(leaf.id) < LEAF_HIGH:
                for fd in leaf.streams:
                    want[fd] = (selectors.EVENT_READ, leaf.ready)
        current = self.sel.get_map()
        for key in [k for k in current.values() if k.fd not in want]:
            self.sel.unregister(key.fd)
        for wanted, (events, data) in want.items():
            if wanted not in current:
                self.sel.register(wanted, events, data)

    def _leaf_ready(self, leaf: Leaf, fd: int, events: int) -> None:
        if fd == leaf.stdin:
            self._write_leaf(leaf)
        elif fd in leaf.streams:
            self._read_leaf(leaf, fd)

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
    def _on_blob(self, body: bytes) -> None:
        self.blob = body

    def _on_keep(self, body: bytes) -> None:
        self.kept = body

    def _on_open(self, body: bytes) -> None:
        lid, rest = parse_leaf(body)
        if lid in self.leaves:
            raise MuxError(f"leaf {lid} is already open")
        argv = parse_json(rest)["argv"]
        if not isinstance(argv, list) or not argv or \
                not all(isinstance(a, str) for a in argv):
            raise MuxError("OPEN needs a non-empty argv of strings")
        self._open(lid, argv)

    def _on_data(self, leaf: Leaf, rest: bytes) -> None:
        leaf.cut.advance(rest)
        self._to_leaf(leaf, rest)

    def _on_serve(self, leaf: Leaf, rest: bytes) -> None:
        serve = parse_json(rest)
        leaf.feed = Feeder(objects_of(self.kept, str(serve["root"]),
                                      [int(i) for i in serve["need"]]))

    def _on_replay(self, leaf: Leaf, rest: bytes) -> None:
        if self.kept is None:
            raise MuxError("REPLAY before any KEEP")
        leaf.cut.advance(self.kept)
        self._to_leaf(leaf, self.kept)

    def _on_payload(self, leaf: Leaf, rest: bytes) -> None:
        if self.blob is None:
            raise MuxError("PAYLOAD before any BLOB")
        self._to_leaf(leaf, self.blob)

    def _on_eof(self, leaf: Leaf, rest: bytes) -> None:
        leaf.eof = True
        if not leaf.down and leaf.stdin is not None:
            self._close(leaf, leaf.stdin)

    def _on_kill(self, leaf: Leaf, rest: bytes) -> None:
        self._kill(leaf, signal.SIGKILL)

    def _open(self, lid: int, argv: List[str]) -> None:
        if not self.upstream:
            return
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, bufsize=0,
                                    start_new_session=True)
        except (OSError, ValueError) as exc:
            self.out += closed_frame(lid, None, None, f"cannot start {argv[0]}: {exc}")
            return
        leaf = Leaf(lid, proc)
        leaf.ready = functools.partial(self._leaf_ready, leaf)
        self.leaves[lid] = leaf
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


    def let_go(self, now: float) -> None:
        """Every leaf's stdin closes once what came for it is written; the leaves get
        `DRAIN_BOUND` seconds to end."""
        for leaf in self.leaves.values():
            leaf.eof = True
            if not leaf.down and leaf.stdin is not None:
                self._close(leaf, leaf.stdin)
        self.term_at = now + DRAIN_BOUND

    def _child_exited(self, signum: int) -> None:
        self.children_exited = True

    # -- from the leaves ---------------------------------------------------------------------------
    def _read_leaf(self, leaf: Leaf, fd: int) -> None:
        data = read_ready(fd, READ_SIZE)
        if data is None:
            return
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
            self.forget(leaf.id)
            if leaf.stdin is not None:
                self._close(leaf, leaf.stdin)
            self.report_closed(leaf.id, leaf.status if leaf.status is not None else -1,
                               leaf.error)

    def _on_deadlines(self, now: float) -> None:
        """The drain bound is over: TERM every leaf's ssh; KILL_AFTER later KILL; as long
        again later, whatever is left is dropped."""
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
                self.forget(leaf.id)


def main() -> int:
    """The relay on a gateway: the mux on stdin and stdout (the bundle runs this for
    ``relay`` mode)."""
    return Relay().run()


#: The mux's names, re-exported for the launcher's side and the tests.
__all__ = ["BATCH", "BATCH_INTERVAL", "BATCH_MAX", "BLOB", "Batcher", "CLOSED", "DATA",
           "DATA_CHUNK", "DOWN_MAX", "DOWN_TYPES", "DRAIN_BOUND", "ENTRY_MAX", "EOF", "ERROR",
           "EXIT_INTERNAL", "EXIT_OK", "EXIT_PROTOCOL", "FrameWatch", "HANDSHAKE",
           "HANDSHAKE_PREFIX", "HELLO", "KEEP", "KILL", "KILL_AFTER", "LAZY", "LAZY_INTERVAL",
           "LEAF_HIGH", "Leaf", "MAX_FRAME", "MuxError", "OPEN", "PAYLOAD", "READ_SIZE",
           "REPLAY", "Reader", "Relay", "SERVE", "STDERR", "STDOUT", "UP_HIGH", "UP_TYPES",
           "URGENT", "VERSION", "WRITE_SIZE", "batch_frame", "closed_frame", "data_frames",
           "frame", "json_body", "leaf_frame", "main", "open_frame", "parse_batch",
           "parse_json", "parse_leaf"]
