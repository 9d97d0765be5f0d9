"""``fdl-fabric attach``: follow a run of this controller live, from any terminal.

It shows the last lines of the run's console (``--tail``, 20 by default), then follows
it as it grows (`runs.reading.follow`); on a terminal the live table (host, rank, pid,
state, last line) stays drawn below the output, as on the launching terminal, rebuilt
from the record (`runs.ranktable`) and drawn by the same writer thread (`screen`).
Ctrl-C leaves the run running and says so; with ``--stop`` it stops the run instead (the
path of ``fdl-fabric stop``) and follows it to its verdict. A run that has ended: its
last lines and its exit code. Attachers only read: several may follow one run at once.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import IO, Optional

from ..errors import EXIT_FAILURE, EXIT_USAGE
from ..events import EventBus, Name
from ..presentation.output import Console, is_terminal
from ..presentation.screen import OUT
from ..runs.ranktable import RankTable
from ..runs.reading import RunView, ended_check, follow, last_lines, view
from ..runs.record import CONSOLE, RunState
from .follow import write
from .runref import ended, find_run
from .stopping import send_stop

#: Lines of what came before, shown first.
ATTACH_TAIL = 20
#: The record's event timeline, read for the live table.
EVENTS = "events.jsonl"


class _Interrupt:
    """Ctrl-C while attached: noted, and the follow loop sees it at its next look."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, signum: int, frame: Optional[FrameType]) -> None:
        self.count += 1


class _Plain:
    """A pipe or a file: the console's bytes as they come."""

    def __init__(self, out: IO[bytes], console: Console) -> None:
        self.out = out
        self.console = console

    def write(self, data: bytes) -> None:
        write(self.out, data)

    def close(self) -> None:
        self.console.close()


class _Live:
    """A terminal: the bytes through the one writer thread, the live table below them."""

    def __init__(self, folder: Path, done: threading.Event) -> None:
        self.console = Console(threaded=True, live=True)
        self.table = RankTable()
        self.done = done
        self.reader = threading.Thread(target=self._events, args=(folder / EVENTS,),
                                       name="attach-events", daemon=True)
        self.reader.start()
        self.console.start_status(self.table.rows)

    def _events(self, path: Path) -> None:
        for chunk in follow(path, 0, done=self.done.is_set):
            for line in chunk.splitlines():
                try:
                    self.table.see(json.loads(line))
                except (ValueError, AttributeError):
                    continue

    def write(self, data: bytes) -> None:
        if not data:
            return
        lines = data.splitlines(keepends=True)
        for line in lines:
            self.table.line(line)
        assert self.console.screen is not None
        self.console.screen.put_output(OUT, data, len(lines))

    def close(self) -> None:
        self.done.set()
        self.reader.join(2.0)
        self.console.stop_status()
        self.console.close()


def _end(run: RunView, events: EventBus) -> int:
    """The exit code of a run that ended; its verdict line is the last of its console
    (already shown), the launcher's loss is said here."""
    if run.phase is RunState.LOST:
        return ended(run, events)
    return run.exit_code if run.exit_code is not None else EXIT_FAILURE


def _state_words(run: RunView) -> str:
    phase: RunState = run.phase
    if phase is RunState.RUNNING:
        return f"running, attempt {run.state.get('attempt', 0)}"
    return str(phase.value)


def run_attach(spec: Optional[str], *, tail: Optional[int] = None, stop: bool = False,
               console: Optional[Console] = None, out: Optional[IO[bytes]] = None) -> int:
    """Follow a run's console live. Ctrl-C detaches (0) or, with ``stop``, stops the run
    and follows it to its verdict; a run that ended: its last lines and its exit code."""
    out = out or sys.stdout.buffer
    live = console is None and is_terminal(sys.stdout) and os.environ.get("TERM") != "dumb"
    done = threading.Event()
    screen: _Plain | _Live = _Plain(out, console or Console())
    events = EventBus(screen.console)
    folder = find_run(spec, "attach", events)
    if folder is None:
        return EXIT_USAGE
    path = folder / CONSOLE
    data, offset = last_lines(path, ATTACH_TAIL if tail is None else tail)
    run = view(folder)
    if run.ended:
        screen.write(data)
        return _end(run, events)
    if live:
        screen = _Live(folder, done)
        events = EventBus(screen.console)
    events(Name.ATTACHED, run_id=run.run_id, state=_state_words(run), stop=stop)
    screen.write(data)
    interrupt = _Interrupt()
    previous = signal.signal(signal.SIGINT, interrupt)
    stopping = False
    try:
        while True:
            for chunk in follow(path, offset, done=ended_check(folder),
                                stop=lambda: interrupt.count > 0):
                screen.write(chunk)
                offset += len(chunk)
            if view(folder).ended:
                return _end(view(folder), events)
            if not stop or stopping:  # a second Ctrl-C while it stops: leave it to stop
                events(Name.ATTACH_LEFT, run_id=run.run_id)
                return 0
            stopping = True  # --stop: the run is stopped, and followed to its verdict
            send_stop(folder, kill=False, events=events, command="fdl-fabric attach --stop")
            interrupt.count = 0
    finally:
        signal.signal(signal.SIGINT, previous)
        screen.close()


__all__ = ["ATTACH_TAIL", "run_attach"]
