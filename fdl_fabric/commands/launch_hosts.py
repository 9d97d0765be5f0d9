"""Connect and agents: a launch's connections to its hosts, and the agent on each.

`Hosts` holds every host's transport (its connection, for a remote host), the agent
session started over it, the tunnels and the keepalive watch, so that whatever was
opened is closed by one `Hosts.teardown`, however the launch ends. It connects the
hosts of an attempt, connects afresh the ones whose connection is not to be trusted,
starts the agents, asks them for ``local_devices: all``, and, once the run is over,
sweeps what a lost host may still hold.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional

from .. import reports
from ..clusterfile import ClusterSpec
from ..errors import EXIT_USAGE, FdlError
from ..events import EventBus, Name
from ..limits import RANKS_MAX, RANKS_PER_WORKER_MAX
from ..planning.plan import coordinator_bind_host
from ..presentation.words import unreachable
from ..supervision.rankoutput import RankOutput
from ..transport import Transport, open_tunnel
from ..transport.fanout import close_all, connect_all, connect_each, start_agents
from ..transport.session import AgentSession
from .cleanup import HostReport, sweep_request, sweep_with_agents

if TYPE_CHECKING:
    from ..transport.keepalive import KeepaliveMonitor

#: Seconds to wait for every agent's answer to a device probe.
PROBE_TIMEOUT = 60.0
#: Seconds the final sweep of lost hosts may take (it runs only after a fault).
SWEEP_TIMEOUT = 30.0


class Hosts:
    """The launch's connections and agents, so every exit path can close them."""

    def __init__(self, events: EventBus, output: RankOutput) -> None:
        self.events = events
        self.output = output
        #: Every host's transport (its connection, for an SSH host), by host.
        self.transports: dict[str, Transport] = {}
        #: The agent of each host of the current attempt.
        self.sessions: dict[str, AgentSession] = {}
        #: The tunnels, closed with the launch.
        self.stack = contextlib.ExitStack()
        self.monitor: Optional[KeepaliveMonitor] = None
        #: Hosts whose connection is not to be trusted until it is made afresh.
        self.stale: set[str] = set()
        #: Hosts whose agent started in some attempt (only they can hold what to sweep).
        self.greeted: set[str] = set()

    # -- connections ---------------------------------------------------------------------------
    def connected(self, transport: Transport) -> None:
        self.events(Name.CONNECTED, host=transport.host)

    def connect(self, hosts: Iterable[str]) -> None:
        """The first attempt's hosts, in parallel; one that cannot be reached ends the
        launch (the roster's path: no min_hosts, no spares)."""
        connect_all({h: self.transports[h] for h in hosts}, self.connected)

    def reconnect(self, cluster: ClusterSpec, faulted: Collection[str]) -> None:
        """Before a restart (the roster's path: no min_hosts, no spares): a fresh
        connection to every host whose connection is gone or whose agent stopped
        answering (its link may be dead while paramiko thinks not)."""
        stale = [t for h, t in self.transports.items() if h in faulted or not t.connected]
        if not stale:
            return
        close_all(stale)
        errors = connect_each(stale, self.connected)
        if errors:
            lines = tuple(f"cluster launcher: host {h!r} {unreachable(why)}"
                          for h, why in errors.items())
            if len(lines) == 1:
                raise FdlError(lines[0])
            raise FdlError(f"cluster launcher: {len(lines)} hosts unreachable "
                           f"({', '.join(errors)})", details=lines)
        for transport in stale:
            self._reconnected(cluster, transport, tunnel=True)

    def probe(self, cluster: ClusterSpec, attempt: int, hosts: Sequence[str]
              ) -> dict[str, str]:
        """Connect the hosts that are not connected, or whose connection is not to be
        trusted (lost or unresponsive in an attempt); each bounded by its connect timeout.
        Why each one that failed failed."""
        todo = [self.transports[h] for h in hosts
                if h in self.stale or not self.transports[h].connected]
        if not todo:
            return {}
        close_all(todo)
        errors = connect_each(todo, self.connected, check=True)
        for transport in todo:
            if transport.host in errors:
                continue
            self.stale.discard(transport.host)
            self._reconnected(cluster, transport, tunnel=bool(attempt))
        return errors

    def _reconnected(self, cluster: ClusterSpec, transport: Transport, *,
                     tunnel: bool) -> None:
        """A fresh connection is watched like the first, and its tunnel opened again."""
        if self.monitor is not None:
            transport.watch(self.monitor)
        if tunnel and any(w.host == transport.host and w.tunnel for w in cluster.workers):
            self.open_tunnel(cluster, transport.host)

    def open_tunnels(self, cluster: ClusterSpec) -> None:
        """Every tunnel the cluster asks for; after the coordinator's bind, since a tunnel
        delivers to it."""
        for w in cluster.workers:
            if w.tunnel:
                self.open_tunnel(cluster, w.host)

    def open_tunnel(self, cluster: ClusterSpec, host: str) -> None:
        port = cluster.controller.port
        # The forward delivers to wherever the coordinator listens.
        target = coordinator_bind_host(cluster)
        try:
            self.stack.enter_context(open_tunnel(self.transports[host], port, target,
                                                 self.events))
        except Exception as exc:
            raise FdlError(f"cluster launcher: host {host!r}: tunnel could not bind "
                           f"127.0.0.1:{port} on the remote side: {exc}") from None
        self.events(Name.TUNNEL_OPENED, host=host, port=port, target=target)

    def watch_connections(self) -> None:
        from ..transport.keepalive import KeepaliveMonitor

        def dead(host: str, silent: float) -> None:
            self.events(Name.KEEPALIVE_LOST, host=host, silent=round(silent, 3))

        self.monitor = KeepaliveMonitor(dead)
        for transport in self.transports.values():
            transport.watch(self.monitor)

    def resumed(self) -> None:
        if self.monitor is not None:
            self.monitor.resumed()

    # -- agents --------------------------------------------------------------------------------
    def start_agents(self, hosts: Iterable[str], inbox: queue.SimpleQueue[reports.Report]
                     ) -> dict[str, AgentSession]:
        """One agent on each host of this attempt; they are the attempt's sessions."""
        self.sessions = start_agents({h: self.transports[h] for h in hosts}, inbox.put,
                                     on_output=self.output)
        return self.sessions

    def ran_an_agent(self, host: str) -> bool:
        """An agent said HELLO on ``host`` in some attempt: something of the run may be
        there (one whose login shell stood in the way left nothing to sweep)."""
        session = self.sessions.get(host)
        return host in self.greeted or (session is not None and session.greeted)

    def note_greeted(self) -> None:
        """The hosts whose agent started in this attempt: only they are swept."""
        self.greeted.update(h for h, s in self.sessions.items() if s.greeted)

    def resolve_devices(self, cluster: ClusterSpec, inbox: queue.SimpleQueue[reports.Report]
                        ) -> dict[str, list[int]]:
        """GPU indices of every ``local_devices: all`` worker, asked of its agent."""
        wanted = {w.host for w in cluster.workers if w.local_devices == "all"}
        for host in wanted:
            self.sessions[host].probe(gpus=True)
        resolved = _device_answers(wanted, inbox)
        total = sum(len(d) for d in resolved.values()) + sum(
            w.nproc or len(w.local_devices or ()) for w in cluster.workers
            if w.local_devices != "all")
        if total > RANKS_MAX:
            raise FdlError(f"cluster launcher: {total} ranks in all once `local_devices: all` "
                              f"is resolved; at most {RANKS_MAX} are allowed", EXIT_USAGE)
        return resolved

    # -- the end -------------------------------------------------------------------------------
    def teardown(self) -> None:
        for session in self.sessions.values():
            session.close_input()
        with contextlib.suppress(Exception):
            self.stack.close()
        if self.monitor is not None:
            self.monitor.close()
        close_all(self.transports.values())

    def sweep_faulted(self, run_id: str, faulted: Collection[str]) -> None:
        """Hosts lost or unresponsive during the run: once the run is over, stop whatever
        of it is still there and remove its registry records, or say they were left."""
        hosts = [t for h, t in self.transports.items()
                 if h in faulted and t.sweep_after_loss and h in self.greeted]
        if not hosts:
            return
        # A connection to a host that stopped answering is not to be trusted, whatever
        # paramiko thinks of it: every faulted host gets a fresh one.
        close_all(hosts)
        errors = connect_each(hosts)
        found = {rep.host: rep for rep in sweep_with_agents(
            [t for t in hosts if t.host not in errors],
            sweep_request(runs=[run_id], by={"command": "the launcher's final sweep"}),
            timeout=SWEEP_TIMEOUT)}
        for host, why in errors.items():
            self.events(Name.SWEEP_UNREACHABLE, host=host, reason=why, run_id=run_id)
        for rep in found.values():
            self._swept(rep, run_id)

    def _swept(self, rep: HostReport, run_id: str) -> None:
        """What the final sweep found on one host, said when it did anything or failed."""
        if rep.error or rep.leftovers:
            self.events(Name.SWEEP_INCOMPLETE, host=rep.host, run_id=run_id,
                        problem=rep.error or rep.leftovers)
        elif rep.stopped:
            pids = sorted({p for s in rep.stopped for p in s.get("pids", [])})
            self.events(Name.SWEEP_STOPPED, host=rep.host, run_id=run_id, pids=pids)


# -- ``local_devices: all`` --------------------------------------------------------------------
def _facts_devices(report: reports.Facts) -> tuple[str, list[int]]:
    """The GPUs an agent found, or why ``local_devices: all`` cannot use them."""
    if not report.gpus:
        raise FdlError(
            f"cluster launcher: host {report.host!r}: `local_devices: all` found no "
            f"GPU (nvidia-smi: {report.error or 'listed none'}); give an explicit "
            "list instead")
    if len(report.gpus) > RANKS_PER_WORKER_MAX:
        raise FdlError(
            f"cluster launcher: host {report.host!r}: `local_devices: all` found "
            f"{len(report.gpus)} GPUs; at most {RANKS_PER_WORKER_MAX} ranks a host",
            EXIT_USAGE)
    return report.host, report.gpus


def _agent_gone(report: reports.AgentGone) -> tuple[str, list[int]]:
    raise FdlError(f"cluster launcher: host {report.host!r}: {report.reason}")


#: The reports a device probe waits for; any other is kept for the supervisor.
_DEVICE_REPORTS: Mapping[type, Callable[[Any], tuple[str, list[int]]]] = {
    reports.Facts: _facts_devices,
    reports.AgentGone: _agent_gone,
}


def _device_answers(wanted: set[str], inbox: queue.SimpleQueue[reports.Report]
                    ) -> dict[str, list[int]]:
    """Each wanted host's GPUs, within `PROBE_TIMEOUT`; the other reports that came
    meanwhile are put back, in order, for the supervisor."""
    resolved: dict[str, list[int]] = {}
    kept: list[reports.Report] = []
    deadline = time.monotonic() + PROBE_TIMEOUT
    while wanted - set(resolved):
        try:
            report = inbox.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            missing = ", ".join(sorted(wanted - set(resolved)))
            raise FdlError(f"cluster launcher: no device list from {missing} within "
                              f"{PROBE_TIMEOUT:g}s") from None
        answer = _DEVICE_REPORTS.get(type(report))
        if answer is None:
            kept.append(report)
        else:
            host, gpus = answer(report)
            resolved[host] = gpus
    for report in kept:
        inbox.put(report)
    return resolved
