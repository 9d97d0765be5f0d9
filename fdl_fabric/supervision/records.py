"""The supervisor's records: one per rank, one per host, and the run's result.

Modelled on torch.distributed.elastic's agent: the run moves through explicit phases
(`RunPhase`), every rank has one record (`Rank`) with an explicit `RankState`, and the
run ends with one frozen `RunResult` that holds the verdict, the exit code and its cause
as data (the event; `presentation.words.render` says it where it is printed).

The supervisor is the only writer of these records (`state.SupervisorState`); the live
table and the summary read them. The protocols here are what the supervisor needs from
the rest: a host's agent (`HostHandle`) and the cohort (`Cohort`), so the policy is
tested with fakes and no process at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional, Protocol

from ..events import Event
from ..planning.plan import RankPlan
from ..states import RankState
from .errorfile import RankError
from .verdict import Verdict


class RunPhase(str, Enum):
    """PREPARING (agents start, pre-flight) -> RUNNING -> STOPPING -> DONE."""

    PREPARING = "preparing"
    RUNNING = "running"
    STOPPING = "stopping"
    DONE = "done"


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

    @property
    def event_data(self) -> dict[str, object]:
        """The data of the event that says how the rank ended: its exit, whether it was
        a success, and what its error file said."""
        data: dict[str, object] = {"exit": self.data, "ok": self.ok}
        if self.error is not None:
            data["error"] = self.error.message
        if self.error_text:
            data["error_file"] = self.error_text
        return data


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
    #: The forwarded signal (its name) that ended it: the program had no handler for it;
    #: or `states.STOPPED_BY_LEASE`: its agent stopped it when the launcher fell silent.
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
    words, `presentation.words.render`, are the last line)."""

    verdict: Verdict
    exit_code: int
    cause: Event
    ranks: tuple[Rank, ...]
    #: The first rank that failed (in the order failures were seen): the root cause.
    root_cause: Optional[Rank] = None
    #: Hosts whose agent went away (``lost``) or stopped answering (``unresponsive``).
    faults: Mapping[str, str] = field(default_factory=dict)

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

    @property
    def beats_flowing(self) -> bool:
        """Its ranks' folded heartbeats arrive (some rank joined through it)."""


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
class HostRecord:
    """One host as the supervisor knows it: its agent, its ranks, how far it got."""

    handle: HostHandle
    ranks: list[Rank] = field(default_factory=list)
    preflight_seen: bool = False
    done_at: Optional[float] = None
    gone: bool = False
    forced: bool = False
    #: The host's rank could not report: lost (its session ended) or unresponsive.
    fault: Optional[str] = None
    #: When (monotonic) its agent was last pinged (`stopping.Stopping._ping`).
    pinged_at: float = 0.0


@dataclass
class StackRequest:
    """Stacks asked of every agent: for a hung run (then the verdict) or for a look."""

    id: int
    reason: str
    pending: set[str]
    deadline: float
    hang: bool
    found: dict[int, dict[str, object]] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)
    py_spy: dict[str, bool] = field(default_factory=dict)
