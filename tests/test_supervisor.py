"""Supervision policy with fake hosts: no process, no socket, just the rules.

A `FakeHost` plays one host's agent: when the supervisor starts its ranks it reports
them spawned, then reports whatever exits its script says, and it answers stop and
kill the way an agent does (a stubborn host ignores them).
"""

from __future__ import annotations

import queue
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import pytest

import fdl_fabric.supervision.timing as sup_module
from fdl_fabric import reports
from fdl_fabric.clusterfile import parse_cluster
from fdl_fabric.events import Event, EventBus, EventLog, Kind, Name, event
from fdl_fabric.planning.plan import RankPlan, build_plan
from fdl_fabric.presentation import stacks
from fdl_fabric.supervision.policy import Elastic
from fdl_fabric.supervision.rankoutput import RankOutput
from fdl_fabric.supervision.supervisor import RankState, RunResult, Supervisor
from fdl_fabric.supervision.verdict import Verdict

#: A script entry: (exit code, signal) the rank reports as soon as it starts, or None
#: for a rank that runs until it is stopped.
Script = Optional[tuple[Optional[int], Optional[int]]]


@dataclass
class FakeHost:
    name: str
    script: dict[int, Script]
    stubborn: bool = False
    sup: Optional[Supervisor] = None
    started: bool = False
    stopped: bool = False
    killed: bool = False
    abandoned: bool = False
    signals: list[str] = field(default_factory=list)
    running: set[int] = field(default_factory=set)
    gone: bool = False
    #: The signal each whole-host stop began with; the ranks stopped one by one.
    stops: list[str] = field(default_factory=list)
    rank_stops: list[int] = field(default_factory=list)
    suspended: int = 0
    resumed: int = 0
    stack_requests: list[int] = field(default_factory=list)
    #: None: heard all the time (a healthy agent); a number: silent since then.
    silent_since: Optional[float] = None
    pings: int = 0
    #: Its ranks' beats arrive (some rank joined through its agent).
    beats_flowing: bool = False
    #: How often the supervisor asked when it was last heard.
    heard_asked: int = 0

    @property
    def last_heard(self) -> float:
        self.heard_asked += 1
        return time.monotonic() if self.silent_since is None else self.silent_since

    def suspend(self) -> None:
        self.suspended += 1

    def resume(self) -> None:
        self.resumed += 1

    def stacks(self, request_id: int) -> None:
        self.stack_requests.append(request_id)

    def post(self, report: reports.Report) -> None:
        assert self.sup is not None
        self.sup.post(report)

    def ping(self) -> None:
        self.pings += 1

    def start_ranks(self) -> None:
        self.started = True
        for rank, outcome in self.script.items():
            self.post(reports.Spawned(self.name, rank, 1000 + rank))
            if outcome is None:
                self.running.add(rank)
            else:
                self.post(reports.Exited(self.name, rank, outcome[0], outcome[1]))
        self._maybe_gone()

    def _end(self, sig: int) -> None:
        for rank in sorted(self.running):
            self.post(reports.Exited(self.name, rank, None, sig))
        self.running.clear()
        self._maybe_gone()

    def _maybe_gone(self) -> None:
        if not self.running and not self.gone:
            self.gone = True
            self.post(reports.AgentDone(self.name))
            self.post(reports.AgentGone(self.name, True, ""))

    def stop(self, signal_name: str = "TERM", rank: Optional[int] = None) -> None:
        if rank is not None:
            self.rank_stops.append(rank)
            if not self.stubborn and rank in self.running:
                self.running.discard(rank)
                self.post(reports.Exited(self.name, rank, None, signal.SIGTERM))
                self._maybe_gone()
            return
        self.stopped = True
        self.stops.append(signal_name)
        if not self.started:
            self._maybe_gone()
        elif not self.stubborn:
            self._end(signal.SIGINT if signal_name == "INT" else signal.SIGTERM)

    def kill(self) -> None:
        self.killed = True
        if not self.stubborn:
            self._end(signal.SIGKILL)

    def signal(self, name: str, rank: Optional[int] = None) -> None:
        self.signals.append(name)

    def abandon(self) -> None:
        self.abandoned = True
        if not self.gone:
            self.gone = True
            self.post(reports.AgentGone(self.name, False, "abandoned"))


def plans(*hosts: int) -> list[RankPlan]:
    """Rank plans for hosts h0, h1, ... with the given numbers of ranks."""
    workers = "".join(f"  - host: h{i}\n    path: /srv\n    nproc: {n}\n"
                      for i, n in enumerate(hosts))
    cluster = parse_cluster("workers:\n" + workers, local_hostname="controller")
    return list(build_plan(cluster, argv=["true"], run_id="r1", salt=b"\0" * 16).ranks)


def policy_for(cohort: Optional[FormedCohort],
               scripts: Sequence[dict[int, Script]]) -> Optional[Elastic]:
    """A launch's policy: elastic when there is a cohort, kill-all (the default) without."""
    if cohort is None:
        return None
    return Elastic(sum(len(s) for s in scripts))


def supervise(*scripts: dict[int, Script], grace: float = 0.05, stubborn: tuple[int, ...] = (),
              cohort: Optional[FormedCohort] = None, preflight: object = None,
              policy: Optional[Elastic] = None,
              ) -> tuple[Supervisor, list[FakeHost], EventLog]:
    log = EventLog()
    hosts = [FakeHost(f"h{i}", s, stubborn=i in stubborn) for i, s in enumerate(scripts)]
    sup = Supervisor(plans(*(len(s) for s in scripts)), {h.name: h for h in hosts},
                     kill_grace=grace, events=EventBus(log), cohort=cohort,
                     policy=policy or policy_for(cohort, scripts),
                     preflight=preflight, tick=0.001)  # type: ignore[arg-type]
    for h in hosts:
        h.sup = sup
    return sup, hosts, log


def test_every_rank_exiting_zero_is_a_success() -> None:
    sup, _, _ = supervise({0: (0, None), 1: (0, None)}, {2: (0, None)})
    result = sup.run()
    assert result.exit_code == 0 and result.verdict is Verdict.OK
    assert all(r.state is RankState.SUCCEEDED for r in result.ranks)


def test_first_failure_stops_every_other_rank_and_is_the_verdict() -> None:
    sup, (h0, h1), log = supervise({0: None, 1: (3, None)}, {2: None})
    result = sup.run()
    assert result.exit_code == 1
    assert failed(result, "h0", 1) == {"code": 3, "signal": None, "lost": None}
    assert h0.stopped and h1.stopped
    assert [r.state for r in result.ranks] == [RankState.STOPPED, RankState.FAILED,
                                              RankState.STOPPED]
    (stopping,) = log.named(Name.STOPPING_ON_FAILURE)
    assert stopping.data == {"hung": False}


def test_signal_death_is_named_as_a_signal() -> None:
    sup, _, _ = supervise({0: (None, 9), 1: None})
    assert failed(sup.run(), "h0", 0)["signal"] == 9


def test_later_failures_do_not_replace_the_first() -> None:
    sup, _, _ = supervise({0: (3, None)}, {1: (4, None)})
    assert failed(sup.run(), "h0", 0)["code"] == 3


def test_a_host_that_ignores_the_stop_is_killed_then_abandoned(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sup_module, "FORCE_MARGIN", 0.01)
    monkeypatch.setattr(sup_module, "ABANDON_MARGIN", 0.01)
    sup, (_, stubborn), log = supervise({0: (1, None)}, {1: None}, stubborn=(1,))
    result = sup.run()
    assert stubborn.killed and stubborn.abandoned
    assert result.ranks[1].state is RankState.LOST
    assert "abandoned" in (result.ranks[1].exit.lost or "")  # type: ignore[union-attr]
    assert [e.host for e in log.named(Name.HOST_ABANDONED)] == ["h1"]


def test_interrupt_stops_all_and_exits_128_plus_signal() -> None:
    sup, hosts, _ = supervise({0: None}, {1: None})
    sup.request_interrupt(signal.SIGTERM)
    result = sup.run()
    assert all(h.stopped for h in hosts) and result.exit_code == 143
    assert result.verdict is Verdict.INTERRUPTED


def test_a_term_from_outside_at_an_agent_interrupts_the_run_naming_its_host() -> None:
    sup, hosts, log = supervise({0: None}, {1: None})
    sup.post(reports.Signaled("h1", "TERM", True))
    result = sup.run()
    assert all(h.stopped for h in hosts) and result.exit_code == 143
    assert result.cause == event(Name.INTERRUPTED, host="h1", signal="SIGTERM")


def test_a_rank_that_got_the_same_term_first_does_not_turn_the_interruption_into_a_failure(
        ) -> None:
    # Slurm signals every process of the step: a rank's death by TERM can reach the
    # launcher before its agent's own report of that TERM.
    sup, (h0,), _ = supervise({0: (None, signal.SIGTERM), 1: None})
    start = h0.start_ranks
    h0.start_ranks = lambda: (start(),  # type: ignore[method-assign]
                              h0.post(reports.Signaled("h0", "TERM", True)))
    result = sup.run()
    assert result.verdict is Verdict.INTERRUPTED and result.exit_code == 143


def test_a_term_from_outside_after_an_unrelated_failure_keeps_the_failure() -> None:
    sup, (h0,), _ = supervise({0: (3, None), 1: None})
    start = h0.start_ranks
    h0.start_ranks = lambda: (start(),  # type: ignore[method-assign]
                              h0.post(reports.Signaled("h0", "TERM", True)))
    result = sup.run()
    assert result.verdict is Verdict.FAILED and result.exit_code == 1


def test_a_usr1_from_outside_is_reported_and_stops_nothing() -> None:
    sup, hosts, log = supervise({0: None})
    sup.post(reports.Signaled("h0", "USR1", False))
    sup.request_interrupt(signal.SIGINT)
    result = sup.run()
    assert result.exit_code == 130
    (outside,) = log.named(Name.OUTSIDE_SIGNAL)
    assert outside.host == "h0" and outside.data == {"signal": "USR1", "forwarded": False}


def test_second_interrupt_kills_at_once() -> None:
    sup, (h0,), _ = supervise({0: None}, grace=30, stubborn=())
    h0.stubborn = True
    sup.request_interrupt(signal.SIGINT)
    sup.request_kill()
    h0.stubborn = False  # answers the KILL
    result = sup.run()
    assert h0.killed and result.exit_code == 130


def test_usr1_is_forwarded_to_every_host_with_live_ranks() -> None:
    sup, (h0, h1), _ = supervise({0: None}, {1: None})
    sup.request_signal("USR1")
    sup.request_interrupt(signal.SIGTERM)
    sup.run()
    assert h0.signals == ["USR1"] and h1.signals == ["USR1"]


def test_an_abort_request_is_a_run_failure_that_stops_everyone() -> None:
    sup, (h0,), _ = supervise({0: None})
    cause = event(Name.COHORT_NOT_FORMED, missing=[0], formation_timeout=1.0)
    sup.request_abort(cause)
    result = sup.run()
    assert h0.stopped and result.exit_code == 1
    assert result.cause is cause


def test_a_lost_agent_loses_its_ranks_and_stops_every_other_host() -> None:
    sup, (h0, h1), log = supervise({0: None}, {1: None, 2: None})
    h1.start_ranks = lambda: (setattr(h1, "started", True),  # type: ignore[method-assign]
                              [h1.post(reports.Spawned("h1", r, 9)) for r in (1, 2)],
                              h1.post(reports.AgentGone("h1", False, "connection reset")))
    result = sup.run()
    assert [r.state for r in result.ranks] == [RankState.STOPPED, RankState.LOST,
                                              RankState.LOST]
    assert h0.stopped
    assert failed(result, "h1", 1)["lost"] == "agent lost: connection reset"


def test_a_spawn_failure_stops_every_host_and_names_the_rank() -> None:
    sup, (h0, h1), _ = supervise({0: None}, {1: None})
    h1.start_ranks = lambda: (setattr(h1, "started", True),  # type: ignore[method-assign]
                              h1.post(reports.SpawnFailed("h1", 1, "train: not found on PATH")),
                              h1._maybe_gone())
    result = sup.run()
    assert h0.stopped and result.exit_code == 1
    assert result.cause == event(Name.RANK_START_FAILED, host="h1", rank=1,
                                 reason="train: not found on PATH")
    assert result.ranks[1].state is RankState.NOT_STARTED


def test_no_rank_starts_until_every_host_passed_its_preflight() -> None:
    def judge(host: str, values: object) -> tuple[list[tuple[str, str]],
                                                   list[tuple[str, str]]]:
        return [], ([] if host == "h0" else [("paths", "/srv does not exist")])

    sup, (h0, h1), log = supervise({0: (0, None)}, {1: (0, None)}, preflight=judge)
    sup.post(reports.Preflight("h0", {}))
    sup.post(reports.Preflight("h1", {}))
    result = sup.run()
    assert not h0.started and not h1.started
    assert result.exit_code == 1 and result.cause == event(Name.PREFLIGHT_FAILED, failures=1)
    assert all(r.state is RankState.NOT_STARTED for r in result.ranks)
    assert not result.started_any
    (check,) = log.named(Name.PREFLIGHT_FAILED_CHECK)
    assert check.host == "h1" and check.data["check"] == "paths"


def test_every_host_starts_once_all_preflights_passed() -> None:
    sup, (h0, h1), _ = supervise({0: (0, None)}, {1: (0, None)},
                                 preflight=lambda host, values: ([], []))
    sup.post(reports.Preflight("h0", {}))
    assert not h0.started
    sup.post(reports.Preflight("h1", {}))
    assert sup.run().exit_code == 0 and h0.started and h1.started


def test_a_hosts_second_preflight_does_not_stand_in_for_another_hosts() -> None:
    sup, (h0, h1), _ = supervise({0: (0, None)}, {1: (0, None)},
                                 preflight=lambda host, values: ([], []))
    sup.post(reports.Preflight("h0", {}))
    sup.post(reports.Preflight("h0", {}))
    sup.request_interrupt(signal.SIGTERM)
    result = sup.run()
    assert not h0.started and not h1.started, "h1's pre-flight was still due"
    assert not result.started_any


def test_output_sets_the_last_line_of_its_rank() -> None:
    sup, (h0,), log = supervise({0: None})
    sup.post(reports.Output("h0", 0, False, b"first\nsecond \xff\n", False))
    sup.request_interrupt(signal.SIGTERM)
    result = sup.run()
    assert result.ranks[0].last_line == "second \ufffd"


def test_rank_output_reaches_the_renderer_with_the_rank_label() -> None:
    log = EventLog()
    router = RankOutput(EventBus(log))
    cluster = parse_cluster("workers:\n  - host: h0\n    path: /srv\n    nproc: 1\n",
                            local_hostname="controller")
    router.attempt(build_plan(cluster, argv=["true"], run_id="r1", salt=b"\0" * 16))
    router(reports.Output("h0", 0, False, b"first\nsecond \xff\n", False))
    seen = log.of(Kind.OUTPUT)[0]
    assert seen.data["label"] == "h0:cpu:r0" and seen.data["text"] == "first\nsecond \ufffd"
    assert seen.data["raw"] == b"first\nsecond \xff\n"


#: How the coordinator says a rank went silent (`coordinator.Reason`).
SILENT = {"silent": 30.2, "heartbeat_timeout": 30.0}


class FormedCohort:
    """The coordinator's side the supervisor sees, for a cohort that has formed."""

    def __init__(self) -> None:
        self.dead: list[int] = []
        self.shutdowns: list[Event] = []
        self.exited: set[int] = set()

    @property
    def cohort_formed(self) -> bool:
        return True

    def mark_dead(self, ranks: Sequence[int], reason: object) -> None:
        self.dead.extend(ranks)

    def broadcast_shutdown(self, cause: Event) -> None:
        self.shutdowns.append(cause)

    last_progress = 0.0

    def resumed(self) -> None:
        pass


def test_after_formation_a_death_is_tolerated_and_reported() -> None:
    cohort = FormedCohort()
    sup, (h0,), log = supervise({0: (9, None), 1: (0, None)}, cohort=cohort)
    result = sup.run()
    assert cohort.dead == [0] and not h0.stopped
    assert result.ranks[0].state is RankState.TOLERATED
    assert result.exit_code == 0 and result.verdict is Verdict.DEGRADED
    assert result.cause == event(Name.DEGRADED, dead=1, world_size=2)
    (tolerated,) = log.named(Name.RANK_TOLERATED)
    assert tolerated.rank == 0 and tolerated.data["exit"]["code"] == 9


def test_when_the_policy_says_shutdown_the_cohort_is_told_and_survivors_finish() -> None:
    cohort = FormedCohort()
    sup, (h0,), _ = supervise({0: (9, None), 1: (0, None), 2: (0, None)}, cohort=cohort,
                              policy=Elastic(3, 1))
    result = sup.run()
    assert cohort.dead == [0] and not h0.stopped
    assert cohort.shutdowns == [event(Name.MAX_FAILURE_REACHED, dead=1, world_size=3, limit=1)]
    assert result.verdict is Verdict.FAILED and result.exit_code == 1
    assert result.cause == event(Name.MAX_FAILURE_EXCEEDED, dead=1, world_size=3, limit=1)



# -- liveness: unresponsive hosts, declared-dead ranks, forwarded signals, hangs, stacks ----------

def supervise_live(*scripts: dict[int, Script], grace: float = 0.05,
                   cohort: Optional[FormedCohort] = None,
                   agent_timeout: Optional[float] = None, hang_timeout: Optional[float] = None,
                   on_resume: object = None, inbox: object = None,
                   lease: Optional[float] = None,
                   ) -> tuple[Supervisor, list[FakeHost], EventLog]:
    """`supervise`, with the liveness settings of a launch."""
    log = EventLog()
    hosts = [FakeHost(f"h{i}", s) for i, s in enumerate(scripts)]
    sup = Supervisor(plans(*(len(s) for s in scripts)), {h.name: h for h in hosts},
                     kill_grace=grace, events=EventBus(log), cohort=cohort,
                     policy=policy_for(cohort, scripts),
                     tick=0.001, agent_timeout=agent_timeout, hang_timeout=hang_timeout,
                     on_resume=on_resume, inbox=inbox, lease=lease)  # type: ignore[arg-type]
    for h in hosts:
        h.sup = sup
    return sup, hosts, log


def answers_stacks(host: FakeHost, entries: dict[int, dict[str, object]]) -> None:
    """Make ``host`` answer a request for stacks at once, the way its agent does."""
    def stacks(request_id: int) -> None:
        host.stack_requests.append(request_id)
        host.post(reports.Stacks(host.name, request_id, "r1", dict(entries), py_spy=True))

    host.stacks = stacks  # type: ignore[method-assign]


def in_frame(name: str, file: str, line: int) -> dict[str, object]:
    return {"pid": 1, "proc": {"state": "S"}, "threads": [
        {"name": "MainThread", "id": 1, "frames": [{"name": name, "file": file, "line": line}]}]}


def index_of(log: EventLog, name: Name) -> int:
    return next(i for i, e in enumerate(log.events) if e.name is name)


def failed(result: RunResult, host: str, rank: int) -> dict[str, object]:
    """The verdict is that rank's failure: how it ended (its exit data)."""
    assert result.cause.name is Name.RANK_FAILED, result.cause
    assert (result.cause.host, result.cause.rank) == (host, rank)
    return dict(result.cause.data["exit"])


def test_a_silent_host_is_unresponsive_its_ranks_are_lost_and_every_other_rank_stopped(
        ) -> None:
    sup, (h0, h1), log = supervise_live({0: None}, {1: None, 2: None}, agent_timeout=0.05)
    h1.silent_since = time.monotonic() - 100
    result = sup.run()
    assert h1.abandoned and not h0.abandoned
    assert h0.stops == ["TERM"]  # before the cohort forms: kill-all
    assert result.verdict is Verdict.FAILED and result.exit_code == 1
    assert failed(result, "h1", 1)["lost"].startswith(  # type: ignore[union-attr]
        "host unresponsive: no word from its agent for")
    assert result.faults == {"h1": "unresponsive"}
    assert [r.state for r in result.ranks] == [RankState.STOPPED, RankState.LOST,
                                              RankState.LOST]
    for r in result.ranks[1:]:
        assert r.exit is not None and r.exit.host_fault == "unresponsive"
        assert r.summary()["host_fault"] == "unresponsive"
    assert result.ranks[0].exit is not None and result.ranks[0].exit.host_fault is None
    death = log.of(Kind.DEATH)[0]
    assert death.name is Name.HOST_UNRESPONSIVE and death.host == "h1"
    assert death.data["host_fault"] == "unresponsive" and death.data["agent_timeout"] == 0.05
    assert result.restartable


def test_after_formation_an_unresponsive_hosts_ranks_are_reported_dead_and_the_run_goes_on(
        ) -> None:
    cohort = FormedCohort()
    sup, (h0, h1), _ = supervise_live({0: (0, None)}, {1: None}, cohort=cohort,
                                      agent_timeout=0.05)
    h1.silent_since = time.monotonic() - 100
    result = sup.run()
    assert h1.abandoned and not h0.stopped
    assert cohort.dead == [1]
    assert result.ranks[1].state is RankState.TOLERATED
    assert result.ranks[1].summary()["host_fault"] == "unresponsive"
    assert result.verdict is Verdict.DEGRADED and result.exit_code == 0
    assert result.faults == {"h1": "unresponsive"}


def test_an_agent_whose_ranks_beats_flow_is_pinged_only_for_its_lease() -> None:
    sup, (quiet, beating), _ = supervise_live({0: None}, {1: None}, lease=30.0,
                                              agent_timeout=10.0)
    beating.beats_flowing = True
    assert sup.ping_every == pytest.approx(10 / 3) and sup.lease_ping_every == 10.0
    now = time.monotonic() + 100.0
    for _ in range(9):  # 30 s of ping rounds
        sup._ping(now)
        now += sup.ping_every + 0.01  # a round comes a little after it is due
    assert quiet.pings == 9, "an agent heard only through its answers: every round"
    assert beating.pings == 3, "its beats keep it heard: a ping only renews the lease"
    beating.beats_flowing = False  # its ranks left: pinged every round again
    for _ in range(3):
        sup._ping(now)
        now += sup.ping_every + 0.01  # a round comes a little after it is due
    assert beating.pings == 6


def test_hosts_are_walked_for_silence_only_once_one_could_be_silent() -> None:
    sup, (old, recent), log = supervise_live({0: None}, {1: None}, agent_timeout=10.0)
    now = time.monotonic()
    sup._watch_from = now - 100.0  # as if it had watched them for long
    old.silent_since = now - 9.4  # silent for the timeout in 0.6 s
    recent.silent_since = now - 1.0
    sup._check_hosts()
    assert (old.heard_asked, recent.heard_asked) == (1, 1) and not log.of(Kind.DEATH)
    while time.monotonic() < now + 0.5:  # nobody can be silent yet: no walk
        sup._check_hosts()
        time.sleep(0.01)
    assert (old.heard_asked, recent.heard_asked) == (1, 1)
    time.sleep(max(0.0, now + 1.0 - time.monotonic()))
    sup._check_hosts()  # due: the least recently heard agent is found at once
    assert old.abandoned and not recent.abandoned
    assert [e.host for e in log.of(Kind.DEATH)] == ["h0"]


def test_a_host_that_keeps_talking_is_never_unresponsive() -> None:
    sup, (h0,), log = supervise_live({0: None}, agent_timeout=0.02)
    start = h0.start_ranks
    h0.start_ranks = lambda: (start(),  # type: ignore[method-assign]
                              threading.Timer(0.2, sup.request_interrupt,
                                              (signal.SIGTERM,)).start())
    result = sup.run()
    assert not h0.abandoned and not log.of(Kind.DEATH)
    assert result.verdict is Verdict.INTERRUPTED and result.exit_code == 143
    assert result.faults == {}


def test_a_rank_declared_dead_is_stopped_on_its_host_and_its_exit_is_tolerated() -> None:
    sup, (h0, h1), log = supervise_live({0: (0, None)}, {1: None, 2: (0, None)},
                                        cohort=FormedCohort())
    start = h1.start_ranks
    h1.start_ranks = lambda: (start(),  # type: ignore[method-assign]
                              h1.post(reports.DeclaredDead(1, SILENT)))
    result = sup.run()
    assert h1.rank_stops == [1] and h1.stops == []  # only that rank, TERM first
    assert h0.rank_stops == [] and not h0.stopped
    rank1 = result.ranks[1]
    assert rank1.state is RankState.TOLERATED and rank1.declared_dead == SILENT
    assert rank1.exit is not None and rank1.exit.signal == signal.SIGTERM
    assert [r.state for r in result.ranks] == [RankState.SUCCEEDED, RankState.TOLERATED,
                                              RankState.SUCCEEDED]
    assert result.verdict is Verdict.DEGRADED and result.exit_code == 0
    (tolerated,) = log.named(Name.RANK_DEAD_STOPPED)
    assert tolerated.rank == 1 and tolerated.data["declared_dead"] == SILENT


def test_a_rank_that_dies_of_a_forwarded_usr1_is_an_interruption_not_a_failure() -> None:
    sup, (h0, h1), log = supervise_live({0: None}, {1: None})

    def dies_of_it(name: str, rank: Optional[int] = None) -> None:
        # Rank 1's program has no handler for SIGUSR1: the default action ends it.
        h1.signals.append(name)
        h1.running.discard(1)
        h1.post(reports.Exited("h1", 1, None, signal.SIGUSR1))
        h1._maybe_gone()

    h1.signal = dies_of_it  # type: ignore[method-assign]
    sup.request_signal("USR1")
    result = sup.run()
    assert h0.signals == ["USR1"] and h1.signals == ["USR1"]
    assert result.verdict is Verdict.INTERRUPTED and result.exit_code == 128 + 10 == 138
    assert result.cause == event(Name.INTERRUPTED_BY_FORWARD, host="h1", rank=1,
                                 signal="SIGUSR1")
    assert not result.restartable
    assert result.ranks[1].state is RankState.STOPPED
    assert result.ranks[1].stopped_by == "SIGUSR1"
    assert result.ranks[0].state is RankState.STOPPED and h0.stopped
    assert result.root_cause is None
    assert not log.of(Kind.DEATH)


def test_a_rank_that_dies_of_a_usr1_nobody_forwarded_is_a_failure() -> None:
    sup, _, _ = supervise_live({0: (None, signal.SIGUSR1), 1: None})
    result = sup.run()
    assert result.verdict is Verdict.FAILED and result.exit_code == 1
    assert failed(result, "h0", 0)["signal"] == signal.SIGUSR1


def test_a_hung_run_collects_every_ranks_stack_then_ends_hung_and_restartable() -> None:
    sup, (h0, h1), log = supervise_live({0: None, 1: None}, {2: None}, hang_timeout=0.05)
    waiting = in_frame("all_reduce", "distributed_c10d.py", 2801)
    answers_stacks(h0, {0: waiting, 1: in_frame("stuck_here", "hang.py", 3)})
    answers_stacks(h1, {2: waiting})
    result = sup.run()
    # One request, asked of every host with live ranks.
    assert len(h0.stack_requests) == 1 and h0.stack_requests == h1.stack_requests
    assert result.verdict is Verdict.HUNG and result.exit_code == 1
    assert result.restartable
    assert result.cause.name is Name.HUNG and result.cause.data["hang_timeout"] == 0.05
    assert all(r.state is RankState.STOPPED for r in result.ranks)
    assert h0.stops == ["TERM"] and h1.stops == ["TERM"]
    (seen,) = log.of(Kind.STACKS)
    assert seen.data["reason"] == "hang"
    assert seen.data["hosts"] == {"0": "h0", "1": "h0", "2": "h1"}
    assert set(seen.data["ranks"]) == {"0", "1", "2"}
    assert seen.data["problems"] == {}
    assert stacks.stacks_text(seen.data).splitlines()[1:] == [
        "  rank 1 (h0): stuck_here (hang.py:3)",
        "  ranks 0, 2 (h0, h1): all_reduce (distributed_c10d.py:2801)"]
    # First the hang is said, then where everyone is, and only then are the ranks stopped.
    hang = index_of(log, Name.HANG_DETECTED)
    shown = index_of(log, Name.STACKS)
    stopping = index_of(log, Name.STOPPING_ON_FAILURE)
    assert log.events[stopping].data == {"hung": True}
    assert hang < shown < stopping


def test_a_host_that_does_not_answer_for_stacks_does_not_hold_the_hung_verdict_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sup_module, "STACKS_TIMEOUT", 0.05)
    sup, (h0, h1), log = supervise_live({0: None}, {1: None}, hang_timeout=0.05)
    answers_stacks(h0, {0: in_frame("stuck_here", "hang.py", 3)})
    result = sup.run()  # h1 only records the request
    assert h1.stack_requests and result.verdict is Verdict.HUNG
    (seen,) = log.of(Kind.STACKS)
    assert seen.data["problems"] == {"h1": "no answer within 0.05s"}
    assert set(seen.data["ranks"]) == {"0"}


def test_rank_output_keeps_a_run_from_being_declared_hung() -> None:
    sup, (h0,), log = supervise_live({0: None}, hang_timeout=0.4)
    answers_stacks(h0, {0: in_frame("stuck_here", "hang.py", 3)})
    asked: list[float] = []
    answer = h0.stacks
    h0.stacks = lambda rid: (asked.append(time.monotonic()),  # type: ignore[method-assign]
                             answer(rid))
    last_output: list[float] = []

    def talk() -> None:
        until = time.monotonic() + 1.0
        while time.monotonic() < until:
            last_output.append(time.monotonic())
            sup.post(reports.Output("h0", 0, False, b"step\n", False))
            time.sleep(0.02)

    start = h0.start_ranks
    h0.start_ranks = lambda: (start(),  # type: ignore[method-assign]
                              threading.Thread(target=talk, daemon=True).start())
    result = sup.run()
    assert result.verdict is Verdict.HUNG
    assert len(asked) == 1 and asked[0] - last_output[-1] >= 0.4 * 0.95


def test_joined_ranks_reporting_progress_are_not_hung_even_when_silent() -> None:
    class Progressing(FormedCohort):
        @property
        def last_progress(self) -> float:  # type: ignore[override]
            return time.monotonic()

    sup, (h0,), log = supervise_live({0: None}, cohort=Progressing(), hang_timeout=0.05)
    start = h0.start_ranks
    h0.start_ranks = lambda: (start(),  # type: ignore[method-assign]
                              threading.Timer(0.3, sup.request_interrupt,
                                              (signal.SIGTERM,)).start())
    result = sup.run()
    assert result.verdict is Verdict.INTERRUPTED
    assert not h0.stack_requests and not log.of(Kind.HANG)


def test_sigquit_shows_where_every_rank_is_and_the_run_goes_on() -> None:
    sup, (h0,), log = supervise_live({0: None})

    def answer_then_finish(request_id: int) -> None:
        h0.stack_requests.append(request_id)
        h0.post(reports.Stacks("h0", request_id, "r1", {0: in_frame("train", "t.py", 9)}))
        h0.running.discard(0)  # the rank then finishes its work
        h0.post(reports.Exited("h0", 0, 0, None))
        h0._maybe_gone()

    h0.stacks = answer_then_finish  # type: ignore[method-assign]
    sup.request_stacks()
    result = sup.run()
    assert h0.stack_requests and not h0.stopped
    (seen,) = log.of(Kind.STACKS)
    assert seen.data["reason"] == "asked (SIGQUIT)"
    assert seen.data["py_spy"] == {"h0": False}
    assert "(no py-spy on h0:" in stacks.stacks_text(seen.data)
    assert result.verdict is Verdict.OK and result.exit_code == 0
    assert log.named(Name.STACKS_ASKED)


def test_a_first_ctrl_c_reaches_every_host_as_int() -> None:
    sup, hosts, log = supervise_live({0: None, 1: None}, {2: None})
    sup.request_interrupt(signal.SIGINT)
    result = sup.run()
    assert [h.stops for h in hosts] == [["INT"], ["INT"]]
    assert result.verdict is Verdict.INTERRUPTED and result.exit_code == 130
    assert result.cause == event(Name.INTERRUPTED, signal="SIGINT")
    assert all(r.state is RankState.STOPPED for r in result.ranks)
    (stopping,) = log.named(Name.STOPPING_ON_SIGNAL)
    assert stopping.data == {"signal": "SIGINT", "live": 3, "int_grace": 0.025,
                             "kill_grace": 0.05}


def test_a_sigterm_reaches_every_host_as_term() -> None:
    sup, hosts, _ = supervise_live({0: None}, {1: None})
    sup.request_interrupt(signal.SIGTERM)
    assert sup.run().exit_code == 143
    assert [h.stops for h in hosts] == [["TERM"], ["TERM"]]


def test_a_death_reported_with_the_last_hosts_end_counts_in_the_verdict() -> None:
    sup, (h0, h1), _ = supervise_live({0: (0, None)}, {1: None})

    def ends_at_once() -> None:
        # The last agent's final frames arrive together: its rank's death, then its end.
        h1.started = True
        h1.post(reports.Spawned("h1", 1, 1001))
        h1.post(reports.Exited("h1", 1, 3, None))
        h1.post(reports.AgentDone("h1"))
        h1.post(reports.AgentGone("h1", True, ""))

    h1.start_ranks = ends_at_once  # type: ignore[method-assign]
    result = sup.run()
    assert result.verdict is Verdict.FAILED and result.exit_code == 1
    assert failed(result, "h1", 1)["code"] == 3
    assert result.ranks[1].state is RankState.FAILED and result.root_cause is result.ranks[1]
    assert result.faults == {}


def test_a_rank_lost_while_it_was_being_stopped_still_counts_in_the_verdict() -> None:
    """Issue 22: a tunnel flood dropped an agent's session while its ranks were being
    stopped; those losses never reached the policy, and the run ended "full workload
    delivered", exit 0. Every lost rank counts: here the run is DEGRADED, not OK."""
    cohort = FormedCohort()
    sup, (h0, h1), log = supervise({0: (0, None)}, {1: None}, cohort=cohort)

    def session_drops() -> None:
        h1.started = True
        h1.post(reports.Spawned("h1", 1, 1001))
        sup.by_rank[1].stop_requested = True  # a stop was on its way when the session went
        h1.gone = True
        h1.post(reports.AgentGone("h1", False, "session dropped"))

    h1.start_ranks = session_drops  # type: ignore[method-assign]
    result = sup.run()
    assert result.ranks[1].state is RankState.LOST
    assert result.verdict is Verdict.DEGRADED and result.cause.name is Name.DEGRADED
    assert result.cause.data == {"dead": 1, "world_size": 2}
    assert result.root_cause is result.ranks[1]


def test_under_kill_all_a_rank_lost_while_being_stopped_fails_the_run() -> None:
    sup, (h0, h1), _ = supervise({0: (0, None)}, {1: None})

    def session_drops() -> None:
        h1.started = True
        h1.post(reports.Spawned("h1", 1, 1001))
        sup.by_rank[1].stop_requested = True
        h1.gone = True
        h1.post(reports.AgentGone("h1", False, "session dropped"))

    h1.start_ranks = session_drops  # type: ignore[method-assign]
    result = sup.run()
    assert result.verdict is Verdict.FAILED and result.exit_code == 1
    assert failed(result, "h1", 1)["lost"] == "agent lost: session dropped"


class PausingInbox:
    """The supervisor's inbox; its next wait with nothing in it lasts ``pause`` seconds,
    as if the launcher had been stopped (SIGSTOP, a suspended VM) while it waited."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[reports.Report] = queue.SimpleQueue()
        self.pause = 0.0

    def put(self, report: reports.Report) -> None:
        self.queue.put(report)

    def get_nowait(self) -> reports.Report:
        return self.queue.get_nowait()

    def get(self, timeout: Optional[float] = None) -> reports.Report:
        if self.pause and self.queue.empty():
            time.sleep(self.pause)
            self.pause = 0.0
        return self.queue.get(timeout=timeout)


def test_a_pause_of_the_launcher_restarts_every_silence_clock_and_blames_no_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sup_module, "PAUSE_GAP", 0.1)

    class Resumable(FormedCohort):
        resumes = 0

        def resumed(self) -> None:
            self.resumes += 1

    cohort = Resumable()
    inbox = PausingInbox()
    resumed: list[float] = []
    sup, (h0,), log = supervise_live(
        {0: None}, cohort=cohort, agent_timeout=0.2, hang_timeout=0.2, inbox=inbox,
        on_resume=lambda: (resumed.append(time.monotonic()),
                           sup.request_interrupt(signal.SIGTERM)))
    h0.silent_since = time.monotonic()  # its agent said nothing since the start
    start = h0.start_ranks
    h0.start_ranks = lambda: (start(), setattr(inbox, "pause", 0.5))  # type: ignore[method-assign]
    result = sup.run()
    assert len(resumed) == 1 and cohort.resumes == 1
    assert not h0.abandoned and not h0.stack_requests
    assert not log.of(Kind.DEATH) and not log.of(Kind.HANG)
    assert result.verdict is Verdict.INTERRUPTED and result.exit_code == 143


def test_agents_are_pinged_a_third_of_the_shorter_timeout_apart_and_never_under_2_s() -> None:
    from fdl_fabric.agent import wire
    from fdl_fabric.supervision.timing import ping_interval

    assert ping_interval(10.0, 30.0) == pytest.approx(10.0 / 3), "the defaults: 3.3 s"
    assert ping_interval(30.0, 9.0) == pytest.approx(3.0), "a short lease is renewed in time"
    assert ping_interval(6.0, 6.0) == wire.PING_INTERVAL
    assert ping_interval(None, None) == wire.PING_INTERVAL
