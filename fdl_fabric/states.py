"""The life of one rank, as a word every layer shares.

The supervisor writes a rank's state; the live table, the summary and a run's record read
it. It is vocabulary (it imports nothing of ours), so presentation and runs can name a
state without importing supervision.
"""

from __future__ import annotations

from enum import Enum


class RankState(str, Enum):
    """Life of one rank: PENDING -> RUNNING -> JOINED -> one terminal state."""

    PENDING = "pending"
    RUNNING = "running"
    JOINED = "joined"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    LOST = "lost"
    TOLERATED = "tolerated"
    NOT_STARTED = "not started"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({RankState.SUCCEEDED, RankState.FAILED, RankState.STOPPED,
                       RankState.LOST, RankState.TOLERATED, RankState.NOT_STARTED})


#: A rank's ``stopped_by`` when its agent stopped it because the launcher was silent for
#: longer than the lease (the launcher was suspended): not a failure, not a forward.
STOPPED_BY_LEASE = "lease"
