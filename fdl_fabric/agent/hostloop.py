"""The host loop: the one event loop the agent (`main`) and the relay (`relay`) run, and
the bench's emulated relay with them.

Both are one process on a host that speaks frames with the launcher over its stdin and
stdout, and both are single-threaded on purpose: the agent forks ranks and its watchdog,
which is only safe without threads, and one ``select`` needs no locking. So the skeleton
is shared, and only what each does with a frame, a signal or a moment differs:

* **select**: every descriptor is registered with its handler as the selector's data,
  so a ready descriptor is dispatched by the table the selector already is;
* **frames**: what the launcher sends is read without blocking, cut into frames by a
  `wire.Reader`, and each frame handed to its handler by type (`frame_handlers`); what
  goes up waits in ``out`` and is written as the pipe takes it, never blocking the loop;
* **leash**: when the launcher's end goes (EOF on the input, EPIPE on the output) the
  subclass is told (`input_ended`, `output_lost`) and stops what it started;
* **signals**: a signal only wakes the loop (`signal.set_wakeup_fd`); the loop then
  hands each one to its handler (`signal_handlers`, which also says which are caught).

Nothing polls on a timer: the loop sleeps until something arrives or until the nearest
moment `deadlines` names. Standard library only, like the rest of the agent.
"""

from __future__ import annotations

import contextlib
import os
import select
import selectors
import signal
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Type

from fdl_fabric.agent import wire

#: Bytes read from a pipe at once.
READ_SIZE = 64 * 1024
#: Bytes written to the launcher per write call.
WRITE_SIZE = 256 * 1024

EXIT_OK = 0
EXIT_PROTOCOL = 3
EXIT_INTERNAL = 4

#: What a ready descriptor is handed to: (fd, the ready events).
Handler = Callable[[int, int], None]


def read_ready(fd: int, size: int = READ_SIZE) -> Optional[bytes]:
    """One read of a non-blocking fd: None when nothing is there yet, b"" at its end (a
    read error ends the stream too: a broken pipe cannot be told from EOF)."""
    while True:
        try:
            return os.read(fd, size)
        except BlockingIOError:
            return None
        except InterruptedError:
            continue
        except OSError:
            return b""


def _noop(signum: int, frame: Any) -> None:
    """Signals only wake the loop (through the wake-up fd); the loop decides."""


class HostLoop:
    """One select loop over the launcher's input and output, a signal wake-up pipe and
    whatever a subclass registers; `run` returns the exit status.

    A subclass fills the tables (`frame_handlers`, `signal_handlers`), names its
    moments (`deadlines`), keeps its registrations in step (`prepare`), acts after each
    wake-up (`after`) and says when it is over (`done`)."""

    #: The launcher's frames: a `wire.Reader` subclass, and the errors that make its
    #: input a protocol error (anything else is a crash).
    READER: Type[wire.Reader] = wire.Reader
    INPUT_ERRORS: Tuple[Type[BaseException], ...] = (wire.ProtocolError,)
    #: Read the input until it would block (the agent), or once per wake-up (the relay,
    #: which then serves its leaves in between).
    DRAIN_INPUT = True
    INPUT_READ = READ_SIZE
    #: Seconds the last write to the launcher may take before the process exits.
    FLUSH_BOUND = 10.0

    def __init__(self, rfd: int = 0, wfd: int = 1,
                 allowed: Iterable[int] = frozenset()) -> None:
        self.rfd = rfd
        self.wfd = wfd
        self.reader = self.READER(frozenset(allowed))
        self.sel = selectors.DefaultSelector()
        #: Frames waiting for the launcher, and whether anybody still reads them.
        self.out = bytearray()
        self.output_open = True
        #: When a frame last went into ``out`` (a heartbeat is due when this gets old).
        self.last_sent = time.monotonic()
        self.exit_code = EXIT_OK
        #: Frame type -> handler of its body; signal number -> handler (also what is caught).
        self.frame_handlers: Dict[int, Callable[[bytes], None]] = {}
        self.signal_handlers: Dict[int, Callable[[int], None]] = {}
        self._wake_r, self._wake_w = os.pipe()

    # -- setup ----------------------------------------------------------------------------
    def install(self) -> None:
        """Non-blocking pipes, the wake-up fd, the caught signals; input and wake-up
        registered. Called by `run`, once the tables are filled."""
        for fd in (self.rfd, self.wfd, self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in self.signal_handlers:
            signal.signal(sig, _noop)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        self.sel.register(self.rfd, selectors.EVENT_READ, self.on_input)
        self.sel.register(self._wake_r, selectors.EVENT_READ, self.on_wake)

    # -- what a subclass says -------------------------------------------------------------
    def hello(self) -> None:
        """The first frames up (a handshake and HELLO)."""

    def done(self) -> bool:
        raise NotImplementedError

    def deadlines(self) -> List[float]:
        """Every moment the loop must wake for, whatever arrives meanwhile."""
        return []

    def prepare(self) -> None:
        """Before each ``select``: registrations in step with the state."""

    def after(self, now: float) -> None:
        """After each wake-up (``now`` taken once the ready descriptors were served)."""

    def crashed(self, trace: str) -> None:
        """An exception escaped a handler: say it, stop what was started."""

    def heard(self) -> None:
        """Bytes (or the end) came from the launcher."""

    def input_ended(self) -> None:
        """The launcher's end of the input is gone: the leash."""

    def output_lost(self) -> None:
        """Nobody reads the output any more (EPIPE): the leash, too."""

    def protocol_error(self, reason: str) -> None:
        """The launcher broke the protocol."""

    def frames(self, data: bytes) -> List[Tuple[int, bytes]]:
        """The complete frames ``data`` ends (a subclass may skip bytes first)."""
        return self.reader.feed(data)

    def closing(self) -> None:
        """Before the last flush: anything still pending goes into ``out``."""

    # -- the loop -------------------------------------------------------------------------
    def run(self) -> int:
        self.install()
        self.hello()
        try:
            while not self.done():
                self.step()
        except Exception:
            import traceback

            self.exit_code = EXIT_INTERNAL
            self.crashed(traceback.format_exc(limit=5).strip())
        self.closing()
        self.flush_blocking(self.FLUSH_BOUND)
        return self.exit_code

    def step(self) -> None:
        self.prepare()
        for key, events in self.sel.select(self.timeout()):
            key.data(key.fd, events)
        self.after(time.monotonic())
        if self.out and self.output_open:
            self.write_out()  # most writes fit the pipe: no need to wait for select

    def timeout(self) -> Optional[float]:
        """How long ``select`` may sleep: until the nearest deadline, or for ever when
        none is set (an idle loop wakes only for what arrives)."""
        due = self.deadlines()
        return max(0.0, min(due) - time.monotonic()) if due else None

    def want_output(self) -> None:
        """Wait for the output to take more only while something waits for it."""
        want = bool(self.out) and self.output_open
        registered = self.wfd in self.sel.get_map()
        if want and not registered:
            self.sel.register(self.wfd, selectors.EVENT_WRITE, self.on_output)
        elif not want and registered:
            self.sel.unregister(self.wfd)

    # -- input ----------------------------------------------------------------------------
    def on_input(self, fd: int = -1, events: int = 0) -> None:
        """Read what the launcher sent and hand each frame to its handler by type; the
        first frame that breaks the protocol ends the input."""
        while True:
            data = read_ready(self.rfd, self.INPUT_READ)
            if data is None:
                return
            self.heard()
            if not data:
                self.input_ended()
                return
            try:
                for kind, body in self.frames(data):
                    handler = self.frame_handlers.get(kind)
                    if handler is not None:
                        handler(body)
            except self.INPUT_ERRORS as exc:
                self.protocol_error(str(exc))
                return
            if not self.DRAIN_INPUT:
                return

    def stop_input(self) -> None:
        """Read no more of the input."""
        if self.rfd in self.sel.get_map():
            self.sel.unregister(self.rfd)

    # -- signals --------------------------------------------------------------------------
    def on_wake(self, fd: int = -1, events: int = 0) -> None:
        """Each signal that arrived, to its handler, in order."""
        for signum in read_ready(self._wake_r, 1024) or b"":
            handler = self.signal_handlers.get(signum)
            if handler is not None:
                handler(signum)

    # -- output ---------------------------------------------------------------------------
    def queue(self, frame: bytes) -> None:
        """A frame for the launcher (dropped once nobody reads)."""
        if self.output_open:
            self.out += frame
            self.last_sent = time.monotonic()

    def on_output(self, fd: int = -1, events: int = 0) -> None:
        self.write_out()

    def write_out(self) -> None:
        """Write what the pipe takes now; a gone reader (EPIPE) is `output_lost`."""
        while self.out and self.output_open:
            try:
                n = os.write(self.wfd, self.out[:WRITE_SIZE])
            except BlockingIOError:
                return
            except InterruptedError:
                continue
            except OSError:  # the launcher's end is gone (EPIPE): nobody to report to
                self.output_open = False
                self.out.clear()
                self.output_lost()
                return
            del self.out[:n]

    def flush_blocking(self, bound: float) -> None:
        """Before exiting: hand everything to the launcher (or give up once it is gone,
        or after ``bound`` seconds)."""
        deadline = time.monotonic() + bound
        while self.out and self.output_open:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self.write_out()
            if self.out:
                with contextlib.suppress(OSError, ValueError):
                    select.select([], [self.wfd], [], min(remaining, 0.5))


__all__ = ["EXIT_INTERNAL", "EXIT_OK", "EXIT_PROTOCOL", "Handler", "HostLoop", "READ_SIZE",
           "WRITE_SIZE", "read_ready"]
