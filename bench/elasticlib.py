"""elastic_hosts.py's machinery: the rank programs, a watched launch (`Launch`), what
must be undone at exit (`cleanup`), the samples, and one run of each tool: fdl-fabric
with a lab host stopped (`Fdl`), torchrun's elastic mode with a node killed
(`Torchrun`)."""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, cast

import benchlib
import psutil

from fdl_fabric.testing import LiveProcess, processes_of_run

ROOT = benchlib.ROOT
FDL = "fdl-fabric"
#: torchrun's worker programs: ``sleep`` is `RANK`; ``allreduce`` is `ALLREDUCE`.
TR_PROGRAMS = ("sleep", "allreduce")

#: One write per line (torchrun's workers share their agent's stdout), then a sleep
#: that depends on the attempt: long in attempt 0, short after.
RANK = """\
import os, sys, time
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
os.write(1, ("start attempt %d rank %s\\n" % (attempt, os.environ.get("RANK", "?"))).encode())
time.sleep(float(sys.argv[1] if attempt == 0 else sys.argv[2]))
"""

#: `RANK`'s line, then a gloo process group (``joined ...``) and an all-reduce every
#: 0.5 s: its collective fails when a peer is lost.
ALLREDUCE = """\
import os, sys, time
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
rank = os.environ.get("RANK", "?")
os.write(1, ("start attempt %d rank %s\\n" % (attempt, rank)).encode())
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
os.write(1, ("joined attempt %d rank %s world %d\\n"
             % (attempt, rank, dist.get_world_size())).encode())
end = time.monotonic() + float(sys.argv[1] if attempt == 0 else sys.argv[2])
t = torch.ones(1)
while time.monotonic() < end:
    dist.all_reduce(t)
    time.sleep(0.5)
dist.destroy_process_group()
"""

#: A rank's line as the launcher forwards it: ``[lab3:cpu:r17] start attempt 1 rank 17``.
FDL_START = re.compile(r"^\[([^:\]]+):[^\]]*\] start attempt (\d+) rank (\d+)$")
TR_START = re.compile(r"start attempt (\d+) rank (\d+)")
#: Lines left out of the printed output (unless --all-lines): peers the launcher stopped,
#: rows of its rank table, traceback frames of torchrun's workers (``[rank1]:   File``).
QUIET = re.compile(r"\(stopped by the launcher\)$|^\s*\d+\s+\S+\s+-?\d+\s+ok\s|"
                   r"^node \d+: \[rank\d+\]:\s{2}")
RUN_ID = re.compile(r"cluster launcher: run (\S+): ")
LONG_SLEEP = 600.0

_RUN_IDS: set[str] = set()  # launches whose leftovers are killed at exit
LABS: list[Any] = []


BenchError = benchlib.BenchError
wait_until = benchlib.wait_until


class Launch(LiveProcess):
    """`fdl_fabric.testing.LiveProcess` (lines timestamped as they arrive by a reader
    thread per stream), remembered by benchlib so its process group is stopped at exit."""

    def __init__(self, argv: Sequence[str], *, cwd: Path = ROOT) -> None:
        super().__init__(argv, cwd=cwd)
        benchlib.adopt(self.proc)

    @property
    def popen(self) -> subprocess.Popen[bytes]:
        """``proc`` as benchlib's helpers are typed (they only signal, wait and reap it)."""
        return cast("subprocess.Popen[bytes]", self.proc)

    def first(self, pred: Callable[[str], bool], after: float,
              stream: Optional[str] = None) -> Optional[float]:
        return next((t for t, line in self._of(stream) if t >= after and pred(line)), None)

    def tail(self, n: int = 6) -> str:
        return " | ".join(line for _, _, line in self.lines[-n:])

    def stop(self, grace: float = 10.0, sig: int = signal.SIGTERM) -> Optional[int]:
        code = benchlib.stop(self.popen, grace=grace, sig=sig)
        for t in self._readers:
            t.join(5)
        return code


def run_leftovers(run_id: str, timeout: float) -> list[int]:
    """Wait up to ``timeout`` for every process of the run to go; SIGKILL (by pid, psutil
    checks it is the same process) what is still there and return those pids."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not processes_of_run(run_id):
            _RUN_IDS.discard(run_id)
            return []
        time.sleep(0.1)
    _RUN_IDS.discard(run_id)
    return benchlib.kill_run(run_id)


def _kill_procs(procs: Sequence[psutil.Process]) -> list[int]:
    killed = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                p.kill()
                killed.append(p.pid)
    return killed


def cleanup() -> None:
    benchlib.stop_all()
    for run_id in list(_RUN_IDS):
        with contextlib.suppress(Exception):
            run_leftovers(run_id, 5.0)
    for lab in list(LABS):
        with contextlib.suppress(Exception):
            lab.stop()
        LABS.remove(lab)


def settle() -> None:
    time.sleep(0.5 + random.uniform(0.0, 1.0))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- samples --------------------------------------------------------------------------------
@dataclass
class Sample:
    tool: str
    rep: int
    ok: bool = False
    error: str = ""
    s: dict[str, Optional[float]] = field(default_factory=dict)  # seconds from t0
    code: Optional[int] = None
    lines: list[str] = field(default_factory=list)  # what the tool said after t0
    notes: list[str] = field(default_factory=list)


def fmt(v: Optional[float], digits: int = 2) -> str:
    return benchlib.fmt(v, digits, none="-")


def values_of(samples: Sequence[Sample], tool: str, key: str) -> list[float]:
    return [v for s in samples if s.tool == tool and s.ok for v in [s.s.get(key)]
            if v is not None]


# ==========================================================================================
# fdl-fabric
# ==========================================================================================
class Fdl:
    def __init__(self, args: argparse.Namespace, tmp: Path, lab: Any) -> None:
        self.args = args
        self.lab = lab
        prog = tmp / "rank.py"
        prog.write_text(RANK)
        self.cmd = (f"{shlex.quote(sys.executable)} -u {shlex.quote(str(prog))} "
                    f"{LONG_SLEEP:g} {args.short:g}")
        self.cluster = lab.write_cluster(
            [lab.worker(h, nproc=args.per_host) for h in lab.hosts],
            filename="elastic.yml", kill_grace=args.kill_grace,
            elastic={"min_hosts": args.min_hosts})
        self.world0: int = args.hosts * args.per_host
        self.world1: int = (args.hosts - 1) * args.per_host

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "invoke", "--search-root", str(ROOT), "launch",
                "--cluster", str(self.cluster), "--max-restarts", "1", "--cmd", self.cmd]

    @staticmethod
    def starts(run: Launch, attempt: int) -> dict[int, tuple[float, str]]:
        """Rank -> (time, host) of the first start line of ``attempt``."""
        got: dict[int, tuple[float, str]] = {}
        for t, line in run._of("out"):
            m = FDL_START.match(line)
            if m and int(m.group(2)) == attempt:
                got.setdefault(int(m.group(3)), (t, m.group(1)))
        return got

    def run(self, rep: int) -> Sample:
        sample = Sample(FDL, rep)
        victim = self.lab.hosts[-1]
        run = Launch(self.argv())
        run_id = ""
        try:
            def up0() -> bool:
                if run.proc.poll() is not None:
                    raise BenchError(f"exited {run.proc.returncode} before attempt 0 was up: "
                                     + run.tail())
                return len(self.starts(run, 0)) >= self.world0

            wait_until(up0, f"{self.world0} start lines of attempt 0", self.args.timeout)
            run_id = wait_until(lambda: next((m.group(1) for line in run.stderr_lines
                                              for m in [RUN_ID.match(line)] if m), None),
                                "the run id line", 30)
            _RUN_IDS.add(run_id)
            settle()
            t0 = time.monotonic()
            victim.stop()
            sample.s["host_down"] = time.monotonic() - t0

            def up1() -> bool:
                if len(self.starts(run, 1)) >= self.world1:
                    return True
                if run.proc.poll() is not None:
                    raise BenchError(f"exited {run.proc.returncode} with "
                                     f"{len(self.starts(run, 1))} of {self.world1} start "
                                     f"lines of attempt 1: " + run.tail())
                return False

            wait_until(up1, f"{self.world1} start lines of attempt 1", self.args.timeout)
            ones = self.starts(run, 1)
            times = sorted(t for t, _ in ones.values())
            sample.s["first_start"] = times[0] - t0
            sample.s["all_started"] = times[-1] - t0
            sample.s["first_line"] = _rel(run.first(lambda x: True, t0, "err"), t0)
            sample.s["restarting"] = _rel(run.first(lambda x: "restarting every rank" in x,
                                                    t0, "err"), t0)
            hosts = {h for _, h in ones.values()}
            if victim.name in hosts or len(hosts) != self.args.hosts - 1:
                sample.notes.append(f"attempt 1 ran on {sorted(hosts)}")
            if sorted(ones) != list(range(self.world1)):
                sample.notes.append("attempt 1's ranks are not 0..N-1")
            try:
                code = run.proc.wait(self.args.short + 60)
                sample.s["exit"] = time.monotonic() - t0
            except subprocess.TimeoutExpired:
                code = None
                sample.notes.append("the launcher did not exit within --short + 60 s")
            for t in run._readers:
                t.join(5)
            sample.code = code
            sample.lines = [line for t, _, line in run.lines
                            if t >= t0 and not FDL_START.match(line)]
            if code != 0:
                sample.notes.append(f"exit {code}, expected 0")
            sample.ok = True
        except BenchError as exc:
            sample.error = str(exc)
        finally:
            run.stop()
            if run_id:
                left = run_leftovers(run_id, 15)
                if left:
                    sample.notes.append(f"left running (killed): pids {left}")
            if victim.sshd.poll() is not None:
                victim.restart()
        return sample


def _rel(t: Optional[float], t0: float) -> Optional[float]:
    return None if t is None else t - t0


# ==========================================================================================
# torchrun
# ==========================================================================================
def torchrun_tool(program: str) -> str:
    return f"torchrun ({program})"


class Torchrun:
    NODES, NPROC = 3, 2

    def __init__(self, args: argparse.Namespace, tmp: Path, program: str) -> None:
        self.args = args
        self.tmp = tmp
        self.program = program
        self.tool = torchrun_tool(program)
        self.prog = tmp / f"tr_{program}.py"
        self.prog.write_text(RANK if program == "sleep" else ALLREDUCE)
        self.torchrun = str(Path(sys.executable).with_name("torchrun"))

    def argv(self, port: int, rdzv_id: str) -> list[str]:
        return [self.torchrun, "--nnodes", f"2:{self.NODES}", "--nproc-per-node",
                str(self.NPROC), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"127.0.0.1:{port}", "--max-restarts", "1", "--rdzv-id", rdzv_id,
                str(self.prog), f"{LONG_SLEEP:g}", f"{self.args.short:g}"]

    @staticmethod
    def starts(node: Launch, after: float = 0.0) -> list[tuple[float, int, int]]:
        """(time, attempt, rank) of every start line ``node``'s workers wrote after ``after``."""
        got = []
        for t, line in node._of("out"):
            m = TR_START.search(line)
            if m and t >= after:
                got.append((t, int(m.group(1)), int(m.group(2))))
        return got

    def _joined(self, sample: Sample, survivors: Sequence[Launch], t0: float,
                want: int) -> None:
        """Whether the next round's workers formed their process group (``joined`` lines),
        watched up to the cap from t0 but at least 30 s after they started."""
        def joined() -> list[float]:
            return sorted(t for n in survivors for t, line in n._of("out")
                          if t >= t0 and line.startswith("joined attempt"))

        def done() -> bool:
            return len(joined()) >= want or all(n.proc.poll() is not None for n in survivors)

        wait = max(self.args.torchrun_cap - (time.monotonic() - t0), 30.0)
        with contextlib.suppress(BenchError):
            wait_until(done, "the next round's process group", wait, 0.05)
        got = joined()
        if len(got) >= want:
            sample.s["joined"] = got[want - 1] - t0
        else:
            sample.notes.append(f"the next round's process group did not form within "
                                f"{time.monotonic() - t0:.0f} s of t0 ({len(got)} of {want} "
                                "joined)")

    def _next_round(self, sample: Sample, survivors: list[Launch], t0: float,
                    want: int) -> None:
        """What the survivors did after the kill: their first line, the next round's
        workers up (and, for allreduce, its process group formed), or why not."""
        cap = self.args.torchrun_cap
        said = [t for n in survivors for t, _, _ in n.lines if t >= t0]
        sample.s["first_line"] = min(said) - t0 if said else None
        new = sorted(x for n in survivors for x in self.starts(n, t0))
        if len(new) >= want:
            sample.s["first_start"] = new[0][0] - t0
            sample.s["all_started"] = new[want - 1][0] - t0
            sample.notes.append("next round's TORCHELASTIC_RESTART_COUNT: "
                                + ",".join(str(a) for _, a, _ in new[:want]))
            if self.program == "allreduce":
                self._joined(sample, survivors, t0, want)
        else:
            ended = [(i, n.proc.returncode) for i, n in enumerate(survivors)
                     if n.proc.poll() is not None]
            sample.notes.append(
                f"did not carry on within {cap:g} s: {len(new)} of {want} start lines "
                f"after the kill" + (f"; exited: {ended}" if ended else
                                     "; both survivors still running"))

    def run(self, rep: int) -> Sample:
        sample = Sample(self.tool, rep)
        port, rdzv_id = free_port(), f"bench-{uuid.uuid4().hex[:8]}"
        nodes: list[Launch] = []
        workers: list[psutil.Process] = []
        try:
            nodes.append(Launch(self.argv(port, rdzv_id), cwd=self.tmp))

            def store_up() -> bool:
                if nodes[0].proc.poll() is not None:
                    raise BenchError(f"node 0 exited {nodes[0].proc.returncode}: "
                                     + nodes[0].tail())
                with socket.socket() as s:
                    s.settimeout(0.5)
                    return s.connect_ex(("127.0.0.1", port)) == 0

            wait_until(store_up, "node 0's c10d store", 120, interval=0.1)
            nodes += [Launch(self.argv(port, rdzv_id), cwd=self.tmp)
                      for _ in range(self.NODES - 1)]
            world = self.NODES * self.NPROC

            def up0() -> bool:
                for i, n in enumerate(nodes):
                    if n.proc.poll() is not None:
                        raise BenchError(f"node {i} exited {n.proc.returncode}: " + n.tail())
                if self.program == "allreduce":  # in the collective, not still importing
                    return sum(1 for n in nodes for line in n.stdout_lines
                               if line.startswith("joined attempt 0")) >= world
                return sum(len(self.starts(n)) for n in nodes) >= world

            what = "joined" if self.program == "allreduce" else "start"
            wait_until(up0, f"{world} {what} lines of round 0", self.args.timeout, 0.05)
            victim = nodes[-1]
            workers = psutil.Process(victim.proc.pid).children(recursive=True)
            settle()
            t0 = time.monotonic()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(victim.proc.pid, signal.SIGKILL)
            killed = _kill_procs(workers)
            victim.proc.wait(10)
            benchlib.forget(victim.popen)
            sample.notes.append(f"node 2: agent's group and {len(killed)} worker(s) "
                                "in sessions of their own killed")
            survivors = nodes[:-1]
            want = len(survivors) * self.NPROC
            cap = self.args.torchrun_cap

            def next_round() -> bool:
                return sum(len(self.starts(n, t0)) for n in survivors) >= want or \
                    all(n.proc.poll() is not None for n in survivors)

            with contextlib.suppress(BenchError):
                wait_until(next_round, "the next round", cap, 0.05)
            self._next_round(sample, survivors, t0, want)
            for i, n in enumerate(survivors):
                sample.lines += [f"node {i}: {line}" for t, _, line in n.lines if t >= t0]
            sample.ok = True
        except BenchError as exc:
            sample.error = str(exc)
        finally:
            for n in nodes:
                with contextlib.suppress(psutil.Error):
                    workers += psutil.Process(n.proc.pid).children(recursive=True)
                n.stop(grace=5)
            left = _kill_procs(workers)  # workers live in sessions of their own
            if left:
                sample.notes.append(f"workers left running (killed): pids {left}")
        return sample
