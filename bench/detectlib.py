"""detect.py's machinery: the scenarios and their measures, processes known by pid and
start time (`Pid`), a launch whose lines are timestamped (`LiveCommand`), the pidfd
watch of peers and victim (`watch`), and one run of each scenario (`Bench`)."""

from __future__ import annotations

import contextlib
import os
import random
import re
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import benchlib
import yaml

from fdl_fabric.agent.procs import stat_fields

ROOT = benchlib.ROOT
TOY = ROOT / "examples" / "toy_train.py"

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

#: How often ``/proc/<victim>`` is looked at until its agent has reaped it.
REAP_POLL = 0.001
#: Pause between "every rank is up" and the kill, so start-up work has settled ...
SETTLE = 0.5
#: ... plus a random 0..JITTER s, so the kill lands at a random phase of periodic loops.
JITTER = 0.2
#: Kill grace in every cluster file (TERM ends the ranks anyway).
KILL_GRACE = 10
#: Longest wait for any one step (ranks up, cohort formed, peers gone, a line, an exit).
STEP_TIMEOUT = 90.0

# Scenario keys, in the order they are reported.
PRE_LOCAL, PRE_LOCAL_TORCH, PRE_REMOTE, PRE_REMOTE_64, POST_LOCAL, POST_REMOTE = (
    "pre-local", "pre-local-torchrun", "pre-remote", "pre-remote-64", "post-local",
    "post-remote")
ALL_KEYS = (PRE_LOCAL, PRE_LOCAL_TORCH, PRE_REMOTE, PRE_REMOTE_64, POST_LOCAL, POST_REMOTE)
FDL, TORCHRUN = "fdl-fabric", "torchrun"

#: key -> (label, tool, hosts, ranks per host (0 = local), victim rank)
SCENARIO: dict[str, tuple[str, str, int, int, int]] = {
    PRE_LOCAL: ("pre-formation, local (1x4, r1 killed)", FDL, 0, 4, 1),
    PRE_LOCAL_TORCH: ("pre-formation, local (1x4, r1 killed)", TORCHRUN, 0, 4, 1),
    PRE_REMOTE: ("pre-formation, remote (2x2, r1 on lab1 killed)", FDL, 2, 2, 1),
    PRE_REMOTE_64: ("pre-formation, remote (8x8, r9 on lab2 killed)", FDL, 8, 8, 9),
    POST_LOCAL: ("post-formation, local rank (r1 killed)", FDL, 1, 2, 1),
    POST_REMOTE: ("post-formation, remote rank (r3 killed)", FDL, 1, 2, 3),
}

_FDL_PRE = (("peers_stopped", "death -> all peers stopped"),
            ("victim_reaped", "death -> victim reaped by its agent"),
            ("exit_reported", "death -> 'rank R ... signal 9' line"),
            ("peer_failure", "death -> 'peer failure' line"),
            ("first_peer_stopped", "death -> first peer stopped"),
            ("verdict", "death -> verdict (last line)"),
            ("tool_exited", "death -> launcher exited"),
            ("exit_after_verdict", "verdict -> launcher exited"))
_FDL_POST = (("declared_dead", "death -> 'declared dead' line"),
             ("victim_reaped", "death -> victim reaped by its agent"),
             ("tolerating", "death -> 'tolerating' line"))

#: (milestone key, what it measures), per scenario; the first one is the headline.
MEASURES: dict[str, tuple[tuple[str, str], ...]] = {
    PRE_LOCAL: _FDL_PRE,
    PRE_LOCAL_TORCH: (("peers_stopped", "death -> all peers stopped"),
                      ("victim_reaped", "death -> victim reaped by torchrun"),
                      ("exit_reported", "death -> 'failed (exitcode: -9)' line"),
                      ("first_peer_stopped", "death -> first peer stopped"),
                      ("tool_exited", "death -> torchrun exited")),
    PRE_REMOTE: _FDL_PRE,
    PRE_REMOTE_64: _FDL_PRE,
    POST_LOCAL: _FDL_POST,
    POST_REMOTE: _FDL_POST,
}

#: The issue's targets: (scenario, measure, bound in ms).
TARGETS = ((PRE_REMOTE_64, "peers_stopped", 50.0), (PRE_REMOTE_64, "exit_after_verdict", 300.0))


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
    fields = stat_fields(pid)
    if fields is None:
        return None
    return fields[0].decode(), int(fields[1]), int(fields[19])


def identify(pid: int) -> Optional[Pid]:
    st = _stat(pid)
    return None if st is None else Pid(pid, st[2])


def alive(p: Pid) -> bool:
    """Running (zombies and dead processes are gone) and still the same process."""
    st = _stat(p.pid)
    return st is not None and st[2] == p.start and st[0] not in ("Z", "X")


def present(p: Pid) -> bool:
    """Still in /proc, zombie or not (not yet reaped by its parent)."""
    st = _stat(p.pid)
    return st is not None and st[2] == p.start


#: Every rank process this script has seen, to be killed at exit if still running.
_RANKS: set[Pid] = set()
#: Launches and torchrun runs that may still be running.
_RUNS: list[LiveCommand] = []


def kill_leftovers(pids: Sequence[Pid]) -> list[int]:
    """SIGKILL those of ``pids`` that are still running; return their pids."""
    left = [p for p in pids if alive(p)]
    for p in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p.pid, signal.SIGKILL)
    return [p.pid for p in left]


class LiveCommand:
    """A running command whose output lines are collected with their arrival time."""

    def __init__(self, argv: Sequence[str], *, cwd: Path) -> None:
        self.proc = benchlib.start(argv, cwd=str(cwd))
        self.out: list[tuple[float, str]] = []
        self.err: list[tuple[float, str]] = []
        self.threads = []
        for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            t = threading.Thread(target=self._pump, args=(stream, sink), daemon=True)
            t.start()
            self.threads.append(t)

    @staticmethod
    def _pump(stream: Any, sink: list[tuple[float, str]]) -> None:
        for line in stream:
            sink.append((time.monotonic(), line.decode("utf-8", "replace").rstrip("\n")))

    def join_pumps(self) -> None:
        for t in self.threads:
            t.join(5)


def stop_run(run: LiveCommand, *, timeout: float = 30.0) -> Optional[int]:
    """TERM the tool's own process (the launcher stops its ranks on TERM), KILL its
    process group after ``timeout``; returns its exit code."""
    proc = run.proc
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)
    code = benchlib.stop(proc, grace=10)
    run.join_pumps()
    if run in _RUNS:
        _RUNS.remove(run)
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


# --------------------------------------------------------------------------------------
# Waiting and timing
# --------------------------------------------------------------------------------------


BenchError = benchlib.BenchError


def wait_until(predicate: Callable[[], Any], what: str, timeout: float = STEP_TIMEOUT,
               interval: float = 0.02) -> Any:
    return benchlib.wait_until(predicate, what, timeout, interval)


def line_time(sink: list[tuple[float, str]], pattern: str, after: float) -> Optional[float]:
    """Arrival time of the first line matching ``pattern`` received after ``after``."""
    regex = re.compile(pattern)
    for stamp, line in list(sink):
        if stamp >= after and regex.search(line):
            return stamp
    return None


def since(sink: list[tuple[float, str]], pattern: str, t0: float) -> Optional[float]:
    """Seconds from ``t0`` to the first line matching ``pattern`` after it, or None."""
    stamp = line_time(sink, pattern, t0)
    return None if stamp is None else stamp - t0


def wait_pid_files(folder: Path, world: int, run: LiveCommand) -> dict[int, Pid]:
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


def _open_pidfds(peers: dict[str, Pid], tool: Optional[subprocess.Popen[bytes]],
                 poller: select.poll, fds: dict[int, str], gone: dict[str, float]) -> None:
    """A pidfd in ``poller`` for each peer still alive and the tool (``fds``: fd -> name);
    a peer already gone counts as stopped at 0."""
    for name, p in peers.items():
        try:
            fd = os.pidfd_open(p.pid)
        except ProcessLookupError:
            gone[name] = 0.0
            continue
        if not alive(p):  # the pid was recycled, or it is a zombie already
            os.close(fd)
            gone[name] = 0.0
            continue
        fds[fd] = name
        poller.register(fd, select.POLLIN)
    if tool is not None:
        fd = os.pidfd_open(tool.pid)
        fds[fd] = "tool"
        poller.register(fd, select.POLLIN)


def watch(peers: dict[str, Pid], victim: Optional[Pid], tool: Optional[subprocess.Popen[bytes]],
          t0: float, until: Callable[[], Any] = lambda: True) -> dict[str, float]:
    """Wait until every peer and the tool exited, the victim was reaped and ``until()``.

    Peers and the tool are watched through pidfds (the kernel wakes us when each exits);
    the victim's /proc entry is looked at every REAP_POLL until it is gone.  Returns the
    seconds from t0 of each event: peer names, ``victim``, ``tool``.
    """
    poller = select.poll()
    fds: dict[int, str] = {}
    gone: dict[str, float] = {}
    try:
        _open_pidfds(peers, tool, poller, fds, gone)
        deadline = t0 + STEP_TIMEOUT
        while True:
            victim_pending = victim is not None and "victim" not in gone
            waiting = any(name not in gone for name in fds.values())
            if not waiting and not victim_pending and until():
                return gone
            now = time.monotonic()
            if now > deadline:
                missing = sorted(set(peers) - set(gone))
                raise BenchError(f"still pending after {STEP_TIMEOUT:g}s: peers {missing}, "
                                 f"victim {'reaped' if 'victim' in gone else 'not reaped'}")
            timeout_ms = 1 if victim_pending else 20
            for fd, _ in poller.poll(timeout_ms if waiting else 0):
                stamp = time.monotonic() - t0
                gone.setdefault(fds[fd], stamp)
                poller.unregister(fd)
            if victim_pending and not present(victim):  # type: ignore[arg-type]
                gone["victim"] = time.monotonic() - t0
            if not waiting:
                time.sleep(REAP_POLL if victim_pending else 0.02)
    finally:
        for fd in fds:
            os.close(fd)


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
    ms: dict[str, Optional[float]] = field(default_factory=dict)
    peers_ms: dict[str, float] = field(default_factory=dict)
    returncode: Optional[int] = None
    leftovers: list[int] = field(default_factory=list)
    verdict_line: str = ""


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

    def launch(self, cluster: Path, cmd: str, folder: Path) -> LiveCommand:
        run = LiveCommand(benchlib.inv_launch_argv(cluster, cmd), cwd=ROOT)
        _RUNS.append(run)
        return run

    # -- pre-formation ------------------------------------------------------------------

    def pre_fdl(self, sample: Sample) -> None:
        _label, _tool, n_hosts, per_host, victim = SCENARIO[sample.key]
        folder = self.folder(sample.key)
        if n_hosts:
            workers = [self.lab.worker(h, nproc=per_host) for h in self.lab.hosts[:n_hosts]]
        else:
            workers = [{"host": "localhost", "nproc": per_host, "path": str(folder)}]
        world = max(1, n_hosts) * per_host
        cluster = self.cluster(folder, workers)
        cmd = " ".join(shlex.quote(w) for w in self.rank_cmd(folder))
        run = self.launch(cluster, cmd, folder)
        try:
            t0 = self._pre(sample, run, folder, world=world, victim=victim)
            sample.ms["exit_reported"] = _ms(since(
                run.err, rf"^cluster launcher: rank {victim} of \S+ exited with signal 9", t0))
            sample.ms["peer_failure"] = _ms(since(run.err, r"^cluster launcher: peer failure",
                                                  t0))
            if run.err:
                stamp, line = run.err[-1]
                sample.verdict_line = line
                sample.ms["verdict"] = _ms(stamp - t0)
                exited = sample.ms.get("tool_exited")
                if exited is not None:
                    sample.ms["exit_after_verdict"] = round(exited - (stamp - t0) * 1000, 2)
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
            t0 = self._pre(sample, run, folder, world=4, victim=1)
            sample.ms["exit_reported"] = _ms(since(run.err, r"failed \(exitcode: -9\)", t0))
        finally:
            sample.returncode = stop_run(run)

    @staticmethod
    def _pre(sample: Sample, run: LiveCommand, folder: Path, *, world: int,
             victim: int) -> float:
        """Wait for the ranks, kill ``victim``, time the peers' end; returns t0."""
        pids = wait_pid_files(folder, world, run)
        settle()
        sample.victim = victim
        peers = {str(r): p for r, p in pids.items() if r != victim}
        t0 = kill_rank(pids[victim])
        gone = watch(peers, pids[victim], run.proc, t0)
        sample.ms["tool_exited"] = _ms(gone["tool"])
        sample.ms["victim_reaped"] = _ms(gone.get("victim"))
        sample.peers_ms = {r: _ms(gone[r]) or 0.0 for r in peers}
        sample.ms["peers_stopped"] = _ms(max(gone[r] for r in peers))
        sample.ms["first_peer_stopped"] = _ms(min(gone[r] for r in peers))
        run.join_pumps()  # the tool has exited: its output is complete
        sample.leftovers = kill_leftovers(list(pids.values()))
        return t0

    # -- post-formation -----------------------------------------------------------------

    def post(self, sample: Sample) -> None:
        victim = SCENARIO[sample.key][4]
        folder = self.folder(sample.key)
        local = {"host": "localhost", "nproc": 2, "path": str(folder)}
        cluster = self.cluster(folder, [local, self.lab.worker(self.lab.hosts[0], nproc=2)])
        cmd = (f"{shlex.quote(sys.executable)} {shlex.quote(str(TOY))} --steps 100000 "
               f"--step-time 0.2 --checkpoint-dir {shlex.quote(str(folder / 'ck'))}")
        run = self.launch(cluster, cmd, folder)
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
            t0 = kill_rank(pids[victim])
            dead = rf"cluster coordinator: rank {victim} declared dead"
            tolerating = rf"rank {victim} of \S+ exited with signal 9 — tolerating"
            gone = watch({}, pids[victim], None, t0,
                         until=lambda: line_time(run.err, dead, t0)
                         and line_time(run.err, tolerating, t0))
            sample.ms["declared_dead"] = _ms(since(run.err, dead, t0))
            sample.ms["victim_reaped"] = _ms(gone.get("victim"))
            sample.ms["tolerating"] = _ms(since(run.err, tolerating, t0))
        finally:
            sample.returncode = stop_run(run)
            # The launcher stopped the survivors on TERM; give them a moment.
            with contextlib.suppress(BenchError):
                wait_until(lambda: not any(alive(p) for p in pids.values()), "ranks gone",
                           timeout=KILL_GRACE + 5)
            sample.leftovers = kill_leftovers(list(pids.values()))
        if sample.returncode != 128 + signal.SIGTERM:
            raise BenchError(f"the launch exited {sample.returncode} on SIGTERM, expected 143")

    def run(self, key: str, rep: int, warmup: bool) -> Sample:
        sample = Sample(key, rep, warmup)
        try:
            if key == PRE_LOCAL_TORCH:
                self.pre_torchrun(sample)
            elif key.startswith("pre-"):
                self.pre_fdl(sample)
            else:
                self.post(sample)
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
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------------------
# The machine's floor: the same ranks stopped with no launcher at all
# --------------------------------------------------------------------------------------


def teardown_floor(program: Path, folder: Path, ranks: int) -> float:
    """ms from one process SIGTERMing ``ranks`` idle rank programs (each in a group of
    its own, as an agent starts them) to the last one exited (pidfds): what stopping
    that many Python processes costs this machine's kernel and cores, with no detection,
    no SSH and no agent. "death -> all peers stopped" cannot be below it."""
    folder.mkdir(parents=True, exist_ok=True)
    procs = [benchlib.start([sys.executable, str(program), str(folder), "120"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for _ in range(ranks)]
    try:
        deadline = time.monotonic() + 30
        while len(list(folder.glob("pid-r*"))) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # every interpreter up and asleep
        fds = [os.pidfd_open(p.pid) for p in procs]
        poll = select.poll()
        for fd in fds:
            poll.register(fd, select.POLLIN)
        left = set(fds)
        t0 = time.perf_counter()
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
        while left and time.perf_counter() - t0 < 10:
            for fd, _ in poll.poll(1000):
                if fd in left:
                    left.discard(fd)
                    poll.unregister(fd)
        took = (time.perf_counter() - t0) * 1000.0
        for fd in fds:
            os.close(fd)
        return took
    finally:
        for p in procs:
            benchlib.stop(p, grace=1)
