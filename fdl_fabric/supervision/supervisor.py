"""Supervision: one record per rank, the failure policy, one verdict.

Modelled on torch.distributed.elastic's agent: the run moves through explicit phases
(`RunPhase`), every rank has one record (`Rank`) with an explicit `RankState`, and the
run ends with one frozen `RunResult` that holds the verdict and the exit code.

The supervisor is the only writer of rank state. Everything that happens reaches it
as a `reports` record in its inbox: what agents report (spawned, output, exited, gone),
joins from the coordinator, and requests from signal handlers. It acts on hosts
through the small `HostHandle` interface (start, stop, kill, signal, abandon), so the
policy is tested with fake hosts and no process at all.

What a failure means is the failure policy's (`policy`): before the cohort forms (or
when the program never joins a coordinator), the first failure is fatal, so every
other rank is stopped at once (kill-all); after the cohort forms, a death is a
membership event and the run carries on until ``max_failure``. The supervisor asks the
policy and acts; the coordinator (`Cohort`) keeps membership and sockets only.

Nothing waits for an exit that may never come. A host whose agent sends nothing for
``agent_timeout`` (frozen agent, frozen sshd, cut link) is *unresponsive*: its ranks are
lost, and the rules above apply. A rank the coordinator declares dead (no heartbeat)
is stopped by its agent. A run in which no rank wrote a line and no joined rank
reported progress for ``hang_timeout`` is *hung*: every rank's stack is collected, and
the run ends with that verdict. Signal handlers only post requests here; this loop is
the one place that acts on them and says so.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import queue
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional, Protocol

from ..agent import wire
from ..events import Event, EventBus, Name, event
from ..planning.plan import RankPlan
from ..presentation.words import cause_data, render
from . import errorfile, reports
from .errorfile import RankError
from .policy import Decision, FailurePolicy, KillAll
from .verdict import Verdict

#: Longest the loop sleeps with nothing in its inbox; bounds the elastic checks' delay.
TICK = 0.05
#: Seconds between two walks over every host for a silent agent, at most (a twentieth of
#: ``agent_timeout`` when that is less: 0.3 s at its 6 s minimum).
HOST_CHECK_EVERY = 0.5
#: Extra seconds past the kill grace before hosts that did not report are sent KILL.
FORCE_MARGIN = 3.0
#: Extra seconds past that before a host that still reports nothing is abandoned.
ABANDON_MARGIN = 3.0
#: Seconds an agent has to end its session after saying it is done.
GONE_MARGIN = 5.0
#: Seconds survivors get to save and exit after a save-and-shutdown broadcast,
#: before the launcher stops them (a checkpoint can take a while to write).
SHUTDOWN_GRACE = 120.0
#: Seconds every agent has to answer a request for stacks (its collector bounds py-spy
#: at 10 s per process, and they run in parallel).
STACKS_TIMEOUT = 15.0
#: A gap this long between two turns of the loop means this process was stopped
#: (Ctrl-Z, SIGSTOP): every silence clock starts again, nobody is blamed for it.
PAUSE_GAP = 2.0


class RunPhase(str, Enum):
    """PREPARING (agents start, pre-flight) -> RUNNING -> STOPPING -> DONE."""

    PREPARING = "preparing"
    RUNNING = "running"
    STOPPING = "stopping"
    DONE = "done"


class RankState(str, Enum):
    """Life of one rank: PENDING -> RUNNING -> JOINED -> one terminal state."""

    PENDING = "pending"
    RUNNING = "running"
    JOINED = "joined"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    LOST = "lost"
    TOLERATED = "tolerated"
    NOT_STARTED = "not started"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({RankState.SUCCEEDED, RankState.FAILED, RankState.STOPPED,
                       RankState.LOST, RankState.TOLERATED, RankState.NOT_STARTED})



@dataclass(frozen=True)
class RankExit:
    """How a rank ended: an exit code, a signal, or lost (no status ever came), and
    what its error file said, if it wrote one."""

    code: Optional[int] = None
    signal: Optional[int] = None
    lost: Optional[str] = None
    error: Optional[RankError] = None
    error_text: str = ""
    #: The rank's host went away (``lost``) or stopped answering (``unresponsive``): no
    #: error file could come from it.
    host_fault: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.code == 0

    @property
    def data(self) -> dict[str, object]:
        """As event data (`words.exit_words` says it)."""
        return {"code": self.code, "signal": self.signal, "lost": self.lost}


@dataclass
class Rank:
    """Everything about one rank; written only by the supervisor."""

    plan: RankPlan
    state: RankState = RankState.PENDING
    pid: Optional[int] = None
    last_line: str = ""
    exit: Optional[RankExit] = None
    started: Optional[float] = None
    ended: Optional[float] = None
    stop_requested: bool = False
    #: Why the coordinator declared this rank dead, once it did (its agent stops it).
    declared_dead: Optional[Mapping[str, object]] = None
    #: The forwarded signal (its name) that ended it: the program had no handler for it.
    stopped_by: Optional[str] = None

    @property
    def rank(self) -> int:
        return self.plan.rank

    @property
    def host(self) -> str:
        return self.plan.host

    @property
    def label(self) -> str:
        return f"rank {self.rank} of {self.host}"

    @property
    def device_name(self) -> str:
        """Its device as the live table shows it."""
        return "cpu" if self.plan.device is None else str(self.plan.device)

    def summary(self) -> dict[str, object]:
        """The rank's row of the end-of-run summary, as data (`words.cause_cell`)."""
        return {"rank": self.rank, "host": self.host, "state": self.state.value,
                "exit": self.exit.data if self.exit is not None else None,
                "host_fault": self.exit.host_fault if self.exit is not None else None,
                "declared_dead": self.declared_dead is not None,
                "stopped_by": self.stopped_by, "duration": round(self.duration, 3)}

    @property
    def duration(self) -> float:
        if self.started is None:
            return 0.0
        return (self.ended or time.monotonic()) - self.started




@dataclass(frozen=True)
class RunResult:
    """The outcome of a run: one verdict, one exit code, and its cause (the event whose
    words are the last line)."""

    verdict: Verdict
    exit_code: int
    cause: Event
    ranks: tuple[Rank, ...]
    #: The first rank that failed (in the order failures were seen): the root cause.
    root_cause: Optional[Rank] = None
    #: Hosts whose agent went away (``lost``) or stopped answering (``unresponsive``).
    faults: Mapping[str, str] = field(default_factory=dict)

    @property
    def message(self) -> str:
        """The verdict line."""
        return render(self.cause)

    @property
    def started_any(self) -> bool:
        return any(r.started is not None for r in self.ranks)

    @property
    def restartable(self) -> bool:
        """A failed or hung run whose ranks had started: another attempt may succeed.
        Pre-flight failures, interrupts and successes are not retried."""
        return self.verdict in (Verdict.FAILED, Verdict.HUNG) and self.started_any


class HostHandle(Protocol):
    """What the supervisor needs from one host's agent (see `sessions.AgentSession`)."""

    def start_ranks(self) -> None: ...
    def stop(self, signal: str = "TERM", rank: Optional[int] = None) -> None: ...
    def kill(self) -> None: ...
    def signal(self, name: str, rank: Optional[int] = None) -> None: ...
    def abandon(self) -> None: ...
    def ping(self) -> None: ...
    def suspend(self) -> None: ...
    def resume(self) -> None: ...
    def stacks(self, request_id: int) -> None: ...

    @property
    def last_heard(self) -> float:
        """When (monotonic) the agent last said anything, or is known to be talking."""


class Cohort(Protocol):
    """The membership the supervisor reads and tells (the coordinator implements it)."""

    @property
    def cohort_formed(self) -> bool: ...

    @property
    def exited(self) -> set[int]:
        """Ranks that announced a clean exit (never counted dead)."""

    def mark_dead(self, ranks: Sequence[int], reason: Mapping[str, object]) -> None: ...

    def broadcast_shutdown(self, cause: Event) -> None: ...

    @property
    def last_progress(self) -> float:
        """When (monotonic) a joined rank last reported progress (0: never)."""

    def resumed(self) -> None:
        """This process was stopped for a while: start the heartbeat clocks again."""


#: Judges a host's pre-flight values: (host, values) -> (warnings, failures), each a
#: list of (check, reason).
PreflightJudge = Callable[[str, Mapping[str, str]],
                          tuple[list[tuple[str, str]], list[tuple[str, str]]]]


@dataclass
class _Host:
    handle: HostHandle
    ranks: list[Rank] = field(default_factory=list)
    preflight_seen: bool = False
    done_at: Optional[float] = None
    gone: bool = False
    forced: bool = False
    #: The host's rank could not report: lost (its session ended) or unresponsive.
    fault: Optional[str] = None


@dataclass
class _StackRequest:
    """Stacks asked of every agent: for a hung run (then the verdict) or for a look."""

    id: int
    reason: str
    pending: set[str]
    deadline: float
    hang: bool
    found: dict[int, dict[str, object]] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)
    py_spy: dict[str, bool] = field(default_factory=dict)


_request_ids = itertools.count(1)


def ping_interval(agent_timeout: Optional[float], lease: Optional[float]) -> float:
    """Seconds between two pings of every agent: a third of the shorter of ``agent_timeout``
    (an agent answers a ping with a heartbeat when it had nothing else to say) and the
    agents' ``lease`` (they stop their ranks without a ping for that long), and never
    less than `wire.PING_INTERVAL`. At the defaults (10 s, 30 s) that is 3.3 s rather
    than 2 s: at 1,024 hosts each ping round is 1,024 frames down and as many up."""
    bounds = [t for t in (agent_timeout, lease) if t is not None]
    return max(wire.PING_INTERVAL, min(bounds) / 3) if bounds else wire.PING_INTERVAL


class Supervisor:
    """Runs the policy over a run's ranks until every host's agent is gone."""

    def __init__(
        self,
        plans: Sequence[RankPlan],
        hosts: Mapping[str, HostHandle],
        *,
        kill_grace: float,
        events: EventBus,
        cohort: Optional[Cohort] = None,
        policy: Optional[FailurePolicy] = None,
        preflight: Optional[PreflightJudge] = None,
        inbox: Optional[queue.SimpleQueue[reports.Report]] = None,
        tick: float = TICK,
        agent_timeout: Optional[float] = None,
        hang_timeout: Optional[float] = None,
        on_resume: Optional[Callable[[], None]] = None,
        lease: Optional[float] = None,
        attempt: int = 0,
        stop_note: Optional[Callable[[], Optional[Mapping[str, object]]]] = None,
    ) -> None:
        self.ranks = [Rank(p) for p in plans]
        #: Which attempt this is (``--max-restarts``), for the events that name it.
        self.attempt = attempt
        #: Who asked for a TERM (``fdl-fabric stop`` leaves a note in the run's record):
        #: read when the TERM arrives, so the verdict names the stopper.
        self.stop_note = stop_note
        self._running = 0
        self.ping_every = ping_interval(agent_timeout, lease)
        #: Hosts given up on or gone (the loop runs until all are), and those that said
        #: DONE (each may need abandoning): kept as they change, not walked every turn.
        self._gone_hosts = 0
        self._done_hosts: list[_Host] = []
        self.by_rank = {r.rank: r for r in self.ranks}
        self.hosts = {name: _Host(handle) for name, handle in hosts.items()}
        for r in self.ranks:
            self.hosts[r.host].ranks.append(r)
        self.kill_grace = kill_grace
        self.events = events
        self.cohort = cohort
        self.policy: FailurePolicy = policy or KillAll()
        self.preflight = preflight
        self.inbox: queue.SimpleQueue[reports.Report] = inbox or queue.SimpleQueue()
        self.tick = tick
        self.phase = RunPhase.PREPARING if preflight is not None else RunPhase.RUNNING
        #: What ended the run, once something did (its words are the verdict).
        self.failure: Optional[Event] = None
        self.tolerated = 0
        #: Ranks whose death the policy has been told of (`_decide`).
        self.counted: set[int] = set()
        self._stop_started: Optional[float] = None
        self._forced = False
        self._interrupt: Optional[int] = None
        #: The host whose agent was signaled, when the interruption came from outside.
        self._interrupted_on: Optional[str] = None
        self._pinged = time.monotonic()
        self._shutdown_seen: Optional[float] = None
        self._preflight_failures = 0
        self.root_cause: Optional[Rank] = None
        self.agent_timeout = agent_timeout
        self.hang_timeout = hang_timeout
        self.on_resume = on_resume
        now = time.monotonic()
        #: Silence clocks start here (and again after a pause of this process).
        self._watch_from = now
        self._hosts_checked_at = 0.0
        self._last_turn = now
        self._last_activity = now
        self._stacks: Optional[_StackRequest] = None
        self._hung: Optional[Event] = None
        #: Signals the launcher forwarded to the ranks, by number.
        self._forwarded: set[int] = set()
        #: A forwarded signal that ended a rank: the run's interruption.
        self._stopped_by_forward: Optional[tuple[int, Rank]] = None
        #: A cleanup that stopped this run: its note (who, for the verdict).
        self._stopped_by: Optional[Mapping[str, object]] = None
        #: ``fdl-fabric stop`` that stopped this run: its note (who, for the verdict).
        self._stopped_by_command: Optional[Mapping[str, object]] = None

    # -- called from other threads (all go through the inbox) --------------------------------
    def post(self, report: reports.Report) -> None:
        self.inbox.put(report)

    def joined(self, rank: int) -> None:
        self.post(reports.Joined(rank))

    def request_interrupt(self, signum: int) -> None:
        """First Ctrl-C/TERM: graceful stop of every rank."""
        self.post(reports.Request("interrupt", str(signum)))

    def request_kill(self) -> None:
        """Second Ctrl-C: KILL every rank's process group now."""
        self.post(reports.Request("kill"))

    def request_signal(self, name: str) -> None:
        """Forward a signal (USR1/USR2) to every running rank."""
        self.post(reports.Request("signal", name))

    def request_abort(self, cause: Event) -> None:
        """A run-level failure outside the ranks (the cohort did not form)."""
        self.post(reports.Request("abort", cause=cause))

    def request_suspend(self) -> None:
        """Ctrl-Z: tell the agents to hold their leases, then stop this process."""
        self.post(reports.Request("suspend"))

    def request_resume(self) -> None:
        """SIGCONT: the agents count their leases again."""
        self.post(reports.Request("resume"))

    def request_stacks(self) -> None:
        """Ctrl-\\ (SIGQUIT): show where every rank is; the run goes on."""
        self.post(reports.Request("stacks"))

    # -- views --------------------------------------------------------------------------------
    def live(self) -> list[Rank]:
        return [r for r in self.ranks if not r.state.terminal]

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> RunResult:
        if self.phase is RunPhase.RUNNING:
            self._start_all()
        while self._gone_hosts < len(self.hosts):
            try:
                report: Optional[reports.Report] = self.inbox.get(timeout=self.tick)
            except queue.Empty:
                report = None
            self._check_pause()
            while report is not None:
                self._handle(report)
                report = self._next()
            self._check_shutdown()
            self._check_pause()  # a stop while handling reports must blame no host
            self._check_hosts()
            self._check_hang()
            self._check_stacks()
            self._escalate()
            self._ping()
        # Reports that came with the last host's end (an exit, a death) still count.
        report = self._next()
        while report is not None:
            self._handle(report)
            report = self._next()
        self.phase = RunPhase.DONE
        for r in self.ranks:
            if not r.state.terminal:  # cannot happen once every host is gone; be safe
                self._end(r, RankExit(lost="agent gone"), RankState.LOST)
        return self._result()

    def _next(self) -> Optional[reports.Report]:
        try:
            return self.inbox.get_nowait()
        except queue.Empty:
            return None

    def _handle(self, report: reports.Report) -> None:
        if isinstance(report, reports.Output):
            self._output(report)
        elif isinstance(report, reports.Exited):
            self._exited(report)
        elif isinstance(report, reports.Spawned):
            self._spawned(report)
        elif isinstance(report, reports.Joined):
            r = self.by_rank.get(report.rank)
            self._last_activity = time.monotonic()
            if r is not None and r.state in (RankState.PENDING, RankState.RUNNING):
                r.state = RankState.JOINED
        elif isinstance(report, reports.DeclaredDead):
            self._declared_dead(report)
        elif isinstance(report, reports.Stacks):
            self._stacks_report(report)
        elif isinstance(report, reports.Request):
            self._request(report)
        elif isinstance(report, reports.Preflight):
            self._preflight(report)
        elif isinstance(report, reports.Swept):
            self._swept(report)
        elif isinstance(report, reports.SpawnFailed):
            self._spawn_failed(report)
        elif isinstance(report, reports.Verified):
            self._verified(report)
        elif isinstance(report, reports.AgentError):
            self.events(Name.AGENT_WARNING, host=report.host, rank=report.rank,
                        text=report.message)
        elif isinstance(report, reports.AgentDone):
            host = self.hosts.get(report.host)
            if host is not None and host.done_at is None:
                host.done_at = time.monotonic()
                self._done_hosts.append(host)
        elif isinstance(report, reports.AgentGone):
            self._gone(report)
        elif isinstance(report, reports.Signaled):
            self._signaled(report)

    # -- pre-flight ---------------------------------------------------------------------------
    def _preflight(self, report: reports.Preflight) -> None:
        host = self.hosts.get(report.host)
        if host is None or self.preflight is None or host.preflight_seen:
            return
        host.preflight_seen = True
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
        if not all(h.preflight_seen or h.gone for h in self.hosts.values()):
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
        r = self.by_rank.get(report.rank)
        if r is None or r.host != report.host or r.state is not RankState.PENDING:
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
        r = self.by_rank.get(report.rank)
        if r is None:
            return
        self._last_activity = time.monotonic()
        tail = report.data[-400:].decode("utf-8", "replace")
        body = tail[:-1] if tail.endswith("\n") else tail
        last = body.rpartition("\n")[2]
        if last:
            r.last_line = last[-200:]

    def _spawn_failed(self, report: reports.SpawnFailed) -> None:
        failure = event(Name.RANK_START_FAILED, host=report.host, rank=report.rank,
                        reason=report.reason)
        self.events.emit(failure)
        self._fail(failure, announced=True)

    def _exited(self, report: reports.Exited) -> None:
        r = self.by_rank.get(report.rank)
        if r is None or r.state.terminal or r.host != report.host:
            return
        self._on_exit(r, RankExit(code=report.code, signal=report.signal,
                                  error=errorfile.parse(report.error),
                                  error_text=report.error))

    def _on_exit(self, r: Rank, info: RankExit) -> None:
        data: dict[str, object] = {"exit": info.data, "ok": info.ok}
        if info.error is not None:
            data["error"] = info.error.message
        if info.error_text:
            data["error_file"] = info.error_text
        if info.ok:
            self._end(r, info, RankState.SUCCEEDED)
            self.events(Name.RANK_EXITED, host=r.host, rank=r.rank, **data)
            return
        if info.signal is not None and info.signal in self._forwarded and not r.stop_requested \
                and r.declared_dead is None:
            self._forward_ended(r, info, data)
            return
        if r.declared_dead is not None and self.failure is None and not r.stop_requested:
            self._end(r, info, RankState.TOLERATED)
            self.tolerated += 1
            self.events(Name.RANK_DEAD_STOPPED, host=r.host, rank=r.rank,
                        declared_dead=dict(r.declared_dead), **data)
            return
        if r.stop_requested:
            # A rank being stopped that reports no status is lost, not known stopped.
            lost = info.lost is not None
            self._end(r, info, RankState.LOST if lost else RankState.STOPPED)
            self.events(Name.RANK_EXITED, host=r.host, rank=r.rank, stopped=not lost, **data)
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

    def _decide(self, rank: int) -> Decision:
        """The policy's word on a death (the cohort's facts at hand)."""
        cohort = self.cohort
        formed = cohort is not None and cohort.cohort_formed
        announced = cohort is not None and rank in cohort.exited
        self.counted.add(rank)
        return self.policy.on_death(rank, formed=formed, announced=announced)

    def _apply(self, decision: Decision) -> None:
        """A tolerated death that leaves the run unable to continue: survivors save and
        stop (the coordinator broadcasts it; the grace timer starts)."""
        if decision is not Decision.SHUTDOWN:
            return
        reason = self.policy.shutdown_reason()
        if self.cohort is not None and reason is not None:
            self.cohort.broadcast_shutdown(reason)
        if self._shutdown_seen is None:
            self._shutdown_seen = time.monotonic()

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

    def _end(self, r: Rank, info: RankExit, state: RankState) -> None:
        r.exit = info
        r.state = state
        r.ended = time.monotonic()

    def _verified(self, report: reports.Verified) -> None:
        if report.stopped:
            self.events(Name.AFTER_RUN_STOPPED, host=report.host, stopped=list(report.stopped))
        if report.remaining:
            self.events(Name.AFTER_RUN_REMAINS, host=report.host,
                        remaining=list(report.remaining))

    def _gone(self, report: reports.AgentGone) -> None:
        host = self.hosts.get(report.host)
        if host is None or host.gone:
            return
        reason = f"agent lost: {report.reason}" if report.reason else "agent ended"
        self._host_ended(report.host, reason, fault=None if report.clean else "lost",
                         warn=not report.clean)

    def _host_ended(self, name: str, reason: str, *, fault: Optional[str], warn: bool) -> None:
        """A host's agent is gone or given up on: its ranks without an exit are lost."""
        host = self.hosts[name]
        if not host.gone:
            self._gone_hosts += 1
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

    # -- liveness, hangs, stacks ----------------------------------------------------------------
    def _check_pause(self) -> None:
        """A long gap between two turns: this process was stopped (Ctrl-Z, SIGSTOP, a
        suspended VM). Nobody else was silent: every silence clock starts again."""
        now = time.monotonic()
        if now - self._last_turn > PAUSE_GAP:
            self._restart_clocks(now)
        self._last_turn = now

    def _restart_clocks(self, now: float) -> None:
        self._watch_from = self._last_activity = self._pinged = now
        if self.cohort is not None:
            self.cohort.resumed()
        if self.on_resume is not None:
            self.on_resume()

    def _check_hosts(self) -> None:
        """An agent that has said nothing for ``agent_timeout`` is unresponsive.

        Every `HOST_CHECK_EVERY` seconds at most (a twentieth of the timeout when that is
        less), not on every turn of the loop: a turn per report burst walked every host,
        40 % of the idle launcher at 1,024 hosts (issue 23's emulator)."""
        if self.agent_timeout is None:
            return
        now = time.monotonic()
        if now < self._hosts_checked_at + min(HOST_CHECK_EVERY, self.agent_timeout / 20):
            return
        self._hosts_checked_at = now
        for name, host in self.hosts.items():
            if host.gone:
                continue
            silent = now - max(host.handle.last_heard, self._watch_from)
            if silent <= self.agent_timeout:
                continue
            reason = f"no word from its agent for {silent:.1f}s"
            self.events(Name.HOST_UNRESPONSIVE, host=name, host_fault="unresponsive",
                        silent=round(silent, 3), agent_timeout=self.agent_timeout)
            host.handle.abandon()
            self._host_ended(name, f"host unresponsive: {reason}", fault="unresponsive",
                             warn=False)

    def _check_hang(self) -> None:
        """No rank wrote a line, and no joined rank reported progress, for hang_timeout."""
        if self.hang_timeout is None or self.phase is not RunPhase.RUNNING \
                or self._stacks is not None or self._hung is not None or not self.live():
            return
        now = time.monotonic()
        last = self._last_activity
        if self.cohort is not None:
            last = max(last, self.cohort.last_progress)
        if now - max(last, self._watch_from) <= self.hang_timeout:
            return
        self._hung = event(Name.HUNG, silent=round(now - last, 3),
                           hang_timeout=self.hang_timeout)
        self.events(Name.HANG_DETECTED, **self._hung.data)
        self._ask_stacks("hang", hang=True)

    def _ask_stacks(self, reason: str, *, hang: bool) -> None:
        if self._stacks is not None:
            return
        pending = {name for name, h in self.hosts.items()
                   if not h.gone and any(not r.state.terminal for r in h.ranks)}
        request = _StackRequest(next(_request_ids), reason, pending,
                                time.monotonic() + STACKS_TIMEOUT, hang)
        self._stacks = request
        for name in pending:
            self.hosts[name].handle.stacks(request.id)
        self._check_stacks()

    def _stacks_report(self, report: reports.Stacks) -> None:
        request = self._stacks
        if request is None or report.request_id != request.id:
            return
        request.pending.discard(report.host)
        request.py_spy[report.host] = report.py_spy
        if report.error and not report.ranks:
            request.problems[report.host] = report.error
        for rank, entry in report.ranks.items():
            if rank in self.by_rank:
                request.found[rank] = entry
        self._check_stacks()

    def _check_stacks(self) -> None:
        request = self._stacks
        if request is None:
            return
        for name in list(request.pending):
            if self.hosts[name].gone:
                request.pending.discard(name)
                request.problems[name] = "its agent is gone"
        if request.pending and time.monotonic() < request.deadline:
            return
        for name in request.pending:
            request.problems[name] = f"no answer within {STACKS_TIMEOUT:g}s"
        self._stacks = None
        labels = {r.rank: (r.host, r.plan.label) for r in self.ranks}
        self.events(Name.STACKS, reason=request.reason,
                    ranks={str(k): v for k, v in request.found.items()},
                    hosts={str(r): labels[r][0] for r in request.found},
                    labels={str(r): labels[r][1] for r in request.found},
                    problems=request.problems, py_spy=request.py_spy)
        if request.hang and self._hung is not None \
                and self.policy.on_hang() is Decision.STOP_ALL:
            self._fail(self._hung, announced=True)

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

    # -- requests ------------------------------------------------------------------------------
    def _request(self, req: reports.Request) -> None:
        if req.kind == "interrupt" and self._interrupt is None:
            assert req.arg is not None
            signum = int(req.arg)
            self._interrupt = signum
            name = signal.Signals(signum).name
            note = self.stop_note() if self.stop_note is not None \
                and signum == signal.SIGTERM else None
            self._stopped_by_command = note
            said: dict[str, Any] = {"by": dict(note)} if note else {}
            self.events(Name.STOPPING_ON_SIGNAL, signal=name, live=len(self.live()),
                        int_grace=min(wire.INT_GRACE, self.kill_grace / 2),
                        kill_grace=self.kill_grace, **said)
            self._stop_all("INT" if signum == signal.SIGINT else "TERM")
            if note and note.get("kill"):  # `fdl-fabric stop --kill`: no grace
                self.events(Name.KILLING_NOW, asked=f"{note.get('command')} --kill")
                self._kill_all()
        elif req.kind == "kill" or req.kind == "interrupt":
            self.events(Name.KILLING_NOW)
            self._stop_all()
            self._kill_all()
        elif req.kind == "signal" and req.arg is not None:
            self._forwarded.add(int(getattr(signal, "SIG" + req.arg)))
            for _name, host in self.hosts.items():
                if not host.gone and any(not r.state.terminal for r in host.ranks):
                    host.handle.signal(req.arg)
        elif req.kind == "abort" and req.cause is not None:
            self._fail(req.cause, announced=False)
        elif req.kind == "suspend":
            self._suspend()
        elif req.kind == "resume":
            self._resume()
        elif req.kind == "stacks" and self.phase is RunPhase.RUNNING and self.live():
            self.events(Name.STACKS_ASKED)
            self._ask_stacks("asked (SIGQUIT)", hang=False)

    def _suspend(self) -> None:
        """Ctrl-Z: the agents hold their leases (the ranks keep running, and block once
        their output fills the pipes), then this process stops until ``fg``."""
        for host in self.hosts.values():
            if not host.gone:
                host.handle.suspend()
        self.events(Name.SUSPENDED, suspended=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        self._resume()

    def _resume(self) -> None:
        for host in self.hosts.values():
            if not host.gone:
                host.handle.resume()
        self._restart_clocks(time.monotonic())

    # -- stopping ------------------------------------------------------------------------------
    def _fail(self, failure: Event, *, announced: bool) -> None:
        """The run failed (``failure`` says why): every rank is stopped. Unless
        ``announced`` (its event, or a warning that says as much, was emitted), it is
        said now."""
        if self.failure is not None:
            return
        self.failure = failure
        if not announced:
            self.events(Name.FAILURE_ANNOUNCED, cause=cause_data(failure))
        if self.started_any():
            self.events(Name.STOPPING_ON_FAILURE, hung=failure is self._hung)
        self._stop_all()

    def started_any(self) -> bool:
        return any(r.started is not None for r in self.ranks)

    def _stop_all(self, first: str = "TERM") -> None:
        if self._stop_started is None:
            self._stop_started = time.monotonic()
            self.phase = RunPhase.STOPPING
        for r in self.live():
            r.stop_requested = True
        for host in self.hosts.values():
            if not host.gone:
                host.handle.stop(first)

    def _kill_all(self) -> None:
        self._forced = True
        for host in self.hosts.values():
            if not host.gone:
                host.handle.kill()

    def _check_shutdown(self) -> None:
        """Survivors told to save and stop get `SHUTDOWN_GRACE` seconds, then are stopped."""
        if self._shutdown_seen is None or self._stop_started is not None \
                or self.failure is not None:
            return
        if time.monotonic() - self._shutdown_seen > SHUTDOWN_GRACE:
            self.events(Name.STOPPING_AFTER_SHUTDOWN, live=len(self.live()), grace=SHUTDOWN_GRACE)
            self._stop_all()

    def _ping(self) -> None:
        """Renew every agent's lease (`ping_interval`): an agent that stops hearing
        from the launcher stops its ranks."""
        now = time.monotonic()
        if now - self._pinged < self.ping_every:
            return
        self._pinged = now
        for host in self.hosts.values():
            if not host.gone:
                host.handle.ping()

    def _escalate(self) -> None:
        """Make sure a stop finishes, and a finished agent goes, even if one stops answering."""
        now = time.monotonic()
        for host in self._done_hosts:  # the hosts that said DONE, not every host each turn
            if host.gone or host.done_at is None or now - host.done_at <= GONE_MARGIN:
                continue
            if not host.forced:
                host.forced = True
                host.handle.abandon()
        if self._stop_started is None:
            return
        waited = now - self._stop_started
        if not self._forced and waited > self.kill_grace + FORCE_MARGIN:
            self._kill_all()
        if waited > self.kill_grace + FORCE_MARGIN + ABANDON_MARGIN:
            for name, host in self.hosts.items():
                if host.gone or host.forced:
                    continue
                host.forced = True
                self.events(Name.HOST_ABANDONED, host=name)
                host.handle.abandon()

    # -- the verdict ---------------------------------------------------------------------------
    def _count_uncounted(self) -> None:
        """Every death counts in the verdict: a rank lost while it was being stopped (a
        save-and-shutdown whose host then went away) or ended by the last drain never
        went through the policy; it does now, so no run with a lost rank ends "full
        workload delivered". A rank that announced a clean exit first is not a death."""
        announced = self.cohort.exited if self.cohort is not None else set()
        for r in self.ranks:
            if r.state not in (RankState.LOST, RankState.FAILED) or r.rank in self.counted \
                    or r.rank in announced:
                continue
            if self.root_cause is None:
                self.root_cause = r
            if self._decide(r.rank) is Decision.STOP_ALL and self.failure is None:
                self.failure = event(Name.RANK_FAILED, host=r.host, rank=r.rank,
                                     exit=r.exit.data if r.exit else {}, ok=False)

    def _result(self) -> RunResult:
        result = self._verdict()
        faults = {name: h.fault for name, h in self.hosts.items() if h.fault}
        return dataclasses.replace(result, faults=faults) if faults else result

    def _verdict(self) -> RunResult:
        ranks = tuple(self.ranks)
        world = len(ranks)
        if self._interrupt is not None:
            code = 128 + self._interrupt
            name = signal.Signals(self._interrupt).name
            if self._stopped_by is not None:
                return RunResult(Verdict.INTERRUPTED, code,
                                 event(Name.STOPPED_BY_CLEANUP, host=self._interrupted_on,
                                       by=dict(self._stopped_by)), ranks)
            if self._stopped_by_command is not None:
                return RunResult(Verdict.INTERRUPTED, code,
                                 event(Name.STOPPED_BY_COMMAND,
                                       by=dict(self._stopped_by_command)), ranks)
            return RunResult(Verdict.INTERRUPTED, code,
                             event(Name.INTERRUPTED, host=self._interrupted_on, signal=name),
                             ranks)
        if self._stopped_by_forward is not None and self.failure is None:
            signum, rank = self._stopped_by_forward
            return RunResult(Verdict.INTERRUPTED, 128 + signum,
                             event(Name.INTERRUPTED_BY_FORWARD, host=rank.host, rank=rank.rank,
                                   signal=signal.Signals(signum).name), ranks)
        if self.failure is None:
            self._count_uncounted()
        if self.failure is not None:
            verdict = Verdict.HUNG if self.failure is self._hung else Verdict.FAILED
            return RunResult(verdict, 1, self.failure, ranks, self.root_cause)
        verdict, cause = self.policy.verdict(world, self.tolerated)
        return RunResult(verdict, 0 if verdict in (Verdict.OK, Verdict.DEGRADED) else 1,
                         cause, ranks, self.root_cause)
