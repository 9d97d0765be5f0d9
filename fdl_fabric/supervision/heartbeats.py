"""Heartbeats and silence: when each joined rank was last heard, and who has gone quiet.

Every frame from a joined rank counts as a sign of life; a heartbeat may also carry the
rank's progress (`fdl_fabric.rank.progress`), which the supervisor's hang detection
reads. Once the cohort has formed, a rank heard from for longer than the heartbeat
timeout is declared dead (`Heartbeats.scan`), at most every `SILENCE_SCAN_MAX` seconds
(a twentieth of the timeout when that is less), so detection stays within 5 % of it
while 8,192 ranks are looked at a few times a second rather than on every tick, in one
comprehension that picks the silent (a walk rank by rank took 4 ms). A pause of this
process (Ctrl-Z) was our silence, not the ranks': `Heartbeats.resume` starts every clock
again.

Touched by the coordinator's I/O thread only, but `last_progress`, which the supervisor
reads, is behind a lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any, Optional

from .cohort import DeadRanks, Reason

#: Seconds between two walks over every rank for silence, at most.
SILENCE_SCAN_MAX = 0.5


class Heartbeats:
    """The cohort's clocks: each rank's last frame, its progress, the first hello."""

    def __init__(self) -> None:
        self.last_frame: dict[int, float] = {}
        self.progress: dict[int, int] = {}
        #: When `scan` next walks every rank for silence.
        self.next_scan = 0.0
        self.first_hello: Optional[float] = None
        self.formed_at = 0.0
        self._lock = threading.Lock()
        self._last_progress = 0.0

    @property
    def last_progress(self) -> float:
        """When (monotonic) a joined rank last reported progress; 0 when none ever did."""
        with self._lock:
            return self._last_progress

    def joined(self, rank: int, now: float) -> None:
        self.last_frame[rank] = now
        if self.first_hello is None:
            self.first_hello = now

    def heard(self, rank: int) -> float:
        """A frame from ``rank``: its clock starts again. Returns the time."""
        now = self.last_frame[rank] = time.monotonic()
        return now

    def beat(self, rank: int, message: Mapping[str, Any], now: float) -> None:
        """A heartbeat: a progress that moved is the run's progress too."""
        progress = message.get("progress")
        if isinstance(progress, int) and not isinstance(progress, bool) \
                and progress != self.progress.get(rank, 0):
            self.progress[rank] = progress
            with self._lock:
                self._last_progress = now

    def folded(self, beats: Iterable[tuple[int, float, int]], now: float) -> None:
        """One host's folded beats, ``(rank, age, progress)`` of ranks already checked:
        each rank alive as of its own last frame, a moved progress the run's progress.
        One loop and no call per rank: 8,192 ranks every 3 s, through `beat`, were most
        of the idle coordinator's CPU at 1,024 hosts (issue 35)."""
        last_frame, progress_of = self.last_frame, self.progress
        moved = False
        for rank, age, progress in beats:
            heard = now - age if age > 0.0 else now
            if heard > last_frame.get(rank, 0.0):
                last_frame[rank] = heard
            if progress != progress_of.get(rank, 0):
                progress_of[rank] = progress
                moved = True
        if moved:
            with self._lock:
                self._last_progress = now

    def resume(self, now: float) -> None:
        """This process was stopped: every clock starts again (formation's too, but for
        the second it may already have waited)."""
        for rank in self.last_frame:
            self.last_frame[rank] = now
        if self.first_hello is not None:
            self.first_hello = max(self.first_hello, now - 1.0)

    def formation_overdue(self, now: float, timeout: float) -> bool:
        """Someone joined more than ``timeout`` seconds ago and the cohort is not formed."""
        return self.first_hello is not None and now - self.first_hello > timeout

    def scan(self, now: float, limit: float, exited: set[int],
             dead: DeadRanks) -> list[tuple[int, Reason]]:
        """Ranks silent for more than ``limit`` seconds since the cohort formed, declared
        dead in ``dead`` now, with why; [] when no walk is due (or nobody is silent)."""
        if now < self.next_scan:
            return []
        self.next_scan = now + min(SILENCE_SCAN_MAX, limit / 20)
        cutoff = now - limit
        if self.formed_at >= cutoff:
            return []
        # One pass in a comprehension picks the silent; only they are checked one by one
        # (8,192 ranks walked rank by rank twice a second was most of an idle cohort's CPU).
        quiet = sorted(rank for rank, last in self.last_frame.items() if last < cutoff)
        found: list[tuple[int, Reason]] = []
        for rank in quiet:
            if rank in exited or dead.is_dead(rank):
                continue
            silent = now - max(self.last_frame[rank], self.formed_at)
            if dead.declare_dead(rank):
                found.append((rank, {"silent": round(silent, 3), "heartbeat_timeout": limit}))
        return found
