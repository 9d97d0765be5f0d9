"""The bytes of a tunnel's connections: each one's channel, its socket to the coordinator
once it has one, and what moves between the two (`fdl_fabric.transport.tunnel` says why
and within which bounds).

`LinkMover` is the part of a `tunnel.Forward` that moves bytes: it reads a channel into
its connection's buffer, connects the socket without blocking, writes each side as it
takes bytes (holding at most `_BUFFER_MAX` a direction, so a slow side slows the sender
rather than growing a buffer), tells the selector what to watch, and closes a connection
for good. What a connection that has not yet sent its first frame becomes (`_framed`) is
the forward's, which bounds those.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import logging
import os
import selectors
import socket
import time
from typing import Any, Optional, Union

from .. import limits

#: The tunnel's logger: what a connection's bytes say is said under the tunnel's name.
log = logging.getLogger(__package__ + ".tunnel")

#: Bytes moved per read, either way.
_CHUNK = 65536
#: Bytes held for one direction of one connection before reading that side pauses (the
#: channel's window then slows the sender on the host, the socket's buffer the coordinator).
_BUFFER_MAX = 1 << 20

WAITING, QUEUED, CONNECTING, OPEN, CLOSED = "waiting", "queued", "connecting", "open", "closed"
#: A frame's tag (`fdl_fabric.rank.TAG_BYTES`): no frame is shorter.
_TAG_BYTES = 32


class Link:
    """One forwarded connection: its channel, and its socket to the coordinator once its
    first frame is in and there is room."""

    __slots__ = ("chan", "sock", "since", "state", "to_sock", "to_chan", "chan_eof",
                 "sock_eof", "interest")

    def __init__(self, chan: Any, since: float) -> None:
        self.chan = chan
        self.sock: Optional[socket.socket] = None
        #: When it arrived; once queued, when its frame was in.
        self.since = since
        self.state = WAITING
        self.to_sock = bytearray()
        self.to_chan = bytearray()
        self.chan_eof = False
        self.sock_eof = False
        self.interest = 0


def first_frame(buf: Union[bytes, bytearray]) -> Optional[bool]:
    """Whether ``buf`` starts with one whole frame of the coordinator's protocol (a 4-byte
    big-endian length, then that many bytes: a 32-byte tag and the payload): True, False
    while it may still become one, None when it cannot (a length no hello has)."""
    if len(buf) < 4:
        return False
    length = int.from_bytes(buf[:4], "big")
    if not _TAG_BYTES <= length <= limits.TUNNEL_FIRST_FRAME_MAX:
        return None
    return len(buf) >= 4 + length


class LinkMover(abc.ABC):
    """The connections of one forward to ``target:port`` here, and the bytes between each
    one's channel and its socket (see the module docstring)."""

    def __init__(self, port: int, target: str) -> None:
        self.port = port
        self.target = target
        #: Connections turned away, by why (`Name.TUNNEL_TURNED_AWAY`'s data).
        self.counts = {"busy": 0, "files": 0, "silent": 0, "garbled": 0}
        self.most_open = 0
        #: Connections without their first frame, and with it waiting for room, oldest
        #: first; and those with a socket to the coordinator.
        self._waiting: dict[int, Link] = {}
        self._queued: dict[int, Link] = {}
        self._open: set[Link] = set()
        self._stalled: set[Link] = set()
        self._sel: Optional[selectors.BaseSelector] = None
        self._family = socket.AF_INET
        self._address: Any = (target, port)

    @abc.abstractmethod
    def _framed(self, link: Link, now: float) -> Optional[bool]:
        """What a waiting connection becomes once more of it came: the forward's to say,
        since it bounds the connections that wait (`tunnel.Forward._framed`)."""

    @staticmethod
    def _recv(link: Link) -> Optional[bytes]:
        """What the channel has (b"" once it ended; None: nothing yet)."""
        try:
            data: bytes = link.chan.recv(_CHUNK)
        except socket.timeout:
            return None
        except Exception:
            return b""
        return data

    def _from_channel(self, link: Link, now: float) -> None:
        while link.state is not CLOSED and len(link.to_sock) < _BUFFER_MAX \
                and not link.chan_eof:
            data = self._recv(link)
            if data is None:
                break
            if data:
                link.to_sock += data
            else:
                link.chan_eof = True
            if link.state is WAITING and self._framed(link, now) is not True:
                return
        if link.state is WAITING and link.chan_eof:
            self._close(link)  # gone before its first frame: it left, nothing to count
        elif link.state in (CONNECTING, OPEN):
            self._to_sock(link)

    def _connect(self, link: Link) -> bool:
        """The connection's socket to the coordinator, connecting without blocking."""
        try:
            sock = socket.socket(self._family, socket.SOCK_STREAM)
        except OSError as exc:
            self._turn_away(link, "files" if exc.errno in (errno.EMFILE, errno.ENFILE)
                            else "busy")
            return False
        sock.setblocking(False)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        err = sock.connect_ex(self._address)
        if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
            sock.close()
            log.debug("tunnel %s: connecting to %s failed: %s", self.port, self._address,
                      os.strerror(err))
            self._close(link)
            return False
        link.sock = sock
        link.state = CONNECTING
        self._open.add(link)
        self.most_open = max(self.most_open, len(self._open))
        return True

    def _to_sock(self, link: Link) -> None:
        if link.state is OPEN and link.to_sock:
            assert link.sock is not None
            try:
                sent = link.sock.send(link.to_sock)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._close(link)
                return
            del link.to_sock[:sent]
        if link.state is OPEN and link.chan_eof and not link.to_sock:
            self._close(link)
            return
        self._interest(link)

    def _sock_writable(self, link: Link) -> None:
        if link.state is CONNECTING:
            assert link.sock is not None
            err = link.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                log.debug("tunnel %s: connecting to %s failed: %s", self.port, self._address,
                          os.strerror(err))
                self._close(link)
                return
            link.state = OPEN
        self._to_sock(link)
        if link.state is OPEN and len(link.to_sock) < _BUFFER_MAX and not link.chan_eof:
            self._from_channel(link, time.monotonic())  # reading may have paused on a full buffer

    def _sock_readable(self, link: Link) -> None:
        assert link.sock is not None
        try:
            data = link.sock.recv(_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(link)
            return
        if data:
            link.to_chan += data
        else:
            link.sock_eof = True
        self._to_channel(link)

    def _to_channel(self, link: Link) -> None:
        while link.to_chan:
            try:
                sent = link.chan.send(bytes(link.to_chan[:_CHUNK]))
            except socket.timeout:  # the channel's window is full: retried every tick
                break
            except Exception:
                self._close(link)
                return
            if not sent:
                self._close(link)
                return
            del link.to_chan[:sent]
        if link.to_chan:
            self._stalled.add(link)
        else:
            self._stalled.discard(link)
            if link.sock_eof:
                self._close(link)
                return
        self._interest(link)

    def _interest(self, link: Link) -> None:
        """What the selector watches on the connection's socket."""
        if link.sock is None or link.state is CLOSED or self._sel is None:
            return
        want = 0
        if link.state is CONNECTING or (link.state is OPEN and link.to_sock):
            want |= selectors.EVENT_WRITE
        if link.state is OPEN and not link.sock_eof and len(link.to_chan) < _BUFFER_MAX:
            want |= selectors.EVENT_READ
        if want == link.interest:
            return
        if not link.interest:
            self._sel.register(link.sock, want, link)
        elif not want:
            self._sel.unregister(link.sock)
        else:
            self._sel.modify(link.sock, want, link)
        link.interest = want

    def _turn_away(self, link: Link, why: str) -> None:
        self.counts[why] += 1
        self._close(link)

    def _close(self, link: Link) -> None:
        if link.state is CLOSED:
            return
        link.state = CLOSED
        self._waiting.pop(id(link), None)
        self._queued.pop(id(link), None)
        self._open.discard(link)
        self._stalled.discard(link)
        if link.sock is not None:
            if link.interest and self._sel is not None:
                with contextlib.suppress(Exception):
                    self._sel.unregister(link.sock)
            link.interest = 0
            link.sock.close()
        with contextlib.suppress(Exception):
            link.chan.close()
