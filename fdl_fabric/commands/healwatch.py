"""Split brain bounded by the heal: a host cut off from an attempt is dialled again until
it answers, and that attempt's ranks there are stopped the moment it does.

A host lost to a partition keeps running its ranks: nothing reaches it. Its agent stops
them when its lease runs out (the launcher's silence for ``heartbeat_timeout``, 30 s by
default), while the next attempt may already run elsewhere. The old connection cannot
tell it sooner: TCP's retransmission backoff delays what it carries by up to a minute
after the link is back. So the launcher does not wait on it. From the moment a host is
lost (`events.Name.HOST_LOST`, `HOST_UNRESPONSIVE`), it opens a fresh connection every
`RETRY` seconds, each bounded by `DIAL_TIMEOUT`; the first that succeeds starts an agent
there whose sweep stops every earlier attempt of this run on that host and never the
one now running (`agent.procs.sweep`'s ``keep_attempt``). It gives up once the lease and
the kill grace have passed since the loss: by then the old agent has stopped its ranks on
its own. The old ranks are therefore gone within min(lease, heal + `DIAL_TIMEOUT` +
the connect) + the kill grace (docs/reliability.md).

A host that is re-admitted by a later attempt is swept by that attempt's own agent the
same way, before it starts any rank.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Optional

from ..events import Event, EventBus, Name
from ..transport import Transport
from .cleanup import sweep_request, sweep_with_agents

#: Seconds one dial of a lost host may wait for its TCP connection: a SYN into a partition
#: is never answered, so the next dial, after the link is back, must not wait behind it.
#: (Its SSH handshake and login, once connected, get the host's own connect timeout.)
DIAL_TIMEOUT = 1.0
#: Seconds between the starts of two dials (a refused connect returns at once).
RETRY = 0.5
#: Seconds the sweep on a host that answered again may take.
SWEEP_TIMEOUT = 30.0
#: The events that say a host was lost to this launcher.
_LOST = frozenset({Name.HOST_LOST, Name.HOST_UNRESPONSIVE})


class HealWatch:
    """An event sink: each host lost in an attempt is watched until it answers again (its
    attempt's ranks then stopped) or until its agent's lease has ended them anyway."""

    def __init__(self, run_id: str, transports: Callable[[], Mapping[str, Transport]],
                 attempt: Callable[[], int], bound: float, events: EventBus,
                 ran: Callable[[str], bool] = lambda host: True) -> None:
        self.run_id = run_id
        self._transports = transports
        #: Whether an agent ever ran on a host (one that never started left nothing).
        self._ran = ran
        self._attempt = attempt
        #: Seconds after a loss past which the agent's own lease has stopped its ranks.
        self.bound = bound
        self.events = events
        self._stop = threading.Event()
        self._threads: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()
        #: Set once `stop` returned: the verdict may be printed, nothing follows it.
        self._silent = False

    def emit(self, e: Event) -> None:
        if e.name in _LOST and e.host is not None:
            self.watch(e.host)

    def watch(self, host: str) -> None:
        """Dial ``host`` again until it answers (once per loss; a watch under way goes on)."""
        transport = self._transports().get(host)
        again = transport.redial(DIAL_TIMEOUT) if transport is not None \
            and transport.sweep_after_loss and self._ran(host) else None
        if again is None:
            return
        with self._lock:
            running = self._threads.get(host)
            if running is not None and running.is_alive() or self._stop.is_set():
                return
            thread = threading.Thread(target=self._dial, name=f"fdl-heal-{host}", daemon=True,
                                      args=(again, self._attempt() + 1, time.monotonic()))
            self._threads[host] = thread
        thread.start()

    def stop(self, timeout: float = DIAL_TIMEOUT + SWEEP_TIMEOUT) -> None:
        """No more dials. A watch that is dialling ends within `DIAL_TIMEOUT`, one that is
        sweeping within `SWEEP_TIMEOUT`: what they say comes before the verdict, which
        is the last line (a watch still running past ``timeout`` says nothing more)."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = list(self._threads.values())
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._silent = True

    def _dial(self, again: Transport, keep_from: int, lost_at: float) -> None:
        while not self._stop.is_set() and time.monotonic() - lost_at < self.bound:
            started = time.monotonic()
            if self._answers(again):
                self._sweep(again, keep_from, lost_at)
                return
            self._stop.wait(max(0.0, RETRY - (time.monotonic() - started)))

    @staticmethod
    def _answers(transport: Transport) -> bool:
        try:
            transport.connect()
        except Exception:  # a TransportError, or paramiko's own on a half-open link
            transport.close()
            return False
        return transport.connected

    def _sweep(self, transport: Transport, keep_from: int, lost_at: float) -> None:
        answered = time.monotonic() - lost_at
        request = sweep_request(by={"command": "the launcher, once the host answered again"})
        request.update(keep=self.run_id, keep_attempt=keep_from)
        try:
            (rep,) = sweep_with_agents([transport], request, timeout=SWEEP_TIMEOUT) or (None,)
        finally:
            transport.close()
        if rep is None:
            return
        pids = sorted({p for s in rep.stopped for p in s.get("pids", [])})
        problem: Optional[str] = rep.error or (str(rep.leftovers) if rep.leftovers else None)
        if self._silent or not (pids or problem):  # a host that answered with nothing left
            return
        self.events(Name.HOST_ANSWERED_AGAIN, host=transport.host, after=round(answered, 1),
                    attempt=keep_from - 1, pids=pids, problem=problem)
