"""The one writer of the launcher's terminal (`fdl_fabric.presentation.screen.Screen`), with
real pipes as the terminal: a reader that is slow, one that stops reading (a paused
terminal), one that is gone (``| head -1``). What the operator relies on: a slow console
loses nothing, a stalled one never stops the run and says how much it did not show, a
closed one is said once, and the live table never tears the output nor stays behind."""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from fdl_fabric.presentation.screen import ERR, OUT, Screen

#: The smallest pipe the kernel allows: the terminal's own buffer fills after 4 KiB.
PIPE_SIZE = 4096
#: Erasing a three-line live table: to the start of its last line, clear, then up and clear.
ERASE_3 = b"\r\x1b[2K" + b"\x1b[1A\x1b[2K" * 2


class Terminal:
    """A pipe playing the console, read by a thread that can be slowed, paused, resumed."""

    def __init__(self, *, reading: bool = True, chunk: int = 65536, delay: float = 0.0) -> None:
        read_fd, write_fd = os.pipe()
        fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        self.read_fd = read_fd
        self.file = os.fdopen(write_fd, "wb", buffering=0)
        self.chunk = chunk
        self.delay = delay
        self._data = bytearray()
        self._lock = threading.Lock()
        self._reading = threading.Event()
        if reading:
            self._reading.set()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._reading.wait()
            try:
                chunk = os.read(self.read_fd, self.chunk)
            except OSError:
                return
            if not chunk:
                return
            with self._lock:
                self._data += chunk
            if self.delay:
                time.sleep(self.delay)

    def resume(self) -> None:
        self._reading.set()

    @property
    def data(self) -> bytes:
        with self._lock:
            return bytes(self._data)

    def close_reader(self) -> None:
        """The reader is gone, as after ``| head -1``: writes now fail with EPIPE."""
        os.close(self.read_fd)
        self.read_fd = -1

    def everything(self) -> bytes:
        """All the console got, once the writer is done with it (after `Screen.close`)."""
        self._reading.set()
        self.file.close()  # EOF for the reader thread
        self._thread.join(5)
        assert not self._thread.is_alive()
        return self.data

    def finish(self) -> None:
        self.everything()
        if self.read_fd >= 0:
            os.close(self.read_fd)
            self.read_fd = -1


@pytest.fixture
def terminals() -> Iterator[Callable[..., Terminal]]:
    made: list[Terminal] = []

    def make(**kw: object) -> Terminal:
        term = Terminal(**kw)  # type: ignore[arg-type]
        made.append(term)
        return term

    yield make
    for term in made:
        with contextlib.suppress(OSError, ValueError):
            term.finish()


def wait_for(predicate: Callable[[], object], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def line(i: int) -> bytes:
    """A 64-byte line of rank output, numbered."""
    return f"rank 0: step {i:06d} ".encode().ljust(63, b".") + b"\n"


def stall(screen: Screen, first: int = 0) -> tuple[list[int], int, float]:
    """Put numbered lines until the screen drops some (and a few more): the lines it took,
    the number it dropped, the longest a single put_output took."""
    shown: list[int] = []
    dropped = 0
    longest = 0.0
    i = first
    while dropped < 50:
        assert i - first < 100_000, "the screen never started dropping"
        started = time.monotonic()
        if screen.put_output(OUT, line(i), 1):
            shown.append(i)
        else:
            dropped += 1
        longest = max(longest, time.monotonic() - started)
        i += 1
    return shown, dropped, longest


def test_a_slow_console_loses_nothing_and_holds_the_producer_back(
        terminals: Callable[..., Terminal]) -> None:
    out = terminals(chunk=512, delay=0.002)
    err = terminals()
    screen = Screen(out.file, err.file, buffer_bytes=2048, stall_after=1.0)
    total = 1500
    for i in range(total):
        assert screen.put_output(OUT, line(i), 1)
    # The producer waited for room: no more than the pipe, the batch being written and
    # the queue can be ahead of what the console has read.
    assert len(out.data) >= total * 64 - 16 * 1024
    assert screen.close(5)
    assert out.everything() == b"".join(line(i) for i in range(total))
    assert screen.dropped == 0 and not screen.stalled
    assert b"not shown" not in err.everything()



def test_a_console_that_reads_slowly_but_steadily_is_not_stalled_by_big_chunks(
        terminals: Callable[..., Terminal]) -> None:
    # One chunk of rank output is whatever the agent read at once (64 KiB of lines, each
    # behind its prefix) or a 1 MiB piece of a long line: writing one takes a while on a
    # slow console, which is still taking bytes every few milliseconds.
    out = terminals(chunk=1024, delay=0.005)
    err = terminals()
    screen = Screen(out.file, err.file, buffer_bytes=2048, stall_after=0.25)
    chunk = b"".join(line(i) for i in range(2048))  # 128 KiB of whole lines
    for _ in range(4):
        assert screen.put_output(OUT, chunk, 2048)
    assert screen.close(10)
    assert out.everything() == chunk * 4
    assert screen.dropped == 0

def test_a_stalled_console_drops_and_counts_rank_output_and_says_so_once_it_drains(
        terminals: Callable[..., Terminal]) -> None:
    out = terminals(reading=False)
    err = terminals()
    screen = Screen(out.file, err.file, buffer_bytes=2048, stall_after=0.3,
                    dropped_hint="every line is in --log-dir")
    started = time.monotonic()
    shown, dropped, longest = stall(screen)
    # The producer (a session's reading thread) waited at most about stall_after.
    assert longest < 0.3 + 0.5
    assert time.monotonic() - started < 0.3 + 1.0
    assert screen.stalled
    assert screen.dropped == dropped
    assert b"not shown" not in err.data

    out.resume()
    notice = (f"cluster launcher: … {dropped:,} lines of rank output not shown: the console "
              "stalled (every line is in --log-dir)\n").encode()
    wait_for(lambda: notice in err.data)
    assert err.data.count(b"not shown") == 1
    # Every line the screen took reached the console, in order; none that it dropped did.
    wait_for(lambda: len(out.data) >= 64 * len(shown))
    assert out.data == b"".join(line(i) for i in shown)
    assert not screen.stalled

    # Once drained, output flows again.
    assert screen.put_output(OUT, b"rank 0: after the stall\n", 1)
    assert screen.close(5)
    assert out.everything().endswith(b"rank 0: after the stall\n")
    assert screen.dropped == dropped
    assert err.everything().count(b"not shown") == 1


def test_launcher_lines_never_wait_even_while_the_console_is_stalled(
        terminals: Callable[..., Terminal]) -> None:
    out = terminals(reading=False)
    err = terminals(reading=False)
    screen = Screen(out.file, err.file, buffer_bytes=2048, stall_after=0.3)
    shown, _, _ = stall(screen)
    assert screen.stalled
    longest = 0.0
    started = time.monotonic()
    for i in range(500):
        t = time.monotonic()
        screen.put_message(ERR if i % 2 else OUT, f"cluster launcher: note {i}\n".encode())
        longest = max(longest, time.monotonic() - t)
    assert longest < 0.1
    assert time.monotonic() - started < 0.5

    out.resume()
    err.resume()
    assert screen.close(5)
    # Launcher lines are never dropped: each one reaches its stream, in order.
    out_data, err_data = out.everything(), err.everything()
    out_notes = [n for n in out_data.split(b"\n") if n.startswith(b"cluster launcher: note")]
    err_notes = [n for n in err_data.split(b"\n") if n.startswith(b"cluster launcher: note")]
    assert out_notes == [f"cluster launcher: note {i}".encode() for i in range(0, 500, 2)]
    assert err_notes == [f"cluster launcher: note {i}".encode() for i in range(1, 500, 2)]
    assert out_data.startswith(b"".join(line(i) for i in shown))


def test_a_closed_stdout_drops_rank_output_and_says_so_once_on_stderr(
        terminals: Callable[..., Terminal]) -> None:
    out = terminals(reading=False)
    err = terminals()
    out.close_reader()
    screen = Screen(out.file, err.file, buffer_bytes=2048, stall_after=0.3)
    screen.put_output(OUT, b"rank 0: first\n", 1)
    wait_for(lambda: b"stdout is closed" in err.data)
    for i in range(10):
        assert not screen.put_output(OUT, line(i), 1)
    screen.put_message(OUT, b"cluster launcher: a line for stdout\n")
    screen.put_message(ERR, b"cluster launcher: still talking on stderr\n")
    assert screen.close(5)
    err_data = err.everything()
    notes = [n for n in err_data.decode().splitlines() if "stdout is closed" in n]
    assert notes == ["cluster launcher: stdout is closed (EPIPE): rank output is no longer "
                     "shown; the run goes on"]
    assert err_data.endswith(b"cluster launcher: still talking on stderr\n")
    assert screen.dropped >= 10


def test_every_line_a_closed_stdout_did_not_take_is_counted(
        terminals: Callable[..., Terminal]) -> None:
    out = terminals(reading=False)
    err = terminals()
    out.close_reader()
    screen = Screen(out.file, err.file, buffer_bytes=2048, stall_after=0.3)
    # Three lines in one chunk, written (and refused) before anyone knew stdout was closed.
    screen.put_output(OUT, b"rank 0: a\nrank 0: b\nrank 0: c\n", 3)
    wait_for(lambda: b"stdout is closed" in err.data)
    for i in range(10):
        screen.put_output(OUT, line(i), 1)
    assert screen.close(5)
    assert screen.dropped == 13


def test_close_returns_within_its_timeout_when_the_console_never_reads(
        terminals: Callable[..., Terminal]) -> None:
    out = terminals(reading=False)
    err = terminals()
    screen = Screen(out.file, err.file, buffer_bytes=2048, stall_after=0.3)
    stall(screen)
    screen.put_message(OUT, b"cluster launcher: the verdict\n")
    started = time.monotonic()
    assert screen.close(timeout=0.5) is False
    assert time.monotonic() - started < 0.5 + 0.5
    assert not screen.put_output(OUT, b"rank 0: too late\n", 1)

    out.resume()  # the console comes back: what was queued is still written
    assert screen.close(5)
    data = out.everything()
    assert data.endswith(b"cluster launcher: the verdict\n")
    assert b"too late" not in data


def test_close_writes_everything_queued_on_a_healthy_console(
        terminals: Callable[..., Terminal]) -> None:
    out = terminals()
    err = terminals()
    screen = Screen(out.file, err.file, buffer_bytes=2048, stall_after=1.0)
    for i in range(100):
        screen.put_output(OUT, line(i), 1)
    screen.put_output(ERR, b"rank 0: a warning\n", 1)
    screen.put_message(ERR, b"cluster launcher: run completed\n")
    assert screen.close(5)
    assert out.everything() == b"".join(line(i) for i in range(100))
    assert err.everything() == b"rank 0: a warning\ncluster launcher: run completed\n"


def three_line_table(columns: int, rows: int) -> str:
    return "table 1\ntable 2\ntable 3"


def test_the_live_table_is_erased_before_output_and_not_left_behind_after_close(
        terminals: Callable[..., Terminal]) -> None:
    out = terminals()
    err = terminals()
    screen = Screen(out.file, err.file, buffer_bytes=2048, stall_after=1.0)
    screen.set_status(three_line_table)
    wait_for(lambda: b"table 3" in out.data)
    assert screen.put_output(OUT, b"rank 0: hello\n", 1)
    wait_for(lambda: out.data.count(b"table 3") >= 2)  # drawn again below the output
    assert screen.close(5)
    data = out.everything()
    # The table is wiped right before the output scrolls in above where it was...
    assert ERASE_3 + b"rank 0: hello\n" in data
    assert data.index(b"table 3") < data.index(b"rank 0: hello\n")
    # ...drawn whole every time...
    assert data.count(b"table 1") == data.count(b"table 2") == data.count(b"table 3")
    # ...and the last thing close() writes is its erasure.
    assert data.endswith(b"table 3" + ERASE_3)


def test_switching_the_live_table_off_erases_it_for_good(
        terminals: Callable[..., Terminal]) -> None:
    out = terminals()
    err = terminals()
    screen = Screen(out.file, err.file, buffer_bytes=2048, stall_after=1.0)
    screen.set_status(three_line_table)
    wait_for(lambda: b"table 3" in out.data)
    screen.set_status(None)
    wait_for(lambda: out.data.endswith(ERASE_3))
    seen = out.data
    time.sleep(0.6)  # more than two redraw periods
    assert out.data == seen
    assert screen.close(5)
    assert out.everything() == seen


def test_an_interrupt_gives_up_queued_rank_output_so_the_verdict_shows_at_once() -> None:
    term = Terminal(chunk=1024, delay=0.01)  # about 100 KB/s: a slow terminal
    screen = Screen(term.file, term.file, buffer_bytes=1 << 20, stall_after=5.0)
    line = b"x" * 99 + b"\n"
    for _ in range(5000):  # 500 KB queued: seconds of work for this terminal
        screen.put_output(OUT, line, 1)
    started = time.monotonic()
    screen.give_up_output("the run was interrupted (SIGINT)")
    assert not screen.put_output(OUT, line, 1)  # nothing more is shown
    screen.seal()
    screen.put_message(ERR, b"cluster launcher: interrupted by SIGINT\n")
    assert screen.close(timeout=5.0)
    took = time.monotonic() - started
    data = term.everything()
    assert data.endswith(b"cluster launcher: interrupted by SIGINT\n")
    assert took < 2.0, took
    assert screen.dropped > 4000  # counted, for the launcher's line before its verdict
