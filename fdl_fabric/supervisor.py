"""Supervision: poll every rank, apply the failure policy, reach one verdict.

Modelled on torch.distributed.elastic's agent: each rank has an explicit
`RankState`, the loop polls at a fixed interval (torchrun's default is
0.1 s; ours is 0.05 s), and the run ends with one `RunResult` that holds the
verdict and the exit code.

The policy has two phases. Before the cohort forms (or when the program never
joins a coordinator), the first failure is fatal: a half-formed collective
hangs in connect-retry, so every other rank is stopped at once. After the
cohort forms, a death is a membership event and the run carries on until the
elastic policy says otherwise; `ElasticPolicy` is that hook.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional, Protocol

from .events import EventBus, Kind

#: How often every rank is polled. Bounds failure-detection latency.
POLL_INTERVAL = 0.05
#: Extra seconds past the kill grace before a silent wrapper is killed outright.
FORCE_MARGIN = 3.0
#: Extra seconds past that before a rank that still reports nothing is abandoned.
ABANDON_MARGIN = 3.0
#: Seconds survivors get to save and exit after a save-and-shutdown broadcast,
#: before the launcher stops them (a checkpoint can take a while to write).
SHUTDOWN_GRACE = 120.0


class RankState(str, Enum):
    """Life of one rank. Terminal states are the ones after RUNNING/JOINED.

    PENDING -> STARTING (session open) -> RUNNING (pid known) -> JOINED
    (coordinator) -> one of SUCCEEDED, FAILED, STOPPED (by the launcher),
    LOST (no status: connection gone), DEAD_TOLERATED (elastic).
    """

    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    JOINED = "joined"
    SUCCEEDED = "exited"
    FAILED = "failed"
    STOPPED = "stopped"
    LOST = "lost"
    DEAD_TOLERATED = "dead-tolerated"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = {RankState.SUCCEEDED, RankState.FAILED, RankState.STOPPED, RankState.LOST,
             RankState.DEAD_TOLERATED}


class ExitLike(Protocol):
    @property
    def ok(self) -> bool: ...
    @property
    def lost(self) -> bool: ...
    @property
    def signal(self) -> Optional[int]: ...
    @property
    def code(self) -> Optional[int]: ...
    def describe(self) -> str: ...


class RankHandle(Protocol):
    """What the supervisor needs from a running rank (local or remote)."""

    def poll(self) -> Optional[ExitLike]: ...
    def stop(self) -> None: ...
    def kill(self) -> None: ...
    def send_signal(self, name: str) -> None: ...
    def abandon(self) -> None: ...
    def finish(self) -> None: ...


@dataclass
class SupervisedRank:
    rank: int
    host: str
    handle: RankHandle
    state: RankState = RankState.RUNNING
    exit: Optional[ExitLike] = None
    started: float = field(default_factory=time.monotonic)
    ended: Optional[float] = None
    stop_requested: bool = False

    @property
    def label(self) -> str:
        return f"rank {self.rank} of {self.host}"

    @property
    def cause(self) -> str:
        """Why the rank ended, in the words of the run summary."""
        return _CAUSES.get(self.state, self.state.value)

    @property
    def exit_text(self) -> str:
        if self.exit is None or self.exit.lost:
            return "-"
        if self.exit.signal is not None:
            return f"signal {self.exit.signal}"
        return str(self.exit.code)

    @property
    def duration(self) -> float:
        return (self.ended or time.monotonic()) - self.started


_CAUSES = {
    RankState.SUCCEEDED: "ok",
    RankState.FAILED: "failed",
    RankState.STOPPED: "stopped by the launcher",
    RankState.DEAD_TOLERATED: "tolerated",
    RankState.LOST: "lost",
}


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
    ranks: tuple[SupervisedRank, ...]


class ElasticPolicy(Protocol):
    """The post-formation hook (the coordinator implements it)."""

    @property
    def cohort_formed(self) -> bool: ...

    def report_dead(self, ranks: Sequence[int], reason: str) -> None: ...

    def abort_reason(self) -> Optional[str]: ...

    @property
    def shutdown_sent(self) -> Optional[str]: ...

    def verdict(self, world_size: int, tolerated: int) -> tuple[Verdict, str]: ...


class Supervisor:
    """Polls ranks until all have ended, and decides what a failure means."""

    def __init__(
        self,
        ranks: Sequence[SupervisedRank],
        *,
        kill_grace: float,
        events: EventBus,
        elastic: Optional[ElasticPolicy] = None,
        poll_interval: float = POLL_INTERVAL,
    ) -> None:
        self.ranks = list(ranks)
        self.kill_grace = kill_grace
        self.events = events
        self.elastic = elastic
        self.poll_interval = poll_interval
        self.failure: Optional[str] = None
        self.tolerated = 0
        self._stop_started: Optional[float] = None
        self._forced = False
        self._interrupt: Optional[int] = None
        self._shutdown_seen: Optional[float] = None
        self._requests: list[tuple[str, Optional[str]]] = []
        self._lock = threading.Lock()

    # -- requests from other threads (signal handlers, coordinator) ---------
    def request_interrupt(self, signum: int) -> None:
        """First Ctrl-C/TERM: graceful stop of every rank."""
        with self._lock:
            self._requests.append(("interrupt", str(signum)))

    def request_kill(self) -> None:
        """Second Ctrl-C: KILL every rank's process group now."""
        with self._lock:
            self._requests.append(("kill", None))

    def request_signal(self, name: str) -> None:
        """Forward a signal (USR1/USR2) to every running rank."""
        with self._lock:
            self._requests.append(("signal", name))

    def request_abort(self, reason: str) -> None:
        """A run-level failure outside the ranks (coordinator, formation timeout)."""
        with self._lock:
            self._requests.append(("abort", reason))

    # -- the loop -----------------------------------------------------------
    def live(self) -> list[SupervisedRank]:
        return [r for r in self.ranks if not r.state.terminal]

    def run(self) -> RunResult:
        while self.live():
            self._drain_requests()
            for r in self.live():
                info = r.handle.poll()
                if info is not None:
                    self._on_exit(r, info)
            if self.elastic is not None and self.failure is None:
                reason = self.elastic.abort_reason()
                if reason is not None:
                    self._fail(reason, announce=False)
                self._watch_shutdown()
            self._escalate()
            if self.live():
                time.sleep(self.poll_interval)
        finishers = [threading.Thread(target=r.handle.finish, name=f"fdl-finish-r{r.rank}")
                     for r in self.ranks]
        for t in finishers:
            t.start()
        for t in finishers:
            t.join()
        return self._result()

    def _watch_shutdown(self) -> None:
        """Survivors told to save and stop get SHUTDOWN_GRACE seconds, then are stopped."""
        assert self.elastic is not None
        if self.elastic.shutdown_sent is None or self._stop_started is not None:
            return
        if self._shutdown_seen is None:
            self._shutdown_seen = time.monotonic()
        elif time.monotonic() - self._shutdown_seen > SHUTDOWN_GRACE:
            self.events(Kind.STOPPING, f"cluster launcher: {len(self.live())} rank(s) did not "
                        f"exit within {SHUTDOWN_GRACE:g}s of save-and-shutdown; stopping them")
            self._stop_all()

    def _drain_requests(self) -> None:
        with self._lock:
            requests, self._requests = self._requests, []
        for kind, arg in requests:
            if kind == "interrupt" and self._interrupt is None:
                assert arg is not None
                self._interrupt = int(arg)
                self._stop_all()
            elif kind == "kill" or (kind == "interrupt" and self._interrupt is not None):
                self.events(Kind.STOPPING, "cluster launcher: second interrupt — killing every "
                            "rank's process group now")
                self._stop_all()
                for r in self.live():
                    r.handle.kill()
                self._forced = True
            elif kind == "signal" and arg is not None:
                for r in self.live():
                    r.handle.send_signal(arg)
            elif kind == "abort" and arg is not None:
                self._fail(arg, announce=False)

    def _on_exit(self, r: SupervisedRank, info: ExitLike) -> None:
        r.exit = info
        r.ended = time.monotonic()
        data = {"status": info.describe(), "ok": info.ok}
        if info.ok:
            r.state = RankState.SUCCEEDED
            self.events(Kind.EXIT, f"cluster launcher: {r.label} exited with status 0",
                        host=r.host, rank=r.rank, data=data)
            return
        msg = f"cluster launcher: {r.label} exited with {info.describe()}"
        if r.stop_requested:
            r.state = RankState.STOPPED
            self.events(Kind.EXIT, f"{msg} (stopped by the launcher)", host=r.host, rank=r.rank,
                        data=data)
            return
        r.state = RankState.LOST if info.lost else RankState.FAILED
        if self.elastic is not None and self.elastic.cohort_formed and self.failure is None:
            r.state = RankState.DEAD_TOLERATED
            self.tolerated += 1
            self.events(Kind.TOLERATED,
                        f"{msg} — tolerating (elastic membership): reporting rank(s) "
                        f"[{r.rank}] dead", host=r.host, rank=r.rank, data=data)
            self.elastic.report_dead([r.rank], info.describe())
            return
        self.events(Kind.DEATH, msg, host=r.host, rank=r.rank, data=data)
        self._fail(msg, announce=True)

    def _fail(self, msg: str, *, announce: bool) -> None:
        if self.failure is not None:
            return
        self.failure = msg
        if not announce:
            self.events(Kind.STOPPING, msg)
        self.events(Kind.STOPPING,
                    "cluster launcher: peer failure — terminating all still-running ranks")
        self._stop_all()

    def _stop_all(self) -> None:
        if self._stop_started is None:
            self._stop_started = time.monotonic()
        for r in self.live():
            if not r.stop_requested:
                r.stop_requested = True
                r.handle.stop()

    def _escalate(self) -> None:
        """Make sure a stop finishes even if a wrapper stops answering."""
        if self._stop_started is None:
            return
        waited = time.monotonic() - self._stop_started
        if not self._forced and waited > self.kill_grace + FORCE_MARGIN:
            self._forced = True
            for r in self.live():
                r.handle.kill()
        if waited > self.kill_grace + FORCE_MARGIN + ABANDON_MARGIN:
            for r in self.live():
                self.events(Kind.WARNING, f"cluster launcher: {r.label} did not report an exit "
                            "after the kill grace; abandoning its session", host=r.host,
                            rank=r.rank)
                r.handle.abandon()
                r.state = RankState.LOST
                r.ended = time.monotonic()

    def _result(self) -> RunResult:
        ranks = tuple(self.ranks)
        world = len(ranks)
        if self._interrupt is not None:
            code = 128 + self._interrupt
            name = "SIGINT" if code == 130 else "SIGTERM" if code == 143 else f"signal {code - 128}"
            return RunResult(Verdict.INTERRUPTED, code,
                             f"cluster launcher: interrupted by {name} — every rank was stopped",
                             ranks)
        if self.failure is not None:
            return RunResult(Verdict.FAILED, 1, self.failure, ranks)
        if self.elastic is not None:
            verdict, message = self.elastic.verdict(world, self.tolerated)
            return RunResult(verdict, 0 if verdict in (Verdict.OK, Verdict.DEGRADED) else 1,
                             message, ranks)
        return RunResult(Verdict.OK, 0,
                         f"cluster launcher: run completed — all {world} ranks exited 0", ranks)


def summary_rows(ranks: Sequence[SupervisedRank]) -> list[tuple[int, str, str, str, str]]:
    """Rows of the end-of-run table: rank, host, exit, cause, duration."""
    return [(r.rank, r.host, r.exit_text, r.cause, f"{r.duration:.1f}s") for r in ranks]
