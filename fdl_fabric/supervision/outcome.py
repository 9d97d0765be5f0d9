"""The verdict: one `RunResult` from what the records say once every host is gone.

An interruption is the verdict whatever else happened (a cleanup's, ``fdl-fabric
stop``'s, a signal's, or a forwarded signal that ended a rank); then a failure (hung or
failed); else the policy's verdict on a run that ended with no failure (ok, degraded,
or failed when too many ranks were lost). The cause is an event, as data: its words
(`presentation.words.render`) are the last line, made where the line is printed.
"""

from __future__ import annotations

import dataclasses
import signal
from typing import Optional

from ..events import Name, event
from ..states import RankState
from .policy import Decision
from .records import RunResult
from .state import SupervisorState
from .verdict import Verdict


class Outcome(SupervisorState):
    """How the run ended, from its records."""

    def _count_uncounted(self) -> None:
        """Every death counts in the verdict: a rank lost while it was being stopped (a
        save-and-shutdown whose host then went away) or ended by the last drain never
        went through the policy; it does now, so no run with a lost rank ends "full
        workload delivered". A rank that announced a clean exit first is not a death."""
        announced = self.cohort.exited if self.cohort is not None else set()
        for r in self.ranks:
            if r.state not in (RankState.LOST, RankState.FAILED) or r.rank in self.counted \
                    or r.rank in announced:
                continue
            if self.root_cause is None:
                self.root_cause = r
            if self._decide(r.rank) is Decision.STOP_ALL and self.failure is None:
                self.failure = event(Name.RANK_FAILED, host=r.host, rank=r.rank,
                                     exit=r.exit.data if r.exit else {}, ok=False)

    def _result(self) -> RunResult:
        result = self._verdict()
        faults = {name: h.fault for name, h in self.hosts.items() if h.fault}
        return dataclasses.replace(result, faults=faults) if faults else result

    def _verdict(self) -> RunResult:
        interrupted = self._interrupted()
        if interrupted is not None:
            return interrupted
        ranks = tuple(self.ranks)
        if self.failure is None:
            self._count_uncounted()
        if self.failure is not None:
            verdict = Verdict.HUNG if self.failure is self._hung else Verdict.FAILED
            return RunResult(verdict, 1, self.failure, ranks, self.root_cause)
        verdict, cause = self.policy.verdict(len(ranks), self.tolerated)
        return RunResult(verdict, 0 if verdict in (Verdict.OK, Verdict.DEGRADED) else 1,
                         cause, ranks, self.root_cause)

    def _interrupted(self) -> Optional[RunResult]:
        """The verdict of an interrupted run (exit code 128 + the signal), else None."""
        ranks = tuple(self.ranks)
        if self._interrupt is not None:
            code = 128 + self._interrupt
            name = signal.Signals(self._interrupt).name
            if self._stopped_by is not None:
                return RunResult(Verdict.INTERRUPTED, code,
                                 event(Name.STOPPED_BY_CLEANUP, host=self._interrupted_on,
                                       by=dict(self._stopped_by)), ranks)
            if self._stopped_by_command is not None:
                return RunResult(Verdict.INTERRUPTED, code,
                                 event(Name.STOPPED_BY_COMMAND,
                                       by=dict(self._stopped_by_command)), ranks)
            return RunResult(Verdict.INTERRUPTED, code,
                             event(Name.INTERRUPTED, host=self._interrupted_on, signal=name),
                             ranks)
        if self._stopped_by_forward is not None and self.failure is None:
            signum, rank = self._stopped_by_forward
            return RunResult(Verdict.INTERRUPTED, 128 + signum,
                             event(Name.INTERRUPTED_BY_FORWARD, host=rank.host, rank=rank.rank,
                                   signal=signal.Signals(signum).name), ranks)
        return None
