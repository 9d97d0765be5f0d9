"""One run's record on the controller, written by its launcher: the one writer.

Layout of ``<runs>/<run_id>/`` (`place`), folders 0700 and files 0600::

    state.json      who runs it (host, user, pid and its start time) and where it is:
                    starting, running (attempt k), stopping, ended; replaced atomically
    console.log     the console as rendered: launcher lines and every rank line behind
                    its ``[host:device:rN]`` prefix, plain (no colour, no live table)
    events.jsonl    every event, one v1 record a line (docs/events.md)
    cluster.json    the resolved plan, secrets masked
    attempt_<k>/r<rank>/{stdout,stderr}.log   each rank's output, byte for byte
    stop.json       who asked ``fdl-fabric stop`` to stop it (`stopping`)
    supervisor.log  a detached supervisor's own stderr (a crash's traceback)
    on_exit.log     what the ``--on-exit`` hook printed
    result.json     verdict, exit code, attempts, root cause: written last, atomically

console.log and every rank log rotate past `limits.RECORD_LOG_BYTES` (`rotating`). The
state is derived from the events the launch emits, so nothing else has to remember to
update it: ``attach``, ``logs``, ``wait`` and ``status`` read it (`reading`).

Everything written here but the ranks' own output goes through `masking` first (the
state's command, the console's words, the events, the plan, the result), so a record
read by another user's ``status`` or copied into a bug report keeps no secret the rule
hides.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import socket
import threading
import time
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Optional

from ..events import Event, Kind, Name
from ..limits import RECORD_LOG_BYTES
from ..masking import mask_data
from ..presentation.output import Console
from ..presentation.records import masked
from ..presentation.rotating import RotatingFile, TextLog, open_private
from ..presentation.runlog import RunLog, json_lines, moves_to_files, weight
from ..presentation.words import render

STATE = "state.json"
RESULT = "result.json"
CONSOLE = "console.log"
STOP_NOTE = "stop.json"
SUPERVISOR_LOG = "supervisor.log"
ON_EXIT_LOG = "on_exit.log"


class RunState(str, Enum):
    """Where a run is, as its record says: STARTING -> RUNNING -> STOPPING -> ENDED (a
    restart goes back to STARTING with the next attempt). LOST is never written: a reader
    says it of a record whose launcher is gone without a result (`reading`)."""

    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    ENDED = "ended"
    LOST = "lost"


def write_json(path: Path, data: dict[str, Any]) -> None:
    """``path`` replaced atomically (a reader sees the old one or the new one), 0600;
    laid out by `runlog.json_lines`."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    fd = open_private(temporary, truncate=True)
    try:
        os.write(fd, json_lines(data).encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)


def process_started(pid: int) -> Optional[float]:
    """When process ``pid`` started (seconds since the epoch), or None when it is gone:
    with the pid, what tells a launcher from a later process given the same pid."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:  # dead, not yet reaped by its parent
            return None
        return float(proc.create_time())
    except psutil.Error:
        return None


def who() -> dict[str, Any]:
    """This process as the records name it: user, host, pid and its start time."""
    pid = os.getpid()
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return {"user": user, "host": socket.gethostname(), "pid": pid,
            "pid_started": process_started(pid)}


#: Events that move the state, and where to (one table, read by `RunRecord._advance`).
_STATE_OF: dict[Name, RunState] = {
    Name.ALL_RANKS_RUNNING: RunState.RUNNING,
    Name.RESTARTING: RunState.STARTING,
    Name.VERDICT: RunState.ENDED,
}


#: The events whose words or data the state and the result keep (`RunRecord._see`):
#: masked where they are seen. The others set at most the state's name and attempt.
_KEPT = frozenset({Name.ROOT_CAUSE, Name.SUMMARY, Name.ATTEMPTS, Name.LAUNCH, Name.CODE,
                   Name.VERDICT})


class RunRecord:
    """The event sink that writes one run's record. Created by the launch once its run
    id is known; `close` after the verdict."""

    def __init__(self, folder: Path, run_id: str, *, detached: bool, verbosity: int,
                 about: dict[str, Any],
                 on_error: Optional[Callable[[str, str], None]] = None) -> None:
        self.folder = folder
        self.run_id = run_id
        #: Told once (the error, the folder) when a write fails: a full disk, an I/O
        #: error. The run goes on; what could not be written is missing from the record.
        self.on_error = on_error
        #: Why the record stopped being written, once it did.
        self.failed: Optional[str] = None
        folder.mkdir(mode=0o700, exist_ok=True)
        os.chmod(folder, 0o700)
        #: Its files (console.log too) are written by the log's own thread, in order.
        self.log = RunLog(str(folder.parent), run_id, max_bytes=RECORD_LOG_BYTES,
                          on_error=self._log_failed, deferred=True)
        self._console_file = RotatingFile(folder / CONSOLE, RECORD_LOG_BYTES)
        self._console_stream = stream = TextLog(self._console_file)
        self.console = Console(stream, stream, verbosity=verbosity,  # type: ignore[arg-type]
                               color=False)
        self.log.after_batch(self._drain_console)
        self._lock = threading.Lock()
        #: What the result keeps of the end's events: the ranks' rows, the attempts.
        self._kept: dict[str, Any] = {"ranks": [], "attempt_list": [],
                                      "root_cause_rank": None}
        self._state: dict[str, Any] = {
            "run_id": run_id, "state": RunState.STARTING.value, "attempt": 0,
            "launcher": who(), "detached": detached, "started": time.time(),
            "cwd": os.getcwd(), **mask_data(about)}
        self._save()

    def emit(self, event: Event) -> None:
        # Masked on the log's writer, not here: a burst of 8,192 ranks starting, printing
        # and joining is 24,576 events, and masking was a third of what their threads
        # (the coordinator's, the channel reader's) spent on each (issue 35).
        self.log.call(self._write_now, event, size=weight(event))
        if event.kind is not Kind.OUTPUT:
            with self._lock:
                self._see(masked(event) if event.name in _KEPT else event)
        self._report()

    def _write_now(self, event: Event) -> None:
        """console.log's line and events.jsonl's (on the log's writer thread)."""
        shown = masked(event)  # the console and the record keep no secret
        try:
            self.console.emit(shown)
        except OSError as exc:
            self._failure(exc)
        # events.jsonl: `records.record` keeps what is masked already, and masks the rest
        self.log.emit(event if moves_to_files(event) else shown)

    def _drain_console(self) -> None:
        """console.log's lines of a batch of the log's writer, in one write."""
        try:
            self._console_stream.drain()
        except OSError as exc:
            self._failure(exc)

    def _failure(self, exc: OSError) -> None:
        if self.failed is None:
            self.failed = exc.strerror or str(exc)

    def _log_failed(self, error: str, folder: str) -> None:
        if self.failed is None:
            self.failed = error

    def _report(self) -> None:
        """Say the first failed write, once, outside every lock (saying it is an event
        that comes back here)."""
        if self.failed is not None and self.on_error is not None:
            tell, self.on_error = self.on_error, None
            tell(self.failed, str(self.folder))

    def _see(self, event: Event) -> None:
        """What the result keeps of the end's events, and the state they move to."""
        if event.name is Name.ROOT_CAUSE:
            self.root_cause = render(event)
            self._kept["root_cause_rank"] = event.rank
        elif event.name is Name.SUMMARY:
            self._kept["ranks"] = event.data.get("ranks") or []
        elif event.name is Name.ATTEMPTS:
            self._kept["attempt_list"] = event.data.get("attempts") or []
        self._advance(event)

    def _advance(self, event: Event) -> None:
        state = _STATE_OF.get(event.name)
        if state is None and event.kind is Kind.STOPPING:
            state = RunState.STOPPING
        if event.name is Name.LAUNCH:
            self._state.update(world_size=event.data.get("world_size"),
                               hosts=sorted(event.data.get("ranks") or {}))
        if event.name is Name.CODE:  # which code the run runs (``sync``)
            self._state.update(code_id=event.data.get("code_id"),
                               code_src=event.data.get("src"))
            self._save()
        if state is None:
            return
        if state is RunState.STOPPING and self._state["state"] == RunState.ENDED.value:
            return
        if "attempt" in event.data and isinstance(event.data["attempt"], int):
            self._state["attempt"] = event.data["attempt"]
        self._state["state"] = state.value
        if state is RunState.ENDED:
            self._state["ended"] = time.time()
        self._save()
        if event.name is Name.VERDICT:
            self._result(event)

    def _save(self) -> None:
        self._state["updated"] = time.time()
        try:
            write_json(self.folder / STATE, self._state)
        except OSError as exc:
            self._failure(exc)

    def _result(self, event: Event) -> None:
        """result.json, written last: after every line before it reached its file."""
        self.log.flush()
        data = event.data
        result = {"run_id": self.run_id, "verdict": data.get("verdict"),
                  "exit_code": data.get("exit_code"), "message": render(event),
                  "attempts": data.get("attempts"), "cause": data.get("cause"),
                  "faults": data.get("faults") or {}, "root_cause": self.root_cause,
                  "started": self._state["started"], "ended": self._state.get("ended"),
                  "launcher": self._state["launcher"], "hosts": self._state.get("hosts"),
                  "code_id": self._state.get("code_id"),
                  **self._kept}
        try:
            write_json(self.folder / RESULT, result)
        except OSError as exc:
            self._failure(exc)

    #: The root cause as said (its words), seen before the verdict.
    root_cause: Optional[str] = None

    def write_cluster(self, text: bytes) -> None:
        """``cluster.json``: the plan as `runlog.cluster_json` laid it out, masked."""
        with contextlib.suppress(OSError):
            self.log.write_cluster(text)

    def close(self) -> None:
        self.log.close()  # what was handed over written first
        if not self.log.writer_alive:  # one a stalled disk holds still owns the file
            self._drain_console()
        with contextlib.suppress(OSError):
            self._console_file.close()


__all__ = ["CONSOLE", "ON_EXIT_LOG", "RESULT", "STATE", "STOP_NOTE", "SUPERVISOR_LOG",
           "RunRecord", "RunState", "process_started", "who", "write_json"]
