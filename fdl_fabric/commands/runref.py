"""A run named on a command line (``logs``, ``attach``, ``stop``, ``wait``): finding its
record, and saying how it ended. Shared by those commands, which import it, never each
other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..errors import EXIT_FAILURE
from ..events import EventBus, Name
from ..runs import place
from ..runs.reading import RunView
from ..runs.record import RunState


def find_run(spec: Optional[str], command: str, events: EventBus) -> Optional[Path]:
    """The record ``spec`` names, or None after saying why (a RUN that names none is
    bad input: exit 2)."""
    try:
        return place.find(spec)
    except (LookupError, OSError) as exc:
        events(Name.RUN_NOT_FOUND, command=command, error=str(exc))
        return None


def ended(run: RunView, events: EventBus) -> int:
    """Say how a run that is over ended (its verdict, or its launcher's loss); its exit
    code."""
    if run.phase is RunState.LOST:
        launcher = run.launcher
        events(Name.SUPERVISOR_LOST, run_id=run.run_id, pid=launcher.get("pid"),
               on=launcher.get("host"), state=run.state.get("state"))
        return EXIT_FAILURE
    assert run.result is not None
    events(Name.RUN_ENDED, message=str(run.result.get("message", "")))
    return run.exit_code if run.exit_code is not None else EXIT_FAILURE
