"""Liveness of SSH connections: declare one dead when it stops answering keepalives.

paramiko's own keepalive only sends packets and never notices a silent peer (a
partitioned network keeps TCP retransmitting for many minutes).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import paramiko

from .sshconfig import SshSettings

#: Seconds between two looks at every connection (each look is a wake-up of this
#: process: 0.5 s rather than 0.2, as a ping is due every `ServerAliveInterval` seconds).
POLL = 0.5
#: A gap this long between two looks means this process was stopped (Ctrl-Z).
PAUSE_GAP = 2.0


class KeepaliveMonitor:
    """Declare a connection dead when it stops answering keepalives.

    paramiko's own keepalive only sends packets and never notices a silent
    peer (a partitioned network keeps TCP retransmitting for many minutes).
    This monitor asks the server for a reply every ``interval`` seconds, as
    OpenSSH's ServerAliveInterval does, and closes the transport after
    ``interval x count_max`` seconds without one; every session on it then
    ends, which the supervisor sees as lost ranks.
    """

    def __init__(self, on_dead: Callable[[str, float], None]) -> None:
        self._on_dead = on_dead
        self._entries: list[_Watched] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fdl-keepalive", daemon=True)

    def watch(self, host: str, transport: paramiko.Transport, settings: SshSettings) -> None:
        if settings.alive_interval <= 0:
            return
        with self._lock:
            self._entries.append(_Watched(host, transport, settings.alive_interval,
                                          settings.alive_timeout))
        if not self._thread.is_alive():
            self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def resumed(self) -> None:
        """This process was stopped (Ctrl-Z): no server could answer while it was, so
        every connection's silence counts from now."""
        now = time.monotonic()
        with self._lock:
            for entry in self._entries:
                entry.last_reply = max(entry.last_reply, now)

    def _loop(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(POLL):
            now = time.monotonic()
            if now - last > PAUSE_GAP:
                self.resumed()  # this process was stopped: the servers were not silent
            last = now
            with self._lock:
                entries = list(self._entries)
            for entry in entries:
                if entry.dead or not entry.transport.is_active():
                    continue
                silent = now - entry.last_reply
                if silent > entry.timeout:
                    entry.dead = True
                    entry.transport.close()
                    self._on_dead(entry.host, silent)
                elif not entry.pinging and now - entry.last_ping >= entry.interval:
                    entry.ping()


class _Watched:
    def __init__(self, host: str, transport: paramiko.Transport, interval: float,
                 timeout: float) -> None:
        self.host = host
        self.transport = transport
        self.interval = interval
        self.timeout = timeout
        self.last_reply = time.monotonic()
        self.last_ping = 0.0
        self.pinging = False
        self.dead = False

    def ping(self) -> None:
        self.pinging = True
        self.last_ping = time.monotonic()
        threading.Thread(target=self._ping, name=f"fdl-ping-{self.host}", daemon=True).start()

    def _ping(self) -> None:
        try:
            # OpenSSH answers an unknown global request with a failure reply;
            # any reply proves the peer is alive.
            self.transport.global_request("keepalive@openssh.com", wait=True)
            if self.transport.is_active():
                self.last_reply = time.monotonic()
        except Exception:
            pass
        finally:
            self.pinging = False
