"""liveness.py's shared parts: the rank programs, what must be undone at exit
(`cleanup`), a watched launch (`Launch`), the samples and their tables."""

from __future__ import annotations

import contextlib
import os
import random
import re
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, TextIO

import benchlib
import psutil

from fdl_fabric.testing import LiveProcess, processes_of_run

ROOT = benchlib.ROOT


SCENARIOS = ("detect", "hang", "idle", "ctrlc")


FDL, TORCHRUN = "fdl-fabric", "torchrun"


#: ``up`` (one write: torchrun's workers share one pipe) then sleep (bounded, so nothing
#: we missed outlives us by long).
UP_SLEEP = """\
import os, sys, time
os.write(1, b"up\\n")
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 300.0)
"""


#: The hang scenario's rank: ``up``, then asleep in a function of its own.
STUCK = """\
import sys, time
def stuck_here():
    time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 300.0)
print("up", flush=True)
stuck_here()
"""


#: ``rN line i`` as fast as Python prints, for argv[1] seconds; one write per line
#: (torchrun's workers share the terminal).
FLOOD = """\
import os, sys, time
tag = "r" + os.environ.get("RANK", "?")
end = time.time() + float(sys.argv[1])
out = sys.stdout
i = 0
while time.time() < end:
    out.write("%s line %d\\n" % (tag, i))
    out.flush()
    i += 1
"""


UP_LINE = re.compile(r"^\[[^\]]*:r(\d+)\] up$")


RUN_ID = re.compile(r"cluster launcher: run (\S+): ")


STEP_TIMEOUT = 120.0


#: The last commit before agent heartbeats (3fa206e): the idle scenario's peer.
BASELINE = "b8c4ced"


# -- what must be undone at exit ----------------------------------------------------------
FROZEN: list[psutil.Process] = []  # SIGSTOPped by us: SIGCONT before anything else


RUN_IDS: set[str] = set()  # launches whose leftovers are killed at exit


DOWN: list[tuple[Any, Any]] = []  # (netns lab, host) whose link we took down


LABS: list[Any] = []


PTYS: list[Any] = []  # liveness_ctrlc.Pty terminals still open


BenchError = benchlib.BenchError


def wait_until(predicate: Callable[[], Any], what: str, timeout: float = STEP_TIMEOUT,
               interval: float = 0.02) -> Any:
    return benchlib.wait_until(predicate, what, timeout, interval)


def exit_time(proc: subprocess.Popen[Any], timeout: float) -> Optional[float]:
    """When ``proc`` exited (a pidfd: the kernel wakes us), reaped; None after ``timeout``."""
    if proc.returncode is not None:
        return time.monotonic()
    try:
        fd = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        proc.wait()
        return time.monotonic()
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(max(0.0, timeout) * 1000):
            return None
        stamp = time.monotonic()
        proc.wait()
        return stamp
    finally:
        os.close(fd)


def exit_times(proc: subprocess.Popen[Any], others: Sequence[psutil.Process],
               timeout: float) -> tuple[Optional[float], list[float]]:
    """When ``proc`` (reaped then) and each of ``others`` exited, through pidfds, within
    ``timeout``: (``proc``'s time or None, the times of those of ``others`` that did)."""
    fds: dict[int, str] = {}
    gone: list[float] = []
    ended: Optional[float] = None
    poller = select.poll()
    try:
        if proc.returncode is None:
            fds[os.pidfd_open(proc.pid)] = "tool"
        else:
            ended = time.monotonic()
        for p in others:
            try:
                fd = os.pidfd_open(p.pid)
            except ProcessLookupError:
                gone.append(time.monotonic())
                continue
            if not _running(p):  # exited, a zombie, or the pid is someone else's now
                os.close(fd)
                gone.append(time.monotonic())
                continue
            fds[fd] = "rank"
        for fd in fds:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timeout
        pending = len(fds)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for fd, _ in poller.poll(left * 1000):
                now = time.monotonic()
                poller.unregister(fd)
                pending -= 1
                if fds[fd] == "tool":
                    ended = now
                else:
                    gone.append(now)
    finally:
        for fd in fds:
            os.close(fd)
    if ended is not None:
        proc.wait()
    return ended, gone


def freeze(p: psutil.Process) -> float:
    """SIGSTOP ``p`` (psutil checks it is still the same process); t0 just before."""
    FROZEN.append(p)
    t0 = time.monotonic()
    p.suspend()
    return t0


def thaw(p: psutil.Process) -> None:
    with contextlib.suppress(psutil.Error):
        p.resume()
    if p in FROZEN:
        FROZEN.remove(p)


def run_leftovers(run_id: str, timeout: float) -> list[int]:
    """Wait up to ``timeout`` for every process of the run to go (0.3 s of quiet);
    SIGKILL what is still there and return its pids."""
    deadline = time.monotonic() + timeout
    quiet_since: Optional[float] = None
    left: list[psutil.Process] = []
    while time.monotonic() < deadline:
        left = processes_of_run(run_id)
        now = time.monotonic()
        if left:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = now
        elif now - quiet_since >= 0.3:
            RUN_IDS.discard(run_id)
            return []
        time.sleep(0.05)
    RUN_IDS.discard(run_id)
    return benchlib.kill_run(run_id)


def kill_alive(procs: Sequence[psutil.Process], timeout: float = 5.0) -> list[int]:
    """Wait up to ``timeout`` for ``procs`` to exit; SIGKILL the rest, return their pids."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_running(p) for p in procs):
        time.sleep(0.05)
    left = [p for p in procs if _running(p)]
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    return [p.pid for p in left]


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def cleanup() -> None:
    """Undo everything, in an order that lets stopped processes go: thaw, links up, stop
    launches (TERM to their groups), kill the runs' leftovers, close ptys, stop labs."""
    for p in list(FROZEN):
        thaw(p)
    for lab, host in list(DOWN):
        with contextlib.suppress(Exception):
            lab.link_up(host)
        DOWN.remove((lab, host))
    benchlib.stop_all()
    for run_id in list(RUN_IDS):
        with contextlib.suppress(Exception):
            run_leftovers(run_id, 5.0)
    for t in list(PTYS):
        t.close()
    for lab in list(LABS):
        with contextlib.suppress(Exception):
            lab.stop()
        LABS.remove(lab)


def inv_argv(cluster: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "invoke", "--search-root", str(ROOT), "launch",
            "--cluster", str(cluster), *extra]


def torchrun_argv(nproc: int, *program: str) -> list[str]:
    return [str(Path(sys.executable).with_name("torchrun")), "--standalone",
            "--nproc-per-node", str(nproc), *program]


class Launch(LiveProcess):
    """`fdl_fabric.testing.LiveProcess` (lines timestamped as they arrive), remembered by
    benchlib so that its process group is stopped at exit."""

    def __init__(self, argv: Sequence[str], *, cwd: Path = ROOT,
                 env: Optional[dict[str, str]] = None) -> None:
        super().__init__(argv, cwd=cwd, env=env)
        benchlib.adopt(self.proc)

    def first(self, needle: str, after: float = 0.0, stream: Optional[str] = "err"
              ) -> Optional[float]:
        return next((t for t, line in self._of(stream) if t >= after and needle in line), None)

    def wait_text(self, needle: str, after: float, timeout: float) -> float:
        return wait_until(lambda: self.first(needle, after), repr(needle), timeout)  # type: ignore[no-any-return]

    def ups(self) -> list[float]:
        return [t for t, line in self._of("out") if UP_LINE.match(line)]

    def wait_ups(self, count: int, timeout: float) -> float:
        """Time of the ``count``-th ``up`` line (stdout), once they all arrived."""

        def ready() -> Optional[float]:
            got = self.ups()
            if len(got) >= count:
                return got[count - 1]
            if self.proc.poll() is not None:
                raise BenchError(f"exited {self.proc.returncode} with {len(got)} of {count} "
                                 "up lines: " + " | ".join(self.stderr_lines[-4:]))
            return None

        return wait_until(ready, f"{count} up lines", timeout)  # type: ignore[no-any-return]

    def remember_run(self) -> str:
        run_id = wait_until(lambda: next((m.group(1) for line in self.stderr_lines
                                          for m in [RUN_ID.match(line)] if m), None),
                            "the run id line", 30)
        RUN_IDS.add(run_id)
        return run_id  # type: ignore[no-any-return]

    def stop(self) -> Optional[int]:
        code = benchlib.stop(self.proc, grace=10)
        for t in self._readers:
            t.join(5)
        return code


def settle(base: float, spread: float) -> None:
    time.sleep(base + random.uniform(0.0, spread))


# -- samples and tables ---------------------------------------------------------------------
@dataclass
class Sample:
    scenario: str
    case: str
    tool: str
    rep: int
    warmup: bool = False
    ok: bool = False
    error: str = ""
    s: dict[str, Optional[float]] = field(default_factory=dict)  # seconds from t0
    code: Optional[int] = None
    last_line: str = ""
    leftovers: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # something looked wrong
    info: list[str] = field(default_factory=list)  # context, printed with the run


def fmt(v: Optional[float], digits: int = 2) -> str:
    return benchlib.fmt(v, digits, none="-")


def stats_rows(samples: Sequence[Sample], case: str, tool: str,
               measures: Sequence[tuple[str, str]], *, capped: Sequence[str] = (),
               cap: Optional[float] = None) -> list[list[str]]:
    """One row per measure: median, min, max, n (and how many runs never got there)."""
    got = [s for s in samples if s.case == case and s.tool == tool and not s.warmup]
    ok = [s for s in got if s.ok]
    rows = []
    for key, label in measures:
        values = [v for s in ok for v in [s.s.get(key)] if v is not None]
        missing = len(ok) - len(values)
        extra = ""
        if missing and key in capped and cap is not None:
            extra = f"{missing} of {len(ok)}: not within {cap:g} s"
        elif missing:
            extra = f"{missing} of {len(ok)} without it"
        if len(got) > len(ok):
            extra = (extra + "; " if extra else "") + f"{len(got) - len(ok)} failed"
        if values:
            rows.append([case, tool, label, fmt(statistics.median(values)),
                         fmt(min(values)), fmt(max(values)), str(len(values)), extra])
        else:
            rows.append([case, tool, label, "-", "-", "-", "0", extra])
    return rows


def print_table(out: TextIO, title: str, rows: list[list[str]]) -> None:
    head = ["case", "tool", "measure (s)", "median", "min", "max", "n", "note"]
    out.write(f"\n{title}\n\n")
    out.write(benchlib.table([head, *rows], [False, False, False, True, True, True, True,
                                             False]) + "\n")


def median_of(samples: Sequence[Sample], case: str, tool: str, key: str) -> Optional[float]:
    values = [v for s in samples if s.case == case and s.tool == tool and s.ok
              and not s.warmup for v in [s.s.get(key)] if v is not None]
    return statistics.median(values) if values else None


def max_of(samples: Sequence[Sample], case: str, tool: str, key: str) -> Optional[float]:
    values = [v for s in samples if s.case == case and s.tool == tool and s.ok
              and not s.warmup for v in [s.s.get(key)] if v is not None]
    return max(values) if values else None


def environ_of(p: psutil.Process) -> dict[str, str]:
    try:
        return p.environ()
    except psutil.Error:
        return {}


def write_verdicts(samples: Sequence[Sample], scenario: str, out: TextIO) -> None:
    seen: dict[tuple[str, str], set[str]] = {}
    for s in samples:
        if s.scenario == scenario and s.last_line:
            line = re.sub(r"\d{8}-\d{6}-[0-9a-f]+", "<run>", s.last_line)
            line = re.sub(r"\d+\.\d+s", "N.Ns", line)
            line = re.sub(r"\b(Process|pid|pids) (\[[\d, ]+\]|\d+)", r"\1 N", line)
            seen.setdefault((s.case, s.tool), set()).add(line[:160])
    for (case, tool), lines in seen.items():
        for line in sorted(lines):
            out.write(f"  last line, {case} ({tool}): {line}\n")
    for s in samples:
        if s.scenario == scenario and (s.error or s.notes):
            what = "FAILED: " + s.error if s.error else "; ".join(s.notes)
            if s.error and s.notes:
                what += " (" + "; ".join(s.notes) + ")"
            out.write(f"  ! {s.case} ({s.tool}) run {s.rep + 1}"
                      f"{' (warm-up)' if s.warmup else ''}: {what}\n")
