"""One writer thread for a run's files: what the launcher's busy threads hand a log is
written in order, off their time.

Why: the threads that see a rank start, print its first line and join (a relay's
reader, the supervisor, the coordinator) used to write the log themselves: a folder,
two files, a JSON line and a console line, about 300 us a rank. At 8,192 ranks that was
seconds, and a hello waited behind the output read before it on the same relay, so the
cohort formed seconds after its last hello (bench/README.md, issue 35). Now they queue a
call and go on; this thread makes the files. Its system calls run without the GIL,
beside the Python of the others.

The guarantees the logs had still hold:
* **Order.** One thread, one queue: the calls run in the order they were handed over
  (a rank's folder before its output, an attempt's number before its ranks' files).
* **Bounds.** At most `limits.RECORD_QUEUE_BYTES` wait (rank output counts its bytes,
  an event `EVENT_SIZE`). A producer past it waits for the disk, as it did when it
  wrote itself, but at most `limits.RECORD_STALL_S`: then the log is given up (told
  once through ``on_stall``) and the run goes on, as after a failed write. `flush` and
  `close` wait at most their ``timeout``.
* **Reentrance.** A call made on this thread itself (a failed write says so through an
  event that comes back to the log) runs at once: it never waits for itself.

While calls keep coming (8,192 ranks starting, printing and joining at once), the writer
lets the burst pass: it writes once no call came for `QUIET_S`, and never later than
`LATEST_S` after the first one waited (or at half its bound, or when asked to flush).
The threads of the burst then have the GIL to themselves, and the cohort forms sooner.
The writer also runs `WRITER_NICE` nicer than they do: where they share a core with it,
the kernel gives them the core first, and the files' system calls wait for a gap.
What a batch's calls buffered (events.jsonl's lines, console.log's) is written when the
batch ends (``after_batch``), in a few large writes, before a `flush` returns.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

from ..limits import RECORD_QUEUE_BYTES, RECORD_STALL_S

#: What an event counts against the bound (its JSON line and its words, about).
EVENT_SIZE = 512
#: A burst has paused when no call came for this long: the writer writes then.
QUIET_S = 0.02
#: The longest a call waits for a burst to pause before it is written anyway.
LATEST_S = 0.5
#: How much nicer than the launcher's other threads the writer runs (Linux: a thread's
#: own nice value): where they share a core, the kernel's time making the logs' files
#: comes after theirs.
WRITER_NICE = 10


class Deferred:
    """Calls run in order on one daemon thread named ``name``, started by the first."""

    def __init__(self, name: str, *, on_stall: Optional[Callable[[str], None]] = None,
                 max_bytes: int = RECORD_QUEUE_BYTES, stall_s: float = RECORD_STALL_S,
                 after_batch: Optional[Callable[[], None]] = None) -> None:
        self.name = name
        self.on_stall = on_stall
        #: Run on the writer after each batch of calls, before `flush` returns: what the
        #: calls buffered goes to disk once a batch, not once a call (issue 35).
        self.after_batch = after_batch
        self.max_bytes = max_bytes
        self.stall_s = stall_s
        self._calls: deque[tuple[Callable[[], None], int]] = deque()
        self._bytes = 0
        self._running = False  # a batch taken off the queue is being written
        self._idle = False  # the writer waits for calls
        self._flushing = 0  # callers waiting in `flush`: no pause is waited for
        self._closed = False
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        #: Why the writer gave up (the disk stalled), once it did.
        self.stalled: Optional[str] = None

    def call(self, fn: Callable[..., Any], *args: Any, size: int = EVENT_SIZE) -> None:
        """``fn(*args)`` on the writer thread, after every call handed over before."""
        if threading.current_thread() is self._thread:
            fn(*args)
            return
        stalled = None
        with self._cond:
            if self._closed or self.stalled is not None:
                return
            if self._bytes + size > self.max_bytes and self._bytes and \
                    not self._cond.wait_for(self._has_room(size), timeout=self.stall_s):
                stalled = self.stalled = (
                    f"the disk took none of the log's writes for {self.stall_s:g} s")
                self._calls.clear()
                self._bytes = 0
                self._cond.notify_all()
            if stalled is None and not self._closed:
                self._calls.append((functools.partial(fn, *args), size))
                self._bytes += size
                self._start()
                if self._idle:  # waking a busy writer costs both threads a GIL switch
                    self._cond.notify_all()
        if stalled is not None and self.on_stall is not None:
            self.on_stall(stalled)

    @property
    def alive(self) -> bool:
        """Whether the writer thread still runs (after `close`: one that a stalled disk
        held past its bound); while it does, only it may touch what its calls write."""
        return self._thread is not None and self._thread.is_alive()

    def _has_room(self, size: int) -> Callable[[], bool]:
        return lambda: self._closed or self._bytes + size <= self.max_bytes or not self._bytes

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def flush(self, timeout: float) -> bool:
        """Wait until every call handed over so far has run (at most ``timeout`` s);
        whether they all did. On the writer thread itself: at once."""
        if threading.current_thread() is self._thread:
            return not self._calls
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()
            try:
                return self._cond.wait_for(lambda: not self._calls and not self._running,
                                           timeout=timeout)
            finally:
                self._flushing -= 1

    def close(self, timeout: float) -> bool:
        """Run what is queued (at most ``timeout`` s), then stop the thread; later calls
        are dropped. Whether everything queued was written."""
        done = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.1, timeout / 10))
        return done

    def _let_the_burst_pass(self) -> None:
        """Under the lock: while calls keep coming, wait for a pause of `QUIET_S`, at most
        `LATEST_S`, unless half the bound is used, a flush waits, or the writer closes."""
        began = time.monotonic()
        seen = len(self._calls)
        while not self._closed and not self._flushing and self._bytes < self.max_bytes // 2:
            left = began + LATEST_S - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(min(QUIET_S, left))
            if len(self._calls) == seen:
                return
            seen = len(self._calls)

    def _run(self) -> None:
        _nicer(WRITER_NICE)
        while True:
            with self._cond:
                self._idle = True
                self._cond.wait_for(lambda: self._calls or self._closed)
                self._idle = False
                self._let_the_burst_pass()
                if not self._calls:
                    return
                batch = list(self._calls)
                self._calls.clear()
                self._running = True
            failed = None
            try:
                for fn, _ in batch:
                    fn()
                if self.after_batch is not None:
                    self.after_batch()
            except Exception as exc:  # a sink must not raise; this one is given up
                failed = f"the log's writer failed: {exc!r}"
            with self._cond:
                self._running = False
                self._bytes = max(0, self._bytes - sum(size for _, size in batch))
                if failed is not None:
                    self.stalled = failed
                    self._calls.clear()
                    self._bytes = 0
                self._cond.notify_all()
            if failed is not None:
                if self.on_stall is not None:
                    self.on_stall(failed)
                return


def _nicer(by: int) -> None:
    """Raise this thread's nice value by ``by`` (never lowers it: no privilege needed);
    where threads cannot have their own (not Linux), nothing."""
    if by <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except (AttributeError, OSError):
        pass


__all__ = ["EVENT_SIZE", "Deferred"]
