"""The failure policy: what a death, a lost host or a hang means for the run; the verdict.

The supervisor owns the rank records and acts; the policy only decides. Three policies,
each one small class:

* `KillAll`: before the cohort forms (or for a program that never joins it), the first
  failure stops every rank: a half-formed collective hangs in connect-retry.
* `Elastic`: after the cohort forms, a death is a membership event; the run carries on
  until ``max_failure`` ranks are dead (or every rank is), then survivors are told to
  save and stop. Before formation it is `KillAll`.
* `Restarts`: after a failed attempt, whether another one starts (torchrun's
  ``--max-restarts``).

A new policy (tolerate the loss of whole hosts, restart on hangs) is one class with
these methods. The coordinator keeps membership and sockets only; the count of dead
ranks and the verdict are here.
"""

from __future__ import annotations

import math
from enum import Enum
from fractions import Fraction
from typing import Optional, Protocol, Union

from ..events import Event, Name, event
from .verdict import Verdict

MaxFailure = Union[int, float, None]


class Decision(str, Enum):
    """What the supervisor does about a failure."""

    #: Stop every rank: the run failed.
    STOP_ALL = "stop all"
    #: The run goes on without this rank.
    TOLERATE = "tolerate"
    #: Tolerated, but the run can no longer continue: survivors save and stop.
    SHUTDOWN = "shutdown"


def max_failure_limit(max_failure: MaxFailure, world_size: int) -> Optional[int]:
    """How many dead ranks breach ``max_failure`` (spec section 5.5); None means no limit.

    An int is absolute and may exceed the world size. A float is a fraction, clamped to
    [0, 1], of the world size, rounded up. The fraction is taken as the decimal it was
    written as (``repr``, then `Fraction`), so 0.7 of 10 is 7, not the 8 that
    ``ceil(0.7 * 10.0)`` gives, and 0.2 of 10 is 2.
    """
    if max_failure is None:
        return None
    if isinstance(max_failure, bool):
        raise TypeError("max_failure must be an int, a float or None, not a bool")
    if isinstance(max_failure, int):
        return max_failure
    if math.isnan(max_failure):
        raise ValueError("max_failure must not be NaN")
    world = max(world_size, 0)
    if max_failure <= 0:
        return 0
    if max_failure >= 1:
        return world
    return math.ceil(Fraction(repr(float(max_failure))) * world)


def _check_max_failure(max_failure: object) -> None:
    """The cluster file and the flags refuse bad values with the key named; this guards
    code that builds a policy by hand."""
    if max_failure is None:
        return
    if isinstance(max_failure, bool) or not isinstance(max_failure, (int, float)):
        raise ValueError(f"max_failure must be an int, a float or None, got {max_failure!r}")
    if isinstance(max_failure, float) and math.isnan(max_failure):
        raise ValueError("max_failure must not be NaN")
    if isinstance(max_failure, int) and max_failure < 0:
        raise ValueError(f"max_failure must be >= 0, got {max_failure}")


class FailurePolicy(Protocol):
    """What the supervisor asks; see the module docstring."""

    def on_death(self, rank: int, *, formed: bool, announced: bool) -> Decision:
        """A rank died (or was declared dead) while the run was not being stopped.
        ``formed``: the cohort had formed; ``announced``: the rank had said it was
        exiting cleanly (a death in the teardown window, never counted)."""

    def shutdown_reason(self) -> Optional[Event]:
        """Why survivors must save and stop, once a decision said `SHUTDOWN`."""

    def on_hang(self) -> Decision:
        """No rank wrote a line or reported progress for ``hang_timeout``."""

    def verdict(self, world_size: int, tolerated: int) -> tuple[Verdict, Event]:
        """The verdict of a run that ended with no failure and no interruption, and
        why (an event whose words are the verdict line)."""


class KillAll:
    """The first failure stops every rank; a run with none succeeded."""

    def on_death(self, rank: int, *, formed: bool, announced: bool) -> Decision:
        return Decision.STOP_ALL

    def shutdown_reason(self) -> Optional[Event]:
        return None

    def on_hang(self) -> Decision:
        return Decision.STOP_ALL

    def verdict(self, world_size: int, tolerated: int) -> tuple[Verdict, Event]:
        return Verdict.OK, event(Name.COMPLETED, world_size=world_size)


class Elastic(KillAll):
    """Kill-all before the cohort forms; after it, tolerance up to ``max_failure``."""

    def __init__(self, world_size: int, max_failure: MaxFailure = None) -> None:
        _check_max_failure(max_failure)
        self.world_size = world_size
        self.max_failure = max_failure
        self.limit = max_failure_limit(max_failure, world_size)
        #: Ranks dead after formation: the one count the verdict is made from.
        self.dead: set[int] = set()
        self._shutdown: Optional[Event] = None

    def on_death(self, rank: int, *, formed: bool, announced: bool) -> Decision:
        if not formed:
            return Decision.STOP_ALL
        if not announced:
            self.dead.add(rank)
        dead, world = len(self.dead), self.world_size
        if self._shutdown is None:
            if self.limit is not None and dead >= self.limit and dead > 0:
                self._shutdown = event(Name.MAX_FAILURE_REACHED, dead=dead, world_size=world,
                                       limit=self.limit)
            elif dead >= world:
                self._shutdown = event(Name.ALL_RANKS_DEAD, dead=dead, world_size=world)
            if self._shutdown is not None:
                return Decision.SHUTDOWN
        return Decision.TOLERATE

    def shutdown_reason(self) -> Optional[Event]:
        return self._shutdown

    def verdict(self, world_size: int, tolerated: int) -> tuple[Verdict, Event]:
        """The end-of-run verdict (spec section 5.6; the words are in `words`)."""
        dead, w = len(self.dead), world_size
        if dead >= w:
            return Verdict.FAILED, event(Name.EVERY_RANK_LOST, dead=dead, world_size=w)
        # `dead > 0`: a limit of 0 means "any death trips it", not "a clean run fails".
        if self.limit is not None and dead > 0 and dead >= self.limit:
            return Verdict.FAILED, event(Name.MAX_FAILURE_EXCEEDED, dead=dead, world_size=w,
                                         limit=self.limit)
        if dead > 0:
            return Verdict.DEGRADED, event(Name.DEGRADED, dead=dead, world_size=w)
        if tolerated > 0:
            return Verdict.OK, event(Name.COMPLETED_TEARDOWN, tolerated=tolerated, world_size=w)
        return super().verdict(world_size, tolerated)


class Restarts:
    """torchrun's ``--max-restarts``: another attempt after a failed or hung one whose
    ranks had started, up to ``max_restarts`` times; never after an interruption."""

    def __init__(self, max_restarts: int) -> None:
        self.max_restarts = max_restarts

    def another(self, restartable: bool, attempt: int, interrupted: bool) -> bool:
        return restartable and not interrupted and attempt < self.max_restarts
