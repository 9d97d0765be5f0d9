"""Issue 34, item 5, at the supervisor's level: a verdict names what really happened.

A launcher stopped for longer than the agents' lease (SIGSTOP, a laptop lid closed)
finds, when it runs again, that every agent stopped its ranks on its own. That is the
verdict (``launcher_suspended``), not the first rank whose SIGTERM it reads, and the
ranks are recorded as stopped by their lease. The same through a real launcher and
sshd hosts: tests/test_verdicts_named_lab.py.
"""

from __future__ import annotations

import time

import pytest
from test_supervisor import PausingInbox, supervise_live

import fdl_fabric.supervision.timing as timing
from fdl_fabric import reports
from fdl_fabric.events import Name
from fdl_fabric.presentation.words import cause_cell, render
from fdl_fabric.states import RankState
from fdl_fabric.supervision.verdict import Verdict


@pytest.fixture(autouse=True)
def short_pause_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timing, "PAUSE_GAP", 0.1)


def paused_run(pause: float, lease: float, on_resume: object = None):  # type: ignore[no-untyped-def]
    """Two hosts, a rank each, running until stopped; the launcher pauses ``pause``
    seconds once both run."""
    inbox = PausingInbox()
    sup, (h0, h1), log = supervise_live({0: None}, {1: None}, inbox=inbox, lease=lease,
                                        on_resume=on_resume)
    start = h1.start_ranks
    h1.start_ranks = lambda: (start(), setattr(inbox, "pause", pause))  # type: ignore[method-assign]
    return sup, (h0, h1), log


def test_a_launcher_stopped_longer_than_the_lease_is_the_verdict_and_no_rank_is_blamed() -> None:
    sup, (h0, h1), log = paused_run(pause=0.6, lease=0.3)
    result = sup.run()
    assert result.verdict is Verdict.FAILED and result.exit_code == 1
    assert result.cause.name is Name.LAUNCHER_SUSPENDED
    assert result.cause.data["lease"] == 0.3 and result.cause.data["suspended"] >= 0.6
    assert result.root_cause is None, "no rank did it"
    assert not log.named(Name.RANK_FAILED)
    assert [r.state for r in result.ranks] == [RankState.STOPPED, RankState.STOPPED]
    assert [cause_cell(r.summary()) for r in result.ranks] == ["stopped by its agent's lease"] * 2
    words = render(result.cause)
    assert "the launcher was suspended for 0.6 s, longer than the agents' lease (0.3 s): " \
        "every host stopped its ranks" in words, words


def test_a_pause_shorter_than_the_lease_blames_nobody_and_ends_nothing() -> None:
    sup, (h0, h1), log = paused_run(pause=0.3, lease=5.0,
                                    on_resume=lambda: sup.request_interrupt(15))
    result = sup.run()
    assert result.verdict is Verdict.INTERRUPTED, "the run went on until the TERM"
    assert not log.named(Name.LAUNCHER_SUSPENDED)


def test_an_agents_lease_running_out_after_a_pause_within_a_ping_of_it_is_the_suspension() -> None:
    """An agent counts its lease from the last ping it heard, up to a ping interval
    before the launcher stopped: its word settles a pause just under the lease."""
    holder: list = []

    def agent_says_lease_ran_out() -> None:
        holder[0].post(reports.AgentError("h0", "no word from the launcher for 0.4s",
                                          lease_ran_out=True))

    sup, (h0, h1), log = paused_run(pause=0.3, lease=0.4, on_resume=agent_says_lease_ran_out)
    holder.append(h0)
    result = sup.run()
    assert result.cause.name is Name.LAUNCHER_SUSPENDED, result.cause
    assert result.root_cause is None


def test_an_agents_lease_running_out_with_no_pause_is_not_called_a_suspension() -> None:
    """A link that stalled longer than the lease, while the launcher ran: the agent's
    line says so, and the launcher does not claim it was suspended."""
    sup, (h0, h1), log = supervise_live({0: None}, {1: None}, lease=0.3)
    start = h0.start_ranks

    def lease_runs_out() -> None:
        start()
        h0.post(reports.AgentError("h0", "no word from the launcher", lease_ran_out=True))
        h0.post(reports.Exited("h0", 0, None, 15))
    h0.start_ranks = lease_runs_out  # type: ignore[method-assign]
    result = sup.run()
    assert result.cause.name is not Name.LAUNCHER_SUSPENDED
    assert log.named(Name.AGENT_WARNING)


def test_the_pause_is_measured_on_the_clock_that_counts_a_suspended_machine() -> None:
    assert hasattr(time, "CLOCK_BOOTTIME"), "Linux has it; the fallback is monotonic"
    assert abs(timing.boottime() - time.clock_gettime(time.CLOCK_BOOTTIME)) < 0.1


def killed_agent_run(cohort: object = None, rank2: object = None):  # type: ignore[no-untyped-def]
    """h0's agent is SIGKILLed (by one of its ranks, or anyone) once both hosts run."""
    sup, (h0, h1), log = supervise_live({0: None, 1: None}, {2: rank2}, cohort=cohort)
    start = h1.start_ranks

    def agent_killed() -> None:
        start()
        h0.gone = True
        h0.running.clear()
        h0.post(reports.AgentGone("h0", False, "the agent was killed by signal 9",
                                  killed_by=9))
    h1.start_ranks = agent_killed  # type: ignore[method-assign]
    return sup, log


def test_an_agent_killed_by_a_signal_is_the_verdict_and_none_of_its_ranks_is_blamed() -> None:
    sup, log = killed_agent_run()
    result = sup.run()
    assert result.verdict is Verdict.FAILED and result.cause.name is Name.AGENT_KILLED
    assert result.root_cause is None, "neither rank 0 nor rank 1 is known to have done it"
    assert not log.named(Name.RANK_FAILED)
    assert [r.state for r in result.ranks] == [RankState.LOST, RankState.LOST,
                                               RankState.STOPPED]
    assert render(result.cause).endswith(
        "the agent of h0 was killed by signal 9 (sender unknown): ranks 0, 1 were "
        "lost with it, and what they wrote after its last frame is lost too")


def test_after_formation_the_ranks_of_a_killed_agent_are_tolerated_and_nobody_is_blamed(
        ) -> None:
    from test_supervisor import FormedCohort

    sup, log = killed_agent_run(cohort=FormedCohort(), rank2=(0, None))
    result = sup.run()
    assert result.verdict is Verdict.DEGRADED, result.cause
    assert result.root_cause is None
    assert len(log.named(Name.RANK_TOLERATED)) == 2
