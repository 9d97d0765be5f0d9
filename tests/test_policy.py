"""The failure policy: what a death or a hang means, ``max_failure``'s arithmetic, the verdict.

Pure: no sockets, no processes. The supervisor tests (test_supervisor.py) check that the
supervisor does what the policy decides; the lab tests check the same end to end.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fdl_fabric.events import Event, Name, event
from fdl_fabric.supervision.policy import (
    Decision,
    Elastic,
    KillAll,
    Restarts,
    max_failure_limit,
)
from fdl_fabric.supervision.verdict import Verdict


# -- max_failure arithmetic -------------------------------------------------------------------
@pytest.mark.parametrize(("max_failure", "world_size", "limit"), [
    (0.2, 10, 2), (0.2, 11, 3), (0.2, 5, 1), (0.2, 3, 1), (0.0, 10, 0), (1.0, 7, 7),
    (2.5, 4, 4), (-0.3, 4, 0), (0.25, 8, 2), (0.5, 0, 0), (3, 4, 3), (9, 4, 9), (None, 4, None),
])
def test_max_failure_limit_follows_the_spec_table(
        max_failure: Any, world_size: int, limit: Optional[int]) -> None:
    assert max_failure_limit(max_failure, world_size) == limit


def test_percent_limit_is_exact_for_round_percentages() -> None:
    # ceil(0.7 * 10.0) is 8 in floating point; 70% of 10 ranks is 7.
    assert max_failure_limit(0.7, 10) == 7
    assert max_failure_limit(0.3, 10) == 3


@given(st.floats(allow_nan=False), st.integers(min_value=0, max_value=10_000))
def test_percent_limit_stays_within_zero_and_world_size(p: float, world_size: int) -> None:
    limit = max_failure_limit(p, world_size)
    assert limit is not None and 0 <= limit <= world_size
    if 0 < p <= 1 and world_size > 0:
        assert limit >= 1 and limit == math.ceil(limit)


@pytest.mark.parametrize(("value", "words"), [
    (-1, "max_failure must be >= 0"),
    ("25%", "max_failure must be an int"),
    (True, "max_failure must be an int"),
    (float("nan"), "must not be NaN"),
])
def test_a_policy_built_by_hand_refuses_a_bad_max_failure(value: Any, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        Elastic(4, value)


# -- decisions --------------------------------------------------------------------------------
def test_kill_all_stops_everything_at_the_first_failure() -> None:
    policy = KillAll()
    assert policy.on_death(0, formed=True, announced=False) is Decision.STOP_ALL
    assert policy.on_hang() is Decision.STOP_ALL
    assert policy.shutdown_reason() is None


def test_before_the_cohort_forms_elastic_is_kill_all() -> None:
    policy = Elastic(4, 3)
    assert policy.on_death(1, formed=False, announced=False) is Decision.STOP_ALL
    assert policy.dead == set()


def test_after_formation_deaths_are_tolerated_until_max_failure() -> None:
    policy = Elastic(4, 0.5)
    assert policy.on_death(1, formed=True, announced=False) is Decision.TOLERATE
    assert policy.shutdown_reason() is None
    assert policy.on_death(3, formed=True, announced=False) is Decision.SHUTDOWN
    reached = event(Name.MAX_FAILURE_REACHED, dead=2, world_size=4, limit=2)
    assert policy.shutdown_reason() == reached
    # The shutdown was decided once; later deaths are counted, not decided again.
    assert policy.on_death(2, formed=True, announced=False) is Decision.TOLERATE
    assert policy.dead == {1, 2, 3}
    assert policy.shutdown_reason() == reached


def test_a_rank_counted_twice_is_one_death() -> None:
    policy = Elastic(4, 2)
    policy.on_death(1, formed=True, announced=False)
    assert policy.on_death(1, formed=True, announced=False) is Decision.TOLERATE
    assert policy.dead == {1}


def test_losing_every_rank_without_max_failure_is_a_shutdown() -> None:
    policy = Elastic(2)
    assert policy.on_death(0, formed=True, announced=False) is Decision.TOLERATE
    assert policy.on_death(1, formed=True, announced=False) is Decision.SHUTDOWN
    assert policy.shutdown_reason() == event(Name.ALL_RANKS_DEAD, dead=2, world_size=2)
    assert policy.verdict(2, 2)[0] is Verdict.FAILED


def test_a_rank_that_announced_its_exit_is_never_counted_dead() -> None:
    policy = Elastic(2, 1)
    assert policy.on_death(1, formed=True, announced=True) is Decision.TOLERATE
    assert policy.dead == set()
    assert policy.verdict(2, 1)[0] is Verdict.OK


def test_a_max_failure_of_zero_fails_at_the_first_death_only() -> None:
    policy = Elastic(4, 0.0)
    assert policy.verdict(4, 0)[0] is Verdict.OK
    assert policy.on_death(2, formed=True, announced=False) is Decision.SHUTDOWN


# -- verdicts ---------------------------------------------------------------------------------
def _ended(world_size: int, max_failure: Any = None, dead: tuple[int, ...] = ()) -> Elastic:
    policy = Elastic(world_size, max_failure)
    for rank in dead:
        policy.on_death(rank, formed=True, announced=False)
    return policy


@pytest.mark.parametrize(("policy", "tolerated", "verdict", "cause"), [
    (_ended(3, dead=(0, 1, 2)), 3, Verdict.FAILED,
     event(Name.EVERY_RANK_LOST, dead=3, world_size=3)),
    (_ended(4, 2, dead=(0, 3)), 2, Verdict.FAILED,
     event(Name.MAX_FAILURE_EXCEEDED, dead=2, world_size=4, limit=2)),
    (_ended(10, 0.2, dead=(4, 5)), 2, Verdict.FAILED,
     event(Name.MAX_FAILURE_EXCEEDED, dead=2, world_size=10, limit=2)),
    (_ended(4, 3, dead=(1, 2)), 2, Verdict.DEGRADED, event(Name.DEGRADED, dead=2, world_size=4)),
    (_ended(4, dead=(1,)), 1, Verdict.DEGRADED, event(Name.DEGRADED, dead=1, world_size=4)),
    (_ended(4), 2, Verdict.OK, event(Name.COMPLETED_TEARDOWN, tolerated=2, world_size=4)),
    (_ended(4), 0, Verdict.OK, event(Name.COMPLETED, world_size=4)),
    (_ended(4, 0.0), 0, Verdict.OK, event(Name.COMPLETED, world_size=4)),
], ids=["all-lost", "absolute", "percent", "degraded", "degraded-no-limit", "teardown", "ok",
        "zero-limit-no-deaths"])
def test_the_verdict_follows_the_dead_count_and_the_limit(
        policy: Elastic, tolerated: int, verdict: Verdict, cause: Event) -> None:
    assert policy.verdict(policy.world_size, tolerated) == (verdict, cause)


# -- restarts ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("restartable", "attempt", "interrupted", "again"), [
    (True, 0, False, True), (True, 2, False, False), (False, 0, False, False),
    (True, 0, True, False),
])
def test_another_attempt_only_after_a_restartable_failure_within_the_budget(
        restartable: bool, attempt: int, interrupted: bool, again: bool) -> None:
    assert Restarts(2).another(restartable, attempt, interrupted) is again
