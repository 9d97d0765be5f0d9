"""One thread reads every SSH session the launcher holds: a selector over their channels.

invoke's runners read a process with a thread per stream, so every agent session cost
the launcher two reading threads besides paramiko's transport thread: 3 threads a host,
195 at 64 hosts (issue 23). Here one daemon thread, started on first use, waits on every
registered channel at once (a paramiko channel's ``fileno()`` is a pipe that becomes
readable when data, EOF or a close arrives) and hands the bytes to the same `ByteSink`s
invoke's threads fed: a flat launch then costs one thread per host (paramiko's own).

* **Fair:** at most `TURN_BYTES` of one channel per turn, so a host that floods its
  output cannot starve the others' frames (exits, heartbeats).
* **A slow console:** a sink may block (rank output waits for room on a slow terminal,
  bounded by `presentation.screen`'s stall rule); while it does, no channel is read.
  `held_until` says until when a sink held the thread for longer than `HELD_AFTER` (now,
  while one does), and a session does not count that time as silence
  (`session.AgentSession.last_heard`): the agents were talking, the launcher was the one
  not listening. Short feeds (a host that merely talks a lot) excuse nobody, so a
  frozen host is still found while another floods the console.
* **The end of a session** (EOF, a close, a lost connection) closes both sinks on a
  short-lived thread of its own, because closing one may wait for the exit status
  (`session.STATUS_WAIT`), which must not hold up every other host. paramiko closes a
  channel's pipe when the channel is closed here (a kill), so a kill pokes the reader
  (`poke`), and every `IDLE_WAIT` seconds the reader looks for closed channels anyway.

Writing to a channel is unchanged (the launcher's threads, under the session's lock).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from .base import ByteSink

#: Bytes read from one channel at a time.
CHUNK = 64 * 1024
#: Bytes of one channel read per turn before the others get theirs.
TURN_BYTES = 4 * CHUNK
#: Seconds the selector waits with nothing ready (only to notice it has no work left).
IDLE_WAIT = 5.0
#: Seconds one sink may hold the reading thread before every session is excused.
HELD_AFTER = 0.5


@dataclass(eq=False)
class Watch:
    """One channel being read: its sinks, and when its streams ended."""

    channel: Any
    stdout: ByteSink
    stderr: ByteSink
    name: str
    ended: threading.Event = field(default_factory=threading.Event)
    #: The descriptor it was registered with (paramiko may close it under us).
    fd: int = -1
    closing: bool = False

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait until both sinks were closed (what joining invoke's threads gave)."""
        return self.ended.wait(timeout)


class ChannelReader:
    """The one reading thread, and the channels it watches."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._adding: list[Watch] = []
        self._poked: list[Watch] = []
        self._watches: dict[int, Watch] = {}
        self._thread: Optional[threading.Thread] = None
        self._feeding: Optional[float] = None
        self._held_until = 0.0

    def held_until(self) -> float:
        """The last moment a sink held the reading thread for over `HELD_AFTER` seconds:
        now while one does; 0.0 if none ever did."""
        since = self._feeding
        now = time.monotonic()
        if since is not None and now - since > HELD_AFTER:
            return now
        return self._held_until

    @property
    def watching(self) -> int:
        """Channels being read now."""
        return len(self._watches)

    def watch(self, channel: Any, stdout: ByteSink, stderr: ByteSink,
              name: str = "") -> Watch:
        """Read ``channel`` into the sinks from now on, until its streams end."""
        watch = Watch(channel, stdout, stderr, name)
        with self._lock:
            self._adding.append(watch)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="fdl-channel-reader")
                self._thread.start()
        self._wake()
        return watch

    def poke(self, watch: Watch) -> None:
        """Look at ``watch`` now: its channel was closed here (its pipe may be gone)."""
        with self._lock:
            self._poked.append(watch)
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    # -- the reading thread ----------------------------------------------------------------
    def _run(self) -> None:
        swept = time.monotonic()
        while True:
            self._take_new()
            for key, _ in self._selector.select(IDLE_WAIT):
                if key.data is None:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                    continue
                self._read(key.data)
            if time.monotonic() - swept >= IDLE_WAIT:
                swept = time.monotonic()
                for watch in list(self._watches.values()):
                    if watch.channel.closed:
                        self._read(watch)

    def _take_new(self) -> None:
        with self._lock:
            adding, self._adding = self._adding, []
            poked, self._poked = self._poked, []
        for watch in poked:
            if self._watches.get(watch.fd) is watch:
                self._read(watch)
        for watch in adding:
            try:
                fd = watch.channel.fileno()
            except Exception:  # closed before it was watched: it has ended
                self._end(watch)
                continue
            stale = self._watches.get(fd)
            if stale is not None:  # its pipe was closed and the number reused
                self._forget(stale)
                self._end(stale)
            watch.fd = fd
            self._watches[fd] = watch
            self._selector.register(fd, selectors.EVENT_READ, watch)

    def _forget(self, watch: Watch) -> None:
        if self._watches.get(watch.fd) is watch:
            del self._watches[watch.fd]
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.unregister(watch.fd)

    def _read(self, watch: Watch) -> None:
        """One turn of one channel: what is buffered, up to `TURN_BYTES` a stream; the
        end once nothing is left and the channel saw EOF or closed."""
        channel = watch.channel
        try:
            got = self._pump(watch.stderr, channel.recv_stderr_ready, channel.recv_stderr)
            got += self._pump(watch.stdout, channel.recv_ready, channel.recv)
            done = not got and not channel.recv_ready() and \
                not channel.recv_stderr_ready() and (channel.eof_received or channel.closed)
        except Exception:  # a channel torn down under us has ended too
            done = True
        if done:
            self._forget(watch)
            self._end(watch)

    def _pump(self, sink: ByteSink, ready: Any, recv: Any) -> int:
        got = 0
        while got < TURN_BYTES and ready():
            data = recv(CHUNK)
            if not data:
                break
            got += len(data)
            start = self._feeding = time.monotonic()
            try:
                sink.feed(data)
            finally:
                self._feeding = None
                end = time.monotonic()
                if end - start > HELD_AFTER:
                    self._held_until = end
        return got

    def _end(self, watch: Watch) -> None:
        if watch.closing:
            return
        watch.closing = True

        def close() -> None:
            try:
                for sink in (watch.stderr, watch.stdout):
                    with contextlib.suppress(Exception):
                        sink.close()
            finally:
                watch.ended.set()

        threading.Thread(target=close, daemon=True,
                         name=f"fdl-session-end-{watch.name}").start()


_reader: Optional[ChannelReader] = None
_reader_lock = threading.Lock()


def reader() -> ChannelReader:
    """The process's one `ChannelReader` (no lock once it exists: every host's liveness
    check asks for it)."""
    global _reader
    found = _reader
    if found is not None:
        return found
    with _reader_lock:
        if _reader is None:
            _reader = ChannelReader()
        return _reader
