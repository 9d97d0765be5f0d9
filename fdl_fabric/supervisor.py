"""Supervision: one record per rank, the failure policy, one verdict.

Modelled on torch.distributed.elastic's agent: the run moves through explicit phases
(`RunPhase`), every rank has one record (`Rank`) with an explicit `RankState`, and the
run ends with one frozen `RunResult` that holds the verdict and the exit code.

The supervisor is the only writer of rank state. Everything that happens reaches it
as a `reports` record in its inbox: what agents report (spawned, output, exited, gone),
joins from the coordinator, and requests from signal handlers. It acts on hosts
through the small `HostHandle` interface (start, stop, kill, signal, abandon), so the
policy is tested with fake hosts and no process at all.

The policy has two phases. Before the cohort forms (or when the program never joins a
coordinator), the first failure is fatal: a half-formed collective hangs in
connect-retry, so every other rank is stopped at once (kill-all). After the cohort
forms, a death is a membership event and the run carries on until the elastic policy
(`ElasticPolicy`, the coordinator) says otherwise.
"""

from __future__ import annotations

import queue
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional, Protocol

from . import errorfile, reports
from .agent import wire
from .errorfile import RankError
from .events import EventBus, Kind
from .plan import RankPlan

#: Longest the loop sleeps with nothing in its inbox; bounds the elastic checks' delay.
TICK = 0.05
#: Extra seconds past the kill grace before hosts that did not report are sent KILL.
FORCE_MARGIN = 3.0
#: Extra seconds past that before a host that still reports nothing is abandoned.
ABANDON_MARGIN = 3.0
#: Seconds an agent has to end its session after saying it is done.
GONE_MARGIN = 5.0
#: Seconds survivors get to save and exit after a save-and-shutdown broadcast,
#: before the launcher stops them (a checkpoint can take a while to write).
SHUTDOWN_GRACE = 120.0


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

_CAUSES = {
    RankState.SUCCEEDED: "ok",
    RankState.FAILED: "failed",
    RankState.STOPPED: "stopped by the launcher",
    RankState.TOLERATED: "tolerated",
    RankState.LOST: "lost",
    RankState.NOT_STARTED: "never started",
}


@dataclass(frozen=True)
class RankExit:
    """How a rank ended: an exit code, a signal, or lost (no status ever came), and
    what its error file said, if it wrote one."""

    code: Optional[int] = None
    signal: Optional[int] = None
    lost: Optional[str] = None
    error: Optional[RankError] = None
    error_text: str = ""

    @property
    def ok(self) -> bool:
        return self.code == 0

    def describe(self) -> str:
        if self.lost is not None:
            return f"no exit status ({self.lost})"
        if self.signal is not None:
            return f"signal {self.signal}"
        return f"status {self.code}"


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
    def cause(self) -> str:
        """Why the rank ended, in the words of the run summary."""
        return _CAUSES.get(self.state, self.state.value)

    @property
    def exit_text(self) -> str:
        if self.exit is None or self.exit.lost is not None:
            return "-"
        if self.exit.signal is not None:
            return f"signal {self.exit.signal}"
        return str(self.exit.code)

    @property
    def duration(self) -> float:
        if self.started is None:
            return 0.0
        return (self.ended or time.monotonic()) - self.started


class Verdict(str, Enum):
    OK = "ok"
    DEGRADED = "degraded"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class RunResult:
    """The outcome of a run: one verdict, one exit code, one last line."""

    verdict: Verdict
    exit_code: int
    message: str
    ranks: tuple[Rank, ...]
    #: The first rank that failed (in the order failures were seen): the root cause.
    root_cause: Optional[Rank] = None

    @property
    def started_any(self) -> bool:
        return any(r.started is not None for r in self.ranks)

    @property
    def restartable(self) -> bool:
        """A failed run whose ranks had started: another attempt may succeed. Pre-flight
        failures, interrupts and successes are not retried."""
        return self.verdict is Verdict.FAILED and self.started_any


class HostHandle(Protocol):
    """What the supervisor needs from one host's agent (see `sessions.AgentSession`)."""

    def start_ranks(self) -> None: ...
    def stop(self) -> None: ...
    def kill(self) -> None: ...
    def signal(self, name: str, rank: Optional[int] = None) -> None: ...
    def abandon(self) -> None: ...
    def ping(self) -> None: ...


class ElasticPolicy(Protocol):
    """The post-formation hook (the coordinator implements it)."""

    @property
    def cohort_formed(self) -> bool: ...

    def report_dead(self, ranks: Sequence[int], reason: str) -> None: ...

    def abort_reason(self) -> Optional[str]: ...

    @property
    def shutdown_sent(self) -> Optional[str]: ...

    def verdict(self, world_size: int, tolerated: int) -> tuple[Verdict, str]: ...


#: Judges a host's pre-flight values: (host, values) -> (warnings, failures).
PreflightJudge = Callable[[str, Mapping[str, str]], tuple[list[str], list[str]]]


@dataclass
class _Host:
    handle: HostHandle
    ranks: list[Rank] = field(default_factory=list)
    preflight_seen: bool = False
    done_at: Optional[float] = None
    gone: bool = False
    forced: bool = False


class Supervisor:
    """Runs the policy over a run's ranks until every host's agent is gone."""

    def __init__(
        self,
        plans: Sequence[RankPlan],
        hosts: Mapping[str, HostHandle],
        *,
        kill_grace: float,
        events: EventBus,
        elastic: Optional[ElasticPolicy] = None,
        preflight: Optional[PreflightJudge] = None,
        inbox: Optional[queue.SimpleQueue[reports.Report]] = None,
        tick: float = TICK,
    ) -> None:
        self.ranks = [Rank(p) for p in plans]
        self.by_rank = {r.rank: r for r in self.ranks}
        self.hosts = {name: _Host(handle) for name, handle in hosts.items()}
        for r in self.ranks:
            self.hosts[r.host].ranks.append(r)
        self.kill_grace = kill_grace
        self.events = events
        self.elastic = elastic
        self.preflight = preflight
        self.inbox: queue.SimpleQueue[reports.Report] = inbox or queue.SimpleQueue()
        self.tick = tick
        self.phase = RunPhase.PREPARING if preflight is not None else RunPhase.RUNNING
        self.failure: Optional[str] = None
        self.tolerated = 0
        self._stop_started: Optional[float] = None
        self._forced = False
        self._interrupt: Optional[int] = None
        #: The host whose agent was signaled, when the interruption came from outside.
        self._interrupted_on: Optional[str] = None
        self._pinged = time.monotonic()
        self._shutdown_seen: Optional[float] = None
        self._preflight_failures: list[str] = []
        self.root_cause: Optional[Rank] = None

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

    def request_abort(self, reason: str) -> None:
        """A run-level failure outside the ranks."""
        self.post(reports.Request("abort", reason))

    # -- views --------------------------------------------------------------------------------
    def live(self) -> list[Rank]:
        return [r for r in self.ranks if not r.state.terminal]

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> RunResult:
        if self.phase is RunPhase.RUNNING:
            self._start_all()
        while not all(h.gone for h in self.hosts.values()):
            try:
                report: Optional[reports.Report] = self.inbox.get(timeout=self.tick)
            except queue.Empty:
                report = None
            while report is not None:
                self._handle(report)
                try:
                    report = self.inbox.get_nowait()
                except queue.Empty:
                    report = None
            self._check_elastic()
            self._escalate()
            self._ping()
        self.phase = RunPhase.DONE
        for r in self.ranks:
            if not r.state.terminal:  # cannot happen once every host is gone; be safe
                self._end(r, RankExit(lost="agent gone"), RankState.LOST)
        return self._result()

    def _handle(self, report: reports.Report) -> None:
        if isinstance(report, reports.Output):
            self._output(report)
        elif isinstance(report, reports.Exited):
            self._exited(report)
        elif isinstance(report, reports.Spawned):
            self._spawned(report)
        elif isinstance(report, reports.Joined):
            r = self.by_rank.get(report.rank)
            if r is not None and r.state in (RankState.PENDING, RankState.RUNNING):
                r.state = RankState.JOINED
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
            self.events(Kind.WARNING, f"cluster launcher: host {report.host!r}: "
                        f"{report.message}", host=report.host, rank=report.rank)
        elif isinstance(report, reports.AgentDone):
            host = self.hosts.get(report.host)
            if host is not None and host.done_at is None:
                host.done_at = time.monotonic()
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
        for text in warnings:
            self.events(Kind.WARNING, f"cluster launcher: pre-flight: {report.host}: {text}",
                        host=report.host)
        for text in failures:
            self.events(Kind.WARNING, f"cluster launcher: pre-flight: {report.host}: {text}",
                        host=report.host, data={"preflight": "fail"})
        self._preflight_failures += [f"{report.host}: {t}" for t in failures]
        self._maybe_start()

    def _maybe_start(self) -> None:
        if self.phase is not RunPhase.PREPARING:
            return
        if not all(h.preflight_seen or h.gone for h in self.hosts.values()):
            return
        if self._preflight_failures:
            self._fail(f"cluster launcher: pre-flight failed on {len(self._preflight_failures)} "
                       "check(s), nothing was started (`inv prebuild-check` checks more; "
                       "--no-preflight skips this)", announce=False)
            return
        self.events(Kind.DEBUG, f"cluster launcher: pre-flight passed on {len(self.hosts)} "
                    "host(s)")
        self._start_all()

    def _start_all(self) -> None:
        self.phase = RunPhase.RUNNING
        for host in self.hosts.values():
            if not host.gone:
                host.handle.start_ranks()

    def _swept(self, report: reports.Swept) -> None:
        data = report.report
        for err in data.get("errors", []):
            self.events(Kind.WARNING, f"cluster launcher: {report.host}: {err}",
                        host=report.host)
        for item in data.get("stopped", []):
            self.events(Kind.WARNING, f"cluster launcher: stopped leftovers of an earlier run "
                        f"of this cluster on {report.host}: run {item.get('run')} "
                        f"(pids {item.get('pids')})", host=report.host)
        for item in data.get("leftovers", []):
            self.events(Kind.WARNING, f"cluster launcher: could not stop a leftover on "
                        f"{report.host}: {item}", host=report.host)

    # -- ranks --------------------------------------------------------------------------------
    def _spawned(self, report: reports.Spawned) -> None:
        r = self.by_rank.get(report.rank)
        if r is None or r.host != report.host or r.state is not RankState.PENDING:
            return
        r.pid = report.pid
        r.state = RankState.RUNNING
        r.started = time.monotonic()
        self.events(Kind.SPAWN, f"cluster launcher: started {r.plan.label} (pid {report.pid})",
                    host=r.host, rank=r.rank, data={"pid": report.pid})
        if self._stop_started is not None and not r.stop_requested:
            r.stop_requested = True  # started while the run was being stopped

    def _output(self, report: reports.Output) -> None:
        r = self.by_rank.get(report.rank)
        if r is None:
            return
        text = report.data.decode("utf-8", "replace")
        body = text[:-1] if text.endswith("\n") else text
        last = body.rpartition("\n")[2]
        if last:
            r.last_line = last[-200:]
        self.events(Kind.OUTPUT, "", host=r.host, rank=r.rank,
                    data={"label": r.plan.label, "text": body, "raw": report.data,
                          "stderr": report.stderr, "partial": report.partial})

    def _spawn_failed(self, report: reports.SpawnFailed) -> None:
        msg = (f"cluster launcher: host {report.host!r}: could not start rank {report.rank}: "
               f"{report.reason}")
        self.events(Kind.DEATH, msg, host=report.host, rank=report.rank)
        self._fail(msg, announce=True)

    def _exited(self, report: reports.Exited) -> None:
        r = self.by_rank.get(report.rank)
        if r is None or r.state.terminal or r.host != report.host:
            return
        self._on_exit(r, RankExit(code=report.code, signal=report.signal,
                                  error=errorfile.parse(report.error),
                                  error_text=report.error))

    def _on_exit(self, r: Rank, info: RankExit) -> None:
        data: dict[str, object] = {"status": info.describe(), "ok": info.ok}
        if info.error is not None:
            data["error"] = info.error.message
        if info.error_text:
            data["error_file"] = info.error_text
        if info.ok:
            self._end(r, info, RankState.SUCCEEDED)
            self.events(Kind.EXIT, f"cluster launcher: {r.label} exited with status 0",
                        host=r.host, rank=r.rank, data=data)
            return
        msg = f"cluster launcher: {r.label} exited with {info.describe()}"
        if r.stop_requested:
            # A rank being stopped that reports no status is lost, not known stopped.
            lost = info.lost is not None
            self._end(r, info, RankState.LOST if lost else RankState.STOPPED)
            self.events(Kind.EXIT, msg if lost else f"{msg} (stopped by the launcher)",
                        host=r.host, rank=r.rank, data=data)
            return
        if self.root_cause is None:
            self.root_cause = r
        if self.elastic is not None and self.elastic.cohort_formed and self.failure is None:
            self._end(r, info, RankState.TOLERATED)
            self.tolerated += 1
            self.events(Kind.TOLERATED, f"{msg} — tolerating (elastic membership): reporting "
                        f"rank(s) [{r.rank}] dead", host=r.host, rank=r.rank, data=data)
            self.elastic.report_dead([r.rank], info.describe())
            return
        self._end(r, info, RankState.LOST if info.lost is not None else RankState.FAILED)
        self.events(Kind.DEATH, msg, host=r.host, rank=r.rank, data=data)
        self._fail(msg, announce=True)

    def _end(self, r: Rank, info: RankExit, state: RankState) -> None:
        r.exit = info
        r.state = state
        r.ended = time.monotonic()

    def _verified(self, report: reports.Verified) -> None:
        if report.stopped:
            pids = ", ".join(f"{p.get('pid')} ({p.get('cmdline', '')[:60]})"
                             for p in report.stopped)
            self.events(Kind.WARNING, f"cluster launcher: {report.host}: stopped what the run "
                        f"left behind after its last rank: {pids}", host=report.host)
        if report.remaining:
            pids = ", ".join(str(p.get("pid")) for p in report.remaining)
            self.events(Kind.WARNING, f"cluster launcher: {report.host}: could NOT stop what "
                        f"the run left behind: pids {pids} (see `inv cleanup`)",
                        host=report.host)

    def _gone(self, report: reports.AgentGone) -> None:
        host = self.hosts.get(report.host)
        if host is None or host.gone:
            return
        host.gone = True
        lost = [r for r in host.ranks if not r.state.terminal]
        if not lost:
            return
        reason = f"agent lost: {report.reason}" if report.reason else "agent ended"
        if not report.clean:
            self.events(Kind.WARNING, f"cluster launcher: host {report.host!r}: {reason}",
                        host=report.host)
        never = [r for r in lost if r.state is RankState.PENDING]
        for r in never:
            self._end(r, RankExit(lost=reason), RankState.NOT_STARTED)
        for r in lost:
            if r.state is not RankState.NOT_STARTED:
                self._on_exit(r, RankExit(lost=reason))
        if never and self._stop_started is None:
            self._fail(f"cluster launcher: host {report.host!r}: {reason} before its ranks "
                       "started", announce=True)
        self._maybe_start()

    def _signaled(self, report: reports.Signaled) -> None:
        """A signal from outside reached an agent: under Slurm, ``scancel`` or the time
        limit (TERM) or ``--signal`` (USR1). A stop is the run's interruption, as if the
        launcher had received it, unless a failure already decided the run."""
        if not report.stopping:
            how = "forwarded to its ranks" if report.forwarded else \
                "which Slurm delivered to its ranks too"
            self.events(Kind.INFO, f"cluster launcher: host {report.host!r}: SIG{report.signal} "
                        f"from outside, {how}", host=report.host)
            return
        signum = int(getattr(signal, "SIG" + report.signal, signal.SIGTERM))
        if self._interrupt is not None:
            return
        if self.failure is not None:
            # The same signal may have reached a rank (Slurm signals every process of the
            # step) and been reported before its agent's own: then it is no failure.
            cause = self.root_cause
            if cause is None or cause.exit is None or cause.exit.signal != signum:
                return
        self._interrupt = signum
        self._interrupted_on = report.host
        self.events(Kind.STOPPING, f"cluster launcher: host {report.host!r}: its agent received "
                    f"SIG{report.signal} from outside (scancel, a time limit, kill) — stopping "
                    "every rank", host=report.host)
        self._stop_all()

    # -- requests ------------------------------------------------------------------------------
    def _request(self, req: reports.Request) -> None:
        if req.kind == "interrupt" and self._interrupt is None:
            assert req.arg is not None
            self._interrupt = int(req.arg)
            self._stop_all()
        elif req.kind == "kill" or req.kind == "interrupt":
            self.events(Kind.STOPPING, "cluster launcher: second interrupt — killing every "
                        "rank's process group now")
            self._stop_all()
            self._kill_all()
        elif req.kind == "signal" and req.arg is not None:
            for _name, host in self.hosts.items():
                if not host.gone and any(not r.state.terminal for r in host.ranks):
                    host.handle.signal(req.arg)
        elif req.kind == "abort" and req.arg is not None:
            self._fail(req.arg, announce=False)

    # -- stopping ------------------------------------------------------------------------------
    def _fail(self, msg: str, *, announce: bool) -> None:
        if self.failure is not None:
            return
        self.failure = msg
        if not announce:
            self.events(Kind.STOPPING, msg)
        if self.started_any():
            self.events(Kind.STOPPING,
                        "cluster launcher: peer failure — terminating all still-running ranks")
        self._stop_all()

    def started_any(self) -> bool:
        return any(r.started is not None for r in self.ranks)

    def _stop_all(self) -> None:
        if self._stop_started is None:
            self._stop_started = time.monotonic()
            self.phase = RunPhase.STOPPING
        for r in self.live():
            r.stop_requested = True
        for host in self.hosts.values():
            if not host.gone:
                host.handle.stop()

    def _kill_all(self) -> None:
        self._forced = True
        for host in self.hosts.values():
            if not host.gone:
                host.handle.kill()

    def _check_elastic(self) -> None:
        if self.elastic is None or self.failure is not None or self.phase is not RunPhase.RUNNING:
            return
        reason = self.elastic.abort_reason()
        if reason is not None:
            self._fail(reason, announce=False)
            return
        if self.elastic.shutdown_sent is None or self._stop_started is not None:
            return
        if self._shutdown_seen is None:
            self._shutdown_seen = time.monotonic()
        elif time.monotonic() - self._shutdown_seen > SHUTDOWN_GRACE:
            self.events(Kind.STOPPING, f"cluster launcher: {len(self.live())} rank(s) did not "
                        f"exit within {SHUTDOWN_GRACE:g}s of save-and-shutdown; stopping them")
            self._stop_all()

    def _ping(self) -> None:
        """Renew every agent's lease (`wire.PING_INTERVAL`): an agent that stops hearing
        from the launcher stops its ranks."""
        now = time.monotonic()
        if now - self._pinged < wire.PING_INTERVAL:
            return
        self._pinged = now
        for host in self.hosts.values():
            if not host.gone:
                host.handle.ping()

    def _escalate(self) -> None:
        """Make sure a stop finishes, and a finished agent goes, even if one stops answering."""
        now = time.monotonic()
        for host in self.hosts.values():
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
                self.events(Kind.WARNING, f"cluster launcher: host {name!r} did not report "
                            "its ranks' exits after the kill grace; abandoning its agent",
                            host=name)
                host.handle.abandon()

    # -- the verdict ---------------------------------------------------------------------------
    def _result(self) -> RunResult:
        ranks = tuple(self.ranks)
        world = len(ranks)
        if self._interrupt is not None:
            code = 128 + self._interrupt
            name = signal.Signals(self._interrupt).name
            where = f" on {self._interrupted_on}" if self._interrupted_on else ""
            return RunResult(Verdict.INTERRUPTED, code,
                             f"cluster launcher: interrupted by {name}{where} — every rank "
                             "was stopped", ranks)
        if self.failure is not None:
            return RunResult(Verdict.FAILED, 1, self.failure, ranks, self.root_cause)
        if self.elastic is not None:
            verdict, message = self.elastic.verdict(world, self.tolerated)
            return RunResult(verdict, 0 if verdict in (Verdict.OK, Verdict.DEGRADED) else 1,
                             message, ranks, self.root_cause)
        return RunResult(Verdict.OK, 0,
                         f"cluster launcher: run completed — all {world} ranks exited 0", ranks)


def summary_rows(ranks: Sequence[Rank]) -> list[tuple[int, str, str, str, str]]:
    """Rows of the end-of-run table: rank, host, exit, cause, duration."""
    return [(r.rank, r.host, r.exit_text, r.cause, f"{r.duration:.1f}s") for r in ranks]
