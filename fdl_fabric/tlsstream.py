"""A TLS connection that one thread reads while others write.

A walk-in's agent speaks over one TLS connection both ways at once: a reader thread
waits for frames while the supervisor's threads send pings and specs. OpenSSL does not
allow two threads inside one connection at the same time, and Python's `ssl` does not
serialise them, so this puts the socket in non-blocking mode and runs every TLS call
under one lock, *never waiting while holding it*: a call that would block
(``SSLWantReadError``, ``SSLWantWriteError``) lets the lock go and waits in ``select``
for the socket. Every wait has a bound (`sendall`'s ``timeout``, `recv_exactly`'s
deadline); `recv` waits in slices so a `close` from another thread ends it.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
import time
from typing import Callable, Optional, Union

#: A deadline (monotonic), or what gives it at each wait: one that can come closer.
Deadline = Union[float, Callable[[], float]]

#: Longest single wait in ``select``: how soon a blocked reader notices a close.
_SLICE = 0.5


class StreamClosed(Exception):
    """The connection ended (its peer closed it, or it was closed here)."""


class TlsStream:
    """One TLS socket shared by a reader and writers (see the module docstring)."""

    def __init__(self, sock: ssl.SSLSocket) -> None:
        self.sock = sock
        sock.setblocking(False)
        self._lock = threading.Lock()
        self._closed = False

    @property
    def peer(self) -> str:
        try:
            return str(self.sock.getpeername()[0])
        except OSError:
            return "?"

    def recv(self, size: int, deadline: Optional[Deadline] = None) -> bytes:
        """Up to ``size`` bytes, waiting for at least one; b"" at the end of the stream.
        ``deadline`` (monotonic, or a callable giving it at each wait): `TimeoutError`
        past it."""
        while True:
            wait_write = False
            with self._lock:
                if self._closed:
                    return b""
                try:
                    return self.sock.recv(size)
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLWantWriteError:
                    wait_write = True
                except ssl.SSLZeroReturnError:
                    return b""
                except (ssl.SSLError, OSError):
                    return b""
            self._wait(wait_write, deadline)

    def recv_exactly(self, size: int, deadline: Deadline) -> bytes:
        """Exactly ``size`` bytes before ``deadline``; `StreamClosed` at the end of the
        stream, `TimeoutError` past the deadline."""
        parts: list[bytes] = []
        left = size
        while left:
            chunk = self.recv(left, deadline)
            if not chunk:
                raise StreamClosed("the connection was closed")
            parts.append(chunk)
            left -= len(chunk)
        return b"".join(parts)

    def sendall(self, data: bytes, timeout: float = 30.0) -> None:
        """All of ``data``, within ``timeout`` seconds (`TimeoutError`: the peer stopped
        reading); `StreamClosed` when the connection is gone."""
        deadline = time.monotonic() + timeout
        view = memoryview(data)
        while view:
            wait_write = True
            with self._lock:
                if self._closed:
                    raise StreamClosed("the connection was closed")
                try:
                    sent = self.sock.send(view)
                    view = view[sent:]
                    continue
                except ssl.SSLWantWriteError:
                    pass
                except ssl.SSLWantReadError:
                    wait_write = False
                except (ssl.SSLError, OSError) as exc:
                    raise StreamClosed(str(exc)) from None
            self._wait(wait_write, deadline)

    def _wait(self, write: bool, deadline: Optional[Deadline]) -> None:
        slice_ = _SLICE
        if deadline is not None:
            left = (deadline() if callable(deadline) else deadline) - time.monotonic()
            if left <= 0:
                raise TimeoutError("the connection's deadline passed")
            slice_ = min(slice_, left)
        try:
            if write:
                select.select([], [self.sock], [], slice_)
            else:
                select.select([self.sock], [], [], slice_)
        except (OSError, ValueError):  # closed under us: the next call says so
            time.sleep(0.01)

    def shutdown_write(self) -> None:
        """No more bytes from this side (the agent's end of input, the leash): a TCP
        half-close. ``SSLSocket.shutdown`` would drop the TLS state and read the rest as
        plain bytes, so the plain socket's is called; the peer reads the end of input."""
        with self._lock, contextlib.suppress(OSError, ValueError):
            socket.socket.shutdown(self.sock, socket.SHUT_WR)

    def close(self) -> None:
        """Cut the connection; a reader waiting in `recv` returns b"" within a slice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(OSError, ValueError):
                self.sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError, ValueError):
                self.sock.close()

    @property
    def closed(self) -> bool:
        return self._closed
