"""Stop and escalation: how a run is stopped, and how a stop is made to finish.

A failure stops every rank (`Stopping._fail`); an interrupt (Ctrl-C, TERM, ``fdl-fabric
stop``) stops them gracefully, a second one or ``--kill`` kills them now. Nothing waits
for an exit that may never come: past the kill grace (and `timing.FORCE_MARGIN`) every
host that has not reported is sent KILL, and past `timing.ABANDON_MARGIN` more its
agent is abandoned. Survivors of a save-and-shutdown get `timing.SHUTDOWN_GRACE`. Every
agent's lease is renewed by a ping (`Stopping._ping`), so an agent that loses the
launcher stops its ranks on its own.
"""

from __future__ import annotations

import signal
import time
from typing import Any

from ..agent import wire
from ..causes import cause_data
from ..events import Event, Name
from . import timing
from .records import RunPhase
from .state import SupervisorState


class Stopping(SupervisorState):
    """The supervisor's stops: on a failure, on a request, and their escalation."""

    # -- a failure -----------------------------------------------------------------------------
    def _fail(self, failure: Event, *, announced: bool, stopping_said: bool = True) -> None:
        """The run failed (``failure`` says why): every rank is stopped. Unless
        ``announced`` (its event, or a warning that says as much, was emitted), it is
        said now. ``stopping_said=False``: the ranks were already stopped by others (their
        agents' lease), so "terminating all still-running ranks" would not be true."""
        if self.failure is not None:
            return
        self.failure = failure
        if not announced:
            self.events(Name.FAILURE_ANNOUNCED, cause=cause_data(failure))
        if self.started_any() and stopping_said:
            self.events(Name.STOPPING_ON_FAILURE, hung=failure is self._hung)
        self._stop_all()

    # -- requests (signal handlers, the launcher) ------------------------------------------------
    def _interrupt_now(self, signum: int) -> None:
        """First Ctrl-C or TERM: every rank is stopped gracefully; with a note from
        ``fdl-fabric stop --kill``, killed at once."""
        self._interrupt = signum
        name = signal.Signals(signum).name
        note = self.stop_note() if self.stop_note is not None \
            and signum == signal.SIGTERM else None
        self._stopped_by_command = note
        said: dict[str, Any] = {"by": dict(note)} if note else {}
        self.events(Name.STOPPING_ON_SIGNAL, signal=name, live=len(self.live()),
                    int_grace=min(wire.INT_GRACE, self.kill_grace / 2),
                    kill_grace=self.kill_grace, **said)
        self._stop_all("INT" if signum == signal.SIGINT else "TERM")
        if note and note.get("kill"):  # `fdl-fabric stop --kill`: no grace
            self.events(Name.KILLING_NOW, asked=f"{note.get('command')} --kill")
            self._kill_all()

    def _kill_now(self) -> None:
        """A second Ctrl-C: every rank's process group is killed now."""
        self.events(Name.KILLING_NOW)
        self._stop_all()
        self._kill_all()

    def _forward(self, name: str) -> None:
        """USR1/USR2 for every running rank (a rank it ends was stopped, not failed)."""
        self._forwarded.add(int(getattr(signal, "SIG" + name)))
        for host in self.hosts.values():
            if not host.gone and any(not r.state.terminal for r in host.ranks):
                host.handle.signal(name)

    # -- stopping ------------------------------------------------------------------------------
    def _stop_all(self, first: str = "TERM") -> None:
        if self._stop_started is None:
            self._stop_started = time.monotonic()
            self.phase = RunPhase.STOPPING
        for r in self.live():
            r.stop_requested = True
        for host in self.hosts.values():
            if not host.gone:
                host.handle.stop(first)

    def _kill_all(self) -> None:
        self._forced = True
        for host in self.hosts.values():
            if not host.gone:
                host.handle.kill()

    def _check_shutdown(self) -> None:
        """Survivors told to save and stop get `SHUTDOWN_GRACE` seconds, then are stopped."""
        if self._shutdown_seen is None or self._stop_started is not None \
                or self.failure is not None:
            return
        if time.monotonic() - self._shutdown_seen > timing.SHUTDOWN_GRACE:
            self.events(Name.STOPPING_AFTER_SHUTDOWN, live=len(self.live()),
                        grace=timing.SHUTDOWN_GRACE)
            self._stop_all()

    def _ping(self, now: float) -> None:
        """Renew every agent's lease (`ping_interval`): an agent that stops hearing
        from the launcher stops its ranks. One whose ranks' beats flow is heard without
        it, so it is pinged only for its lease (`lease_ping_interval`)."""
        if now - self._pinged < self.ping_every:
            return
        self._pinged = now
        for host in self.hosts.values():
            if host.gone or (host.handle.beats_flowing
                             and now - host.pinged_at < self.lease_ping_every - timing.TICK):
                continue
            host.pinged_at = now
            host.handle.ping()

    # -- escalation ----------------------------------------------------------------------------
    def _escalate(self) -> None:
        """Make sure a stop finishes, and a finished agent goes, even if one stops answering."""
        now = time.monotonic()
        self._abandon_done(now)
        if self._stop_started is None:
            return
        waited = now - self._stop_started
        if not self._forced and waited > self.kill_grace + timing.FORCE_MARGIN:
            self._kill_all()
        if waited > self.kill_grace + timing.FORCE_MARGIN + timing.ABANDON_MARGIN:
            for name, host in self.hosts.items():
                if host.gone or host.forced:
                    continue
                host.forced = True
                self.events(Name.HOST_ABANDONED, host=name)
                host.handle.abandon()

    def _abandon_done(self, now: float) -> None:
        """An agent that said DONE and has not gone within `GONE_MARGIN` is abandoned."""
        for host in self._done_hosts:  # the hosts that said DONE, not every host each turn
            if host.gone or host.done_at is None or now - host.done_at <= timing.GONE_MARGIN:
                continue
            if not host.forced:
                host.forced = True
                host.handle.abandon()
