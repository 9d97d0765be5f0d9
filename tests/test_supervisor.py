"""Supervision policy with fake hosts: no process, no socket, just the rules.

A `FakeHost` plays one host's agent: when the supervisor starts its ranks it reports
them spawned, then reports whatever exits its script says, and it answers stop and
kill the way an agent does (a stubborn host ignores them).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Optional

import pytest

import fdl_fabric.supervisor as sup_module
from fdl_fabric import reports
from fdl_fabric.config import parse_cluster
from fdl_fabric.events import EventBus, EventLog, Kind
from fdl_fabric.plan import RankPlan, build_plan
from fdl_fabric.rankoutput import RankOutput
from fdl_fabric.supervisor import RankState, Supervisor, Verdict

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

    @property
    def last_heard(self) -> float:
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
        pass

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


def supervise(*scripts: dict[int, Script], grace: float = 0.05, stubborn: tuple[int, ...] = (),
              elastic: object = None, preflight: object = None,
              ) -> tuple[Supervisor, list[FakeHost], EventLog]:
    log = EventLog()
    hosts = [FakeHost(f"h{i}", s, stubborn=i in stubborn) for i, s in enumerate(scripts)]
    sup = Supervisor(plans(*(len(s) for s in scripts)), {h.name: h for h in hosts},
                     kill_grace=grace, events=EventBus(log), elastic=elastic,  # type: ignore[arg-type]
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
    assert result.message == "cluster launcher: rank 1 of h0 exited with status 3"
    assert h0.stopped and h1.stopped
    assert [r.state for r in result.ranks] == [RankState.STOPPED, RankState.FAILED,
                                              RankState.STOPPED]
    messages = [e.message for e in log.events]
    assert "cluster launcher: peer failure — terminating all still-running ranks" in messages


def test_signal_death_is_named_as_a_signal() -> None:
    sup, _, _ = supervise({0: (None, 9), 1: None})
    assert sup.run().message == "cluster launcher: rank 0 of h0 exited with signal 9"


def test_later_failures_do_not_replace_the_first() -> None:
    sup, _, _ = supervise({0: (3, None)}, {1: (4, None)})
    assert sup.run().message.endswith("rank 0 of h0 exited with status 3")


def test_a_host_that_ignores_the_stop_is_killed_then_abandoned(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sup_module, "FORCE_MARGIN", 0.01)
    monkeypatch.setattr(sup_module, "ABANDON_MARGIN", 0.01)
    sup, (_, stubborn), log = supervise({0: (1, None)}, {1: None}, stubborn=(1,))
    result = sup.run()
    assert stubborn.killed and stubborn.abandoned
    assert result.ranks[1].state is RankState.LOST
    assert "abandoned" in (result.ranks[1].exit.lost or "")  # type: ignore[union-attr]
    assert any("did not report its ranks' exits" in e.message for e in log.of(Kind.WARNING))


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
    assert result.message == "cluster launcher: interrupted by SIGTERM on h1 — every rank " \
        "was stopped"


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
    assert any("SIGUSR1 from outside, which Slurm delivered to its ranks too" in e.message
               for e in log.events)


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
    sup.request_abort("cluster launcher: coordinator could not bind")
    result = sup.run()
    assert h0.stopped and result.exit_code == 1
    assert result.message == "cluster launcher: coordinator could not bind"


def test_a_lost_agent_loses_its_ranks_and_stops_every_other_host() -> None:
    sup, (h0, h1), log = supervise({0: None}, {1: None, 2: None})
    h1.start_ranks = lambda: (setattr(h1, "started", True),  # type: ignore[method-assign]
                              [h1.post(reports.Spawned("h1", r, 9)) for r in (1, 2)],
                              h1.post(reports.AgentGone("h1", False, "connection reset")))
    result = sup.run()
    assert [r.state for r in result.ranks] == [RankState.STOPPED, RankState.LOST,
                                              RankState.LOST]
    assert h0.stopped
    assert result.message == ("cluster launcher: rank 1 of h1 exited with no exit status "
                              "(agent lost: connection reset)")


def test_a_spawn_failure_stops_every_host_and_names_the_rank() -> None:
    sup, (h0, h1), _ = supervise({0: None}, {1: None})
    h1.start_ranks = lambda: (setattr(h1, "started", True),  # type: ignore[method-assign]
                              h1.post(reports.SpawnFailed("h1", 1, "train: not found on PATH")),
                              h1._maybe_gone())
    result = sup.run()
    assert h0.stopped and result.exit_code == 1
    assert result.message == ("cluster launcher: host 'h1': could not start rank 1: "
                              "train: not found on PATH")
    assert result.ranks[1].state is RankState.NOT_STARTED


def test_no_rank_starts_until_every_host_passed_its_preflight() -> None:
    def judge(host: str, values: object) -> tuple[list[str], list[str]]:
        return [], ([] if host == "h0" else ["paths: FAIL: /srv does not exist"])

    sup, (h0, h1), log = supervise({0: (0, None)}, {1: (0, None)}, preflight=judge)
    sup.post(reports.Preflight("h0", {}))
    sup.post(reports.Preflight("h1", {}))
    result = sup.run()
    assert not h0.started and not h1.started
    assert result.exit_code == 1 and "pre-flight failed" in result.message
    assert all(r.state is RankState.NOT_STARTED for r in result.ranks)
    assert not result.started_any
    assert any("h1: paths: FAIL" in e.message for e in log.of(Kind.WARNING))


def test_every_host_starts_once_all_preflights_passed() -> None:
    sup, (h0, h1), _ = supervise({0: (0, None)}, {1: (0, None)},
                                 preflight=lambda host, values: ([], []))
    sup.post(reports.Preflight("h0", {}))
    assert not h0.started
    sup.post(reports.Preflight("h1", {}))
    assert sup.run().exit_code == 0 and h0.started and h1.started


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
    event = log.of(Kind.OUTPUT)[0]
    assert event.data["label"] == "h0:cpu:r0" and event.data["text"] == "first\nsecond \ufffd"
    assert event.data["raw"] == b"first\nsecond \xff\n"


class FormedCohort:
    def __init__(self) -> None:
        self.dead: list[int] = []

    @property
    def cohort_formed(self) -> bool:
        return True

    def report_dead(self, ranks: list[int], reason: str) -> None:
        self.dead.extend(ranks)

    def abort_reason(self) -> Optional[str]:
        return None

    @property
    def shutdown_sent(self) -> Optional[str]:
        return None

    def verdict(self, world_size: int, tolerated: int) -> tuple[Verdict, str]:
        return Verdict.DEGRADED, f"degraded {len(self.dead)}/{world_size}"

    last_progress = 0.0

    def resumed(self) -> None:
        pass


def test_after_formation_a_death_is_tolerated_and_reported() -> None:
    cohort = FormedCohort()
    sup, (h0,), log = supervise({0: (9, None), 1: (0, None)}, elastic=cohort)
    result = sup.run()
    assert cohort.dead == [0] and not h0.stopped
    assert result.ranks[0].state is RankState.TOLERATED
    assert result.exit_code == 0 and result.message == "degraded 1/2"
    assert "tolerating (elastic membership): reporting rank(s) [0] dead" in \
        log.of(Kind.TOLERATED)[0].message

