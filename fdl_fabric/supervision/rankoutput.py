"""Rank output, from the agents' sessions to the console and ``--log-dir``.

Called on each session's reading thread (`sessions.AgentSession.on_output`), never on
the supervisor's: the log gets every byte first, then the console, which may make this
one reader wait while the terminal is slow (`screen`). The supervisor learns only that
output came (its rank's last line, the time, for the live table and hang detection).

Each rank's last stderr lines are kept here too (`supervision.tail`), before any sink
sees the chunk, so the root cause can quote them whatever the console shows
(``--quiet``, a stalled terminal) and whether or not there is a ``--log-dir``.

It renders nothing (the console and the run log turn the events into words and files),
so it is supervision's, next to the tails it keeps.
"""

from __future__ import annotations

from .. import reports
from ..events import EventBus, Name
from ..planning.plan import LaunchPlan
from .tail import RankTail


class RankOutput:
    """Turns `reports.Output` chunks into ``OUTPUT`` events labelled ``host:device:rN``,
    and keeps each rank's last stderr lines of the current attempt (`tail`)."""

    def __init__(self, events: EventBus) -> None:
        self.events = events
        self._labels: dict[int, str] = {}
        self._tails: dict[int, RankTail] = {}

    def attempt(self, plan: LaunchPlan) -> None:
        """The labels of this attempt's ranks (a restart may number them differently);
        the stderr tails start afresh, one per rank of the plan."""
        self._labels = {r.rank: r.label for r in plan.ranks}
        self._tails = {r.rank: RankTail() for r in plan.ranks}

    def tail(self, rank: int) -> list[str]:
        """The last stderr lines of ``rank`` in this attempt, made inert; [] if none."""
        kept = self._tails.get(rank)
        return kept.lines() if kept is not None else []

    def __call__(self, report: reports.Output) -> None:
        if report.stderr:
            kept = self._tails.get(report.rank)
            if kept is not None:
                kept.feed(report.data, report.partial)
        label = self._labels.get(report.rank, f"{report.host}:?:r{report.rank}")
        text = report.data.decode("utf-8", "replace")
        body = text[:-1] if text.endswith("\n") else text
        self.events(Name.RANK_OUTPUT, host=report.host, rank=report.rank, label=label,
                    text=body, raw=report.data, stderr=report.stderr, partial=report.partial)
