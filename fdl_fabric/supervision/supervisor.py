"""Supervision: one record per rank, the failure policy, one verdict.

Modelled on torch.distributed.elastic's agent: the run moves through explicit phases,
every rank has one record with an explicit `RankState`, and the run ends with one frozen
`RunResult` that holds the verdict, the exit code and its cause (`records`).

The supervisor is the only writer of rank state. Everything that happens reaches it
as a `reports` record in its inbox: what agents report (spawned, output, exited, gone),
joins from the coordinator, and requests from signal handlers. Each kind of report has
one handler, found in a table (`Supervisor._handle`), as each kind of request does
(`Supervisor._request`). It acts on hosts through the small `HostHandle` interface
(start, stop, kill, signal, abandon), so the policy is tested with fake hosts and no
process at all.

The supervisor is built in layers, one responsibility each, over its records
(`state`): stop and escalation (`stopping`), what hosts and ranks report
(`rankevents`), silence, hangs and stacks (`liveness`), the verdict (`outcome`); this
module adds the loop and its dispatch tables. What a failure means is the failure
policy's (`policy`); the coordinator (`Cohort`) keeps membership and sockets only.
Signal handlers only post requests here; this loop is the one place that acts on them.
Nothing here renders words: events carry data, and `presentation.words` says them.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Mapping
from typing import Any, Optional

from .. import reports
from ..events import Event
from ..states import RankState as RankState  # named here by the launcher
from . import timing
from .liveness import Liveness
from .outcome import Outcome
from .records import RankExit, RunPhase
from .records import RunResult as RunResult  # what `Supervisor.run` gives the launcher
from .timing import TICK as TICK  # the loop's longest sleep, as benchmarks report it


class Supervisor(Liveness, Outcome):
    """Runs the policy over a run's ranks until every host's agent is gone."""

    # -- called from other threads (all go through the inbox) --------------------------------
    def post(self, report: reports.Report) -> None:
        self.inbox.put(report)

    def joined(self, rank: int) -> None:
        self.post(reports.Joined(rank))

    def request_interrupt(self, signum: int) -> None:
        """First Ctrl-C/TERM: graceful stop of every rank."""
        self.post(reports.Request("interrupt", str(signum)))

    def request_kill(self) -> None:
        """Second Ctrl-C: KILL every rank's process group now."""
        self.post(reports.Request("kill"))

    def request_signal(self, name: str) -> None:
        """Forward a signal (USR1/USR2) to every running rank."""
        self.post(reports.Request("signal", name))

    def request_abort(self, cause: Event) -> None:
        """A run-level failure outside the ranks (the cohort did not form)."""
        self.post(reports.Request("abort", cause=cause))

    def request_suspend(self) -> None:
        """Ctrl-Z: tell the agents to hold their leases, then stop this process."""
        self.post(reports.Request("suspend"))

    def request_resume(self) -> None:
        """SIGCONT: the agents count their leases again."""
        self.post(reports.Request("resume"))

    def request_stacks(self) -> None:
        """Ctrl-\\ (SIGQUIT): show where every rank is; the run goes on."""
        self.post(reports.Request("stacks"))

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> RunResult:
        if self.phase is RunPhase.RUNNING:
            self._start_all()
        wait = self.tick
        while self._gone_hosts < len(self.hosts):
            try:
                report: Optional[reports.Report] = self.inbox.get(timeout=wait)
            except queue.Empty:
                report = None
            wait = timing.next_wait(wait, self.tick, busy=report is not None)
            self._check_pause()
            while report is not None:
                self._handle(report)
                report = self._next()
            self._check_shutdown()
            self._check_pause()  # a stop while handling reports must blame no host
            self._check_hosts()
            self._check_hang()
            self._check_stacks()
            self._escalate()
            self._ping(time.monotonic())
        # Reports that came with the last host's end (an exit, a death) still count.
        report = self._next()
        while report is not None:
            self._handle(report)
            report = self._next()
        self.phase = RunPhase.DONE
        for r in self.ranks:
            if not r.state.terminal:  # cannot happen once every host is gone; be safe
                self._end(r, RankExit(lost="agent gone"), RankState.LOST)
        return self._result()

    def _next(self) -> Optional[reports.Report]:
        try:
            return self.inbox.get_nowait()
        except queue.Empty:
            return None

    # -- dispatch -----------------------------------------------------------------------------
    def _handle(self, report: reports.Report) -> None:
        handler = _HANDLERS.get(type(report))
        if handler is not None:
            handler(self, report)

    def _request(self, req: reports.Request) -> None:
        handler = _REQUESTS.get(req.kind)
        if handler is not None:
            handler(self, req)

    def _interrupt_request(self, req: reports.Request) -> None:
        """The first interrupt stops every rank gracefully; another kills them now."""
        if self._interrupt is None:
            assert req.arg is not None
            self._interrupt_now(int(req.arg))
        else:
            self._kill_now()

    def _signal_request(self, req: reports.Request) -> None:
        if req.arg is not None:
            self._forward(req.arg)

    def _abort_request(self, req: reports.Request) -> None:
        if req.cause is not None:
            self._fail(req.cause, announced=False)


#: Each kind of report to its one handler (a kind not here is not the loop's: facts,
#: sync and setup answers go to whoever asked for them).
_HANDLERS: Mapping[type, Callable[[Supervisor, Any], None]] = {
    reports.Output: Supervisor._output,
    reports.Exited: Supervisor._exited,
    reports.Spawned: Supervisor._spawned,
    reports.Joined: Supervisor._joined,
    reports.DeclaredDead: Supervisor._declared_dead,
    reports.Stacks: Supervisor._stacks_report,
    reports.Request: Supervisor._request,
    reports.Preflight: Supervisor._preflight,
    reports.Swept: Supervisor._swept,
    reports.SpawnFailed: Supervisor._spawn_failed,
    reports.Verified: Supervisor._verified,
    reports.AgentError: Supervisor._agent_error,
    reports.AgentDone: Supervisor._agent_done,
    reports.AgentGone: Supervisor._gone,
    reports.Signaled: Supervisor._signaled,
}

#: Each kind of request (`reports.Request.kind`) to its one handler.
_REQUESTS: Mapping[str, Callable[[Supervisor, reports.Request], None]] = {
    "interrupt": Supervisor._interrupt_request,
    "kill": lambda s, req: s._kill_now(),
    "signal": Supervisor._signal_request,
    "abort": Supervisor._abort_request,
    "suspend": lambda s, req: s._suspend(),
    "resume": lambda s, req: s._resume(),
    "stacks": lambda s, req: s._stacks_asked(),
}
