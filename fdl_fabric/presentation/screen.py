"""The one thread that writes to the launcher's terminal: supervision never waits on it.

A terminal can stop taking bytes at any moment: Ctrl-S (XOFF) blocks every write once
the pty's buffer is full, a pager stops reading, ``| head -1`` closes the pipe, a closed
terminal answers EIO. A launcher that wrote from its supervising loop would stop
supervising (no pings, no kill-all) for as long as that lasts. So everything the
launcher shows goes through a `Screen`: a bounded queue drained by one writer thread.

* **Rank output** (`put_output`) is lossless while the console merely reads slowly: the
  producer, a session's reading thread, waits for room, which slows that one agent
  down (its ranks block on full pipes, as they would under torchrun). When the writer
  makes no progress for `STALL_AFTER` seconds (a paused terminal), output is dropped
  and counted instead, and once the console drains, one line says how much was not
  shown. ``--log-dir`` gets every byte either way (it is written before the console).
* **Launcher lines** (`put_message`) never wait and are never dropped, up to
  `MESSAGES_MAX` queued lines.
* **The live table** is redrawn in place on a terminal by this same thread: erased
  before anything scrolls above it, drawn again after, so no other writer can tear it.

Writes go straight to the file descriptors (``os.write``), never through Python's
buffered ``sys.stdout``: a thread blocked on a paused terminal then holds no lock that
the interpreter's exit needs. A stream that fails (EPIPE, EIO) is dropped for good and
the run goes on; a closed stdout is reported once on stderr.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import IO, Any, Optional

from fdl_fabric.events import Event, Name, event
from fdl_fabric.presentation.words import render

#: Bytes of rank output queued for the console before producers wait for room.
BUFFER_BYTES = 4 * 1024 * 1024
#: Seconds without a completed write, while output waits, after which the console
#: counts as stalled and rank output is dropped (and counted) instead of waited for.
STALL_AFTER = 1.0
#: Launcher lines queued at most while the console is stalled; beyond, they are counted.
MESSAGES_MAX = 10_000
#: Seconds between redraws of the live table.
REFRESH = 0.25
#: Seconds the launcher's last lines may wait for a stalled console at exit.
FINAL_DRAIN = 30.0
#: Bytes handed to one write: a pipe or pty takes this much without a long wait.
WRITE_SLICE = 4096

OUT = "out"
ERR = "err"

#: Renders the live table for a terminal this many columns wide and rows high. A trailing
#: newline leaves the cursor on the empty line below the table (erased with it).
StatusRender = Callable[[int, int], str]


class _Stream:
    """One output stream: its file descriptor (or a text object in tests)."""

    def __init__(self, target: Any, progress: Callable[[], None]) -> None:
        self.target = target
        self.progress = progress
        self.fd: Optional[int] = None
        with contextlib.suppress(AttributeError, OSError, ValueError):
            fd = target.fileno()
            with contextlib.suppress(AttributeError, ValueError, OSError):
                target.flush()
            self.fd = fd
        self.dead: Optional[str] = None
        #: The last write was cut mid-way (a line may be unfinished on the terminal).
        self.cut = False

    def write(self, data: bytes, stop: Optional[Callable[[], bool]] = None) -> bool:
        """Write everything, or up to the slice where ``stop()`` turned true; False (and
        the stream dead) when it cannot take more."""
        if self.dead is not None:
            return False
        if self.fd is None:
            try:
                self.target.write(data.decode("utf-8", "replace"))
                self.target.flush()
            except (OSError, ValueError) as exc:
                self.dead = str(exc)
                return False
            return True
        view = memoryview(data)
        while view:
            try:
                # Bounded slices: each completed one is progress, so a console that reads
                # slowly but steadily is never taken for a stalled one.
                n = os.write(self.fd, view[:WRITE_SLICE])
            except BlockingIOError:  # someone made the fd non-blocking: wait for room
                with contextlib.suppress(OSError, ValueError):
                    select.select([], [self.fd], [], 1.0)
                continue
            except InterruptedError:
                continue
            except OSError as exc:  # EPIPE (reader gone), EIO (terminal closed), ENOSPC...
                self.dead = errno.errorcode.get(exc.errno or 0, str(exc))
                return False
            view = view[n:]
            self.progress()
            if view and stop is not None and stop():
                self.cut = True
                return True
        return True


class Screen:
    """The writer thread and its queue; see the module docstring."""

    def __init__(self, out: IO[Any], err: IO[Any], *, buffer_bytes: int = BUFFER_BYTES,
                 stall_after: float = STALL_AFTER, dropped_hint: str = "",
                 notice: Optional[Callable[[Event], bytes]] = None) -> None:
        self._streams = {OUT: _Stream(out, self._moved), ERR: _Stream(err, self._moved)}
        self._items: deque[tuple[str, str, bytes, int]] = deque()
        self._queued_bytes = 0
        self._queued_messages = 0
        self._cond = threading.Condition()
        self._limit = buffer_bytes
        self._stall_after = stall_after
        self._progress = time.monotonic()
        self._busy = False
        self._dropping = False
        self.dropped_lines = 0
        self._dropped_total = 0
        self._dropped_messages = 0
        self._closed_out_lines = 0
        self._told_closed = False
        self._hint = dropped_hint
        #: How the writer's own notices reach stderr (the console lays them out).
        self._notice = notice or _line
        self._status: Optional[StatusRender] = None
        self._status_lines = 0
        self._closing = False
        #: Set by `give_up_output`: rank output is no longer shown, for good.
        self._given_up: Optional[str] = None
        #: Set by `seal`: the launcher's last line is queued; nothing may follow it.
        self._sealed = False
        self._thread = threading.Thread(target=self._run, name="fdl-screen", daemon=True)
        self._thread.start()

    def _moved(self) -> None:
        """A write completed: the console is taking bytes (read without the lock)."""
        self._progress = time.monotonic()

    # -- producers ------------------------------------------------------------------------
    def put_output(self, stream: str, data: bytes, lines: int) -> bool:
        """Queue rank output; waits for room while the console is slow, drops (and counts)
        while it is stalled. True when the bytes were queued."""
        with self._cond:
            while True:
                if self._closing or self._streams[stream].dead is not None:
                    if stream == OUT and self._streams[OUT].dead is not None:
                        self._closed_out_lines += lines
                    return False
                if self._dropping or self._given_up is not None:
                    self.dropped_lines += lines
                    return False
                if self._queued_bytes + len(data) <= self._limit or not self._queued_bytes:
                    self._items.append(("output", stream, data, lines))
                    self._queued_bytes += len(data)
                    self._cond.notify_all()
                    return True
                stalled_for = time.monotonic() - self._progress
                if stalled_for >= self._stall_after:
                    self._dropping = True
                    self.dropped_lines += lines
                    return False
                self._cond.wait(self._stall_after - stalled_for)

    def put_message(self, stream: str, data: bytes) -> None:
        """Queue a launcher line; never waits."""
        with self._cond:
            if self._queued_messages >= MESSAGES_MAX:
                self._dropped_messages += 1
                return
            self._items.append(("message", stream, data, 0))
            self._queued_messages += 1
            self._cond.notify_all()

    def give_up_output(self, why: str) -> None:
        """Stop showing rank output, queued or to come, and count it instead: the operator
        asked the run to stop (Ctrl-C), and the verdict must reach a slow terminal now,
        not after megabytes of output it is still taking in."""
        with self._cond:
            if self._given_up is not None:
                return
            self._given_up = why
            kept: deque[tuple[str, str, bytes, int]] = deque()
            for item in self._items:
                if item[0] == "output":
                    self.dropped_lines += item[3]
                else:
                    kept.append(item)
            self._items = kept
            self._queued_bytes = 0
            self._cond.notify_all()

    def _gave_up(self) -> bool:
        return self._given_up is not None

    def seal(self) -> None:
        """The verdict comes next: from here on the writer adds no line of its own, so
        the verdict stays the last line (the launcher counts what was not shown)."""
        with self._cond:
            self._sealed = True

    def set_status(self, render: Optional[StatusRender]) -> None:
        """Show (or, with None, erase for good) the live table below the output."""
        with self._cond:
            self._status = render
            self._cond.notify_all()

    @property
    def stalled(self) -> bool:
        """True while rank output is being dropped."""
        return self._dropping

    def close(self, timeout: float = FINAL_DRAIN) -> bool:
        """Write what is queued (erasing the live table) and stop; False if the console
        did not take it within ``timeout`` (the lines are then given up)."""
        with self._cond:
            self._status = None
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        out_fd = self._streams[OUT].fd
        if self._streams[OUT].dead is not None and out_fd is not None:
            # Nothing more may reach a closed stdout, not even Python's flush at exit.
            with contextlib.suppress(OSError):
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, out_fd)
                os.close(null)
        return not self._thread.is_alive()

    # -- the writer thread -------------------------------------------------------------------
    def _run(self) -> None:
        next_draw = 0.0
        while True:
            with self._cond:
                while not self._items and not self._closing:
                    if self._status is not None:
                        wait = next_draw - time.monotonic()
                        if wait <= 0:
                            break
                        self._cond.wait(wait)
                    elif self._status_lines:
                        break  # erase a table that was switched off
                    else:
                        self._cond.wait()
                items = list(self._items)
                self._items.clear()
                self._queued_bytes = 0
                self._queued_messages = 0
                status = self._status
                closing = self._closing
                self._busy = True
            self._write_batch(items, status)
            next_draw = time.monotonic() + REFRESH
            with self._cond:
                self._busy = False
                self._progress = time.monotonic()
                self._after_batch()
                self._cond.notify_all()
                if closing and not self._items:
                    return

    def _after_batch(self) -> None:
        """Under the lock: leave drop mode once the queue drained, and say what was lost."""
        if self._given_up is not None or self._sealed:
            return  # the launcher's last lines count what was not shown: nothing after them
        if self._dropping and self._queued_bytes <= self._limit // 4:
            self._dropping = False
            if self.dropped_lines:
                self._dropped_total += self.dropped_lines
                self._items.append(("message", ERR, self._notice(event(
                    Name.CONSOLE_STALLED, dropped=self.dropped_lines, hint=self._hint)), 0))
                self.dropped_lines = 0
        out = self._streams[OUT]
        if out.dead is not None and not self._told_closed:
            self._told_closed = True
            self._items.append(("message", ERR, self._notice(event(
                Name.STDOUT_CLOSED, error=out.dead, hint=self._hint)), 0))

    def _write_batch(self, items: list[tuple[str, str, bytes, int]],
                     status: Optional[StatusRender]) -> None:
        out = self._streams[OUT]
        if self._status_lines and (items or status is None) and out.dead is None:
            out.write(_erase(self._status_lines))
            self._status_lines = 0
        writers = {"output": self._write_output, "message": self._write_message}
        for kind, stream, data, lines in items:
            writers[kind](stream, data, lines)
        if status is not None and out.dead is None:
            self._draw(out, status)

    def _write_output(self, stream: str, data: bytes, lines: int) -> None:
        """Rank output: dropped (and counted) once the operator gave up on the console."""
        if self._given_up is not None:  # taken off the queue before the Ctrl-C
            with self._cond:
                self.dropped_lines += lines
            return
        if not self._streams[stream].write(data, self._gave_up) and stream == OUT:
            with self._cond:
                self._closed_out_lines += lines  # refused by a stdout that closed

    def _write_message(self, stream: str, data: bytes, _lines: int) -> None:
        """A launcher line: on a line of its own, after any line an interrupt cut."""
        for cut in self._streams.values():
            if cut.cut:  # finish the line the interrupt cut, then the launcher's words
                cut.cut = False
                cut.write(b"\n")
        self._streams[stream].write(data)

    def _draw(self, out: _Stream, status: StatusRender) -> None:
        """The live table, drawn again in place of the last one."""
        size = _size(out)
        with contextlib.suppress(Exception):  # a rendering problem must not end output
            text = status(size.columns, size.lines)
            if self._status_lines:
                out.write(_erase(self._status_lines))
            if text and out.write(text.encode("utf-8", "replace")):
                self._status_lines = text.count("\n") + 1
            else:
                self._status_lines = 0

    @property
    def dropped(self) -> int:
        """Lines of rank output not shown so far (console stalls and a closed stdout)."""
        return self._dropped_total + self.dropped_lines + self._closed_out_lines


def _size(stream: _Stream) -> os.terminal_size:
    """The size of the terminal the live table is drawn on, asked of its descriptor: a
    stale ``COLUMNS`` would draw a table wider than the terminal, which wraps it, and
    the erasure would miss the lines it wrapped onto."""
    if stream.fd is not None:
        with contextlib.suppress(OSError):
            size = os.get_terminal_size(stream.fd)
            if size.columns > 0 and size.lines > 0:
                return size
    return shutil.get_terminal_size((100, 24))


def _erase(lines: int) -> bytes:
    """Move to the start of a drawn block of ``lines`` lines and clear it (as rich does)."""
    return b"\r\x1b[2K" + b"\x1b[1A\x1b[2K" * (lines - 1)


def _line(notice: Event) -> bytes:
    """A notice the writer puts in the stream itself, in order with the output it concerns."""
    return (render(notice) + "\n").encode()
