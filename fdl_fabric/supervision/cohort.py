"""The cohort's membership, as rules and records: who may join, who is dead.

Every rank dials the coordinator and says ``hello``; once every rank 0..W-1 has joined,
the cohort is formed (flodl spec section 5.3). A hello is judged here (`hello_refusal`):
a rank out of range, a dead rank that comes back or a second hello for one rank is
refused with its reason, which goes back to the rank on the wire. A dead rank stays
dead (`DeadRanks`). What a death means for the run is the failure policy's (`policy`);
these records only count. No sockets here, and no clocks.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

#: Why a rank is counted dead (the data of `Name.RANK_DECLARED_DEAD`): the supervisor's
#: ``{"exit": {...}}``, or the coordinator's ``{"silent": s, "heartbeat_timeout": t}``.
Reason = Mapping[str, Any]


@dataclass(frozen=True)
class CoordinatorSpec:
    """What the launcher decides about the coordinator; timeouts arrive already scaled."""

    run_id: str
    salt: bytes
    world_size: int
    bind_host: str
    port: int
    formation_timeout: float = 300.0
    heartbeat_timeout: float = 30.0
    #: A connection that has not sent a valid hello by then is dropped (spec: 10 s, scaled).
    hello_timeout: float = 10.0
    #: Ranks expected on the TCP port (None: the whole world, as for ranks started by
    #: hand); a launch's ranks speak through their agents (0), so the port's bound for
    #: connections before their hello does not grow with the world.
    direct_ranks: Optional[int] = None

    def __post_init__(self) -> None:
        """Invariants, not input checks: the cluster file and the flags validated every
        value with its key or flag named; these guard code that builds a spec by hand."""
        for name, ok, expected in (
            ("run_id", _text(self.run_id), "a non-empty string"),
            ("salt", isinstance(self.salt, bytes) and len(self.salt) == 16, "16 bytes"),
            ("world_size", _whole(self.world_size) and self.world_size >= 1, "an int >= 1"),
            ("bind_host", _text(self.bind_host), "a non-empty address"),
            ("port", _whole(self.port) and 0 <= self.port <= 65535, "in 0..65535"),
            *((t, _positive_seconds(getattr(self, t)), "a positive number of seconds")
              for t in ("formation_timeout", "heartbeat_timeout", "hello_timeout")),
        ):
            if not ok:
                raise ValueError(f"coordinator: {name} must be {expected}, "
                                 f"got {getattr(self, name)!r}")


def _text(value: object) -> bool:
    return isinstance(value, str) and bool(value)


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_seconds(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


class DeadRanks:
    """The dead-rank ledger: one flag per rank, idempotent, safe from any thread.

    Only deaths count here; a rank that exited cleanly is never in it.
    """

    def __init__(self, world_size: int) -> None:
        self._flags = [False] * max(world_size, 0)
        self._count = 0
        self._lock = threading.Lock()

    @property
    def world_size(self) -> int:
        return len(self._flags)

    def declare_dead(self, rank: int) -> bool:
        """Mark ``rank`` dead; True only the first time. Out of range is a no-op."""
        with self._lock:
            if not 0 <= rank < len(self._flags) or self._flags[rank]:
                return False
            self._flags[rank] = True
            self._count += 1
            return True

    def is_dead(self, rank: int) -> bool:
        with self._lock:
            return 0 <= rank < len(self._flags) and self._flags[rank]

    def dead_count(self) -> int:
        with self._lock:
            return self._count

    def ranks(self) -> list[int]:
        """The dead ranks, in order (nothing to walk while nobody died: every rank's
        welcome carries this list)."""
        with self._lock:
            if not self._count:
                return []
            return [r for r, dead in enumerate(self._flags) if dead]


def hello_refusal(message: Mapping[str, Any], world_size: int, dead: DeadRanks,
                  joined: set[int], aborting: bool) -> Optional[str]:
    """Why a hello is refused (its reason goes back to the peer), or None when the rank
    joins. ``aborting``: the cohort did not form in time, nobody joins any more."""
    rank, host, pid = message.get("rank"), message.get("host"), message.get("pid")
    if isinstance(rank, bool) or not isinstance(rank, int):
        return f"rank must be an integer, got {rank!r}"
    if not isinstance(host, str) or not host:
        return f"host must be a non-empty string, got {host!r}"
    if isinstance(pid, bool) or not isinstance(pid, int):
        return f"pid must be an integer, got {pid!r}"
    if not 0 <= rank < world_size:
        return f"rank {rank} is out of range 0..{world_size - 1} (world size {world_size})"
    if dead.is_dead(rank):
        return f"rank {rank} was declared dead"
    if rank in joined:
        return f"rank {rank} already joined"
    if aborting:
        return "the cohort did not form in time; the run is being aborted"
    return None
