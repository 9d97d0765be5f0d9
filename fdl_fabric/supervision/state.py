"""The supervisor's state and its one writer: what every part of the supervisor reads
and writes, and the writes that more than one part makes.

The supervisor is built in layers over this base, one responsibility each: `stopping`
(stop and escalation), `rankevents` (what hosts and ranks report), `liveness` (silence,
hangs, stacks), `outcome` (the verdict) and `supervisor` (the loop and its dispatch
tables). They all run on the supervisor's one thread, so nothing here is locked: other
threads only post to the inbox.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Optional

from .. import reports
from ..events import Event, EventBus
from ..planning.plan import RankPlan
from ..states import RankState
from . import timing
from .policy import Decision, FailurePolicy, KillAll
from .records import (
    Cohort,
    HostHandle,
    HostRecord,
    PreflightJudge,
    Rank,
    RankExit,
    RunPhase,
    StackRequest,
)
from .timing import TICK, lease_ping_interval, ping_interval


class SupervisorState:
    """Every rank's and host's record, the run's phase and what ended it."""

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
        #: How often an agent whose ranks' beats flow is pinged: only its lease needs it.
        self.lease_ping_every = lease_ping_interval(lease, self.ping_every)
        #: Hosts given up on or gone (the loop runs until all are), and those that said
        #: DONE (each may need abandoning): kept as they change, not walked every turn.
        self._gone_hosts = 0
        #: Hosts whose pre-flight came or that are gone: the ranks start when all are
        #: (counted, not walked at each of 1,024 hosts' reports).
        self._settled_hosts = 0
        self._done_hosts: list[HostRecord] = []
        self.by_rank = {r.rank: r for r in self.ranks}
        self.hosts = {name: HostRecord(handle) for name, handle in hosts.items()}
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
        #: When the next walk over the hosts for a silent agent is due (`_check_hosts`).
        self._hosts_due = 0.0
        #: The last turn of the loop, on the clock that counts a suspended machine.
        self._last_turn = timing.boottime()
        #: The agents' lease (seconds of the launcher's silence after which they stop
        #: their ranks), and the longest pause of this process seen so far.
        self.lease = lease
        self._paused_for = 0.0
        self._last_activity = now
        self._stacks: Optional[StackRequest] = None
        self._hung: Optional[Event] = None
        #: Signals the launcher forwarded to the ranks, by number.
        self._forwarded: set[int] = set()
        #: A forwarded signal that ended a rank: the run's interruption.
        self._stopped_by_forward: Optional[tuple[int, Rank]] = None
        #: A cleanup that stopped this run: its note (who, for the verdict).
        self._stopped_by: Optional[Mapping[str, object]] = None
        #: ``fdl-fabric stop`` that stopped this run: its note (who, for the verdict).
        self._stopped_by_command: Optional[Mapping[str, object]] = None

    # -- views --------------------------------------------------------------------------------
    def live(self) -> list[Rank]:
        return [r for r in self.ranks if not r.state.terminal]

    def started_any(self) -> bool:
        return any(r.started is not None for r in self.ranks)

    # -- the writes every part makes ------------------------------------------------------------
    def _end(self, r: Rank, info: RankExit, state: RankState) -> None:
        r.exit = info
        r.state = state
        r.ended = time.monotonic()

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
