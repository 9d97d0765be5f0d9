"""``--detach``: the run goes on under a supervisor that outlives this terminal.

A fork after threads and paramiko connections exist is unsafe, so the supervisor is a
fresh interpreter (`commands.supervise`; started early by `prestart` when the command
line allows) started before anything is contacted, in a
session of its own (no controlling terminal: closing this one sends it no SIGHUP). It
is handed the options exactly as the one builder made them (`options.launch_options`),
pickled on its stdin, never in argv or a file; its stdin is /dev/null from then on.

This process waits on it and relays what it says, so a detached launch refuses and
fails in the foreground exactly as a foreground launch does (bad input: exit 2; a host
that cannot be reached: exit 1 with its verdict), and nothing stays behind. Once every
rank of the first attempt runs, the supervisor says ``ready`` on a pipe of its own and
stops relaying; this process then prints the run id and the commands to follow it, and
exits 0. A Ctrl-C or TERM before that is passed on: the launch stops with its verdict.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Optional

from ..errors import EXIT_USAGE, FdlError
from ..planning.envelope import new_run_id
from ..runs import place
from . import prestart
from .launchoptions import LaunchOptions
from .prestart import READY_FD

#: What the supervisor writes on that pipe once every rank of the first attempt runs.
READY = b"ready\n"
#: Seconds to read what the supervisor relayed after it said ready (its pipes may stay
#: open in a process it started; what it wrote before ``ready`` is there by then).
DRAIN = 1.0


@dataclass(frozen=True)
class Detached:
    """A run that goes on under its detached supervisor."""

    run_id: str
    pid: int
    folder: Path


def supervisor_options(opts: LaunchOptions) -> LaunchOptions:
    """The options the supervisor runs: the same, with the run id chosen now."""
    return dataclasses.replace(opts, detach=False, detached=True, on_event=None,
                               run_id=opts.run_id or new_run_id())


def detach(opts: LaunchOptions) -> Detached | int:
    """Start the supervisor and relay it until every rank runs (`Detached`) or the launch
    ended before (its exit code: 2 for bad input, 1 for a failure, 128+N)."""
    handed = supervisor_options(opts)
    try:  # a detached run is followed through its record: none, no detached run
        place.runs_root()
    except OSError as exc:
        raise FdlError(f"--detach: no folder for the run's record: {exc.strerror or exc}; "
                       f"set {place.ENV_RUNS_DIR} to a folder of yours", EXIT_USAGE) from None
    started = prestart.take() or prestart.spawn()
    proc, ready_r = started.proc, started.ready_fd
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    with _passed_on(proc.pid):
        try:
            proc.stdin.write(pickle.dumps(handed))
            proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at once: its exit code says how
        ready = _relay(proc.stdout, proc.stderr, ready_r)
    if ready:
        assert handed.run_id is not None
        return Detached(handed.run_id, proc.pid, place.record_folder(handed.run_id))
    return _exit_code(proc)


def launch_detached(opts: LaunchOptions, binary: str = "fdl-fabric",
                    on: Optional[str] = None) -> int:
    """``--detach`` on the command line: the run id and how to follow it once every rank
    runs (exit 0), or the launch's own refusal or verdict, relayed, and its exit code."""
    from ..events import EventBus, Name
    from ..presentation.output import Console, JsonConsole

    try:
        outcome = detach(opts)
    except FdlError as exc:
        from .options import refuse

        refuse(exc, None, as_json=opts.json)
        return exc.exit_code
    if isinstance(outcome, int):
        return outcome
    prestart.Started.handed_over = True
    console = JsonConsole() if opts.json else Console()
    EventBus(console)(Name.DETACHED, run_id=outcome.run_id, pid=outcome.pid,
                      host=socket.gethostname(), folder=str(outcome.folder), binary=binary,
                      on=on)
    return 0


def _exit_code(proc: subprocess.Popen[bytes]) -> int:
    """The supervisor ended before every rank ran: its verdict was relayed; its code."""
    try:
        code = proc.wait(30)
    except subprocess.TimeoutExpired:  # said its verdict but hangs in its teardown
        proc.kill()
        code = proc.wait(10)
    return 128 - code if code < 0 else code


@contextmanager
def _passed_on(pid: int) -> Iterator[None]:
    """Ctrl-C and TERM while the launch starts are the launch's: passed on to the
    supervisor, which stops it with a verdict (relayed here). A closed terminal is not:
    the run was asked to outlive it."""
    def forward(signum: int, frame: Optional[FrameType]) -> None:
        with suppress(ProcessLookupError):
            os.kill(pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _relay(out: IO[bytes], err: IO[bytes], ready_fd: int) -> bool:
    """Copy the supervisor's stdout and stderr to ours until it says ready (True) or
    ends (False)."""
    targets = {out.fileno(): sys.stdout.buffer, err.fileno(): sys.stderr.buffer}
    open_fds = set(targets) | {ready_fd}
    said = b""
    deadline: Optional[float] = None
    while open_fds:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        if timeout == 0.0:
            break
        readable, _, _ = select.select(list(open_fds), [], [], timeout)
        if not readable:
            break
        for fd in readable:
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.discard(fd)
                if fd == ready_fd:
                    deadline = time.monotonic() + DRAIN
                continue
            if fd == ready_fd:
                said += chunk
                continue
            target = targets[fd]
            try:
                target.write(chunk)
                target.flush()
            except (BrokenPipeError, OSError):
                targets[fd] = _Discard()  # type: ignore[assignment]
    os.close(ready_fd)
    return said.startswith(READY)


class _Discard:
    """Where relayed output goes once our own stdout is closed."""

    def write(self, data: bytes) -> int:
        return len(data)

    def flush(self) -> None:
        pass


__all__ = ["READY", "READY_FD", "Detached", "detach", "launch_detached",
           "supervisor_options"]
