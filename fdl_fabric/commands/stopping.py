"""``fdl-fabric stop`` and ``fdl-fabric wait``: act on a run of this controller, or wait
for its end, from any terminal or script.

``stop`` takes exactly the path of a TERM to the launcher (the same as ``kill PID``):
the launcher stops every rank with TERM, then KILL after the kill grace, and ends with
its verdict. Before the TERM, ``stop`` leaves a note in the run's record addressed to
that launcher's pid (`runs.record.STOP_NOTE`), so the verdict names who stopped it
(``stopped by fdl-fabric stop (user@host, pid P)``, exit 143); ``--kill`` asks for the
KILL at once. It then waits for the verdict, bounded by the kill grace.

``wait`` polls the record until its result is written, and exits with the run's exit
code (``--timeout``: 124 while it still runs; a launcher gone without a verdict: 1).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Optional

from ..errors import EXIT_FAILURE, EXIT_USAGE
from ..events import EventBus, Name
from ..presentation.output import Console
from ..runs.reading import RunView, view
from ..runs.record import STOP_NOTE, who, write_json
from .runref import ended, find_run

#: Seconds ``stop`` waits for the verdict beyond the run's kill grace (the agents' own
#: bounds, the final sweep of lost hosts).
STOP_MARGIN = 45.0
#: Seconds between two looks at a record that is waited on.
WAIT_POLL = 0.1
#: ``wait --timeout`` ran out (as timeout(1) exits).
EXIT_TIMED_OUT = 124


def send_stop(folder: Path, *, kill: bool, events: EventBus,
              command: str = "fdl-fabric stop") -> Optional[RunView]:
    """Leave the note (``command`` is who asks), then TERM the run's launcher; the run as
    it was, or None when it had already ended (said)."""
    run = view(folder)
    if run.ended:
        ended(run, events)
        return None
    launcher = run.launcher
    pid = int(launcher["pid"])
    me = who()
    write_json(folder / STOP_NOTE, {"command": command, "user": me["user"],
                                    "host": me["host"], "pid": me["pid"], "kill": kill,
                                    "to_pid": pid, "at": time.time()})
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:  # it ended between the look and the TERM
        return run
    events(Name.STOP_SENT, run_id=run.run_id, pid=pid, kill=kill,
           kill_grace=run.state.get("kill_grace", "?"))
    return run


def run_stop(spec: Optional[str], *, kill: bool = False,
             console: Optional[Console] = None) -> int:
    """Stop a run and wait for its verdict: 0 once it ended (or had), 1 when it did not
    end within its kill grace and the margin, 2 when no run is named."""
    events = EventBus(console or Console())
    folder = find_run(spec, "stop", events)
    if folder is None:
        return EXIT_USAGE
    run = send_stop(folder, kill=kill, events=events)
    if run is None:
        return 0
    grace = run.state.get("kill_grace")
    bound = (float(grace) if isinstance(grace, (int, float)) else 30.0) + STOP_MARGIN
    code = _wait_for(folder, bound, events)
    return EXIT_FAILURE if code is None else 0


def _wait_for(folder: Path, timeout: Optional[float], events: EventBus) -> Optional[int]:
    """The run's exit code once it ended (its verdict said), or None after ``timeout``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        run = view(folder)
        if run.ended:
            return ended(run, events)
        if deadline is not None and time.monotonic() >= deadline:
            events(Name.WAIT_TIMED_OUT, run_id=run.run_id, state=run.phase.value,
                   timeout=timeout)
            return None
        time.sleep(WAIT_POLL)


def run_wait(spec: Optional[str], *, timeout: Optional[float] = None,
             console: Optional[Console] = None) -> int:
    """Wait for a run's end: its exit code; 124 after ``timeout``; 2 when none is named."""
    events = EventBus(console or Console())
    folder = find_run(spec, "wait", events)
    if folder is None:
        return EXIT_USAGE
    code = _wait_for(folder, timeout, events)
    return EXIT_TIMED_OUT if code is None else code


__all__ = ["EXIT_TIMED_OUT", "ended", "run_stop", "run_wait", "send_stop"]
