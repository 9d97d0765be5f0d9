"""Rank output, from the agents' sessions to the console and ``--log-dir``.

Called on each session's reading thread (`sessions.AgentSession.on_output`), never on
the supervisor's: the log gets every byte first, then the console, which may make this
one reader wait while the terminal is slow (`screen`). The supervisor learns only that
output came (its rank's last line, the time, for the live table and hang detection).

Each rank's last stderr lines are kept here too (`supervision.tail`), before any sink
sees the chunk, so the root cause can quote them whatever the console shows
(``--quiet``, a stalled terminal) and whether or not there is a ``--log-dir``.

Every chunk is checked against its sender first: only output a host's agent (or a
gateway's relay, for its leaf) sends for a rank that host runs in this attempt goes on.
A chunk for another host's rank, or for a rank number outside the plan, reaches no sink:
no console line under another rank's label, no line in another rank's ``stdout.log``, no
log folder for a rank that does not exist. The supervisor, which gets the same report,
counts it (`rankevents`), so it is said once, not twice.

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
        #: This attempt's ranks (each one's host and label) and the stderr tails kept so
        #: far, as one pair that a restart replaces whole (the reading threads see the
        #: old one or the new one). A tail is made at its rank's first stderr chunk: a
        #: plan of 8,192 ranks made 8,192 empty ones before the first spawn (issue 35).
        self._now: tuple[dict[int, tuple[str, str]], dict[int, RankTail]] = ({}, {})

    def attempt(self, plan: LaunchPlan) -> None:
        """The hosts and labels of this attempt's ranks (a restart may number them
        differently); the stderr tails start afresh. Until the first attempt's plan, no
        rank is anyone's: no output goes on."""
        self._now = ({r.rank: (r.host, r.label) for r in plan.ranks}, {})

    def runs(self, host: str, rank: int) -> bool:
        """Whether ``host`` runs ``rank`` in this attempt: the only output it may send."""
        of = self._now[0].get(rank)
        return of is not None and of[0] == host

    def tail(self, rank: int) -> list[str]:
        """The last stderr lines of ``rank`` in this attempt, made inert; [] if none."""
        kept = self._now[1].get(rank)
        return kept.lines() if kept is not None else []

    def __call__(self, report: reports.Output) -> None:
        ranks, tails = self._now
        of = ranks.get(report.rank)
        if of is None or of[0] != report.host:
            return  # forged or misrouted: dropped here, counted by the supervisor
        label = of[1]
        if report.stderr:
            kept = tails.get(report.rank)
            if kept is None:  # setdefault: one tail even if two threads get here at once
                kept = tails.setdefault(report.rank, RankTail())
            kept.feed(report.data, report.partial)
        text = report.data.decode("utf-8", "replace")
        body = text[:-1] if text.endswith("\n") else text
        self.events(Name.RANK_OUTPUT, host=report.host, rank=report.rank, label=label,
                    text=body, raw=report.data, stderr=report.stderr, partial=report.partial)
