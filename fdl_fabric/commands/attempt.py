"""One attempt: the coordinator bound, every agent given its spec, the supervisor run to
the attempt's verdict.

Each agent runs the fast pre-flight its spec carries and sweeps this cluster's
leftovers; the supervisor starts the ranks once every host passed (`judge_of` judges
what each agent found), then applies the failure policy to one verdict. The signal
handlers post to this attempt's supervisor while it runs (`launch_signals.Signals`).
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from .. import reports
from ..errors import FdlError
from ..events import EventBus
from ..planning.plan import LaunchPlan, coordinator_bind_host, interpreted_argv
from ..preflight import Status, agent_checks, judge, launch_plan
from ..preflight.probe import HostPlan
from ..presentation.output import Console
from ..supervision.coordinator import Coordinator, CoordinatorError, CoordinatorSpec
from ..supervision.policy import Elastic
from ..supervision.relayed import link_sessions
from ..supervision.supervisor import RunResult, Supervisor
from .launch_hosts import Hosts
from .launch_settings import Resolved
from .launch_signals import Signals

#: A host's pre-flight judged: its warnings and its failures, (check, reason) each.
Judged = tuple[list[tuple[str, str]], list[tuple[str, str]]]


def coordinator_spec(plan: LaunchPlan, scale: float) -> CoordinatorSpec:
    """The coordinator for this plan: loopback when no worker dials it over the network."""
    cluster = plan.cluster
    return CoordinatorSpec(
        run_id=plan.run_id,
        salt=plan.salt,
        world_size=plan.world_size,
        bind_host=coordinator_bind_host(cluster),
        port=cluster.controller.port,
        formation_timeout=cluster.elastic.formation_timeout * scale,
        heartbeat_timeout=cluster.elastic.heartbeat_timeout * scale,
        hello_timeout=10.0 * scale,
        direct_ranks=0,  # every rank speaks through its agent (docs/protocol.md)
    )


def preflight_checks(r: Resolved, plan: LaunchPlan) -> dict[str, HostPlan]:
    """The fast pre-flight of every host of the plan: what its agent checks."""
    cluster = plan.cluster
    return {w.host: launch_plan(cluster, w, interpreted_argv(cluster, w, r.argv),
                                r.prebuilt.get(w.host),
                                master=(plan.master_addr, cluster.master_port))
            for w in cluster.workers}


def judge_of(checks: Mapping[str, HostPlan]) -> Callable[[str, Mapping[str, str]], Judged]:
    """The supervisor's judge of what a host's agent found, against that host's checks."""

    def judge_host(host: str, values: Mapping[str, str]) -> Judged:
        rows = judge(checks[host], values)
        warn = [(c.name, c.reason) for c in rows if c.status is Status.WARN]
        fail = [(c.name, c.reason) for c in rows if c.status is Status.FAIL]
        return warn, fail

    return judge_host


@dataclass
class Attempt:
    """One attempt of a launch, and what it runs with."""

    resolved: Resolved
    plan: LaunchPlan
    inbox: queue.SimpleQueue[reports.Report]
    hosts: Hosts
    events: EventBus
    console: Console
    signals: Signals
    #: ``--no-preflight`` turns it off: the ranks start at once.
    preflight: bool
    #: Who launched (host, pid, start), for the agents' records.
    launcher: dict[str, Any]
    #: Who sent the TERM, when ``fdl-fabric stop`` left a note (`commands.stopping`).
    stop_note: Callable[[], Optional[Mapping[str, object]]]
    #: Whether a rank joined the coordinator in this attempt (``max_failure`` was usable).
    joined: bool = False

    def run(self) -> RunResult:
        """The coordinator, every agent's spec, the supervisor to a verdict."""
        plan, inbox = self.plan, self.inbox
        coordinator = Coordinator(
            coordinator_spec(plan, self.resolved.scale), self.events,
            on_join=lambda rank: inbox.put(reports.Joined(rank)),
            on_dead=lambda rank, why: inbox.put(reports.DeclaredDead(rank, why)),
            on_abort=lambda why: inbox.put(reports.Request("abort", cause=why)),
            rank_hosts={r.rank: r.host for r in plan.ranks})
        # The ranks reach it through their agents' sessions (docs/protocol.md).
        link_sessions(coordinator, self.hosts.sessions)
        try:
            coordinator.start()
        except CoordinatorError as exc:
            from ..preflight.run import port_owner  # a taken port only: the module is heavy

            held = (f" (held by {port_owner(plan.cluster.controller.port)})"
                    if "in use" in str(exc) else "")
            raise FdlError(f"{exc}{held} — nothing was started") from None
        try:
            if plan.attempt == 0:  # after the bind: a tunnel delivers to the coordinator
                self.hosts.open_tunnels(plan.cluster)
                self.hosts.watch_connections()
            result = self._supervise(coordinator)
        finally:
            coordinator.stop()
        self.joined = bool(coordinator.joined)
        return result

    def _supervise(self, coordinator: Coordinator) -> RunResult:
        r, plan = self.resolved, self.plan
        cluster = plan.cluster
        checks = preflight_checks(r, plan)
        supervisor = Supervisor(
            plan.ranks, self.hosts.sessions, kill_grace=cluster.kill_grace,
            events=self.events, cohort=coordinator, policy=Elastic(plan.world_size,
                                                                   r.max_failure),
            preflight=judge_of(checks) if self.preflight else None,
            inbox=self.inbox, agent_timeout=cluster.agent_timeout * r.scale,
            hang_timeout=cluster.hang_timeout, on_resume=self.hosts.resumed, lease=r.lease,
            attempt=plan.attempt, stop_note=self.stop_note)
        self.signals.supervisor = supervisor
        if self.signals.received is not None:  # arrived while this attempt was set up
            supervisor.request_interrupt(self.signals.received)
        self.console.start_status(lambda: supervisor.ranks)
        try:
            for host in plan.hosts():
                spec = plan.agent_spec(
                    host, checks=agent_checks(checks[host]) if self.preflight else None,
                    start_now=not self.preflight, lease=r.lease, launcher=self.launcher)
                self.hosts.sessions[host].spec(spec)
            return supervisor.run()
        finally:
            self.signals.supervisor = None
            self.console.stop_status()
