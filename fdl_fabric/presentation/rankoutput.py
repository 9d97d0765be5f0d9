"""Rank output, from the agents' sessions to the console and ``--log-dir``.

Called on each session's reading thread (`sessions.AgentSession.on_output`), never on
the supervisor's: the log gets every byte first, then the console, which may make this
one reader wait while the terminal is slow (`screen`). The supervisor learns only that
output came (its rank's last line, the time, for the live table and hang detection).
"""

from __future__ import annotations

from ..events import EventBus, Name
from ..planning.plan import LaunchPlan
from ..supervision import reports


class RankOutput:
    """Turns `reports.Output` chunks into ``OUTPUT`` events labelled ``host:device:rN``."""

    def __init__(self, events: EventBus) -> None:
        self.events = events
        self._labels: dict[int, str] = {}

    def attempt(self, plan: LaunchPlan) -> None:
        """The labels of this attempt's ranks (a restart may number them differently)."""
        self._labels = {r.rank: r.label for r in plan.ranks}

    def __call__(self, report: reports.Output) -> None:
        label = self._labels.get(report.rank, f"{report.host}:?:r{report.rank}")
        text = report.data.decode("utf-8", "replace")
        body = text[:-1] if text.endswith("\n") else text
        self.events(Name.RANK_OUTPUT, host=report.host, rank=report.rank, label=label,
                    text=body, raw=report.data, stderr=report.stderr, partial=report.partial)
