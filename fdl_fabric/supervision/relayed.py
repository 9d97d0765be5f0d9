"""Ranks that reach the coordinator through their host's agent (issue 35).

A rank started by an agent dials that agent's Unix socket, not the coordinator's port.
The agent checks that the caller is one of its own ranks (``SO_PEERCRED``) and verifies
every frame's tag and sequence, as the coordinator would; then it speaks for its ranks
on the session it already holds with the launcher (docs/protocol.md, "Which path a rank
takes"): ``cohort`` (a rank's hello, exiting or ack_shutdown, or its closed connection)
and ``beats`` (every joined rank's silence and progress, one frame per host a second).
So the launcher holds one stream per host, not a connection and a heartbeat per rank.

The session's reading thread hands those reports here (`Relayed.relayed`); the I/O
thread takes them at its next turn, so every rule of the coordinator (the hello rules,
formation, the heartbeat timeout, membership, save-and-shutdown) applies to them exactly
as to a socket's frames: a relayed rank is a `connections.Conn` whose messages go down
through its agent (``Conn.down``). A host speaks only for the ranks it runs in this
attempt; anything else is dropped and counted, once per host and reason.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping
from typing import Any

from .. import reports
from ..agent import wire
from ..events import Name
from ..rank import FrameError
from .connections import Conn, Connections
from .heartbeats import Heartbeats

#: How a message reaches one host's agent (a COHORT_DOWN body), by host.
Downlink = Callable[[dict[str, Any]], None]


class Relayed(Connections):
    """The coordinator's side of the agents' cohort frames; the coordinator handles what
    they carry (`_handle`, `_lost`) as it handles a socket's."""

    #: The coordinator's heartbeat clocks (set by the coordinator).
    _beats: Heartbeats

    def _relay_init(self, rank_hosts: Mapping[int, str]) -> None:
        #: Which host runs each rank in this attempt: a host speaks for these only.
        self._rank_hosts = dict(rank_hosts)
        #: Reports from the sessions' reading threads, taken by the I/O thread (a deque's
        #: append and popleft are atomic).
        self._inbound: collections.deque[reports.Report] = collections.deque()
        #: A wake for `_inbound` is on its way: a burst of reports (a relay's read holds
        #: dozens of hosts' frames) wakes the I/O thread once, not once each.
        self._inbound_woken = False
        self._downlinks: dict[str, Downlink] = {}
        #: Each relayed rank's current connection, by rank (I/O thread only).
        self._relayed: dict[int, Conn] = {}

    def link(self, host: str, down: Downlink) -> None:
        """How the coordinator's messages reach ``host``'s ranks (its agent's session)."""
        self._downlinks[host] = down

    def relayed(self, report: reports.Report) -> None:
        """A ``cohort`` or ``beats`` report from an agent's session (any thread)."""
        self._inbound.append(report)
        if not self._inbound_woken:
            self._inbound_woken = True
            self._wake()

    # -- the coordinator's hooks ----------------------------------------------------------------
    def _handle(self, conn: Conn, message: dict[str, Any]) -> None:
        raise NotImplementedError

    # -- I/O thread -----------------------------------------------------------------------------
    def _take_relayed(self, now: float) -> None:
        """Everything the agents said since the last turn, in order. The flag is cleared
        before the queue is read, so a report appended after that read wakes again."""
        self._inbound_woken = False
        while self._inbound:
            report = self._inbound.popleft()
            take = _TAKE.get(type(report))
            if take is not None:
                take(self, report, now)

    def _speaks_for(self, host: str, rank: int) -> bool:
        """A host speaks for the ranks it runs in this attempt, and no other."""
        if self._rank_hosts.get(rank) == host:
            return True
        self._refusals.report(Name.PEER_DROPPED, f"{host} (its agent)",
                              f"cohort frames for rank {rank}, which {host} does not run")
        return False

    def _relayed_message(self, report: reports.CohortUp) -> None:
        host, rank = report.host, report.rank
        if not self._speaks_for(host, rank):
            return
        if report.closed is not None:
            conn = self._relayed.pop(rank, None)
            if conn is not None and not conn.closed:
                conn.down = None  # closed from below: nothing to tell its agent
                self._lost(conn, report.closed)
            return
        message = report.msg or {}
        conn = self._relayed.get(rank)
        if message.get("type") == "hello":
            if message.get("rank") != rank:  # its agent bound the caller to ``rank``
                self._refusals.report(Name.PEER_DROPPED, f"{host} (its agent)",
                                      f"a hello naming rank {str(message.get('rank'))[:20]} "
                                      f"relayed as rank {rank}")
                return
            joined = self._relayed.get(rank)
            conn = self._new_relayed(host, rank)
            if joined is None or joined.closed or joined.rank is None:
                self._relayed[rank] = conn  # else a second hello: refused, the first kept
        elif conn is None or conn.closed:
            return  # said after its connection closed: nothing to act on
        try:
            self._handle(conn, message)
        except FrameError as exc:
            self._drop(conn, str(exc))

    def _new_relayed(self, host: str, rank: int) -> Conn:
        down = self._downlinks.get(host)
        return Conn(sock=None, peer=f"{host} (through its agent)", opened=time.monotonic(),
                    source=host, down=down if down is not None else _nowhere, via_rank=rank)

    def _relayed_beats(self, report: reports.Beats, now: float) -> None:
        """One host's folded heartbeats: each rank alive as of its own last frame
        (`Heartbeats.folded`), for the joined ranks this host runs."""
        host, owners, relayed = report.host, self._rank_hosts, self._relayed
        fresh = []
        for rank, (age, progress) in report.ranks.items():
            if owners.get(rank) != host:
                self._speaks_for(host, rank)  # dropped, said once and counted
                continue
            conn = relayed.get(rank)
            if conn is not None and not conn.closed and conn.rank is not None:
                fresh.append((rank, age, progress))
        self._beats.folded(fresh, now)


#: What the I/O thread does with each kind of relayed report.
_TAKE: dict[type, Callable[[Relayed, Any, float], None]] = {
    reports.Beats: lambda c, r, now: c._relayed_beats(r, now),
    reports.CohortUp: lambda c, r, now: c._relayed_message(r),
}


def _nowhere(body: dict[str, Any]) -> None:
    """A host with no session linked (it cannot happen in a launch): nothing to send to."""


def link_sessions(coordinator: Relayed, sessions: Mapping[str, Any]) -> None:
    """Route every host's ``cohort``/``beats`` reports to ``coordinator``, and its
    messages down to that host's agent (COHORT_DOWN)."""
    for host, session in sessions.items():
        session.cohort = coordinator.relayed
        coordinator.link(host, _sender(session))


def _sender(session: Any) -> Downlink:
    """Lazy writes: through a gateway, the welcomes of a burst of hellos (and a broadcast
    to every host) wait up to `gateway.LAZY_WRITE_DELAY` and cross as one SSH packet per
    relay, not one per rank."""
    def send(body: dict[str, Any]) -> None:
        session.write(wire.message(wire.COHORT_DOWN, body), lazy=True)
    return send
