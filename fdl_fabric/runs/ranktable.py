"""The live table of a run that is followed from its record (``attach`` on a terminal).

The launcher's own table reads its supervisor's rank records; a follower has only the
record, so it rebuilds the same rows from what the record holds: each rank's start, pid
and end from events.jsonl (the events the supervisor emitted as they happened), and its
last line from console.log. A restart starts the rows afresh, as the launcher's table
does. The rows are what `presentation.output.status_table` draws.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from ..events import Name
from ..states import RankState

#: A rank's line in console.log: ``[host:device:rN] text`` (a host may hold colons).
RANK_LINE = re.compile(rb"\[(?P<host>.*):(?P<device>[^:\]]*):r(?P<rank>[0-9]+)\] ")


def _exited(d: Mapping[str, Any]) -> RankState:
    if d.get("ok"):
        return RankState.SUCCEEDED
    return RankState.STOPPED if d.get("stopped") else RankState.LOST


def _failed(d: Mapping[str, Any]) -> RankState:
    return RankState.LOST if (d.get("exit") or {}).get("lost") else RankState.FAILED


#: How each event that ends a rank names its end (one table, as the supervisor's).
_ENDS: dict[str, Callable[[Mapping[str, Any]], RankState]] = {
    Name.RANK_EXITED.value: _exited,
    Name.RANK_FAILED.value: _failed,
    Name.RANK_TOLERATED.value: lambda d: RankState.TOLERATED,
    Name.RANK_DEAD_STOPPED.value: lambda d: RankState.TOLERATED,
    Name.RANK_FORWARD_STOPPED.value: lambda d: RankState.STOPPED,
}


@dataclass
class RankRow:
    """One rank as the record tells it (what the live table shows of a `Rank`)."""

    host: str
    rank: int
    device_name: str
    pid: Optional[int] = None
    state: RankState = RankState.RUNNING
    started: float = 0.0
    ended: Optional[float] = None
    last_line: str = ""

    @property
    def duration(self) -> float:
        return max(0.0, (self.ended or time.time()) - self.started)


class RankTable:
    """The rows, fed from two readers' threads (`see` events, `line` console lines)."""

    def __init__(self) -> None:
        self._rows: dict[int, RankRow] = {}
        self._lock = threading.Lock()

    def see(self, record: Mapping[str, Any]) -> None:
        """One record of events.jsonl."""
        name, rank, data = record.get("name"), record.get("rank"), record.get("data") or {}
        with self._lock:
            if name == Name.RESTARTING.value:
                self._rows.clear()
            elif name == Name.RANK_STARTED.value and isinstance(rank, int):
                label = str(data.get("label") or "")
                device = label.rsplit(":", 2)[1] if label.count(":") >= 2 else "cpu"
                self._rows[rank] = RankRow(str(record.get("host")), rank, device,
                                           data.get("pid"), RankState.RUNNING,
                                           float(record.get("time") or time.time()))
            elif name == Name.RANK_JOINED.value and rank in self._rows:
                self._rows[rank].state = RankState.JOINED
            elif name in _ENDS and rank in self._rows:
                row = self._rows[rank]
                row.state = _ENDS[name](data)
                row.ended = float(record.get("time") or time.time())

    def line(self, line: bytes) -> None:
        """One line of console.log: a rank's line becomes its last line."""
        found = RANK_LINE.match(line)
        if found is None:
            return
        with self._lock:
            row = self._rows.get(int(found.group("rank")))
            if row is not None:
                row.last_line = line[found.end():].decode("utf-8", "replace").rstrip("\n")

    def rows(self) -> list[RankRow]:
        with self._lock:
            return [self._rows[r] for r in sorted(self._rows)]


__all__ = ["RANK_LINE", "RankRow", "RankTable"]
