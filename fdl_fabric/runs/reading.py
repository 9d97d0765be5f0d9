"""Reading a run's record from any terminal: its state, whether its launcher lives, its
result, and its files as they grow (``attach``, ``logs -f``, ``wait``, ``status``).

A record only says what its launcher wrote (`record`). Whether that launcher is still
there is asked of the process table here, by pid *and* start time, so a pid reused by
another process never makes a dead run look alive; a record with no result whose
launcher is gone is LOST. Every wait here is a poll with a bound: nothing blocks on a
file that stopped growing.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .record import RESULT, STATE, RunState, process_started

#: Seconds between two looks at a file that is followed: a line shows within this (plus
#: the launcher's own write), and an idle follower costs ~50 opens a second.
POLL = 0.02
#: Bytes read at a time: a follower's memory and its latency to the first line are
#: bounded by it, whatever the backlog (bench/detach_follow.py).
CHUNK = 1 << 20
#: A pid's start time as psutil reads it, and as the record wrote it, may differ by the
#: clock tick's rounding.
START_SLACK = 1.0


def read_json(path: Path) -> Optional[dict[str, Any]]:
    """A record's JSON file, or None when it is missing or (being replaced) unreadable."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def launcher_alive(state: dict[str, Any]) -> bool:
    """Whether the process that wrote ``state`` still runs: same host, same pid, same
    start time."""
    launcher = state.get("launcher") or {}
    if launcher.get("host") != socket.gethostname():
        return False
    pid, started = launcher.get("pid"), launcher.get("pid_started")
    if not isinstance(pid, int) or pid <= 0:
        return False
    now_started = process_started(pid)
    if now_started is None:
        return False
    return not isinstance(started, (int, float)) or abs(now_started - started) <= START_SLACK


@dataclass(frozen=True)
class RunView:
    """One record as read now."""

    folder: Path
    state: dict[str, Any]
    result: Optional[dict[str, Any]]
    alive: bool

    @property
    def run_id(self) -> str:
        return self.folder.name

    @property
    def phase(self) -> RunState:
        """ENDED once a result is written; LOST when the launcher is gone without one;
        else what the launcher last wrote."""
        if self.result is not None:
            return RunState.ENDED
        if not self.alive:
            return RunState.LOST
        try:
            said = RunState(self.state.get("state", "starting"))
        except ValueError:
            return RunState.STARTING
        # The state says ended a moment before result.json is written: only the result
        # makes a run ended (what `wait` and `stop` then read), so until then it stops.
        return RunState.STOPPING if said is RunState.ENDED else said

    @property
    def ended(self) -> bool:
        return self.phase in (RunState.ENDED, RunState.LOST)

    @property
    def exit_code(self) -> Optional[int]:
        if self.result is None:
            return None
        code = self.result.get("exit_code")
        return code if isinstance(code, int) else 1

    @property
    def launcher(self) -> dict[str, Any]:
        return dict(self.state.get("launcher") or {})

    def row(self) -> dict[str, Any]:
        """What ``status`` shows of it (and ``--json`` prints)."""
        state = self.state
        result = self.result or {}
        return {"run_id": self.run_id, "state": self.phase.value,
                "attempt": state.get("attempt", 0), "detached": bool(state.get("detached")),
                "started": state.get("started"), "ended": result.get("ended"),
                "updated": state.get("updated"),
                "verdict": result.get("verdict"), "exit_code": result.get("exit_code"),
                "world_size": state.get("world_size"), "hosts": state.get("hosts") or [],
                "launcher": self.launcher, "command": state.get("command"),
                "cwd": state.get("cwd"), "folder": str(self.folder),
                "code_id": state.get("code_id")}


def view(folder: Path) -> RunView:
    """The record in ``folder`` as it is now (the result is read before the state, so a
    run that ends meanwhile is never LOST)."""
    result = read_json(folder / RESULT)
    state = read_json(folder / STATE) or {}
    alive = result is None and launcher_alive(state)
    if result is None and not alive:  # it may have written its result and gone meanwhile
        result = read_json(folder / RESULT)
    return RunView(folder, state, result, alive)


def ended_check(folder: Path, every: float = 0.25) -> Callable[[], bool]:
    """``view(folder).ended`` for a follower's ``done``, cheap enough to ask after every
    chunk: a result file is one stat; the launcher's life (a process lookup) is asked at
    most every ``every`` seconds."""
    result = folder / RESULT
    asked = [0.0]

    def ended() -> bool:
        if result.exists():
            return True
        now = time.monotonic()
        if now - asked[0] < every:
            return False
        asked[0] = now
        return view(folder).ended

    return ended


def is_live(folder: Path) -> bool:
    """A record that must not be pruned: no result yet and its launcher runs, or runs on
    another host (a records folder shared over NFS: only that host can tell). A result
    file ends the question at one stat: a run of 8,192 ranks keeps a state of a few MB,
    which every launch's prune parsed for each kept record (issue 35)."""
    if (folder / RESULT).is_file():
        return False
    run = view(folder)
    if run.result is None and run.launcher.get("host") not in (None, socket.gethostname()):
        return True
    return run.phase not in (RunState.ENDED, RunState.LOST)


def last_lines(path: Path, count: Optional[int]) -> tuple[bytes, int]:
    """The last ``count`` lines of ``path`` (all of them when None) with the rotated
    ``<path>.1`` before it when more are needed, and the offset in ``path`` they end at.
    With a count, only the blocks at the end that hold those lines are read."""
    try:
        size = os.stat(path).st_size
    except OSError:
        size = 0
    data = _tail_blocks(path, size, count)
    rotated = path.with_name(path.name + ".1")
    if (count is None or data.count(b"\n") < count) and rotated.exists():
        with contextlib.suppress(OSError):
            data = _tail_blocks(rotated, os.stat(rotated).st_size,
                                None if count is None else count + 1) + data
    if count is not None:
        lines = data.splitlines(keepends=True)
        data = b"".join(lines[-count:]) if count else b""
    return data, size


def _tail_blocks(path: Path, size: int, count: Optional[int]) -> bytes:
    """The end of ``path`` (its first ``size`` bytes) holding at least ``count`` lines
    (all when None), read backwards a block at a time."""
    data = b""
    with contextlib.suppress(OSError), open(path, "rb") as fh:
        if count is None:
            return fh.read(size)
        end = size
        while end > 0 and data.count(b"\n") <= count:
            start = max(0, end - CHUNK)
            fh.seek(start)
            data = fh.read(end - start) + data
            end = start
    return data


def follow(path: Path, offset: int, *, done: Callable[[], bool],
           poll: float = POLL, stop: Optional[Callable[[], bool]] = None
           ) -> Iterator[bytes]:
    """The bytes written to ``path`` after ``offset``, as they come, whole lines only, a
    chunk at a time (a backlog is never held whole); across a rotation (the file renamed
    and started afresh) too. Ends once ``done()`` (checked before the last reads, so
    nothing written before the end is missed) or ``stop()``."""
    inode = _inode(path)
    partial = b""
    while True:
        finished = done()
        got = 0
        while True:  # what is there now, a chunk at a time
            old, chunk, inode, offset = _next_chunk(path, inode, offset)
            got += len(old) + len(chunk)
            data = partial + old + chunk if partial or old else chunk
            cut = data.rfind(b"\n") + 1
            partial = data[cut:]
            if cut:
                yield data if cut == len(data) else data[:cut]
            if len(chunk) < CHUNK:
                break
        if finished:
            if partial:
                yield partial
            return
        if stop is not None and stop():
            return
        if not got:
            time.sleep(poll)


def _next_chunk(path: Path, inode: Optional[int], offset: int
                ) -> tuple[bytes, bytes, Optional[int], int]:
    """What the old file still held after a rotation, the next chunk of ``path`` from
    ``offset``, the inode read and the new offset."""
    old_rest = b""
    chunk = b""
    with contextlib.suppress(OSError), open(path, "rb") as fh:
        current = os.fstat(fh.fileno()).st_ino  # the file read, whatever the path is now
        if inode is not None and current != inode:
            # rotated: what was left of the old file, then the new one from its start
            with contextlib.suppress(OSError), \
                    open(path.with_name(path.name + ".1"), "rb") as old:
                if os.fstat(old.fileno()).st_ino == inode:
                    old.seek(offset)
                    old_rest = old.read()
            offset = 0
        inode = current
        fh.seek(offset)
        chunk = fh.read(CHUNK)
    return old_rest, chunk, inode, offset + len(chunk)


def _inode(path: Path) -> Optional[int]:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


__all__ = ["POLL", "RunView", "ended_check", "follow", "is_live", "last_lines",
           "launcher_alive", "read_json", "view"]
