"""The one thread that reads every SSH session (`fdl_fabric.transport.channels`), over fake
channels that behave as paramiko's do: ``fileno()`` is a pipe that is readable while data
is buffered and for good after EOF or a close, and a local close closes that pipe."""

from __future__ import annotations

import os
import threading
import time
from typing import Optional

from fdl_fabric.transport import channels
from fdl_fabric.transport.channels import ChannelReader


class FakeChannel:
    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        self._lock = threading.Lock()
        self.out = bytearray()
        self.err = bytearray()
        self.eof_received = False
        self.closed = False
        self._signalled = False

    def fileno(self) -> int:
        return self._r

    def _set(self) -> None:
        if not self._signalled:
            os.write(self._w, b"x")
            self._signalled = True

    def _clear(self) -> None:
        if self._signalled and not (self.out or self.err or self.eof_received):
            os.read(self._r, 1)
            self._signalled = False

    def feed(self, data: bytes, stderr: bool = False) -> None:
        with self._lock:
            (self.err if stderr else self.out).extend(data)
            self._set()

    def eof(self) -> None:
        with self._lock:
            self.eof_received = True
            self._set()

    def close_here(self) -> None:
        """A local close, as paramiko's: the pipe goes with it."""
        with self._lock:
            self.closed = True
            os.close(self._r)
            os.close(self._w)

    def recv_ready(self) -> bool:
        return bool(self.out)

    def recv_stderr_ready(self) -> bool:
        return bool(self.err)

    def _take(self, buf: bytearray, n: int) -> bytes:
        with self._lock:
            data = bytes(buf[:n])
            del buf[:n]
            self._clear()
            return data

    def recv(self, n: int) -> bytes:
        return self._take(self.out, n)

    def recv_stderr(self, n: int) -> bytes:
        return self._take(self.err, n)


class Sink:
    def __init__(self, hold: Optional[threading.Event] = None) -> None:
        self.data = bytearray()
        self.closed = threading.Event()
        self.hold = hold
        self.feeds = 0

    def feed(self, data: bytes) -> None:
        self.feeds += 1
        if self.hold is not None:
            self.hold.wait(10)
        self.data.extend(data)

    def close(self) -> None:
        self.closed.set()


def _wait(predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_every_byte_of_both_streams_reaches_its_sink_and_eof_closes_both() -> None:
    reader = ChannelReader()
    chan, out, err = FakeChannel(), Sink(), Sink()
    watch = reader.watch(chan, out, err, name="h1")
    chan.feed(b"frame one;")
    chan.feed(b"traceback", stderr=True)
    chan.feed(b"frame two")
    _wait(lambda: len(out.data) == 19 and len(err.data) == 9)
    assert bytes(out.data) == b"frame one;frame two" and bytes(err.data) == b"traceback"
    assert not out.closed.is_set()
    chan.eof()
    assert watch.wait(5) and out.closed.is_set() and err.closed.is_set()
    _wait(lambda: reader.watching == 0)


def test_one_reader_serves_many_channels_with_one_thread() -> None:
    reader = ChannelReader()
    before = threading.active_count()
    pairs = [(FakeChannel(), Sink()) for _ in range(20)]
    for i, (chan, sink) in enumerate(pairs):
        reader.watch(chan, sink, Sink(), name=f"h{i}")
        chan.feed(b"hello %d" % i)
    _wait(lambda: all(sink.data for _, sink in pairs))
    assert threading.active_count() - before == 1
    assert [bytes(s.data) for _, s in pairs] == [b"hello %d" % i for i in range(20)]


def test_a_flooding_channel_gets_one_turn_at_a_time() -> None:
    """A host that never stops talking must not starve the others' frames."""
    reader = ChannelReader()
    loud, quiet = FakeChannel(), FakeChannel()
    loud_sink, quiet_sink = Sink(), Sink()
    loud.feed(b"x" * (channels.TURN_BYTES * 8))
    reader.watch(loud, loud_sink, Sink(), name="loud")
    reader.watch(quiet, quiet_sink, Sink(), name="quiet")
    quiet.feed(b"exited")
    _wait(lambda: bytes(quiet_sink.data) == b"exited")
    _wait(lambda: len(loud_sink.data) == channels.TURN_BYTES * 8)


def test_a_sink_held_past_the_bound_excuses_every_session_until_it_lets_go() -> None:
    reader = ChannelReader()
    hold = threading.Event()
    chan = FakeChannel()
    reader.watch(chan, Sink(hold), Sink(), name="slow-console")
    assert reader.held_until() == 0.0
    chan.feed(b"output")
    time.sleep(channels.HELD_AFTER + 0.2)
    assert abs(reader.held_until() - time.monotonic()) < 0.05, "held: now"
    hold.set()
    _wait(lambda: reader._feeding is None)
    released = reader.held_until()
    time.sleep(0.1)
    assert reader.held_until() == released, "after: the moment it let go, not now"


def test_short_feeds_excuse_nobody() -> None:
    reader = ChannelReader()
    chan, sink = FakeChannel(), Sink()
    reader.watch(chan, sink, Sink(), name="chatty")
    for _ in range(50):
        chan.feed(b"line\n")
        time.sleep(0.002)
    _wait(lambda: len(sink.data) == 250)
    assert reader.held_until() == 0.0


def test_a_channel_closed_here_ends_when_poked_though_its_pipe_is_gone() -> None:
    reader = ChannelReader()
    chan, out, err = FakeChannel(), Sink(), Sink()
    watch = reader.watch(chan, out, err, name="killed")
    chan.feed(b"last words")
    _wait(lambda: bytes(out.data) == b"last words")
    chan.close_here()
    reader.poke(watch)
    assert watch.wait(5) and out.closed.is_set() and err.closed.is_set()
    # The descriptor number is free again: a new channel may get it.
    fresh, fresh_out = FakeChannel(), Sink()
    reader.watch(fresh, fresh_out, Sink(), name="next")
    fresh.feed(b"ok")
    _wait(lambda: bytes(fresh_out.data) == b"ok")


def test_ending_a_session_does_not_wait_on_the_reading_thread() -> None:
    """Closing a sink may wait for the exit status (seconds): not on the shared thread."""
    reader = ChannelReader()
    slow_close = threading.Event()

    class SlowCloseSink(Sink):
        def close(self) -> None:
            slow_close.wait(10)
            super().close()

    chan = FakeChannel()
    reader.watch(chan, SlowCloseSink(), Sink(), name="ending")
    chan.eof()
    other, other_sink = FakeChannel(), Sink()
    reader.watch(other, other_sink, Sink(), name="other")
    other.feed(b"still read")
    _wait(lambda: bytes(other_sink.data) == b"still read")
    slow_close.set()
