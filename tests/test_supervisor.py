"""Supervision policy, with fake ranks: no processes, just the rules."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Optional

from fdl_fabric.events import EventBus, EventLog, Kind
from fdl_fabric.spawn import ExitInfo
from fdl_fabric.supervisor import RankState, SupervisedRank, Supervisor, Verdict


@dataclass
class FakeRank:
    """Exits with ``status`` after ``polls`` polls; stops when asked unless stubborn."""

    status: Optional[int] = 0
    polls: int = 1
    stubborn: bool = False
    stopped: bool = False
    killed: bool = False
    signals: list[str] = field(default_factory=list)
    abandoned: bool = False

    def poll(self) -> Optional[ExitInfo]:
        if self.killed or (self.stopped and not self.stubborn):
            return ExitInfo.from_status(137 if self.killed else 143)
        self.polls -= 1
        if self.polls <= 0 and self.status is not None:
            return ExitInfo.from_status(self.status)
        return None

    def stop(self) -> None:
        self.stopped = True

    def kill(self) -> None:
        self.killed = True

    def send_signal(self, name: str) -> None:
        self.signals.append(name)

    def abandon(self) -> None:
        self.abandoned = True

    def finish(self) -> None:
        pass


def _run(*fakes: FakeRank, grace: float = 0.05) -> tuple[Supervisor, EventLog]:
    log = EventLog()
    ranks = [SupervisedRank(i, f"h{i // 2}", f) for i, f in enumerate(fakes)]
    sup = Supervisor(ranks, kill_grace=grace, events=EventBus(log), poll_interval=0.001)
    return sup, log


def test_every_rank_exiting_zero_is_a_success() -> None:
    sup, _ = _run(FakeRank(0), FakeRank(0, polls=3))
    result = sup.run()
    assert result.exit_code == 0 and result.verdict is Verdict.OK
    assert all(r.state is RankState.SUCCEEDED for r in result.ranks)


def test_first_failure_stops_every_other_rank_and_is_the_verdict() -> None:
    a, b, c = FakeRank(None), FakeRank(3, polls=2), FakeRank(None)
    sup, log = _run(a, b, c)
    result = sup.run()
    assert result.exit_code == 1
    assert result.message == "cluster launcher: rank 1 of h0 exited with status 3"
    assert a.stopped and c.stopped
    assert [r.state for r in result.ranks] == [RankState.STOPPED, RankState.FAILED,
                                              RankState.STOPPED]
    messages = [e.message for e in log.events]
    assert "cluster launcher: peer failure — terminating all still-running ranks" in messages


def test_signal_death_is_named_as_a_signal() -> None:
    sup, _ = _run(FakeRank(137), FakeRank(None))
    assert sup.run().message == "cluster launcher: rank 0 of h0 exited with signal 9"


def test_later_failures_do_not_replace_the_first() -> None:
    sup, _ = _run(FakeRank(3, polls=1), FakeRank(4, polls=5, stubborn=True))
    assert sup.run().message.endswith("rank 0 of h0 exited with status 3")


def test_a_rank_that_ignores_the_stop_is_killed_then_abandoned() -> None:
    stubborn = FakeRank(None, stubborn=True)
    stubborn.kill = lambda: None  # type: ignore[method-assign]
    sup, log = _run(FakeRank(1), stubborn)
    import fdl_fabric.supervisor as s

    s_force, s_abandon = s.FORCE_MARGIN, s.ABANDON_MARGIN
    s.FORCE_MARGIN, s.ABANDON_MARGIN = 0.01, 0.01
    try:
        result = sup.run()
    finally:
        s.FORCE_MARGIN, s.ABANDON_MARGIN = s_force, s_abandon
    assert stubborn.abandoned and result.ranks[1].state is RankState.LOST
    assert log.of(Kind.WARNING)


def test_interrupt_stops_all_and_exits_128_plus_signal() -> None:
    a, b = FakeRank(None), FakeRank(None)
    sup, _ = _run(a, b)
    sup.request_interrupt(signal.SIGTERM)
    result = sup.run()
    assert a.stopped and b.stopped and result.exit_code == 143
    assert result.verdict is Verdict.INTERRUPTED


def test_second_interrupt_kills_at_once() -> None:
    a = FakeRank(None, stubborn=True)
    sup, _ = _run(a)
    sup.request_interrupt(signal.SIGINT)
    sup.request_kill()
    result = sup.run()
    assert a.killed and result.exit_code == 130


def test_usr1_is_forwarded_to_every_live_rank() -> None:
    a, b = FakeRank(0, polls=3), FakeRank(0, polls=3)
    sup, _ = _run(a, b)
    sup.request_signal("USR1")
    sup.run()
    assert a.signals == ["USR1"] and b.signals == ["USR1"]


def test_an_abort_request_is_a_run_failure_that_stops_everyone() -> None:
    a = FakeRank(None)
    sup, _ = _run(a)
    sup.request_abort("cluster launcher: coordinator could not bind")
    result = sup.run()
    assert a.stopped and result.exit_code == 1
    assert result.message == "cluster launcher: coordinator could not bind"


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


def test_after_formation_a_death_is_tolerated_and_reported() -> None:
    cohort = FormedCohort()
    a, b = FakeRank(9, polls=1), FakeRank(0, polls=3)
    log = EventLog()
    ranks = [SupervisedRank(0, "h", a), SupervisedRank(1, "h", b)]
    sup = Supervisor(ranks, kill_grace=0.05, events=EventBus(log), elastic=cohort,
                     poll_interval=0.001)
    result = sup.run()
    assert cohort.dead == [0] and not b.stopped
    assert result.ranks[0].state is RankState.DEAD_TOLERATED
    assert result.exit_code == 0 and result.message == "degraded 1/2"
    assert "tolerating (elastic membership): reporting rank(s) [0] dead" in \
        log.of(Kind.TOLERATED)[0].message
