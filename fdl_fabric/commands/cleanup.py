"""Cleanup on demand: every host's agent sweeps its run registry, all hosts at once.

``inv cleanup`` (the hosts of a cluster file) and ``fab -H a,b cleanup`` (any hosts,
no file) start one agent per host, exactly as a launch does, and send it a sweep
instead of a spec. The agent stops the recorded runs that match (only processes that
provably belong to them, see `fdl_fabric.agent.procs`), verifies that nothing of them
remains, and reports. A host that cannot be reached, or where something survives,
makes the cleanup fail loudly; every other host is still swept.

A run whose launcher still holds its agents is *live* (`fdl_fabric.agent.procs`): no
sweep stops it unless it is named (``--run-id``) or ``--force`` is given, and each
sweep says what it left alone. A live run that is stopped is told who did it, and its
verdict says so.
"""

from __future__ import annotations

import os
import queue
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from .. import reports
from ..agent.pids import lineage
from ..clusterfile import ClusterSpec
from ..errors import EXIT_USAGE, FdlError
from ..events import EventBus, Name
from ..planning.plan import cluster_key
from ..presentation.output import Console
from ..transport import (
    Transport,
    for_cluster,
    for_connections,
    kinds_of,
    resolve_cluster,
    resolve_settings,
)
from ..transport.fanout import close_all, connect_each, start_each
from .launch_settings import trusted_cluster

#: Seconds a sweep may take on a host (TERM, the sweep grace, KILL, plus start-up).
SWEEP_TIMEOUT = 60.0


@dataclass
class HostReport:
    host: str
    stopped: list[dict[str, Any]] = field(default_factory=list)
    leftovers: list[dict[str, Any]] = field(default_factory=list)
    error: Optional[str] = None
    #: Live runs the sweep left alone: run, host, launcher.
    live: list[dict[str, Any]] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return self.error is None and not self.leftovers

    @property
    def data(self) -> dict[str, Any]:
        """As the data of `Name.CLEANUP_HOST`."""
        return {"stopped": self.stopped, "leftovers": self.leftovers, "error": self.error,
                "live": self.live}


def sweep_request(*, runs: Sequence[str] = (), cluster: Optional[str] = None,
                  all_runs: bool = False, pattern: Optional[str] = None,
                  scope: Optional[str] = None, force: bool = False,
                  by: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """What an agent's sweep does (`fdl_fabric.agent.procs.sweep`); ``by`` says who
    stops a live run (the note its verdict quotes)."""
    return {"runs": list(runs), "cluster": cluster, "all": all_runs, "pattern": pattern,
            "scope": scope, "force": force, "by": by or stopper("a cleanup"),
            # this cleanup's own process and its shells: a pattern never stops them
            "spare": lineage() if pattern else None}


def stopper(command: str) -> dict[str, Any]:
    """The note a cleanup leaves for a live run it stops: the command, its pid and host."""
    return {"command": command, "pid": os.getpid(), "host": socket.gethostname()}


def sweep_with_agents(transports: Sequence[Transport], request: Mapping[str, Any], *,
                      timeout: float = SWEEP_TIMEOUT) -> list[HostReport]:
    """Start one agent per (connected) host and sweep them all at once."""
    inbox: queue.SimpleQueue[reports.Report] = queue.SimpleQueue()
    sessions, errors = start_each(transports, inbox.put)
    found = {host: HostReport(host, error=why) for host, why in errors.items()}
    for session in sessions.values():
        session.sweep(dict(request))
    pending = set(sessions)
    deadline = time.monotonic() + timeout
    while pending:
        try:
            report = inbox.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            for host in pending:
                found[host] = HostReport(host, error=f"no answer within {timeout:g}s")
                sessions[host].abandon()
            break
        if isinstance(report, reports.Swept):
            data = report.report
            problems = data.get("errors") or []
            found[report.host] = HostReport(report.host, list(data.get("stopped", [])),
                                            list(data.get("leftovers", [])),
                                            "; ".join(problems) if problems else None,
                                            list(data.get("live", [])))
        elif isinstance(report, reports.AgentGone):
            pending.discard(report.host)
            if report.host not in found:
                found[report.host] = HostReport(report.host, error=report.reason)
    for session in sessions.values():
        session.close_input()
    return [found[t.host] for t in transports if t.host in found]


def run_cleanup(cluster_file: Optional[str], *, cluster: Optional[ClusterSpec] = None,
                run_id: Optional[str] = None,
                all_runs: bool = False, pattern: Optional[str] = None, slurm: bool = False,
                force: bool = False, console: Any = None) -> int:
    """``inv cleanup``: sweep every host of a cluster (with ``slurm``: every node of this
    allocation, for this job's runs only); 0 clean, 1 leftovers, 2 config or usage. Live
    runs are left alone unless named by ``run_id`` or ``force``d. ``cluster``: hosts
    named on the command line (``--hosts``; ``cluster_file`` None)."""
    events = EventBus(console or Console())
    try:
        if slurm:
            _refuse_with_slurm(all_runs=all_runs, pattern=pattern)
        cluster = trusted_cluster(resolve_cluster(cluster_file, cluster, slurm=slurm,
                                                  nproc_per_node=1 if slurm else None), False)
        settings = resolve_settings(cluster, events)
    except FdlError as exc:
        events(Name.REFUSED, error=str(exc))
        return exc.exit_code
    key = cluster_key(cluster)
    request = sweep_request(runs=[run_id] if run_id else [],
                            cluster=None if (run_id or all_runs) else key,
                            all_runs=all_runs, pattern=pattern,
                            scope=key if slurm else None, force=force,
                            by=stopper(_said_as("inv cleanup", run_id, force)))
    transports = for_cluster(cluster, settings, purpose="cleanup")
    found = _sweep_each(list(transports.values()), request, close=True)
    for cls in kinds_of(cluster.workers):
        cls.after_sweep(cluster.workers, events)
    return report_and_verdict([found[w.host] for w in cluster.workers], events)


def _refuse_with_slurm(*, all_runs: bool, pattern: Optional[str]) -> None:
    for flag, given in (("--all", all_runs), ("--pattern", pattern)):
        if given:
            raise FdlError(f"{flag}: not with --slurm, which sweeps this job's runs "
                           "only (another job may share the nodes)", EXIT_USAGE)


def _said_as(command: str, run_id: Optional[str], force: bool) -> str:
    """The command as the swept runs' records name who stopped them."""
    return command + (f" --run-id {run_id}" if run_id else "") + (" --force" if force else "")


def _sweep_each(transports: Sequence[Transport], request: Mapping[str, Any], *,
                close: bool) -> dict[str, HostReport]:
    """Every host connected and swept at once; a host that cannot be reached is a report
    with its error, never a stop for the others. ``close``: the connections are ours."""
    errors = connect_each(transports)
    try:
        found = {r.host: r for r in sweep_with_agents(
            [t for t in transports if t.host not in errors], request)}
    finally:
        if close:
            close_all(transports)
    found.update({host: HostReport(host, error=reason) for host, reason in errors.items()})
    return found


def report_and_verdict(reports_: Sequence[HostReport], events: EventBus) -> int:
    """One event per host and a verdict; non-zero when anything survived."""
    for rep in reports_:
        events(Name.CLEANUP_HOST, host=rep.host, **rep.data)
    bad = [r.host for r in reports_ if not r.clean]
    if bad:
        events(Name.CLEANUP_FAILED, hosts=bad)
        return 1
    events(Name.CLEANUP_VERIFIED, hosts=len(reports_),
           stopped=sum(len(r.stopped) for r in reports_))
    return 0


def adhoc_cleanup_hosts(conns: Sequence[Any], *, run_id: Optional[str] = None,
                        pattern: Optional[str] = None, force: bool = False,
                        console: Any = None) -> int:
    """``fab -H a,b cleanup``: every host in parallel; a failing host never stops the others.
    Runs whose launcher is alive are left alone, unless named (``run_id``) or ``force``d.

    fab builds its Connections; they get our host-key policy and bounded waits before
    they open (`transport.for_connections`), like every other connection we make; a
    failure on port 22 points to fab -H's user@host:port.
    """
    console = console or Console()
    transports = for_connections(conns, flag="-H")
    request = sweep_request(runs=[run_id] if run_id else [], all_runs=not run_id,
                            pattern=pattern, force=force,
                            by=stopper(_said_as("fab cleanup", run_id, force)))
    found = _sweep_each(transports, request, close=False)
    return report_and_verdict([found[t.host] for t in transports], EventBus(console))


__all__ = ["HostReport", "FdlError", "adhoc_cleanup_hosts", "run_cleanup",
           "sweep_with_agents"]
