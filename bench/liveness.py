#!/usr/bin/env python3
"""Liveness of `inv launch` (issue 18): detection, hang to verdict, idle cost, Ctrl-C.

A script, not a test: it prints medians (min, max) over ``--repeat`` runs, beside peers
measured in the same run where there is one, and never asserts a timing. Scenarios
(``--only NAME``, repeatable; default all four, in this order):

* ``detect``: a frozen agent and a black-holed host against ``agent_timeout`` (``--agent-
  timeout``, 5 s). *Frozen agent*: 2 lab hosts x 1 rank (it writes ``up``, then sleeps);
  once both ranks are up, plus 0.5 s and a random 0-1 s (one heartbeat period: a random
  phase of the agent's heartbeats), the agent of rank 1 (the rank's parent) gets
  SIGSTOP. Measured from just before the SIGSTOP: the launcher's ``unresponsive`` line,
  its verdict (last stderr line) and its exit. Then SIGCONT; what is left of the run is
  waited for (the agent's lease stops its rank), then killed by pid and reported.
  *Black hole* (root only: `fdl_fabric.testing.NetnsLab`): localhost x 1 + one netns
  host x 1, the host's veth taken down (``link_down``: no FIN, no RST), timed the same
  way; the link comes back after the launcher exits. *Peer*: torchrun has no liveness
  check of its own; its nearest case on one machine is a frozen worker: ``torchrun
  --standalone --nproc-per-node 2`` with the same program, worker 1 SIGSTOPped, and
  whatever torchrun prints or does is watched for ``--torchrun-cap`` s (30). (An
  fdl-fabric *rank* frozen the same way is not a host fault: its agent still answers;
  only ``hang_timeout`` catches it. Not measured here.)
  Target: detected within ``agent_timeout`` + 1 s.

* ``hang``: ``--hosts`` x ``--per-host`` (8 x 8) lab ranks print ``up`` and sleep in
  ``stuck_here()``; ``--hang-timeout`` 5. From the launcher's ``run hung ...;
  collecting every rank's stack`` line (the timeout expired): its ``where each rank is
  (hang):`` line, its last grouped line, and its exit; also the last ``up`` line to the
  ``run hung`` line (the timeout plus the supervisor's reaction). Variants, round-robin:
  the agents' own py-spy (what ``FLODL_PY_SPY`` unset finds: on this machine a pyenv
  shim), the py-spy binary itself (only when the one found is a script, e.g. a pyenv
  shim), and no py-spy (``FLODL_PY_SPY=none``: what ``/proc`` says). The agents' value
  of ``FLODL_PY_SPY`` comes from a one-line file the lab's login shell reads
  (``SshdLab(login_shell_rc=...)``), rewritten before each launch. Target: <= 3 s from
  the hang timeout to the grouped view, with py-spy.

* ``idle``: the launcher's own CPU (user+sys of its process, all threads, from
  ``/proc/<pid>/stat``, % of one core) and thread count while every rank sleeps, over
  ``--window`` s (20) of steady state, 2 s after the last ``up``; shapes ``--idle-shapes``
  (``8x8,32x8``), round-robin. The measurement is `idle.measure` (bench/idle.py), reused
  as is: the agents (which now send a heartbeat every second when idle) and the
  per-session sshd processes are reported beside it. Peer, interleaved: the same
  launch by ``--baseline`` (b8c4ced, the last commit before heartbeats; ``git archive``
  into the temporary folder and imported first through PYTHONPATH, so its agents are
  the old ones too). Target: <= 2 % at 32 x 8 (1.6 % before heartbeats, measured by
  idle.py at another moment).

* ``ctrlc``: Ctrl-C on a real pty (80x24, the launcher's controlling terminal, a thread
  draining the master as fast as it can, or at ``--pty-rate`` MB/s): localhost x 1 + 2
  lab hosts x 1, each rank writing ``rN line i`` (one write per line) as fast as it
  can; once every rank's lines showed, plus 0.5 s and a random 0-0.2 s, ``\\x03`` is
  written to the master. Measured: the key to the launcher's exit and to every rank
  process gone (pidfds), its exit status, the terminal's last line, and anything of
  the run left 5 s later. Peer, interleaved: ``torchrun --standalone --nproc-per-node
  3`` with the same program on the same pty set-up, capped at ``--ctrlc-cap`` s (60;
  then its process group is killed and the run reported as not exited). Default 20
  runs each. The issue saw 0.18 s vs 29.5 s (tmux, whose reader is slower than this
  one).

Everything the script starts runs in a process group of its own (benchlib) and is
stopped by pid or group at exit; frozen processes get SIGCONT first; links taken down
come back up; labs are stopped. Run ``python3 bench/liveness.py --help``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import random
import re
import select
import shlex
import signal
import statistics
import struct
import subprocess
import sys
import termios
import threading
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
_FROZEN: list[psutil.Process] = []  # SIGSTOPped by us: SIGCONT before anything else
_RUN_IDS: set[str] = set()  # launches whose leftovers are killed at exit
_DOWN: list[tuple[Any, Any]] = []  # (netns lab, host) whose link we took down
_LABS: list[Any] = []
_PTYS: list[Pty] = []


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
    _FROZEN.append(p)
    t0 = time.monotonic()
    p.suspend()
    return t0


def thaw(p: psutil.Process) -> None:
    with contextlib.suppress(psutil.Error):
        p.resume()
    if p in _FROZEN:
        _FROZEN.remove(p)


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
            _RUN_IDS.discard(run_id)
            return []
        time.sleep(0.05)
    _RUN_IDS.discard(run_id)
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
    for p in list(_FROZEN):
        thaw(p)
    for lab, host in list(_DOWN):
        with contextlib.suppress(Exception):
            lab.link_up(host)
        _DOWN.remove((lab, host))
    benchlib.stop_all()
    for run_id in list(_RUN_IDS):
        with contextlib.suppress(Exception):
            run_leftovers(run_id, 5.0)
    for t in list(_PTYS):
        t.close()
    for lab in list(_LABS):
        with contextlib.suppress(Exception):
            lab.stop()
        _LABS.remove(lab)


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
        _RUN_IDS.add(run_id)
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


def _fmt(v: Optional[float], digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


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
            rows.append([case, tool, label, _fmt(statistics.median(values)),
                         _fmt(min(values)), _fmt(max(values)), str(len(values)), extra])
        else:
            rows.append([case, tool, label, "-", "-", "-", "0", extra])
    return rows


def print_table(out: TextIO, title: str, rows: list[list[str]]) -> None:
    head = ["case", "tool", "measure (s)", "median", "min", "max", "n", "note"]
    out.write(f"\n{title}\n\n")
    out.write(benchlib.table([head, *rows], [False, False, False, True, True, True, True,
                                             False]) + "\n")


def _median(samples: Sequence[Sample], case: str, tool: str, key: str) -> Optional[float]:
    values = [v for s in samples if s.case == case and s.tool == tool and s.ok
              and not s.warmup for v in [s.s.get(key)] if v is not None]
    return statistics.median(values) if values else None


def _max(samples: Sequence[Sample], case: str, tool: str, key: str) -> Optional[float]:
    values = [v for s in samples if s.case == case and s.tool == tool and s.ok
              and not s.warmup for v in [s.s.get(key)] if v is not None]
    return max(values) if values else None


# ==========================================================================================
# detect
# ==========================================================================================
FROZEN_AGENT, BLACK_HOLE, FROZEN_WORKER = "frozen agent", "black-holed host", "frozen worker"


class Detect:
    def __init__(self, args: argparse.Namespace, tmp: Path, lab: Any, netns: Any) -> None:
        self.args = args
        self.tmp = tmp
        self.lab = lab
        self.netns = netns
        self.prog = tmp / "up_sleep.py"
        self.prog.write_text(UP_SLEEP)
        self.cmd = f"{shlex.quote(sys.executable)} -u {shlex.quote(str(self.prog))} 300"
        self.cluster = lab.write_cluster([lab.worker(h, nproc=1) for h in lab.hosts[:2]],
                                         filename="detect-frozen.yml", kill_grace=1,
                                         agent_timeout=args.agent_timeout)
        self.ns_cluster: Optional[Path] = None
        if netns is not None:
            (host,) = netns.hosts
            opts = [*netns.ssh_options(), "ServerAliveInterval=0"]  # only the heartbeats
            self.ns_cluster = netns.write_cluster(
                [{"host": "localhost", "nproc": 1, "path": str(ROOT)},
                 netns.worker(host, nproc=1, ssh={"options": opts})],
                filename="detect-blackhole.yml", kill_grace=1, agent_timeout=args.agent_timeout)

    def cases(self) -> list[tuple[str, str]]:
        cases = [(FROZEN_AGENT, FDL)]
        if not self.args.no_torchrun:
            cases.append((FROZEN_WORKER, TORCHRUN))
        if self.netns is not None:
            cases.append((BLACK_HOLE, FDL))
        return cases

    def run(self, case: str, tool: str, rep: int) -> Sample:
        sample = Sample("detect", case, tool, rep)
        try:
            if case == FROZEN_AGENT:
                self.frozen_agent(sample)
            elif case == BLACK_HOLE:
                self.black_hole(sample)
            else:
                self.frozen_worker(sample)
            sample.ok = not sample.error
        except BenchError as exc:
            sample.error = str(exc)
        if sample.leftovers:
            sample.notes.append(f"killed leftovers {sample.leftovers}")
        return sample

    def _verdict(self, sample: Sample, run: Launch, t0: float, host: str,
                 needle: str) -> None:
        """The launcher's unresponsive line, its verdict and exit, from t0."""
        cap = self.args.agent_timeout + 30
        try:
            said = run.wait_text(needle, t0, cap)
        except BenchError:
            said = None
            sample.error = f"no {needle!r} line within {cap:g}s"
        sample.s["unresponsive"] = None if said is None else said - t0
        ended = exit_time(run.proc, 30)
        if ended is None:
            sample.error = sample.error or "the launcher did not exit within 30 s of the line"
            return
        sample.s["exit"] = ended - t0
        for t in run._readers:
            t.join(5)
        sample.code = run.proc.returncode
        err = run._of("err")
        if err:
            sample.s["verdict"] = err[-1][0] - t0
            sample.last_line = err[-1][1]
            if host not in sample.last_line:
                sample.notes.append(f"the verdict does not name {host}")
        if sample.code != 1:
            sample.notes.append(f"exit {sample.code}, expected 1")

    def frozen_agent(self, sample: Sample) -> None:
        run = Launch(inv_argv(self.cluster, "--cmd", self.cmd))
        agent: Optional[psutil.Process] = None
        run_id = ""
        try:
            run.wait_ups(2, 60)
            run_id = run.remember_run()
            ranks = {int(p.environ().get("RANK", -1)): p for p in processes_of_run(run_id)
                     if os.getpgid(p.pid) == p.pid}
            if 1 not in ranks:
                raise BenchError(f"rank 1 not found among the run's processes: {ranks}")
            agent = psutil.Process(ranks[1].ppid())
            settle(0.5, 1.0)
            t0 = freeze(agent)
            self._verdict(sample, run, t0, self.lab.hosts[1].name, "unresponsive")
        finally:
            if agent is not None:
                thaw(agent)
            run.stop()
            if run_id:
                sample.leftovers = run_leftovers(run_id, 10)
            if agent is not None:
                left = kill_alive([agent], 10)
                if left:
                    sample.notes.append(f"the thawed agent (pid {agent.pid}) did not exit "
                                        "within 10 s: killed")

    def black_hole(self, sample: Sample) -> None:
        assert self.ns_cluster is not None
        (host,) = self.netns.hosts
        run = Launch(inv_argv(self.ns_cluster, "--cmd", self.cmd))
        run_id = ""
        try:
            run.wait_ups(2, 60)
            run_id = run.remember_run()
            settle(0.5, 1.0)
            _DOWN.append((self.netns, host))
            t0 = time.monotonic()
            self.netns.link_down(host)
            self._verdict(sample, run, t0, host.name, f"host '{host.name}' unresponsive")
        finally:
            if (self.netns, host) in _DOWN:
                self.netns.link_up(host)
                _DOWN.remove((self.netns, host))
            run.stop()
            if run_id:
                # Behind the cut, sshd's ClientAlive (1 s x 3) ends the session and the
                # agent stops its rank.
                sample.leftovers = run_leftovers(run_id, 15)

    def frozen_worker(self, sample: Sample) -> None:
        cap = self.args.torchrun_cap
        run = Launch(torchrun_argv(2, str(self.prog), "300"), cwd=self.tmp)
        worker: Optional[psutil.Process] = None
        workers: list[psutil.Process] = []
        try:
            try:
                wait_until(lambda: sum(line.count("up") for line in run.stdout_lines) >= 2
                           or run.proc.poll() is not None, "2 up lines from torchrun's workers",
                           60)
            except BenchError as exc:
                raise BenchError(f"{exc}; torchrun said: "
                                 + " | ".join(line for _, _, line in run.lines[-6:])) from None
            if run.proc.poll() is not None:
                raise BenchError(f"torchrun exited {run.proc.returncode} early: "
                                 + " | ".join(line for _, _, line in run.lines[-6:]))
            workers = [p for p in psutil.Process(run.pid).children(recursive=True)
                       if "LOCAL_RANK" in _environ(p)]
            by_rank = {int(_environ(p).get("RANK", -1)): p for p in workers}
            if 1 not in by_rank:
                raise BenchError(f"worker 1 not found among torchrun's children: {by_rank}")
            worker = by_rank[1]
            settle(0.5, 1.0)
            t0 = freeze(worker)
            ended = exit_time(run.proc, cap)
            said = [(t, line) for t, _, line in list(run.lines) if t >= t0]
            sample.s["first_line"] = said[0][0] - t0 if said else None
            sample.s["exit"] = None if ended is None else ended - t0
            if said:
                sample.last_line = said[0][1]
            sample.code = run.proc.returncode
            sample.info.append(f"watched {cap:g} s: " + (
                f"exited {sample.code}" if ended is not None else "still running") +
                f", {len(said)} line(s)")
        finally:
            if worker is not None:
                thaw(worker)
            run.stop()
            sample.leftovers = kill_alive(workers, 5)

    def report(self, samples: Sequence[Sample], out: TextIO) -> None:
        a = self.args.agent_timeout
        measures = (("unresponsive", "fault -> 'unresponsive' line"),
                    ("verdict", "fault -> verdict (last line)"),
                    ("exit", "fault -> launcher exited"))
        rows = stats_rows(samples, FROZEN_AGENT, FDL, measures)
        if self.netns is not None:
            rows += stats_rows(samples, BLACK_HOLE, FDL, measures)
        if not self.args.no_torchrun:
            cap = self.args.torchrun_cap
            rows += stats_rows(samples, FROZEN_WORKER, TORCHRUN,
                               (("first_line", "SIGSTOP -> torchrun's first line"),
                                ("exit", "SIGSTOP -> torchrun exited")),
                               capped=("first_line", "exit"), cap=cap)
        print_table(out, f"detect: agent_timeout {a:g} s; seconds from the SIGSTOP (frozen "
                    "agent / worker) or the link going down (black hole)", rows)
        out.write("\ntargets\n\n")
        trows = [["target", "median", "max", f"bound (agent_timeout {a:g} + 1)", "met"]]
        cases = [FROZEN_AGENT] + ([BLACK_HOLE] if self.netns is not None else [])
        for case in cases:
            med = _median(samples, case, FDL, "unresponsive")
            top = _max(samples, case, FDL, "unresponsive")
            trows.append([f"{case} -> 'unresponsive' line", _fmt(med), _fmt(top),
                          f"{a + 1:g}", "n/a" if top is None else
                          ("yes" if top <= a + 1 else "NO (max)")])
        out.write(benchlib.table(trows, [False, True, True, True, False]) + "\n")
        if not self.args.no_torchrun:
            t = [s for s in samples if s.tool == TORCHRUN and s.ok]
            exited = [s for s in t if s.s.get("exit") is not None]
            out.write(f"  peer: torchrun, a SIGSTOPped worker: {len(exited)} of {len(t)} "
                      f"run(s) ended within {self.args.torchrun_cap:g} s "
                      "(torchrun has no liveness check)\n")
        _verdicts(samples, "detect", out)


def _environ(p: psutil.Process) -> dict[str, str]:
    try:
        return p.environ()
    except psutil.Error:
        return {}


def _verdicts(samples: Sequence[Sample], scenario: str, out: TextIO) -> None:
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


# ==========================================================================================
# hang
# ==========================================================================================
class Hang:
    def __init__(self, args: argparse.Namespace, tmp: Path, lab: Any, mode_file: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.lab = lab
        self.mode_file = mode_file
        self.world = args.hosts * args.per_host
        prog = tmp / "stuck.py"
        prog.write_text(STUCK)
        self.cmd = f"{shlex.quote(sys.executable)} -u {shlex.quote(str(prog))} 300"
        self.cluster = lab.write_cluster(
            [lab.worker(h, nproc=args.per_host) for h in lab.hosts[:args.hosts]],
            filename="hang.yml", kill_grace=2, hang_timeout=args.hang_timeout)
        #: variant name -> the FLODL_PY_SPY value the agents get ("" = let them look)
        self.variants: dict[str, str] = {}
        self.found = self.host_py_spy("")
        self.variants["py-spy (as found)"] = ""
        binary = args.py_spy or _py_spy_binary()
        if args.py_spy or (binary and self.found and not _is_elf(self.found)):
            self.variants["py-spy (binary)"] = binary or ""
        self.variants["no py-spy"] = "none"
        self.views: dict[str, list[str]] = {}

    def host_py_spy(self, mode: str) -> str:
        """What the agents' login shell on the first host sees: py-spy on PATH, or
        FLODL_PY_SPY."""
        self.mode_file.write_text(mode + "\n")
        out = subprocess.run(self.lab.ssh_argv(
            self.lab.hosts[0], 'if [ -n "$FLODL_PY_SPY" ]; then echo "$FLODL_PY_SPY"; '
            'else command -v py-spy || echo none; fi'), capture_output=True, text=True,
            timeout=30, stdin=subprocess.DEVNULL)
        return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "?"

    def cases(self) -> list[tuple[str, str]]:
        return [(v, FDL) for v in self.variants]

    def run(self, case: str, tool: str, rep: int) -> Sample:
        sample = Sample("hang", case, tool, rep)
        self.mode_file.write_text(self.variants[case] + "\n")
        run = Launch(inv_argv(self.cluster, "--cmd", self.cmd))
        run_id = ""
        try:
            last_up = run.wait_ups(self.world, self.args.timeout)
            run_id = run.remember_run()
            cap = self.args.hang_timeout + 60
            hung = run.wait_text("run hung", last_up, cap)
            if "collecting every rank's stack" not in next(
                    line for t, line in run._of("err") if t == hung and "run hung" in line):
                sample.notes.append("the 'run hung' line does not say it collects stacks")
            sample.s["detected"] = hung - last_up
            head = run.wait_text("where each rank is (hang):", hung, 60)
            ended = exit_time(run.proc, 60)
            if ended is None:
                raise BenchError("the launcher did not exit within 60 s of the grouped view")
            for t in run._readers:
                t.join(5)
            err = run._of("err")
            at = next(i for i, (t, line) in enumerate(err) if "where each rank is (hang):" in line)
            view = []
            for t, line in err[at + 1:]:
                if not line.startswith("  "):
                    break
                view.append((t, line))
            sample.s["header"] = head - hung
            sample.s["grouped"] = (view[-1][0] if view else head) - hung
            sample.s["exit"] = ended - hung
            sample.code = run.proc.returncode
            sample.last_line = err[-1][1] if err else ""
            self.views.setdefault(case, [line for _, line in view])
            if sample.code != 1:
                sample.notes.append(f"exit {sample.code}, expected 1")
            if not sample.last_line.startswith("cluster launcher: run hung"):
                sample.notes.append("the last line is not the hung verdict")
            if self.variants[case] != "none" and not any("stuck_here" in line
                                                         for _, line in view):
                sample.notes.append("no stuck_here frame in the grouped view")
            sample.ok = True
        except BenchError as exc:
            sample.error = str(exc)
        finally:
            run.stop()
            if run_id:
                sample.leftovers = run_leftovers(run_id, 15)
        if sample.leftovers:
            sample.notes.append(f"killed leftovers {sample.leftovers}")
        return sample

    def report(self, samples: Sequence[Sample], out: TextIO) -> None:
        h = self.args.hang_timeout
        rows: list[list[str]] = []
        for case in self.variants:
            rows += stats_rows(samples, case, FDL, (
                ("detected", f"last up -> 'run hung' line (hang_timeout {h:g})"),
                ("header", "'run hung' -> 'where each rank is (hang):'"),
                ("grouped", "'run hung' -> last grouped line"),
                ("exit", "'run hung' -> launcher exited")))
        print_table(out, f"hang: {self.args.hosts} hosts x {self.args.per_host} ranks, "
                    f"hang_timeout {h:g} s; seconds from the 'run hung ...; collecting every "
                    "rank's stack' line unless said", rows)
        for case, view in self.views.items():
            out.write(f"\n  grouped view, {case} (FLODL_PY_SPY="
                      f"{self.variants[case] or '<unset>'}):\n")
            for line in view:
                out.write(f"  {line[:150]}\n")
        out.write(f"\n  py-spy the agents find with FLODL_PY_SPY unset: {self.found}"
                  f"{'' if _is_elf(self.found) else ' (a script, not the binary)'}\n")
        out.write("\ntargets\n\n")
        trows = [["target", "median", "max", "bound", "met"]]
        for case in self.variants:
            if self.variants[case] == "none":
                continue
            med = _median(samples, case, FDL, "grouped")
            trows.append([f"hang timeout -> grouped view, {case}", _fmt(med),
                          _fmt(_max(samples, case, FDL, "grouped")), "3",
                          "n/a" if med is None else ("yes" if med <= 3 else "NO")])
        out.write(benchlib.table(trows, [False, True, True, True, False]) + "\n")
        _verdicts(samples, "hang", out)


def _py_spy_binary() -> Optional[str]:
    """The py-spy executable next to this interpreter (pip puts it there), if any."""
    path = Path(sys.executable).with_name("py-spy")
    return str(path) if _is_elf(str(path)) else None


def _is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"\x7fELF"
    except OSError:
        return False


# ==========================================================================================
# idle
# ==========================================================================================
class Idle:
    def __init__(self, args: argparse.Namespace, tmp: Path, lab: Any) -> None:
        import idle  # bench/idle.py: its measure() is what this scenario runs

        self.idle = idle
        self.args = args
        self.lab = lab
        script = tmp / "rank_idle.py"  # idle._host_side finds the ranks by this name
        script.write_text(idle.RANK_SCRIPT)
        sleep = args.timeout + 2 + args.window + 120
        cmd = f"{shlex.quote(sys.executable)} {shlex.quote(str(script))} {sleep:g}"
        #: tool -> the command that starts `inv launch` (the baseline: an older tree of
        #: this repository, imported first through PYTHONPATH; its agents come from it too)
        launchers = {FDL: [sys.executable, "-m", "invoke", "--search-root", str(ROOT),
                           "launch"]}
        self.remark = ""
        if args.baseline and args.baseline != "none":
            tree = tmp / "baseline"
            tree.mkdir()
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.baseline],
                                     capture_output=True, timeout=60)
            if archive.returncode == 0:
                subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout,
                               check=True, timeout=60)
                # From the old tree's folder: ``python -m`` puts the working directory
                # first on sys.path, so from this repository's root the current fdl_fabric
                # would be imported instead.
                head = ["env", "-C", str(tree), f"PYTHONPATH={tree}", sys.executable]
                where = subprocess.run([*head, "-c", "import fdl_fabric; "
                                        "print(fdl_fabric.__file__)"], capture_output=True,
                                       text=True, timeout=60).stdout.strip()
                if where.startswith(str(tree)):
                    launchers[f"{FDL} @{args.baseline}"] = [
                        *head, "-m", "invoke", "--search-root", str(tree), "launch"]
                else:
                    self.remark = (f"  baseline {args.baseline} skipped: it imports "
                                   f"fdl_fabric from {where or '?'}, not {tree}\n")
            else:
                self.remark = (f"  baseline {args.baseline} skipped: git archive: "
                               f"{archive.stderr.decode(errors='replace').strip()[:200]}\n")
        self.tools = list(launchers)
        self.plans: dict[tuple[str, str], tuple[list[str], int, int]] = {}
        for hosts, per in args.idle_shape_list:
            shape = f"{hosts}x{per}"
            cluster = lab.write_cluster([lab.worker(h, nproc=per) for h in lab.hosts[:hosts]],
                                        filename=f"idle-{shape}.yml")
            for tool, head in launchers.items():
                self.plans[shape, tool] = ([*head, "--cluster", str(cluster), "--cmd", cmd],
                                           hosts * per, hosts)

    def cases(self) -> list[tuple[str, str]]:
        return list(self.plans)

    def run(self, case: str, tool: str, rep: int) -> Sample:
        argv, world, _hosts = self.plans[case, tool]
        ns = argparse.Namespace(timeout=self.args.timeout, settle=2.0, window=self.args.window)
        got = self.idle.measure(self.lab, case, FDL, rep, argv, world, ns)
        sample = Sample("idle", case, tool, rep, ok=got.ok, error=got.error)
        sample.s = {"cpu": got.cpu_pct, "threads": got.threads,
                    "slice": max(got.slices) if got.slices else None,
                    "agents": got.agents_pct, "sshd": got.sshd_pct, "up": got.up_after}
        return sample

    def report(self, samples: Sequence[Sample], out: TextIO) -> None:
        rows = [["shape (hosts x ranks)", "tool", "launcher CPU %", "min-max",
                 "max 1 s slice %", "threads", "agents % (all)", "agents % per host",
                 "sshd sessions %", "all up s", "runs"]]
        for (shape, tool), (_argv, _world, hosts) in self.plans.items():
            got = [s for s in samples if s.case == shape and s.tool == tool and s.ok]
            bad = [s for s in samples if s.case == shape and s.tool == tool and not s.ok]

            def med(key: str, got: list[Sample] = got) -> Optional[float]:
                vals = [v for s in got for v in [s.s.get(key)] if v is not None]
                return statistics.median(vals) if vals else None

            cpus = [s.s["cpu"] for s in got if s.s.get("cpu") is not None]
            agents = med("agents")
            rows.append([shape, tool, _fmt(med("cpu")),
                         f"{_fmt(min(cpus))}-{_fmt(max(cpus))}" if cpus else "-",
                         _fmt(max((s.s["slice"] for s in got if s.s.get("slice") is not None),
                                  default=None)),
                         str(max((int(s.s["threads"] or 0) for s in got), default=0) or "-"),
                         _fmt(agents), _fmt(None if agents is None else agents / hosts, 3),
                         _fmt(med("sshd")), _fmt(med("up"), 1),
                         f"{len(got)}" + (f" ({len(bad)} failed)" if bad else "")])
        out.write(f"\nidle: every rank asleep; CPU over a {self.args.window:g} s window, % of "
                  "one core (medians); idle agents answer the launcher's pings (every 2 s) "
                  "with a heartbeat\n\n")
        out.write(benchlib.table(rows, [False, False] + [True] * 9) + "\n")
        for tool in self.tools:
            big = [s for s in samples if s.case == "32x8" and s.tool == tool and s.ok
                   and s.s.get("cpu") is not None]
            if big:
                cpu = statistics.median(s.s["cpu"] for s in big)  # type: ignore[misc]
                out.write(f"\ntarget: launcher CPU <= 2 % of one core at 32x8, {tool}: "
                          f"{cpu:.2f} % -> {'met' if cpu <= 2.0 else 'NOT met'} (1.60 % "
                          "before heartbeats, bench/README.md)\n")
        out.write(self.remark)
        for s in samples:
            if not s.ok:
                out.write(f"  ! {s.case} {s.tool} run {s.rep + 1}: {s.error}\n")


# ==========================================================================================
# ctrlc
# ==========================================================================================
def _plain(data: bytes) -> bytes:
    """Terminal output without its escape sequences (colours, cursor moves, erases)."""
    return re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]", b"", data)


class Pty:
    """A command on a pty of 80x24 that is its controlling terminal (it leads the
    foreground process group, so ``\\x03`` on the master is a terminal's SIGINT to it);
    a thread drains the master as fast as it can, and notes when each of ``needles``
    first showed."""

    def __init__(self, argv: Sequence[str], cwd: Path, needles: Sequence[bytes],
                 rate: float = 0.0) -> None:
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))

        def own_terminal() -> None:
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "80", "LINES": "24"}
        try:
            self.proc = subprocess.Popen(list(argv), stdin=slave, stdout=slave, stderr=slave,
                                         cwd=str(cwd), env=env, start_new_session=True,
                                         preexec_fn=own_terminal)
        finally:
            os.close(slave)
        benchlib.adopt(self.proc)
        _PTYS.append(self)
        self.master = master
        self.head = bytearray()  # the first 64 KiB (the run id line)
        self.tail = bytearray()
        self.bytes = 0
        self.seen: dict[bytes, float] = {}
        self._needles = list(needles)
        self._closing = False
        self._rate = rate  # bytes/s the reader takes at most (0: as fast as it can)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        """Until the pty hangs up (every holder of the slave is gone) or `close`; this
        thread alone closes the master, so its fd number is never read after reuse."""
        try:
            self._drain()
        finally:
            os.close(self.master)

    def _drain(self) -> None:
        carry = b""
        while not self._closing:
            ready, _, _ = select.select([self.master], [], [], 0.2)
            if not ready:
                continue
            try:
                data = os.read(self.master, 4096 if self._rate else 65536)
            except OSError:
                return
            if not data:
                return
            now = time.monotonic()
            if self._rate:
                time.sleep(len(data) / self._rate)
            self.bytes += len(data)
            if len(self.head) < 65536:
                self.head += data[:65536 - len(self.head)]
            self.tail += data
            del self.tail[:-65536]
            if len(self.seen) < len(self._needles):
                window = carry + data
                for n in self._needles:
                    if n not in self.seen and n in window:
                        self.seen[n] = now
                carry = data[-64:]

    def key(self, data: bytes) -> float:
        t = time.monotonic()
        os.write(self.master, data)
        return t

    def last_line(self) -> str:
        text = _plain(bytes(self.tail)).decode("utf-8", "replace")
        lines = [ln.strip("\r\x00 ") for ln in re.split(r"[\r\n]", text)]
        lines = [ln for ln in lines if ln]
        return lines[-1] if lines else ""

    def run_id(self) -> Optional[str]:
        m = re.search(rb"run (\d{8}-\d{6}-[0-9a-f]+):", _plain(bytes(self.head)))
        return m.group(1).decode() if m else None

    def close(self) -> None:
        benchlib.stop(self.proc, grace=5, sig=signal.SIGKILL)
        self._closing = True
        self._reader.join(5)
        if self in _PTYS:
            _PTYS.remove(self)


class CtrlC:
    def __init__(self, args: argparse.Namespace, tmp: Path, lab: Any) -> None:
        self.args = args
        self.tmp = tmp
        prog = tmp / "flood.py"
        prog.write_text(FLOOD)
        duration = args.ctrlc_cap + 120
        self.cluster = lab.write_cluster(
            [{"host": "localhost", "nproc": 1, "path": str(ROOT)}]
            + [lab.worker(h, nproc=1) for h in lab.hosts[:2]], filename="ctrlc.yml",
            kill_grace=args.kill_grace,
            command=f"{shlex.quote(sys.executable)} -u {shlex.quote(str(prog))} {duration:g}")
        self.argv = {FDL: inv_argv(self.cluster),
                     TORCHRUN: torchrun_argv(3, str(prog), f"{duration:g}")}

    def cases(self) -> list[tuple[str, str]]:
        tools = [FDL] + ([] if self.args.no_torchrun else [TORCHRUN])
        return [("Ctrl-C, 3 flooding ranks", t) for t in tools]

    def run(self, case: str, tool: str, rep: int) -> Sample:
        sample = Sample("ctrlc", case, tool, rep)
        needles = [f"r{r} line".encode() for r in range(3)]
        term = Pty(self.argv[tool], ROOT if tool == FDL else self.tmp, needles,
                   rate=self.args.pty_rate * 1e6)
        workers: list[psutil.Process] = []
        run_id: Optional[str] = None
        try:
            wait_until(lambda: len(term.seen) == 3 or term.proc.poll() is not None,
                       "every rank's lines on the terminal", 90)
            if term.proc.poll() is not None:
                raise BenchError(f"exited {term.proc.returncode} early: {term.last_line()}")
            run_id = term.run_id() if tool == FDL else None
            if run_id:
                _RUN_IDS.add(run_id)
            if tool == TORCHRUN:
                workers = [p for p in psutil.Process(term.proc.pid).children(recursive=True)
                           if "LOCAL_RANK" in _environ(p)]
            elif run_id:
                workers = [p for p in processes_of_run(run_id) if os.getpgid(p.pid) == p.pid]
            if len(workers) != 3:
                sample.notes.append(f"{len(workers)} rank processes found, not 3")
            settle(0.5, 0.2)
            pressed = term.key(b"\x03")
            ended, gone = exit_times(term.proc, workers, self.args.ctrlc_cap)
            sample.s["exit"] = None if ended is None else ended - pressed
            if workers and len(gone) == len(workers):
                sample.s["ranks_gone"] = max(gone) - pressed
            sample.code = term.proc.returncode
            time.sleep(0.2)  # the last bytes through the pty
            sample.last_line = term.last_line()
            sample.info.append(f"{term.bytes / 1e6:.1f} MB on the terminal")
            if tool == FDL and sample.code != 130:
                sample.notes.append(f"exit {sample.code}, expected 130")
            if tool == FDL and not sample.last_line.startswith("cluster launcher: interrupted"):
                sample.notes.append("the verdict is not the terminal's last line")
            if ended is None:
                sample.notes.append(f"did not exit within {self.args.ctrlc_cap:g} s: killed")
            sample.ok = True
        except BenchError as exc:
            sample.error = str(exc)
        finally:
            term.close()
            if run_id:
                sample.leftovers = run_leftovers(run_id, 5)
            sample.leftovers += kill_alive(workers, 5)
        if sample.leftovers:
            sample.notes.append(f"left running (killed): pids {sample.leftovers}")
        return sample

    def report(self, samples: Sequence[Sample], out: TextIO) -> None:
        rows = []
        for case, tool in self.cases():
            rows += stats_rows(samples, case, tool, (("exit", "Ctrl-C -> exited"),
                                                     ("ranks_gone", "Ctrl-C -> every rank gone")),
                               capped=("exit", "ranks_gone"), cap=self.args.ctrlc_cap)
        rate = (f"{self.args.pty_rate:g} MB/s" if self.args.pty_rate else
                "as fast as it can")
        print_table(out, f"ctrlc: Ctrl-C on a pty (80x24, read {rate}), localhost + 2 lab "
                    f"hosts x 1 flooding rank (torchrun: 3 local workers); kill_grace "
                    f"{self.args.kill_grace:g} s; median = p50", rows)
        out.write("\n")
        trows = [["tool", "p50 s", "max s", "exit statuses", "not exited", "runs left "
                  "something", "MB/run"]]
        for case, tool in self.cases():
            got = [s for s in samples if s.case == case and s.tool == tool and s.ok
                   and not s.warmup]
            codes: dict[Optional[int], int] = {}
            for s in got:
                codes[s.code] = codes.get(s.code, 0) + 1
            mbs = [float(n.split()[0]) for s in got for n in s.info if n.endswith("terminal")]
            trows.append([tool, _fmt(_median(samples, case, tool, "exit")),
                          _fmt(_max(samples, case, tool, "exit")),
                          ", ".join(f"{c} x{n}" for c, n in sorted(
                              codes.items(), key=lambda kv: str(kv[0]))),
                          str(sum(1 for s in got if s.s.get("exit") is None)),
                          str(sum(1 for s in got if s.leftovers)),
                          _fmt(statistics.median(mbs), 1) if mbs else "-"])
        out.write(benchlib.table(trows, [False, True, True, False, True, True, True]) + "\n")
        _verdicts(samples, "ctrlc", out)


# ==========================================================================================
# main
# ==========================================================================================
def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", choices=SCENARIOS, metavar="NAME",
                    help=f"run only this scenario (repeatable): {', '.join(SCENARIOS)}")
    ap.add_argument("--repeat", type=int, help="measured runs per case of every scenario "
                    "(default: detect 5, hang 5, idle 1, ctrlc 20)")
    ap.add_argument("--warmup", type=int, default=1, help="discarded warm-up rounds for "
                    "hang and ctrlc (default 1; detect and idle have none)")
    ap.add_argument("--agent-timeout", type=float, default=6.0,
                    help="detect: agent_timeout in the cluster files, s (5)")
    ap.add_argument("--torchrun-cap", type=float, default=30.0,
                    help="detect: how long a torchrun with a frozen worker is watched, s (30)")
    ap.add_argument("--no-netns", action="store_true",
                    help="detect: skip the black hole (it needs root and iproute2)")
    ap.add_argument("--hosts", type=int, default=8, help="hang: lab hosts (8)")
    ap.add_argument("--per-host", type=int, default=8, help="hang: ranks per host (8)")
    ap.add_argument("--hang-timeout", type=float, default=5.0, help="hang: hang_timeout, s (5)")
    ap.add_argument("--py-spy", metavar="PATH", help="hang: also run with FLODL_PY_SPY=PATH "
                    "(default: the py-spy next to this Python, when the one the agents find "
                    "is a script such as a pyenv shim)")
    ap.add_argument("--idle-shapes", default="8x8,32x8",
                    help="idle: comma-separated HOSTSxRANKS (8x8,32x8)")
    ap.add_argument("--window", type=float, default=20.0, help="idle: sampling window, s (20)")
    ap.add_argument("--baseline", metavar="REV", default=BASELINE,
                    help="idle: also measure the launcher of this git revision (`git archive "
                    "REV`, imported through PYTHONPATH; its agents too), interleaved "
                    f"(default {BASELINE}, the last commit before agent heartbeats; 'none': "
                    "skip)")
    ap.add_argument("--ctrlc-cap", type=float, default=60.0,
                    help="ctrlc: longest wait for an exit after Ctrl-C, s (60)")
    ap.add_argument("--pty-rate", type=float, default=0.0, metavar="MB/S",
                    help="ctrlc: the terminal reads at most this many MB/s, like a slow "
                         "terminal emulator or tmux (default 0: as fast as it can)")
    ap.add_argument("--kill-grace", type=float, default=10.0,
                    help="ctrlc: kill_grace of the cluster file, s (10, the default)")
    ap.add_argument("--no-torchrun", action="store_true", help="skip the torchrun peers")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="longest wait for every rank's up line, s (300)")
    ap.add_argument("--wait-load", type=float, metavar="L",
                    help="first wait (up to 20 min) until the 1-minute load is <= L")
    ap.add_argument("--seed", type=int, help="seed for the random pauses before each fault")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args(argv)
    if args.repeat is not None and args.repeat < 1:
        ap.error("--repeat must be at least 1")
    try:
        args.idle_shape_list = [tuple(int(x) for x in s.lower().split("x"))
                                for s in args.idle_shapes.split(",") if s.strip()]
        assert args.idle_shape_list and all(len(s) == 2 and min(s) > 0
                                            for s in args.idle_shape_list)
    except (ValueError, AssertionError):
        ap.error("--idle-shapes: HOSTSxRANKS[,HOSTSxRANKS...], e.g. 8x8,32x8")
    if args.hosts < 1 or args.per_host < 1:
        ap.error("--hosts and --per-host must be at least 1")
    return args


DEFAULT_REPEAT = {"detect": 5, "hang": 5, "idle": 1, "ctrlc": 20}


def main(argv: Optional[Sequence[str]] = None) -> int:
    return benchlib.run_in_scratch("fdl-liveness-", parse_args(argv), _bench, cleanup)


def _bench(args: argparse.Namespace, tmp: Path, out: TextIO) -> int:
    from fdl_fabric.testing import NetnsLab, netns_available, sshd_available

    names = [n for n in SCENARIOS if not args.only or n in args.only]
    remarks: list[str] = []
    if not sshd_available():
        out.write("no sshd (install openssh-server): nothing to run\n")
        return 2
    if not args.no_torchrun and not Path(sys.executable).with_name("torchrun").exists():
        args.no_torchrun = True
        remarks.append("torchrun peers skipped: no torchrun next to this Python")
    load_start = benchlib.wait_for_quiet(args.wait_load, out)
    random.seed(args.seed)
    need = {"detect": 2, "hang": args.hosts, "idle": max(h for h, _ in args.idle_shape_list),
            "ctrlc": 2}
    mode_file = tmp / "py-spy-mode"
    mode_file.write_text("\n")
    # Every session's login shell reads FLODL_PY_SPY from mode_file (one line, empty:
    # unset, the agent looks for py-spy itself); only the hang scenario changes it.
    lab = benchlib.start_lab(tmp / "lab", max(need[n] for n in names), out,
                             login_shell_rc=f"read -r FLODL_PY_SPY < {mode_file} || true; "
                                            "export FLODL_PY_SPY")
    _LABS.append(lab)
    netns = None
    if "detect" in names and not args.no_netns:
        why = netns_available()
        if why is None:
            out.write("starting 1 netns lab host... ")
            out.flush()
            netns = NetnsLab(tmp / "netns", 1, client_alive_interval=1,
                             client_alive_count_max=3)
            _LABS.append(netns)
            netns.start()
            Path(netns.known_hosts).write_text(
                "".join(h.known_hosts_line() + "\n" for h in netns.hosts))
            out.write("ok\n")
        else:
            remarks.append(f"black hole skipped: {why}")
    started = time.monotonic()
    failed = 0
    for name in names:
        bench: Any
        if name == "detect":
            bench = Detect(args, tmp, lab, netns)
        elif name == "hang":
            bench = Hang(args, tmp, lab, mode_file)
        elif name == "idle":
            bench = Idle(args, tmp, lab)
        else:
            bench = CtrlC(args, tmp, lab)
        repeat = args.repeat or DEFAULT_REPEAT[name]
        warmup = args.warmup if name in ("hang", "ctrlc") else 0
        samples: list[Sample] = []
        t_scn = time.monotonic()
        out.write(f"\n== {name}: {repeat} run(s) per case"
                  f"{f' after {warmup} warm-up round(s)' if warmup else ''}, round-robin\n")
        for rnd in range(warmup + repeat):
            for case, tool in bench.cases():
                s = bench.run(case, tool, rnd - warmup if rnd >= warmup else rnd)
                s.warmup = rnd < warmup
                samples.append(s)
                headline = {"detect": "unresponsive" if tool == FDL else "exit",
                            "hang": "grouped", "idle": "cpu", "ctrlc": "exit"}[name]
                value = s.s.get(headline)
                status = ("FAILED: " + s.error if not s.ok else f"{headline}: not seen"
                          if value is None else
                          f"{headline} {_fmt(value)}" + (" %" if name == "idle" else " s"))
                if s.ok and (s.notes or s.info):
                    status += "  [" + "; ".join(s.info + s.notes) + "]"
                label = "warm-up" if s.warmup else f"run {s.rep + 1}"
                out.write(f"  {label} {case} ({tool}): {status}  (load {benchlib.loadavg()})\n")
                out.flush()
                if not s.ok and not s.warmup:
                    failed += 1
        bench.report(samples, out)
        mode_file.write_text("\n")  # FLODL_PY_SPY unset again for what follows
        out.write(f"  ({name}: {time.monotonic() - t_scn:.0f} s)\n")
    benchlib.write_machine_notes(out, load_start, started)
    with contextlib.suppress(Exception):
        from fdl_fabric.agent import stacks, wire

        out.write(f"  intervals: agent heartbeat {wire.HEARTBEAT_INTERVAL:g} s, launcher ping "
                  f"{wire.PING_INTERVAL:g} s, stack collector's CPU window "
                  f"{stacks.CPU_WINDOW:g} s\n")
    for r in remarks:
        out.write(f"  - {r}\n")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
