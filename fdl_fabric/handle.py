"""``RunHandle``: a run of this controller, from Python, wherever it was started.

``fdl_fabric.launch(..., detach=True)`` returns one once every rank runs under the
detached supervisor; ``fdl_fabric.attach(run_id)`` returns one for a run started
elsewhere (another terminal, ``inv launch --detach``, a foreground launch still going).
It only reads the run's record (`runs.reading`) and, for ``stop``, takes the path of
``fdl-fabric stop``: the handle holds no connection, so it may be dropped, pickled or
made again at any time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .commands.follow import LineFilter
from .commands.onhost import there
from .commands.stopping import EXIT_TIMED_OUT, WAIT_POLL, send_stop
from .errors import EXIT_USAGE, FdlError
from .events import EventBus
from .presentation.words import cause_event, render
from .results import Attempt, LaunchResult, RankOutcome
from .runs import place
from .runs.reading import ended_check, last_lines, view
from .runs.reading import follow as follow_file
from .runs.record import CONSOLE, RESULT, RunState


class _Quiet:
    def emit(self, event: Any) -> None:
        pass


@dataclass(frozen=True)
class RunHandle:
    """One run, by its id; every call reads its record afresh."""

    run_id: str
    folder: Path

    def status(self) -> dict[str, Any]:
        """Its state now: ``state`` (starting, running, stopping, ended, lost),
        ``attempt``, ``verdict`` and ``exit_code`` once it ended, its hosts, its launcher."""
        return view(self.folder).row()

    def logs(self, *, follow: bool = False, rank: Optional[int] = None,
             host: Optional[str] = None) -> Iterator[str]:
        """Its console's lines (``rank``/``host``: theirs only); ``follow``: as they
        come, until the run ends."""
        keep = LineFilter(rank, host)
        path = self.folder / CONSOLE
        data, offset = last_lines(path, None)
        yield from _lines(keep.lines(data))
        if follow:
            for chunk in follow_file(path, offset, done=ended_check(self.folder)):
                yield from _lines(keep.lines(chunk))

    def stop(self, *, kill: bool = False) -> None:
        """Ask its launcher to stop it (TERM, then KILL after the kill grace; ``kill``: at
        once); `wait` for the verdict."""
        send_stop(self.folder, kill=kill, events=EventBus(_Quiet()))

    def wait(self, timeout: Optional[float] = None) -> LaunchResult:
        """Block until it ends; its result. Raises TimeoutError after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            run = view(self.folder)
            if run.ended:
                return result_of_record(run.run_id, run.result, run.phase is RunState.LOST)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"run {self.run_id} is still {run.phase.value} after "
                                   f"{timeout:g}s")
            time.sleep(WAIT_POLL)


@dataclass(frozen=True)
class RemoteRunHandle:
    """A run whose controller is another host (``launch(..., detach=True, on=HOST)``):
    each call is the same command there, over SSH (`commands.onhost`)."""

    run_id: str
    on: str

    def status(self) -> dict[str, Any]:
        code, out, _ = there(self.on, ["status", "--all", "--json"], hide=True)
        rows = json.loads(out)["controller"]["runs"] if code == 0 else []
        for row in rows:
            if row["run_id"] == self.run_id:
                return dict(row)
        raise FdlError(f"run {self.run_id} is not recorded on {self.on}")

    def logs(self, *, follow: bool = False, rank: Optional[int] = None,
             host: Optional[str] = None) -> Iterator[str]:
        words = ["logs", self.run_id, *(["-f"] if follow else []),
                 *(["--rank", str(rank)] if rank is not None else []),
                 *(["--host", host] if host is not None else [])]
        yield from there(self.on, words, hide=True)[1].splitlines()

    def stop(self, *, kill: bool = False) -> None:
        there(self.on, ["stop", self.run_id, *(["--kill"] if kill else [])], hide=True)

    def wait(self, timeout: Optional[float] = None) -> LaunchResult:
        words = ["wait", self.run_id, *(["--timeout", f"{timeout:g}"] if timeout else [])]
        folder = self.status()["folder"]
        code, _, data = there(self.on, words, hide=True, read=f"{folder}/{RESULT}")
        if code == EXIT_TIMED_OUT:
            raise TimeoutError(f"run {self.run_id} on {self.on} is still going after "
                               f"{timeout:g}s")
        result = json.loads(data) if data else None
        return result_of_record(self.run_id, result, result is None)


def _lines(data: bytes) -> Iterator[str]:
    yield from data.decode("utf-8", "replace").splitlines()


def attach(run_id: Optional[str] = None) -> RunHandle:
    """The handle of a run of this controller: its id, the id's unique start, or None for
    the newest. Raises `FdlError` (exit_code 2) when none matches."""
    try:
        folder = place.find(run_id)
    except (LookupError, OSError) as exc:
        raise FdlError(str(exc), EXIT_USAGE) from None
    return RunHandle(folder.name, folder)


def result_of_record(run_id: str, result: Optional[dict[str, Any]], lost: bool
                     ) -> LaunchResult:
    """A `LaunchResult` from a record's result.json (or its absence: the launcher lost)."""
    if result is None or lost:
        message = (f"cluster launcher: failed: run {run_id}: its launcher is gone without "
                   "a verdict")
        return LaunchResult(verdict="failed", exit_code=1, message=message, run_id=run_id,
                            ranks=(), attempts=(), root_cause=None)
    ranks = tuple(_outcome(row) for row in result.get("ranks") or [])
    cause_rank = result.get("root_cause_rank")
    root = next((r for r in ranks if r.rank == cause_rank), None) \
        if cause_rank is not None else None
    return LaunchResult(verdict=str(result.get("verdict")),
                        exit_code=int(result.get("exit_code") or 0),
                        message=str(result.get("message")), run_id=run_id, ranks=ranks,
                        attempts=_attempts(result), root_cause=root)


def _attempts(result: dict[str, Any]) -> tuple[Attempt, ...]:
    """Each attempt of the record: its list, or (a record without one) the run as one."""
    listed = result.get("attempt_list") or []
    if not listed:
        return (Attempt(str(result.get("verdict")), int(result.get("exit_code") or 0),
                        str(result.get("message")), tuple(result.get("hosts") or ())),)
    return tuple(_attempt(a) for a in listed)


def _attempt(row: dict[str, Any]) -> Attempt:
    return Attempt(row.get("verdict", "?"), 0 if row.get("verdict") in ("ok", "degraded") else 1,
                   render(cause_event(row["cause"])) if row.get("cause") else "",
                   tuple(row.get("hosts") or ()))


def _outcome(row: dict[str, Any]) -> RankOutcome:
    exit_ = row.get("exit") or {}
    return RankOutcome(rank=row["rank"], host=row["host"], state=row["state"],
                       exit_code=exit_.get("code"), signal=exit_.get("signal"),
                       lost=exit_.get("lost"), duration=row.get("duration", 0.0))


__all__ = ["RemoteRunHandle", "RunHandle", "attach", "result_of_record"]
