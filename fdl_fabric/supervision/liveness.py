"""Silence, hangs and stacks: what the supervisor notices when nothing is said.

A host whose agent sends nothing for ``agent_timeout`` (frozen agent, frozen sshd, cut
link) is *unresponsive*: its ranks are lost, and the failure rules apply. A run in which
no rank wrote a line and no joined rank reported progress for ``hang_timeout`` is *hung*:
every rank's stack is collected, and the run ends with that verdict. A long gap between
two turns of the loop means this process was stopped (Ctrl-Z): every silence clock
starts again and nobody is blamed.
"""

from __future__ import annotations

import itertools
import os
import signal
import time

from .. import reports
from ..events import Name, event
from . import timing
from .policy import Decision
from .rankevents import RankEvents
from .records import RunPhase, StackRequest

_request_ids = itertools.count(1)


class Liveness(RankEvents):
    """The supervisor's clocks: pauses of this process, silent agents, hung runs, stacks."""

    # -- pauses of this process ------------------------------------------------------------------
    def _check_pause(self) -> None:
        """A long gap between two turns: this process was stopped (Ctrl-Z, SIGSTOP, a
        suspended VM or laptop). Nobody else was silent: every silence clock starts
        again. A gap longer than the agents' lease is the verdict (`_suspended_past`)."""
        now = timing.boottime()
        gap = now - self._last_turn
        self._last_turn = now
        if gap > timing.PAUSE_GAP:
            self._restart_clocks(time.monotonic())
            self._paused_for = max(self._paused_for, gap)
            self._suspended_past(gap, slack=0.0)

    def _restart_clocks(self, now: float) -> None:
        self._watch_from = self._last_activity = self._pinged = now
        if self.cohort is not None:
            self.cohort.resumed()
        if self.on_resume is not None:
            self.on_resume()

    def _suspend(self) -> None:
        """Ctrl-Z: the agents hold their leases (the ranks keep running, and block once
        their output fills the pipes), then this process stops until ``fg``."""
        for host in self.hosts.values():
            if not host.gone:
                host.handle.suspend()
        self.events(Name.SUSPENDED, suspended=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        self._last_turn = timing.boottime()  # a pause the agents were told of: no gap
        self._resume()

    def _resume(self) -> None:
        for host in self.hosts.values():
            if not host.gone:
                host.handle.resume()
        self._restart_clocks(time.monotonic())

    # -- silent agents --------------------------------------------------------------------------
    def _check_hosts(self) -> None:
        """An agent that has said nothing for ``agent_timeout`` is unresponsive.

        Walked when the least recently heard agent could first be silent that long
        (a host's last word only moves forward, so none is missed), and at least every
        `HOST_SILENCE_WALK` of the timeout; never more often than `HOST_CHECK_EVERY`
        (a twentieth of the timeout when that is less). A walk every half second was
        a fifth of the idle supervisor's CPU at 1,024 hosts (issue 35)."""
        if self.agent_timeout is None:
            return
        now = time.monotonic()
        if now < self._hosts_due:
            return
        timeout = self.agent_timeout
        earliest = now
        for name, host in self.hosts.items():
            if host.gone:
                continue
            heard = max(host.handle.last_heard, self._watch_from)
            if now - heard <= timeout:
                earliest = min(earliest, heard)
                continue
            reason = f"no word from its agent for {now - heard:.1f}s"
            self.events(Name.HOST_UNRESPONSIVE, host=name, host_fault="unresponsive",
                        silent=round(now - heard, 3), agent_timeout=timeout)
            host.handle.abandon()
            self._host_ended(name, f"host unresponsive: {reason}", fault="unresponsive",
                             warn=False)
        # A host whose output the console held counts as heard while it was held: the
        # cap bounds how late its silence can be seen once the hold ends.
        due = min(earliest + timeout, now + timeout * timing.HOST_SILENCE_WALK)
        self._hosts_due = max(due, now + min(timing.HOST_CHECK_EVERY, timeout / 20))

    # -- hangs and stacks -----------------------------------------------------------------------
    def _check_hang(self) -> None:
        """No rank wrote a line, and no joined rank reported progress, for hang_timeout."""
        if self.hang_timeout is None or self.phase is not RunPhase.RUNNING \
                or self._stacks is not None or self._hung is not None:
            return
        now = time.monotonic()
        last = self._last_activity
        if self.cohort is not None:
            last = max(last, self.cohort.last_progress)
        # The live ranks last: listing 8,192 of them at every turn cost the idle loop.
        if now - max(last, self._watch_from) <= self.hang_timeout or not self.live():
            return
        self._hung = event(Name.HUNG, silent=round(now - last, 3),
                           hang_timeout=self.hang_timeout)
        self.events(Name.HANG_DETECTED, **self._hung.data)
        self._ask_stacks("hang", hang=True)

    def _stacks_asked(self) -> None:
        """Ctrl-\\ (SIGQUIT) while ranks run: show where each is; the run goes on."""
        if self.phase is RunPhase.RUNNING and self.live():
            self.events(Name.STACKS_ASKED)
            self._ask_stacks("asked (SIGQUIT)", hang=False)

    def _ask_stacks(self, reason: str, *, hang: bool) -> None:
        if self._stacks is not None:
            return
        pending = {name for name, h in self.hosts.items()
                   if not h.gone and any(not r.state.terminal for r in h.ranks)}
        request = StackRequest(next(_request_ids), reason, pending,
                               time.monotonic() + timing.STACKS_TIMEOUT, hang)
        self._stacks = request
        for name in pending:
            self.hosts[name].handle.stacks(request.id)
        self._check_stacks()

    def _stacks_report(self, report: reports.Stacks) -> None:
        request = self._stacks
        if request is None or report.request_id != request.id:
            return
        request.pending.discard(report.host)
        request.py_spy[report.host] = report.py_spy
        if report.error and not report.ranks:
            request.problems[report.host] = report.error
        for rank, entry in report.ranks.items():
            if self._of_sender(report.host, rank, "stacks") is not None:
                request.found[rank] = entry
        self._check_stacks()

    def _check_stacks(self) -> None:
        request = self._stacks
        if request is None:
            return
        for name in list(request.pending):
            if self.hosts[name].gone:
                request.pending.discard(name)
                request.problems[name] = "its agent is gone"
        if request.pending and time.monotonic() < request.deadline:
            return
        for name in request.pending:
            request.problems[name] = f"no answer within {timing.STACKS_TIMEOUT:g}s"
        self._stacks = None
        labels = {r.rank: (r.host, r.plan.label) for r in self.ranks}
        self.events(Name.STACKS, reason=request.reason,
                    ranks={str(k): v for k, v in request.found.items()},
                    hosts={str(r): labels[r][0] for r in request.found},
                    labels={str(r): labels[r][1] for r in request.found},
                    problems=request.problems, py_spy=request.py_spy)
        if request.hang and self._hung is not None \
                and self.policy.on_hang() is Decision.STOP_ALL:
            self._fail(self._hung, announced=True)
