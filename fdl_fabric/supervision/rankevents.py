"""What hosts and ranks report, and what the supervisor writes of it.

Each report from the inbox that concerns a host or a rank has one handler here: the
pre-flight that starts the ranks, spawns, output, exits, the coordinator's joins and
deaths, an agent that is done or gone, a signal from outside. What a failure means is
the failure policy's (`policy`): before the cohort forms (or when the program never joins
a coordinator), the first failure is fatal, so every other rank is stopped at once
(kill-all); after the cohort forms, a death is a membership event and the run carries on
until ``max_failure``. A rank the coordinator declares dead (no heartbeat) is stopped by
its agent.

Every report about a rank is checked against its sender first (`_of_sender`): a host's
agent (or a gateway's relay, for its leaf) speaks only of the ranks that host runs in
this attempt. Output, a spawn, an exit, a spawn failure or an error for another host's
rank, or for a rank number outside the plan, is dropped: it changes no record, fails
nothing and shows nothing. A compromised host can end its own ranks, never touch
another's. Each host's dropped frames are counted and said once, when its agent ends
(``foreign_frames``: the count, by kind, and the first few rank numbers).
"""

from __future__ import annotations

import functools
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from .. import reports
from ..events import Event, Name, event
from ..states import STOPPED_BY_LEASE, RankState
from . import errorfile
from .policy import Decision
from .records import Rank, RankExit, RunPhase
from .stopping import Stopping

#: Rank numbers a ``foreign_frames`` event names; beyond, only the count.
RANKS_NAMED = 8


@dataclass
class Foreign:
    """The frames one host sent for ranks it does not run in this attempt."""

    dropped: int = 0
    #: By kind of frame: ``output``, ``spawned``, ``exited``, ``spawn_failed``, ``error``.
    kinds: Counter[str] = field(default_factory=Counter)
    #: The first `RANKS_NAMED` distinct rank numbers they named, and whether they named
    #: others too.
    ranks: list[int] = field(default_factory=list)
    more_ranks: bool = False

    def add(self, kind: str, rank: int) -> None:
        self.dropped += 1
        self.kinds[kind] += 1
        if rank in self.ranks:
            return
        if len(self.ranks) < RANKS_NAMED:
            self.ranks.append(rank)
        else:
            self.more_ranks = True


class RankEvents(Stopping):
    """The handlers of host and rank reports (the dispatch table is the supervisor's)."""

    # -- the sender ---------------------------------------------------------------------------
    @functools.cached_property
    def agents_killed(self) -> dict[str, Event]:
        """Hosts whose agent was killed by a signal while ranks ran: the cause of their
        ranks' loss (`reports.AgentGone.killed_by`)."""
        return {}

    @functools.cached_property
    def foreign(self) -> dict[str, Foreign]:
        """Each host's frames for ranks it does not run, until its agent ends."""
        return {}

    def _of_sender(self, host: str, rank: int, kind: str) -> Optional[Rank]:
        """The record of ``rank`` when ``host`` runs it in this attempt; else None, and
        the frame (of ``kind``) is counted as foreign to its sender."""
        r = self.by_rank.get(rank)
        if r is not None and r.host == host:
            return r
        self.foreign.setdefault(host, Foreign()).add(kind, rank)
        return None

    def _say_foreign(self, host: str) -> None:
        """Once per host, when its agent ended: how many of its frames were dropped."""
        seen = self.foreign.pop(host, None)
        if seen is not None:
            self.events(Name.FOREIGN_FRAMES, host=host, dropped=seen.dropped,
                        frames=dict(seen.kinds), ranks=list(seen.ranks),
                        more_ranks=seen.more_ranks)

    # -- pre-flight ---------------------------------------------------------------------------
    def _preflight(self, report: reports.Preflight) -> None:
        host = self.hosts.get(report.host)
        if host is None or self.preflight is None or host.preflight_seen:
            return
        host.preflight_seen = True
        if not host.gone:
            self._settled_hosts += 1
        warnings, failures = self.preflight(report.host, report.values)
        for check, reason in warnings:
            self.events(Name.PREFLIGHT_WARNING, host=report.host, check=check, reason=reason)
        for check, reason in failures:
            self.events(Name.PREFLIGHT_FAILED_CHECK, host=report.host, check=check,
                        reason=reason, preflight="fail")
        self._preflight_failures += len(failures)
        self._maybe_start()

    def _maybe_start(self) -> None:
        if self.phase is not RunPhase.PREPARING:
            return
        if self._settled_hosts < len(self.hosts):  # some host's pre-flight is still due
            return
        if self._preflight_failures:
            # Each failed check was said as it came; the verdict line ends the launch.
            self._fail(event(Name.PREFLIGHT_FAILED, failures=self._preflight_failures),
                       announced=True)
            return
        self.events(Name.PREFLIGHT_PASSED, hosts=len(self.hosts))
        self._start_all()

    def _start_all(self) -> None:
        self.phase = RunPhase.RUNNING
        for host in self.hosts.values():
            if not host.gone:
                host.handle.start_ranks()

    def _swept(self, report: reports.Swept) -> None:
        data = report.report
        for err in data.get("errors", []):
            self.events(Name.LEFTOVER_ERROR, host=report.host, error=err)
        for item in data.get("stopped", []):
            self.events(Name.LEFTOVERS_STOPPED, host=report.host, run=item.get("run"),
                        pids=item.get("pids"))
        for item in data.get("leftovers", []):
            self.events(Name.LEFTOVER_KEPT, host=report.host, item=item)
        for item in data.get("live", []):
            self.events(Name.LIVE_RUN_LEFT, host=report.host, live_run=item.get("run"),
                        launcher=item.get("launcher"))

    # -- ranks --------------------------------------------------------------------------------
    def _spawned(self, report: reports.Spawned) -> None:
        r = self._of_sender(report.host, report.rank, "spawned")
        if r is None or r.state is not RankState.PENDING:
            return
        r.pid = report.pid
        r.state = RankState.RUNNING
        r.started = self._last_activity = time.monotonic()
        self.events(Name.RANK_STARTED, host=r.host, rank=r.rank, pid=report.pid,
                    label=r.plan.label)
        self._running += 1
        if self._running == len(self.ranks):
            self.events(Name.ALL_RANKS_RUNNING, attempt=self.attempt,
                        world_size=len(self.ranks), hosts=len(self.hosts))
        if self._stop_started is not None and not r.stop_requested:
            r.stop_requested = True  # started while the run was being stopped

    def _output(self, report: reports.Output) -> None:
        """Bookkeeping only: the chunk itself reached the console and the logs on the
        session's reading thread (`rankoutput`), so a stalled terminal never stalls this
        loop."""
        r = self._of_sender(report.host, report.rank, "output")
        if r is None:
            return
        self._last_activity = time.monotonic()
        tail = report.data[-400:].decode("utf-8", "replace")
        body = tail[:-1] if tail.endswith("\n") else tail
        last = body.rpartition("\n")[2]
        if last:
            r.last_line = last[-200:]

    def _joined(self, report: reports.Joined) -> None:
        r = self.by_rank.get(report.rank)
        self._last_activity = time.monotonic()
        if r is not None and r.state in (RankState.PENDING, RankState.RUNNING):
            r.state = RankState.JOINED

    def _spawn_failed(self, report: reports.SpawnFailed) -> None:
        if self._of_sender(report.host, report.rank, "spawn_failed") is None:
            return
        failure = event(Name.RANK_START_FAILED, host=report.host, rank=report.rank,
                        reason=report.reason)
        self.events.emit(failure)
        self._fail(failure, announced=True)

    def _exited(self, report: reports.Exited) -> None:
        r = self._of_sender(report.host, report.rank, "exited")
        if r is None or r.state.terminal:
            return
        self._on_exit(r, RankExit(code=report.code, signal=report.signal,
                                  error=errorfile.parse(report.error),
                                  error_text=report.error))

    def _on_exit(self, r: Rank, info: RankExit) -> None:
        """A rank ended: a success, a stop (by a forwarded signal, the coordinator or the
        launcher), or a death the policy judges."""
        data = info.event_data
        if info.ok:
            self._end(r, info, RankState.SUCCEEDED)
            self.events(Name.RANK_EXITED, host=r.host, rank=r.rank, **data)
        elif info.signal is not None and info.signal in self._forwarded \
                and not r.stop_requested and r.declared_dead is None:
            self._forward_ended(r, info, data)
        elif r.declared_dead is not None and self.failure is None and not r.stop_requested:
            self._end(r, info, RankState.TOLERATED)
            self.tolerated += 1
            self.events(Name.RANK_DEAD_STOPPED, host=r.host, rank=r.rank,
                        declared_dead=dict(r.declared_dead), **data)
        elif r.stop_requested:
            # A rank being stopped that reports no status is lost, not known stopped.
            lost = info.lost is not None
            self._end(r, info, RankState.LOST if lost else RankState.STOPPED)
            by = {"stopped_by": r.stopped_by} if r.stopped_by else {}
            self.events(Name.RANK_EXITED, host=r.host, rank=r.rank, stopped=not lost, **by,
                        **data)
        else:
            self._died(r, info, data)

    def _died(self, r: Rank, info: RankExit, data: dict[str, object]) -> None:
        """A death nobody asked for: the first is the root cause; the policy tolerates
        it (the run goes on, or survivors save and stop) or the run fails. A rank lost
        with its agent, killed by a signal, is no rank's doing: the agent's death is the
        cause (any rank of the host may have sent the signal, or anyone else)."""
        killed = self.agents_killed.get(r.host)
        if killed is not None:
            self._lost_with_killed_agent(r, info, data, killed)
            return
        if self.root_cause is None:
            self.root_cause = r
        decision = self._decide(r.rank) if self.failure is None else Decision.STOP_ALL
        if decision is not Decision.STOP_ALL:
            self._end(r, info, RankState.TOLERATED)
            self.tolerated += 1
            self.events(Name.RANK_TOLERATED, host=r.host, rank=r.rank, **data)
            if self.cohort is not None:
                self.cohort.mark_dead([r.rank], {"exit": info.data})
            self._apply(decision)
            return
        self._end(r, info, RankState.LOST if info.lost is not None else RankState.FAILED)
        failure = event(Name.RANK_FAILED, host=r.host, rank=r.rank, **data)
        self.events.emit(failure)
        self._fail(failure, announced=True)

    def _lost_with_killed_agent(self, r: Rank, info: RankExit, data: dict[str, object],
                                killed: Event) -> None:
        """`_died` for a rank whose agent was killed: counted by the policy as any lost
        rank, but never the root cause; a failure names the agent's death."""
        decision = self._decide(r.rank) if self.failure is None else Decision.STOP_ALL
        tolerated = decision is not Decision.STOP_ALL
        self._end(r, info, RankState.TOLERATED if tolerated else RankState.LOST)
        self.events(Name.RANK_TOLERATED if tolerated else Name.RANK_EXITED, host=r.host,
                    rank=r.rank, **data)
        if not tolerated:
            self._fail(killed, announced=False)
            return
        self.tolerated += 1
        if self.cohort is not None:
            self.cohort.mark_dead([r.rank], {"exit": info.data})
        self._apply(decision)

    def _forward_ended(self, r: Rank, info: RankExit, data: dict[str, object]) -> None:
        """A signal the launcher forwarded (USR1, USR2) killed a rank that has no handler
        for it: the operator's signal stopped the run, the program did not fail."""
        assert info.signal is not None
        name = signal.Signals(info.signal).name
        r.stopped_by = name
        self._end(r, info, RankState.STOPPED)
        self.events(Name.RANK_FORWARD_STOPPED, host=r.host, rank=r.rank, forwarded=name, **data)
        if self._stopped_by_forward is None and self._interrupt is None \
                and self.failure is None:
            self._stopped_by_forward = (info.signal, r)
            self._stop_all()

    def _declared_dead(self, report: reports.DeclaredDead) -> None:
        """The coordinator heard nothing from a joined rank for its heartbeat timeout: the
        policy counts it now, and its agent stops it (TERM, KILL after the kill grace),
        so its exit comes."""
        r = self.by_rank.get(report.rank)
        if r is None or r.state.terminal or r.declared_dead is not None:
            return
        r.declared_dead = report.reason
        if self.failure is None:
            self._apply(self._decide(r.rank))
        host = self.hosts[r.host]
        if not host.gone:
            host.handle.stop("TERM", r.rank)

    # -- hosts --------------------------------------------------------------------------------
    def _verified(self, report: reports.Verified) -> None:
        if report.stopped:
            self.events(Name.AFTER_RUN_STOPPED, host=report.host, stopped=list(report.stopped))
        if report.remaining:
            self.events(Name.AFTER_RUN_REMAINS, host=report.host,
                        remaining=list(report.remaining))

    def _agent_error(self, report: reports.AgentError) -> None:
        """A problem the agent survived: its own (no rank), or one of its ranks'."""
        if report.rank is not None and \
                self._of_sender(report.host, report.rank, "error") is None:
            return
        self.events(Name.AGENT_WARNING, host=report.host, rank=report.rank,
                    text=report.message)
        if report.lease_ran_out and self._paused_for:
            self._suspended_past(self._paused_for, slack=self.ping_every)

    def _suspended_past(self, gap: float, *, slack: float) -> None:
        """This process was stopped for ``gap`` seconds, longer than the agents' lease:
        every agent has stopped its ranks on its own. That is what ended the run, not a
        rank: the ranks are recorded as stopped by their lease, and nobody is blamed.
        ``slack``: an agent said its lease ran out, and it counts from the last ping it
        heard, up to a ping interval before this process stopped."""
        lease = self.lease
        if lease is None or gap + slack <= lease or not self.started_any() \
                or self.failure is not None or self._interrupt is not None:
            return
        for r in self.live():
            r.stopped_by = STOPPED_BY_LEASE
        self._fail(event(Name.LAUNCHER_SUSPENDED, suspended=round(gap, 1), lease=lease),
                   announced=False, stopping_said=False)

    def _agent_done(self, report: reports.AgentDone) -> None:
        host = self.hosts.get(report.host)
        if host is not None and host.done_at is None:
            host.done_at = time.monotonic()
            self._done_hosts.append(host)

    def _gone(self, report: reports.AgentGone) -> None:
        host = self.hosts.get(report.host)
        if host is None or host.gone:
            return
        reason = f"agent lost: {report.reason}" if report.reason else "agent ended"
        if report.killed_by is not None and any(not r.state.terminal for r in host.ranks):
            self.agents_killed[report.host] = event(
                Name.AGENT_KILLED, host=report.host, signal=report.killed_by,
                ranks=[r.rank for r in host.ranks if not r.state.terminal])
        self._host_ended(report.host, reason, fault=None if report.clean else "lost",
                         warn=not report.clean)

    def _host_ended(self, name: str, reason: str, *, fault: Optional[str], warn: bool) -> None:
        """A host's agent is gone or given up on: its ranks without an exit are lost."""
        self._say_foreign(name)
        host = self.hosts[name]
        if not host.gone:
            self._gone_hosts += 1
            if not host.preflight_seen:
                self._settled_hosts += 1
        host.gone = True
        host.fault = fault
        lost = [r for r in host.ranks if not r.state.terminal]
        if not lost:
            self._maybe_start()
            return
        if warn:
            self.events(Name.HOST_LOST, host=name, reason=reason, host_fault=fault)
        never = [r for r in lost if r.state is RankState.PENDING]
        for r in never:
            self._end(r, RankExit(lost=reason, host_fault=fault), RankState.NOT_STARTED)
        for r in lost:
            if r.state is not RankState.NOT_STARTED:
                self._on_exit(r, RankExit(lost=reason, host_fault=fault))
        if never and self._stop_started is None:
            self._fail(event(Name.HOST_ENDED_EARLY, host=name, reason=reason), announced=True)
        self._maybe_start()

    def _signaled(self, report: reports.Signaled) -> None:
        """A signal from outside reached an agent: under Slurm, ``scancel`` or the time
        limit (TERM) or ``--signal`` (USR1). A stop is the run's interruption, as if the
        launcher had received it, unless a failure already decided the run."""
        if not report.stopping:
            self.events(Name.OUTSIDE_SIGNAL, host=report.host, signal=report.signal,
                        forwarded=report.forwarded)
            return
        signum = int(getattr(signal, "SIG" + report.signal, signal.SIGTERM))
        if self._interrupt is not None:
            return
        if report.by:
            self._stopped_by = report.by
        if self.failure is not None:
            # The same signal may have reached a rank (Slurm signals every process of the
            # step) and been reported before its agent's own: then it is no failure.
            cause = self.root_cause
            if cause is None or cause.exit is None or cause.exit.signal != signum:
                return
        self._interrupt = signum
        self._interrupted_on = report.host
        self.events(Name.AGENT_SIGNALED, host=report.host, signal=report.signal,
                    by=dict(self._stopped_by) if self._stopped_by else None)
        self._stop_all()
