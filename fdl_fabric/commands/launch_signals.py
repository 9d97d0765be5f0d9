"""The launch's signal handlers: they record and post, the supervisor's loop acts.

A handler runs in the main thread between two bytecodes of whatever it interrupted, so
it never takes a lock and never waits: it posts a request to the running supervisor's
inbox (`queue.SimpleQueue.put` is safe there), or, with no supervisor running
(connecting, starting agents, between attempts), raises `LaunchInterrupted` so the
launch ends where it stands, with a verdict.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Optional

from ..supervision.supervisor import Supervisor


class LaunchInterrupted(Exception):
    """A stop signal arrived while no supervisor was running (connecting, between
    attempts): the launch ends where it stands, with a verdict."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


#: Signals that stop a run: Ctrl-C, ``kill``, the terminal closing.
_STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Every signal a launch handles.
_HANDLED = (*_STOPS, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGTSTP,
            signal.SIGCONT)


def _forward(signum: int) -> Callable[[Supervisor], None]:
    name = signal.Signals(signum).name[3:]
    return lambda sup: sup.request_signal(name)


#: What a signal other than a stop asks of a running supervisor.
_REQUESTS: dict[int, Callable[[Supervisor], None]] = {
    signal.SIGQUIT: Supervisor.request_stacks,
    signal.SIGUSR1: _forward(signal.SIGUSR1),
    signal.SIGUSR2: _forward(signal.SIGUSR2),
    signal.SIGTSTP: Supervisor.request_suspend,
    signal.SIGCONT: Supervisor.request_resume,
}


class Signals:
    """The launch's signal handlers. They only record what arrived and post it to the
    running supervisor's inbox (`queue.SimpleQueue.put` is safe there): the supervisor's
    loop prints and acts. A handler never takes a lock, so it can never wait on the
    thread it interrupted.

    With no supervisor running (connecting, starting agents, between attempts), a stop
    signal raises `LaunchInterrupted` in the main thread, while ``raising``.

    INT (Ctrl-C), TERM and HUP (the terminal closed) stop the run gracefully, a second
    INT kills; QUIT (Ctrl-\\) shows every rank's stack and the run goes on; USR1 and
    USR2 are forwarded; TSTP (Ctrl-Z) suspends supervision and CONT resumes it.
    """

    def __init__(self) -> None:
        self.supervisor: Optional[Supervisor] = None
        #: The first stop signal of the launch.
        self.received: Optional[int] = None
        self.raising = True
        #: SIGHUP was ignored when the launch started (``nohup``, a detached supervisor):
        #: it stays ignored, as well-behaved programs do.
        self.hangup_ignored = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self.hangup_ignored = signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        handled = [s for s in _HANDLED if not (s is signal.SIGHUP and self.hangup_ignored)]
        previous = {sig: signal.signal(sig, self._handle) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        sup = self.supervisor
        if signum in _STOPS:
            self._stop(signum, sup)
        elif sup is not None:
            _REQUESTS[signum](sup)
        elif signum == signal.SIGTSTP:  # nothing runs that must know: just stop
            os.kill(os.getpid(), signal.SIGSTOP)

    def _stop(self, signum: int, sup: Optional[Supervisor]) -> None:
        """INT, TERM, HUP: the first one stops gracefully, a second INT kills."""
        first = self.received is None
        if first:
            self.received = signum
        if sup is None:
            if self.raising:
                raise LaunchInterrupted(signum)
            return
        if first or signum != signal.SIGINT:
            sup.request_interrupt(signum)
        else:
            sup.request_kill()
