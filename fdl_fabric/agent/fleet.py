"""The fleet pre-flight on this host: a listener on the ports the job will use, dials to
the other hosts' listeners, and this host's interfaces (`fdl_fabric.preflight.matrix`
says what to dial and judges the answers).

Three requests, each a PROBE ``{"fleet": ...}`` answered by FACTS ``{"fleet": ...}``:

- ``listen``: bind the ports asked (``master_port`` on rank 0's host) and a sample of the
  ephemeral range (the ports gloo and NCCL listen on), on every address, and say which
  could be bound, with this host's interfaces. A port already taken is reported, never
  taken over; the ports are held only until ``close`` (or the first rank's start), so the
  job finds them free.
- ``dial``: connect to every target at once, each bounded by the request's timeout, and
  prove it is the named host's listener: a probe frame keyed with the check's token, and
  a keyed reply naming the host. Meanwhile this host's own listener keeps answering, so
  every host can dial at the same moment.
- ``close``: release every port.

One listener object serves all its sockets from the agent's own ``select`` loop (the
agent is single-threaded); the dial runs its own loop over the same sockets. Standard
library only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hmac
import os
import random
import selectors
import socket
import struct
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from fdl_fabric import rank
from fdl_fabric.agent import wire

Send = Callable[[int, Optional[Dict[str, Any]]], None]
Beat = Callable[[float], None]

#: The run id the check's frames are keyed with (with the check's own token).
FLEET_RUN = "fleet-check"
#: Bytes a connection to the listener may send before it is dropped (one probe frame).
MAX_PROBE = 4096
#: Seconds an accepted connection has to send its probe.
ACCEPT_TIMEOUT = 5.0
#: Dials in flight at once (each holds a file descriptor).
MAX_IN_FLIGHT = 256
#: The listener closes itself this long after ``listen`` if no ``close`` came.
HOLD_LIMIT = 120.0
_SIOCGIFADDR = 0x8915


def interfaces() -> Dict[str, Dict[str, Any]]:
    """name -> {"up": bool, "addrs": [IPv4 addresses]} of this host's interfaces, from
    /sys and ``SIOCGIFADDR`` (the primary IPv4 address), so no tool is needed."""
    found: Dict[str, Dict[str, Any]] = {}
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return found
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in names:
            addrs: List[str] = []
            try:
                packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR,
                                     struct.pack("256s", name.encode()[:15]))
                addrs.append(socket.inet_ntoa(packed[20:24]))
            except OSError:
                pass
            found[name] = {"up": _is_up(name), "addrs": addrs}
    return found


def _is_up(name: str) -> bool:
    """IFF_UP in the interface's flags (a veth whose peer is down is still "up" here:
    the dials tell whether it carries traffic)."""
    try:
        with open(f"/sys/class/net/{name}/flags", encoding="ascii") as fh:
            return bool(int(fh.read().strip(), 16) & 0x1)
    except (OSError, ValueError):
        return True


def ephemeral_range() -> Tuple[int, int]:
    """The range the kernel picks listening ports from when a program binds port 0 (as
    gloo and NCCL do)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as fh:
            low, high = (int(x) for x in fh.read().split()[:2])
            return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _bind(port: int) -> socket.socket:
    """A listening socket on every address of this host: IPv6 and IPv4 on one socket
    where the host has IPv6, else IPv4 only."""
    try:
        return _listening(socket.AF_INET6, ("::", port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise
    return _listening(socket.AF_INET, ("0.0.0.0", port))


def _listening(family: int, address: Tuple[Any, ...]) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class _Conn:
    """An accepted connection: what it sent so far, and until when it may."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.until = time.monotonic() + ACCEPT_TIMEOUT


class FleetCheck:
    """This host's side of the fleet pre-flight (see the module)."""

    def __init__(self, send: Send, sel: selectors.BaseSelector) -> None:
        self.send = send
        self.sel = sel
        self.listeners: Dict[int, socket.socket] = {}
        self.conns: Dict[int, _Conn] = {}
        self.token = b""
        self.host = ""
        self.held_until = 0.0
        self.handlers: Dict[str, Callable[[Dict[str, Any], Beat], Dict[str, Any]]] = {
            "listen": self._listen, "dial": self._dial, "close": self._close}

    def on_request(self, request: Dict[str, Any], beat: Beat) -> None:
        """One PROBE ``{"fleet": request}``: its handler by ``op``, its answer sent up."""
        handler = self.handlers.get(str(request.get("op")))
        answer: Dict[str, Any] = handler(request, beat) if handler else \
            {"error": "unknown fleet op"}
        answer["op"] = str(request.get("op"))
        self.send(wire.FACTS, {"fleet": answer})

    # -- listen ---------------------------------------------------------------------------
    def _listen(self, request: Dict[str, Any], beat: Beat) -> Dict[str, Any]:
        self.close()
        self.token = bytes.fromhex(str(request.get("token", "")))
        self.host = str(request.get("host", ""))
        ports: Dict[str, str] = {}
        for port in [int(p) for p in request.get("ports") or []]:
            ports[str(port)] = self._hold(port)
        sampled = self._sample(int(request.get("ephemeral") or 0))
        self.held_until = time.monotonic() + HOLD_LIMIT
        return {"ports": ports, "ephemeral": sampled, "ifaces": interfaces()}

    def _hold(self, port: int) -> str:
        try:
            sock = _bind(port)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "!in use on this host"
            return "!" + (exc.strerror or str(exc))
        self.listeners[sock.fileno()] = sock
        self.sel.register(sock, selectors.EVENT_READ, self._on_accept)
        return "ok"

    def _sample(self, count: int) -> List[int]:
        """``count`` free ports of the ephemeral range, held like the others."""
        low, high = ephemeral_range()
        got: List[int] = []
        for _ in range(count * 8):
            if len(got) >= count:
                break
            port = random.randint(low, high)
            if port not in got and self._hold(port) == "ok":
                got.append(port)
        return got

    def _on_accept(self, fd: int, events: int = 0) -> None:
        listener = self.listeners.get(fd)
        if listener is None:
            return
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        conn.setblocking(False)
        self.conns[conn.fileno()] = _Conn(conn)
        self.sel.register(conn, selectors.EVENT_READ, self._on_probe)

    def _on_probe(self, fd: int, events: int = 0) -> None:
        conn = self.conns.get(fd)
        if conn is None:
            return
        try:
            data = conn.sock.recv(MAX_PROBE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        conn.buf += data
        reply = self._reply(conn.buf) if data and len(conn.buf) <= MAX_PROBE else b""
        if reply is None:
            return  # not all of it yet
        if reply:
            with contextlib.suppress(OSError):
                conn.sock.send(reply)  # small: fits the socket buffer
        self._drop(fd)

    def _reply(self, buf: bytearray) -> Optional[bytes]:
        """The keyed answer to a whole, keyed probe; b"" for anything else; None while
        the frame is incomplete."""
        try:
            frame = rank.take_frame(buf, MAX_PROBE)
        except rank.FrameError:
            return b""
        if frame is None:
            return None
        tag, payload = frame
        if not hmac.compare_digest(tag, rank.frame_tag(self.token, FLEET_RUN, 0, payload)):
            return b""
        try:
            message = rank.decode_payload(payload)
        except rank.FrameError:
            return b""
        return rank.encode_frame(self.token, FLEET_RUN, 1, {
            "type": "probe_ok", "host": self.host, "nonce": message.get("nonce")})

    def _drop(self, fd: int) -> None:
        conn = self.conns.pop(fd, None)
        if conn is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(conn.sock)
            conn.sock.close()

    def expire(self, now: float) -> None:
        """Drop connections that said nothing in time; release the ports past the hold
        limit (a launcher that never said ``close``)."""
        for fd in [fd for fd, c in self.conns.items() if now >= c.until]:
            self._drop(fd)
        if self.listeners and now >= self.held_until:
            self.close()

    def deadline(self) -> Optional[float]:
        due = [c.until for c in self.conns.values()]
        if self.listeners:
            due.append(self.held_until)
        return min(due) if due else None

    # -- dial -----------------------------------------------------------------------------
    def _dial(self, request: Dict[str, Any], beat: Beat) -> Dict[str, Any]:
        timeout = float(request.get("timeout") or 2.0)
        targets = [t for t in request.get("targets") or [] if isinstance(t, dict)]
        results: Dict[str, str] = {}
        started = time.monotonic()
        for start in range(0, len(targets), MAX_IN_FLIGHT):
            batch = targets[start:start + MAX_IN_FLIGHT]
            results.update(_Dials(self, batch, timeout).run(beat))
        return {"dialed": results, "seconds": round(time.monotonic() - started, 3)}

    def serve(self, timeout: float) -> None:
        """Answer this host's own listener for up to ``timeout`` (inside a dial)."""
        for key, events in self.sel.select(timeout):
            if key.data in (self._on_accept, self._on_probe):
                key.data(key.fd, events)

    # -- close ----------------------------------------------------------------------------
    def _close(self, request: Dict[str, Any], beat: Beat) -> Dict[str, Any]:
        self.close()
        return {"closed": True}

    def close(self) -> None:
        """Release every port and connection it holds."""
        for fd in list(self.conns):
            self._drop(fd)
        for sock in self.listeners.values():
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(sock)
            sock.close()
        self.listeners.clear()


class _Dials:
    """One batch of dials, all in flight at once, each to its end or the deadline."""

    def __init__(self, check: FleetCheck, targets: List[Dict[str, Any]],
                 timeout: float) -> None:
        self.check = check
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.results: Dict[str, str] = {}
        self.open: Dict[int, Tuple[socket.socket, Dict[str, Any], bytearray, bool]] = {}
        self.sel = selectors.DefaultSelector()
        for target in targets:
            self._start(target)

    def _start(self, target: Dict[str, Any]) -> None:
        key = str(target.get("id"))
        try:
            infos = socket.getaddrinfo(str(target["addr"]), int(target["port"]),
                                       type=socket.SOCK_STREAM)
        except (OSError, UnicodeError, ValueError) as exc:
            why = getattr(exc, "strerror", None) or exc
            self.results[key] = f"!{target.get('addr')} does not resolve here ({why})"
            return
        sock = socket.socket(infos[0][0], socket.SOCK_STREAM)
        sock.setblocking(False)
        err = sock.connect_ex(infos[0][4])
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            self.results[key] = "!" + os.strerror(err)
            return
        self.open[sock.fileno()] = (sock, target, bytearray(), False)
        self.sel.register(sock, selectors.EVENT_WRITE)

    def run(self, beat: Beat) -> Dict[str, str]:
        last_beat = time.monotonic()
        while self.open:
            now = time.monotonic()
            if now >= self.deadline:
                break
            if now - last_beat >= 0.5:
                beat(0.0)
                last_beat = now
            self.check.serve(0.0)
            for key, _ in self.sel.select(min(0.02, self.deadline - now)):
                self._step(key.fd)
        for fd, (_sock, _target, _, sent) in list(self.open.items()):
            why = "no reply" if sent else "timed out"
            self._end(fd, f"!{why} after {self.timeout:g} s")
        self.sel.close()
        return self.results

    def _step(self, fd: int) -> None:
        sock, target, buf, sent = self.open[fd]
        if not sent:
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._end(fd, "!" + os.strerror(err))
                return
            frame = rank.encode_frame(self.check.token, FLEET_RUN, 0, {
                "type": "probe", "host": self.check.host, "nonce": str(target.get("id"))})
            try:
                sock.send(frame)
            except OSError as exc:
                self._end(fd, "!" + (exc.strerror or str(exc)))
                return
            self.open[fd] = (sock, target, buf, True)
            self.sel.modify(sock, selectors.EVENT_READ)
            return
        self._read(fd, sock, target, buf)

    def _read(self, fd: int, sock: socket.socket, target: Dict[str, Any],
              buf: bytearray) -> None:
        try:
            data = sock.recv(MAX_PROBE)
        except BlockingIOError:
            return
        except OSError as exc:
            self._end(fd, "!" + (exc.strerror or str(exc)))
            return
        if not data:
            self._end(fd, "?closed without a keyed reply: something else listens there")
            return
        buf += data
        try:
            frame = rank.take_frame(buf, MAX_PROBE)
        except rank.FrameError:
            frame, buf[:] = (b"", b""), b""
        if frame is None:
            return
        self._end(fd, self._verdict(frame, target))

    def _verdict(self, frame: Tuple[bytes, bytes], target: Dict[str, Any]) -> str:
        tag, payload = frame
        if not payload or not hmac.compare_digest(
                tag, rank.frame_tag(self.check.token, FLEET_RUN, 1, payload)):
            return "?answered without this check's key: something else listens there"
        try:
            message = rank.decode_payload(payload)
        except rank.FrameError:
            return "?an unreadable reply"
        got, want = str(message.get("host")), str(target.get("host"))
        if want and got != want:
            return f"?answered as {got}, not {want}"
        return "ok"

    def _end(self, fd: int, result: str) -> None:
        sock, target, _, _ = self.open.pop(fd)
        self.results[str(target.get("id"))] = result
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(sock)
        sock.close()
