"""The detached supervisor: ``python -m fdl_fabric.commands.supervise``, started by
`commands.detach` and by nothing else.

It is the same launcher as a foreground launch (`launch.execute`), with the same
options, holding the agents' sessions, so the leash (the agents' lease) and every rule
of a foreground launch hold unchanged; only its console differs. Until every rank of
the first attempt runs it relays its console to the process that started it; then it
says ``ready`` and from there on its words go to the run's record only (console.log,
events.jsonl: `runs.record`), its stdout to /dev/null and its stderr to the record's
supervisor.log (a crash's traceback lands there).

It runs in a session of its own with no terminal, stdin from /dev/null and SIGHUP
ignored. If it dies, the agents' lease runs out and they stop every rank; ``status``
and ``wait`` then say the launcher was lost (`runs.reading`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import threading
from typing import TextIO

from ..events import Event, Name
from ..presentation.output import Console, JsonConsole
from ..presentation.rotating import open_private
from ..runs import place
from ..runs.record import SUPERVISOR_LOG
from .detach import READY
from .heap import left_to_the_os
from .launch import LaunchOptions, execute
from .prestart import READY_FD


class Relay:
    """The console's stream to the starting process, until it is cut: then nothing (the
    record has every word). Writes and the cut share one lock, so no line is half
    relayed and nothing is written to a descriptor that was just replaced."""

    def __init__(self, fd: int, lock: threading.Lock) -> None:
        self.fd = fd
        self.lock = lock
        self.cut = False

    def write(self, text: str) -> int:
        with self.lock:
            if not self.cut:
                try:
                    data = text.encode("utf-8", "replace")
                    while data:
                        data = data[os.write(self.fd, data):]
                except OSError:  # the starting process is gone (its terminal closed)
                    self.cut = True
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


class Ready:
    """The event sink that says ``ready`` once every rank of the first attempt runs."""

    def __init__(self, fd: int, relays: tuple[Relay, Relay], run_id: str) -> None:
        self.fd = fd
        self.relays = relays
        self.run_id = run_id
        self.said = False

    def emit(self, event: Event) -> None:
        if self.said or event.name is not Name.ALL_RANKS_RUNNING:
            return
        self.said = True
        lock = self.relays[0].lock
        with lock:
            for relay in self.relays:
                relay.cut = True
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(devnull, 1)
            try:
                log = open_private(place.record_folder(self.run_id) / SUPERVISOR_LOG)
                os.dup2(log, 2)
                os.close(log)
            except OSError:
                os.dup2(devnull, 2)
            os.close(devnull)
        with contextlib.suppress(OSError):
            os.write(self.fd, READY)
        os.close(self.fd)


def main() -> int:
    left_to_the_os()
    ready_fd = int(os.environ.pop(READY_FD))
    os.set_inheritable(ready_fd, False)
    handed = sys.stdin.buffer.read()
    if not handed:  # started early (`prestart`), and the command ended without a launch
        return 0
    opts: LaunchOptions = pickle.loads(handed)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    lock = threading.Lock()
    out, err = Relay(1, lock), Relay(2, lock)
    streams: tuple[TextIO, TextIO] = (out, err)  # type: ignore[assignment]
    console: Console = (
        JsonConsole(out=streams[0], err=streams[1], verbosity=opts.verbosity)
        if opts.json else
        Console(streams[0], streams[1], verbosity=opts.verbosity,
                show_rank_output=not opts.quiet, color=False))
    assert opts.run_id is not None
    ready = Ready(ready_fd, (out, err), opts.run_id)
    opts.on_event = ready.emit
    code = execute(opts, console=console).exit_code
    if not ready.said:
        os.close(ready_fd)
    return 1 if code is None else code


if __name__ == "__main__":
    sys.exit(main())
