#!/usr/bin/env python3
"""Failure-detection latency of `inv launch`, beside torchrun on the same scenario.

Prints medians (and min/max) over ``--repeat`` runs; it is a script, not a test, so no
timing is ever asserted.  Every time is measured from ``t0``, taken just before the
benchmark sends SIGKILL to one rank:

* **pre-formation** (the rank program writes its pid and sleeps; it never joins the
  coordinator, so the first failure is fatal and every other rank is stopped):
  ``t0 -> all peers stopped``, the moment the last other rank's pid is gone (``/proc``
  polled every 5 ms, zombies count as gone).  Also timed: the launcher's
  ``rank R of HOST exited with signal 9`` line, its ``peer failure`` line and its exit.

  - local: one ``localhost`` worker, ``nproc: 4``, ``kill_grace: 10``, rank 1 killed;
  - remote: two sshd-lab hosts x 2 ranks, rank 1 (on lab1) killed, peers on both hosts;
  - torchrun: ``torchrun --standalone --nproc-per-node 4`` with the same program and
    defaults (``--max-restarts 0``, ``--monitor-interval 0.1``), worker 1 killed.

* **post-formation** (``examples/toy_train.py``, one local worker and one lab host, two
  ranks each; a death is a tolerated membership event): ``t0 -> the coordinator's
  "rank R declared dead" line``, and ``t0 -> the supervisor's "tolerating" line``;
  a local rank (1) or a remote rank (3) is killed, then the launch is stopped with
  SIGTERM.

Line times are taken by reader threads the moment a line arrives on the launcher's pipe
(``tests/labutil.LiveLaunch``).  For fdl-fabric the exit of the killed rank's bash
wrapper (its parent, also on lab hosts, which are this machine) is timed too, which
splits the latency into the wrapper's share and the launcher's.  The kill comes 0.5 s
plus a random 0-0.2 s after the last rank is up, so it lands at a random phase of the
polling loops being measured.  One discarded warm-up run per scenario comes first, then
the scenarios run round-robin.

Run ``python3 bench/detect.py`` (``--help`` for options).  Everything the script starts
(launches, torchrun, rank processes, the sshd lab) is stopped before it exits.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import random
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional, TextIO

import yaml

ROOT = Path(__file__).resolve().parent.parent
TOY = ROOT / "examples" / "toy_train.py"


def _load_labutil() -> ModuleType:
    """tests/labutil.py, the integration tests' launch helper, imported by path."""
    path = ROOT / "tests" / "labutil.py"
    spec = importlib.util.spec_from_file_location("fdl_bench_labutil", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


labutil = _load_labutil()
LiveLaunch = labutil.LiveLaunch

#: The pre-formation rank program: write our pid to ``<dir>/pid-r<RANK>`` (atomically),
#: then sleep.  It never joins the coordinator.  The sleep is bounded so that a rank the
#: benchmark somehow failed to stop still goes away on its own.
RANK_PROGRAM = """\
import os
import sys
import time

folder, rank = sys.argv[1], os.environ.get("RANK", "x")
tmp = os.path.join(folder, ".pid-r%s.tmp" % rank)
with open(tmp, "w") as fh:
    fh.write(str(os.getpid()))
os.replace(tmp, os.path.join(folder, "pid-r%s" % rank))
time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 120.0)
"""

#: How often ``/proc`` is read while waiting for peers to go.
PROC_POLL = 0.005
#: Pause between "every rank is up" and the kill, so start-up work has settled ...
SETTLE = 0.5
#: ... plus a random 0..JITTER s, so the kill lands at a random phase of the polling loops
#: being measured (wrapper tick 100 ms, supervisor poll and coordinator tick 50 ms,
#: torchrun's monitor 100 ms).  Those loops start with the ranks, and a fixed delay would
#: hit the same phase in every run and bias every sample the same way.
JITTER = 0.2
#: Kill grace in every cluster file (the issue's scenario; TERM ends the ranks anyway).
KILL_GRACE = 10
#: Longest wait for any one step (ranks up, cohort formed, peers gone, a line, an exit).
STEP_TIMEOUT = 60.0

# Scenario keys, in the order they are reported.
PRE_LOCAL, PRE_LOCAL_TORCH, PRE_REMOTE, POST_LOCAL, POST_REMOTE = (
    "pre-local", "pre-local-torchrun", "pre-remote", "post-local", "post-remote")
ALL_KEYS = (PRE_LOCAL, PRE_LOCAL_TORCH, PRE_REMOTE, POST_LOCAL, POST_REMOTE)
FDL, TORCHRUN = "fdl-fabric", "torchrun"

#: Scenario label and tool, per key.  Topologies: pre-formation local = one ``localhost``
#: worker x 4 ranks; remote = lab1 x 2 + lab2 x 2, rank 1 (lab1) killed; post-formation =
#: localhost x 2 (ranks 0-1) + lab1 x 2 (ranks 2-3).
SCENARIO = {
    PRE_LOCAL: ("pre-formation, local (1x4, r1 killed)", FDL),
    PRE_LOCAL_TORCH: ("pre-formation, local (1x4, r1 killed)", TORCHRUN),
    PRE_REMOTE: ("pre-formation, remote (2x2, r1 on lab1 killed)", FDL),
    POST_LOCAL: ("post-formation, local rank (r1 killed)", FDL),
    POST_REMOTE: ("post-formation, remote rank (r3 killed)", FDL),
}

#: (milestone key, what it measures), per scenario; the first one is the headline.
MEASURES: dict[str, tuple[tuple[str, str], ...]] = {
    PRE_LOCAL: (("peers_stopped", "death -> all peers stopped"),
                ("wrapper_exited", "death -> its wrapper exited"),
                ("exit_reported", "death -> 'rank 1 ... signal 9' line"),
                ("peer_failure", "death -> 'peer failure' line"),
                ("first_peer_stopped", "death -> first peer stopped"),
                ("tool_exited", "death -> launcher exited")),
    PRE_LOCAL_TORCH: (("peers_stopped", "death -> all peers stopped"),
                      ("exit_reported", "death -> 'failed (exitcode: -9)' line"),
                      ("first_peer_stopped", "death -> first peer stopped"),
                      ("tool_exited", "death -> torchrun exited")),
    PRE_REMOTE: (("peers_stopped", "death -> all peers stopped"),
                 ("wrapper_exited", "death -> its wrapper exited"),
                 ("exit_reported", "death -> 'rank 1 ... signal 9' line"),
                 ("peer_failure", "death -> 'peer failure' line"),
                 ("first_peer_stopped", "death -> first peer stopped"),
                 ("tool_exited", "death -> launcher exited")),
    POST_LOCAL: (("declared_dead", "death -> 'declared dead' line"),
                 ("wrapper_exited", "death -> its wrapper exited"),
                 ("tolerating", "death -> 'tolerating' line")),
    POST_REMOTE: (("declared_dead", "death -> 'declared dead' line"),
                  ("wrapper_exited", "death -> its wrapper exited"),
                  ("tolerating", "death -> 'tolerating' line")),
}


# --------------------------------------------------------------------------------------
# Processes: identity, liveness, cleanup
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pid:
    """A process identified by pid *and* kernel start time, so a recycled pid never
    passes for it (or gets signalled in its place)."""

    pid: int
    start: int


def _stat(pid: int) -> Optional[tuple[str, int, int]]:
    """(state letter, parent pid, start time in clock ticks) from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2:].split()
    return fields[0].decode(), int(fields[1]), int(fields[19])


def identify(pid: int) -> Optional[Pid]:
    st = _stat(pid)
    return None if st is None else Pid(pid, st[2])


def wrapper_of(rank: Pid) -> Optional[Pid]:
    """The fdl-fabric bash wrapper that runs ``rank`` (its parent), or None.

    The wrapper's subshell ``exec``s ``setsid`` which ``exec``s the program without
    forking, so the rank's parent is the wrapper, on lab hosts as well (they are this
    machine).  Recognised by the wrapper text on its command line (``bash -c``).
    """
    st = _stat(rank.pid)
    if st is None:
        return None
    try:
        cmdline = Path(f"/proc/{st[1]}/cmdline").read_bytes()
    except OSError:
        return None
    return identify(st[1]) if b"__fdl_pid" in cmdline else None


def alive(p: Pid) -> bool:
    """Running (zombies and dead processes are gone) and still the same process."""
    st = _stat(p.pid)
    return st is not None and st[2] == p.start and st[0] not in ("Z", "X")


#: Every rank process this script has seen, to be killed at exit if still running.
_RANKS: set[Pid] = set()
#: Launches and torchrun runs that may still be running.
_RUNS: list[Any] = []


def kill_leftovers(pids: Sequence[Pid]) -> list[int]:
    """SIGKILL those of ``pids`` that are still running; return their pids."""
    left = [p for p in pids if alive(p)]
    for p in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p.pid, signal.SIGKILL)
    return [p.pid for p in left]


def stop_run(run: Any, *, timeout: float = 30.0) -> Optional[int]:
    """TERM the tool's own process (the launcher stops its ranks on TERM), KILL its
    process group after ``timeout``; returns its exit code."""
    proc = run.proc
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            run.kill()
            proc.wait(10)
    for t in run._threads:
        t.join(5)
    if run in _RUNS:
        _RUNS.remove(run)
    code: Optional[int] = proc.returncode
    return code


def stop_everything() -> None:
    for run in list(_RUNS):
        with contextlib.suppress(Exception):
            stop_run(run)
    # Grace for ranks that the stopped tools are still terminating, then KILL.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(alive(p) for p in _RANKS):
        time.sleep(0.05)
    kill_leftovers(list(_RANKS))


@contextlib.contextmanager
def _terminate_gracefully() -> Iterator[None]:
    """SIGTERM/SIGHUP to the benchmark unwind like Ctrl-C, so cleanup still runs."""

    def raise_exit(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, raise_exit) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


class LiveCommand(LiveLaunch):  # type: ignore[misc, valid-type]
    """LiveLaunch's line collection (monotonic time per line) for any command."""

    def __init__(self, argv: Sequence[str], *, cwd: Path) -> None:
        self.proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     cwd=str(cwd), start_new_session=True)
        self._start_pumps()


# --------------------------------------------------------------------------------------
# Waiting and timing
# --------------------------------------------------------------------------------------


class BenchError(RuntimeError):
    """One run went wrong (a timeout, a missing line); the sample is recorded as failed."""


def wait_until(predicate: Callable[[], Any], what: str, timeout: float = STEP_TIMEOUT,
               interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def line_time(sink: list[tuple[float, str]], pattern: str, after: float) -> Optional[float]:
    """Arrival time of the first line matching ``pattern`` received after ``after``."""
    regex = re.compile(pattern)
    for stamp, line in list(sink):
        if stamp >= after and regex.search(line):
            return stamp
    return None


def after(sink: list[tuple[float, str]], pattern: str, t0: float) -> Optional[float]:
    """Seconds from ``t0`` to the first line matching ``pattern`` after it, or None."""
    stamp = line_time(sink, pattern, t0)
    return None if stamp is None else stamp - t0


def wait_pid_files(folder: Path, world: int, run: Any) -> dict[int, Pid]:
    """Pids of ranks 0..world-1 from their pid files, once all are there and running."""

    def ready() -> Optional[dict[int, Pid]]:
        if run.proc.poll() is not None:
            raise BenchError(f"the tool exited early with {run.proc.returncode}: "
                             + " | ".join(line for _, line in run.err[-5:]))
        found: dict[int, Pid] = {}
        for r in range(world):
            try:
                p = identify(int((folder / f"pid-r{r}").read_text()))
            except (OSError, ValueError):
                return None
            if p is None:
                return None
            found[r] = p
        return found

    pids: dict[int, Pid] = wait_until(ready, f"{world} pid files in {folder}")
    _RANKS.update(pids.values())
    return pids


def watch_gone(procs: dict[str, Pid], t0: float,
               until: Callable[[], Any] = lambda: True) -> dict[str, float]:
    """Poll /proc every PROC_POLL until every process is gone and ``until()`` holds.

    Returns the seconds from t0 at which each process was first seen gone.
    """
    gone: dict[str, float] = {}
    deadline = t0 + STEP_TIMEOUT
    while True:
        now = time.monotonic()
        for name, p in procs.items():
            if name not in gone and not alive(p):
                gone[name] = now - t0
        if len(gone) == len(procs) and until():
            return gone
        if now > deadline:
            raise BenchError(f"{sorted(set(procs) - set(gone)) or 'a line'} still pending "
                             f"after {STEP_TIMEOUT:g}s")
        time.sleep(PROC_POLL)


def wait_exit(run: Any, t0: float) -> float:
    """Seconds from t0 to the tool's exit, polled every PROC_POLL."""
    deadline = t0 + STEP_TIMEOUT
    while run.proc.poll() is None:
        if time.monotonic() > deadline:
            raise BenchError("the tool did not exit after its ranks were stopped")
        time.sleep(PROC_POLL)
    return time.monotonic() - t0


def settle() -> None:
    time.sleep(SETTLE + random.uniform(0.0, JITTER))


def kill_rank(p: Pid) -> float:
    """SIGKILL one rank; returns t0, taken just before the kill."""
    if not alive(p):
        raise BenchError(f"the victim (pid {p.pid}) is not running")
    t0 = time.monotonic()
    os.kill(p.pid, signal.SIGKILL)
    return t0


# --------------------------------------------------------------------------------------
# Samples
# --------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One run of one scenario; milestone times in ms from t0 (just before SIGKILL)."""

    key: str
    rep: int
    warmup: bool
    ok: bool = False
    error: str = ""
    victim: Optional[int] = None
    ms: dict[str, float] = field(default_factory=dict)
    peers_ms: dict[str, float] = field(default_factory=dict)
    returncode: Optional[int] = None
    leftovers: list[int] = field(default_factory=list)


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else round(seconds * 1000.0, 2)


# --------------------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------------------


@dataclass
class Bench:
    tmp: Path
    program: Path
    lab: Any = None
    runs: int = 0

    def folder(self, key: str) -> Path:
        self.runs += 1
        path = self.tmp / f"{self.runs:03d}-{key}"
        path.mkdir()
        return path

    @staticmethod
    def cluster(folder: Path, workers: list[dict[str, Any]]) -> Path:
        """A cluster.yml with a controller port that is free right now."""
        path = folder / "cluster.yml"
        doc = {"controller": {"host": "127.0.0.1", "port": free_port()},
               "kill_grace": KILL_GRACE, "workers": workers}
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def rank_cmd(self, folder: Path) -> list[str]:
        return [sys.executable, str(self.program), str(folder)]

    # -- pre-formation ------------------------------------------------------------------

    def pre_fdl(self, sample: Sample, *, remote: bool) -> None:
        folder = self.folder(sample.key)
        if remote:
            workers = [self.lab.worker(h, nproc=2) for h in self.lab.hosts[:2]]
        else:
            workers = [{"host": "localhost", "nproc": 4, "path": str(folder)}]
        cluster = self.cluster(folder, workers)
        cmd = " ".join(shlex.quote(w) for w in self.rank_cmd(folder))
        run = LiveLaunch(cluster, "--cmd", cmd)
        _RUNS.append(run)
        try:
            t0 = self._pre(sample, run, folder, victim=1)
            sample.ms["exit_reported"] = _ms(after(
                run.err, r"^cluster launcher: rank 1 of \S+ exited with signal 9$", t0))
            sample.ms["peer_failure"] = _ms(after(run.err, r"^cluster launcher: peer failure", t0))
        finally:
            sample.returncode = stop_run(run)
        if sample.returncode != 1:
            raise BenchError(f"the launch exited {sample.returncode}, expected 1")

    def pre_torchrun(self, sample: Sample) -> None:
        folder = self.folder(sample.key)
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "4", *self.rank_cmd(folder)[1:]]
        run = LiveCommand(argv, cwd=folder)
        _RUNS.append(run)
        try:
            t0 = self._pre(sample, run, folder, victim=1)
            sample.ms["exit_reported"] = _ms(after(run.err, r"failed \(exitcode: -9\)", t0))
        finally:
            sample.returncode = stop_run(run)

    @staticmethod
    def _pre(sample: Sample, run: Any, folder: Path, *, victim: int) -> float:
        """Wait for 4 ranks, kill ``victim``, time the peers' end; returns t0."""
        pids = wait_pid_files(folder, 4, run)
        settle()
        sample.victim = victim
        peers = {str(r): p for r, p in pids.items() if r != victim}
        wrapper = wrapper_of(pids[victim])
        watched = {**peers, **({"wrapper": wrapper} if wrapper is not None else {})}
        t0 = kill_rank(pids[victim])
        gone = watch_gone(watched, t0)
        sample.ms["tool_exited"] = _ms(wait_exit(run, t0))
        sample.peers_ms = {r: _ms(gone[r]) or 0.0 for r in peers}
        sample.ms["peers_stopped"] = _ms(max(gone[r] for r in peers))
        sample.ms["first_peer_stopped"] = _ms(min(gone[r] for r in peers))
        if wrapper is not None:
            sample.ms["wrapper_exited"] = _ms(gone["wrapper"])
        for t in run._threads:  # the tool has exited: its output is complete
            t.join(5)
        sample.leftovers = kill_leftovers(list(pids.values()))
        return t0

    # -- post-formation -----------------------------------------------------------------

    def post(self, sample: Sample, *, victim: int) -> None:
        folder = self.folder(sample.key)
        local = {"host": "localhost", "nproc": 2, "path": str(folder)}
        cluster = self.cluster(folder, [local, self.lab.worker(self.lab.hosts[0], nproc=2)])
        cmd = (f"{shlex.quote(sys.executable)} {shlex.quote(str(TOY))} --steps 100000 "
               f"--step-time 0.2 --checkpoint-dir {shlex.quote(str(folder / 'ck'))}")
        run = LiveLaunch(cluster, "--cmd", cmd)
        _RUNS.append(run)
        pids: dict[int, Pid] = {}
        joined = re.compile(r":r(\d+)\] rank (\d+)/\d+ joined on .* \(pid (\d+)\)")

        def all_joined() -> bool:
            if run.proc.poll() is not None:
                raise BenchError(f"the launch exited early with {run.proc.returncode}: "
                                 + " | ".join(line for _, line in run.err[-5:]))
            for _, line in list(run.out):
                m = joined.search(line)
                if m and int(m.group(2)) not in pids:
                    p = identify(int(m.group(3)))
                    if p is not None:
                        pids[int(m.group(2))] = p
                        _RANKS.add(p)
            formed = line_time(run.err, r"cohort formed — 4 ranks", 0.0) is not None
            return formed and len(pids) == 4

        try:
            wait_until(all_joined, "cohort formed and 4 joined lines")
            settle()
            sample.victim = victim
            wrapper = wrapper_of(pids[victim])
            t0 = kill_rank(pids[victim])
            dead = rf"cluster coordinator: rank {victim} declared dead"
            gone = watch_gone({"wrapper": wrapper} if wrapper is not None else {}, t0,
                              until=lambda: line_time(run.err, dead, t0))
            sample.ms["declared_dead"] = _ms(after(run.err, dead, t0))
            if wrapper is not None:
                sample.ms["wrapper_exited"] = _ms(gone["wrapper"])
            sample.ms["tolerating"] = _ms(after(
                run.err, rf"rank {victim} of \S+ exited with signal 9 — tolerating", t0))
        finally:
            sample.returncode = stop_run(run)
            # The launcher stopped the survivors on TERM; give the wrappers a moment.
            with contextlib.suppress(BenchError):
                wait_until(lambda: not any(alive(p) for p in pids.values()), "ranks gone",
                           timeout=KILL_GRACE + 5)
            sample.leftovers = kill_leftovers(list(pids.values()))
        if sample.returncode != 128 + signal.SIGTERM:
            raise BenchError(f"the launch exited {sample.returncode} on SIGTERM, expected 143")

    def run(self, key: str, rep: int, warmup: bool) -> Sample:
        sample = Sample(key, rep, warmup)
        try:
            if key == PRE_LOCAL:
                self.pre_fdl(sample, remote=False)
            elif key == PRE_REMOTE:
                self.pre_fdl(sample, remote=True)
            elif key == PRE_LOCAL_TORCH:
                self.pre_torchrun(sample)
            elif key == POST_LOCAL:
                self.post(sample, victim=1)
            elif key == POST_REMOTE:
                self.post(sample, victim=3)
            headline = MEASURES[key][0][0]
            if sample.ms.get(headline) is None:
                raise BenchError(f"no {headline} time")
            sample.ok = True
        except BenchError as exc:
            sample.error = str(exc)
        if sample.leftovers:
            sample.error = (sample.error + "; " if sample.error else "") + \
                f"killed leftover rank pids {sample.leftovers}"
        return sample


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def _fmt(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def table(samples: Sequence[Sample], keys: Sequence[str]) -> str:
    head = ("scenario", "tool", "measure", "median ms", "min", "max", "n")
    rows: list[tuple[str, ...]] = []
    for key in keys:
        scenario, tool = SCENARIO[key]
        good = [s for s in samples if s.key == key and s.ok and not s.warmup]
        for mkey, label in MEASURES[key]:
            values = [s.ms[mkey] for s in good if s.ms.get(mkey) is not None]
            if values:
                rows.append((scenario, tool, label, _fmt(statistics.median(values)),
                             _fmt(min(values)), _fmt(max(values)), str(len(values))))
            else:
                rows.append((scenario, tool, label, "-", "-", "-", "0"))
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    numeric = {3, 4, 5, 6}

    def fmt_row(r: tuple[str, ...]) -> str:
        cells = [c.rjust(w) if i in numeric else c.ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths))]
        return "| " + " | ".join(cells) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if i in numeric else "-" * (w + 2)
                         for i, w in enumerate(widths)) + "|"
    return "\n".join([fmt_row(head), sep, *(fmt_row(r) for r in rows)])


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def _openssh() -> str:
    ssh = shutil.which("ssh")
    if ssh is None:
        return "?"
    out = subprocess.run([ssh, "-V"], capture_output=True, text=True, timeout=10)
    return (out.stderr or out.stdout).strip().split(",")[0]


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def machine_notes(load_before: str) -> list[str]:
    from fdl_fabric import commands, coordinator, spawn, supervisor

    return [
        f"cpus: {os.cpu_count()} x {_cpu_model()}; kernel {platform.release()}; "
        f"python {platform.python_version()}",
        f"fabric {_version('fabric')}, invoke {_version('invoke')}, "
        f"paramiko {_version('paramiko')}, torch {_version('torch')}, {_openssh()}",
        f"load average before {load_before}, after {_loadavg()}",
        "remote = sshd-lab hosts (real OpenSSH servers on 127.x loopback addresses, same "
        "machine); post-formation runs: localhost x 2 (r0-r1) + lab1 x 2 (r2-r3), "
        "examples/toy_train.py --step-time 0.2",
        f"fdl-fabric intervals: supervisor poll {supervisor.POLL_INTERVAL * 1000:g} ms, "
        f"wrapper tick {commands.WRAPPER_TICK * 1000:g} ms, "
        f"coordinator tick {coordinator.TICK_INTERVAL * 1000:g} ms, "
        f"stdin thread nap {spawn._Streaming.input_sleep * 1000:g} ms; "
        "torchrun monitor interval 100 ms (default)",
        f"measurement: /proc polled every {PROC_POLL * 1000:g} ms (zombies count as gone); "
        "line times = arrival on the launcher's pipe in a reader thread; kill "
        f"{SETTLE * 1000:g} ms + uniform 0-{JITTER * 1000:g} ms after the last rank is up",
    ]


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5,
                    help="measured runs per scenario, after the warm-up (default 5)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="discarded warm-up runs per scenario (default 1)")
    ap.add_argument("--only", action="append", choices=ALL_KEYS, metavar="SCENARIO",
                    help=f"run only this scenario (repeatable): {', '.join(ALL_KEYS)}")
    ap.add_argument("--no-torchrun", action="store_true", help="skip the torchrun baseline")
    ap.add_argument("--json", metavar="FILE",
                    help="also write the raw samples as JSON to FILE ('-': JSON on stdout, "
                         "the report on stderr)")
    ap.add_argument("--seed", type=int, help="seed for the random kill delay (reproducible "
                    "kill phases)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if args.warmup < 0:
        ap.error("--warmup must be at least 0")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    report = sys.stderr if args.json == "-" else sys.stdout
    with _terminate_gracefully():
        tmp = Path(tempfile.mkdtemp(prefix="fdl-detect-"))
        try:
            return _bench(args, tmp, report)
        finally:
            stop_everything()
            if args.keep:
                report.write(f"\nkept {tmp}\n")
            else:
                shutil.rmtree(tmp, ignore_errors=True)


def _bench(args: argparse.Namespace, tmp: Path, report: TextIO) -> int:
    from fdl_fabric.testing import SshdLab, sshd_available

    keys = [k for k in ALL_KEYS if not args.only or k in args.only]
    remarks: list[str] = []
    if PRE_LOCAL_TORCH in keys and (args.no_torchrun or importlib.util.find_spec("torch") is None):
        keys.remove(PRE_LOCAL_TORCH)
        remarks.append("torchrun baseline skipped (--no-torchrun or torch not installed)")
    needs_lab = [k for k in keys if k in (PRE_REMOTE, POST_LOCAL, POST_REMOTE)]
    if needs_lab and not sshd_available():
        keys = [k for k in keys if k not in needs_lab]
        remarks.append(f"skipped {', '.join(needs_lab)}: no sshd (install openssh-server)")
    if not keys:
        report.write("nothing to run\n")
        return 2

    random.seed(args.seed)
    program = tmp / "rank_program.py"
    program.write_text(RANK_PROGRAM)
    bench = Bench(tmp=tmp, program=program)
    load_before = _loadavg()
    samples: list[Sample] = []
    started = time.monotonic()
    lab = None
    try:
        if any(k in needs_lab for k in keys):
            report.write("starting the sshd lab (2 hosts)...\n")
            report.flush()
            lab = SshdLab(tmp / "lab", 2).start()
            bench.lab = lab
        plan = [(rep, True) for rep in range(args.warmup)] + \
               [(rep, False) for rep in range(args.repeat)]
        for rep, warm in plan:
            for key in keys:
                sample = bench.run(key, rep, warm)
                samples.append(sample)
                head = MEASURES[key][0][0]
                value = sample.ms.get(head)
                status = (f"{value:.0f} ms" if sample.ok and value is not None
                          else f"FAILED: {sample.error}")
                if sample.ok and sample.error:
                    status += f" ({sample.error})"
                report.write(f"  {'warm-up' if warm else f'run {rep + 1}'} {key}: {status}\n")
                report.flush()
    finally:
        if lab is not None:
            stop_everything()
            lab.stop()

    elapsed = time.monotonic() - started
    failed = [s for s in samples if not s.ok and not s.warmup]
    report.write(
        f"\nfailure-detection latency, ms from SIGKILL of one rank (t0 = just before "
        f"os.kill); median, min, max over {args.repeat} run(s) after {args.warmup} warm-up "
        "run(s); first measure of each scenario is the headline\n\n")
    report.write(table(samples, keys) + "\n\n")
    report.write("machine and method:\n")
    for note in [*machine_notes(load_before), *remarks,
                 f"{len(samples)} runs in {elapsed:.0f} s; {len(failed)} measured run(s) failed"]:
        report.write(f"  - {note}\n")
    for s in failed:
        report.write(f"  ! {s.key} run {s.rep + 1}: {s.error}\n")

    if args.json:
        doc = {"repeat": args.repeat, "warmup": args.warmup,
               "scenarios": {k: {"scenario": SCENARIO[k][0], "tool": SCENARIO[k][1],
                                 "measures": dict(MEASURES[k])} for k in keys},
               "notes": machine_notes(load_before) + remarks,
               "samples": [asdict(s) for s in samples]}
        text = json.dumps(doc, indent=2) + "\n"
        if args.json == "-":
            sys.stdout.write(text)
        else:
            Path(args.json).write_text(text)
    return 0 if not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
