"""What a launch gives back as data: `LaunchResult`, its `Attempt` s and `RankOutcome` s.

Kept apart from `fdl_fabric.api`, which makes them, so that `fdl_fabric.handle` (a
detached run's result, read from its record) shares the types without importing the API.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class RankOutcome:
    """How one rank of the last attempt ended."""

    rank: int
    host: str
    #: ``succeeded``, ``failed``, ``stopped``, ``lost``, ``tolerated``, ``not started``.
    state: str
    exit_code: Optional[int]
    signal: Optional[int]
    #: Why no exit status came (its host was lost or stopped answering), else None.
    lost: Optional[str]
    duration: float


@dataclass(frozen=True)
class Attempt:
    """One attempt of the launch (``--max-restarts`` makes several)."""

    verdict: str
    exit_code: int
    #: The attempt's verdict in words (what ended it).
    message: str
    hosts: tuple[str, ...]


@dataclass(frozen=True)
class LaunchResult:
    """The outcome of a launch: what the command line's last line and exit code say, as
    data."""

    #: ``ok``, ``degraded``, ``failed``, ``hung`` or ``interrupted``; ``dry-run`` when
    #: ``dry_run`` asked for the plan only (``on_event`` sees it as the ``dry_run`` event).
    verdict: str
    #: What ``inv launch`` would exit with (0 ok or degraded, 1 failed, 128 + signal).
    exit_code: int
    #: The verdict line.
    message: str
    run_id: Optional[str]
    #: The ranks of the last attempt that started any.
    ranks: tuple[RankOutcome, ...]
    attempts: tuple[Attempt, ...]
    #: The first rank that failed, when one did.
    root_cause: Optional[RankOutcome]

    @property
    def ok(self) -> bool:
        return self.exit_code == 0
