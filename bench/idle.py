#!/usr/bin/env python3
"""The launcher's own cost while remote ranks sleep: CPU and threads of `inv launch`.

A script, not a test: it prints figures, never asserts them.

For each shape (``HOSTSxRANKS``, default ``8x8,8x32,32x8``) the benchmark starts a
launch on that many sshd-lab hosts whose ranks print ``up <RANK>`` and then sleep,
reads its stdout until every ``up`` line arrived, lets it settle, and then samples, over
``--window`` seconds (default 10):

* the ``inv launch`` process's user+system CPU (``/proc/<pid>/stat``, all threads), as
  a percentage of one core, and its thread count (``/proc/<pid>/status``);
* on the hosts' side (the lab hosts are this machine): the agents (and their
  watchdogs) and the per-session sshd processes, summed, for context;
* the same for ``parallel-ssh -P -p N`` holding N sessions whose ranks sleep (pssh's own
  process, and pssh plus its N ``ssh`` clients: the fair peer of a launcher that does
  its SSH in-process).

``8x32`` has as many ranks as ``32x8`` on a quarter of the hosts: threads that grow with
hosts and not with ranks show as ``8x8 == 8x32 < 32x8``.

The sleeping rank waits with ``poll`` on its own stdout for the reader to go away (the
agent, or the sshd session once the ssh client is gone) with no timer, so ranks cost
nothing while they idle and none outlives its tool. Shapes and tools run round-robin
(``--repeat`` rounds, default 1). Run ``python3 bench/idle.py --help``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, TextIO

import benchlib
import psutil

#: Prints ``up <RANK>`` and waits until its stdout's reader is gone (POLLERR/POLLHUP),
#: at most argv[1] seconds.
RANK_SCRIPT = """\
import os, select, sys
os.write(1, ("up " + os.environ.get("RANK", "?") + "\\n").encode())
p = select.poll()
p.register(1, 0)
p.poll(float(sys.argv[1]) * 1000)
"""

UP_LINE = re.compile(rb"^(?:\[[^\]]*\] |[0-9A-Za-z.:\[\]-]+: )?up (\S+)\s*$", re.M)


@dataclass
class Sample:
    shape: str
    tool: str
    rep: int
    ok: bool = False
    error: str = ""
    up_after: Optional[float] = None  # s from Popen to the last up line
    cpu_pct: Optional[float] = None  # the tool's own process, % of one core
    cpu_with_children_pct: Optional[float] = None  # plus its ssh clients (pssh)
    threads: Optional[int] = None
    agents_pct: Optional[float] = None  # hosts' side: agents + watchdogs
    sshd_pct: Optional[float] = None  # hosts' side: per-session sshd processes
    ranks_pct: Optional[float] = None
    slices: list[float] = field(default_factory=list)  # the tool's % per second


class UpCounter:
    """Drains a pipe in a thread and counts ``up`` lines; keeps the last bytes."""

    def __init__(self, stream: Any) -> None:
        self.count = 0
        self.tail = b""
        self.done_at: Optional[float] = None
        self._partial = b""
        self.thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self.thread.start()

    def _run(self, stream: Any) -> None:
        while True:
            data = os.read(stream.fileno(), 65536)
            if not data:
                return
            data = self._partial + data
            cut = data.rfind(b"\n") + 1
            self._partial = data[cut:]
            self.count += len(UP_LINE.findall(data[:cut]))
            self.tail = (self.tail + data)[-2000:]


def _host_side(lab: Any) -> tuple[list[psutil.Process], list[psutil.Process],
                                  list[psutil.Process]]:
    """(agents and watchdogs, per-session sshd processes, ranks) under the lab's listeners."""
    found = benchlib.lab_processes(lab)
    return ([p for p, cmd in found if not cmd.startswith("sshd") and "-I -S -c" in cmd],
            [p for p, cmd in found if cmd.startswith("sshd")],
            [p for p, cmd in found if not cmd.startswith("sshd") and "-I -S -c" not in cmd
             and "rank_idle.py" in cmd])


def measure(lab: Any, shape: str, tool: str, rep: int, argv: list[str], world: int,
            args: argparse.Namespace) -> Sample:
    sample = Sample(shape, tool, rep)
    t0 = time.monotonic()
    proc = benchlib.start(argv, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, bufsize=0)
    counter = UpCounter(proc.stdout)
    try:
        deadline = t0 + args.timeout
        while counter.count < world:
            if proc.poll() is not None:
                raise RuntimeError(f"exited early with {proc.returncode}: {counter.tail[-300:]!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {counter.count} of {world} up lines after "
                                   f"{args.timeout:g}s")
            time.sleep(0.02)
        sample.up_after = time.monotonic() - t0
        time.sleep(args.settle)
        me = psutil.Process(proc.pid)
        kids = me.children(recursive=True)
        agents, sshd, ranks = _host_side(lab)
        start_own = benchlib.cpu_seconds(proc.pid) or 0.0
        start_kids = benchlib.cpu_sum(kids)
        start_agents, start_sshd, start_ranks = (benchlib.cpu_sum(agents),
                                                 benchlib.cpu_sum(sshd), benchlib.cpu_sum(ranks))
        began = time.monotonic()
        sample.threads = benchlib.threads(proc.pid)
        last, last_t = start_own, began
        while time.monotonic() - began < args.window:
            time.sleep(1.0)
            now_cpu, now_t = benchlib.cpu_seconds(proc.pid) or 0.0, time.monotonic()
            sample.slices.append(100.0 * (now_cpu - last) / (now_t - last_t))
            last, last_t = now_cpu, now_t
        elapsed = time.monotonic() - began
        own = (benchlib.cpu_seconds(proc.pid) or 0.0) - start_own
        sample.cpu_pct = 100.0 * own / elapsed
        sample.cpu_with_children_pct = 100.0 * (own + benchlib.cpu_sum(kids) - start_kids) / elapsed
        sample.agents_pct = 100.0 * (benchlib.cpu_sum(agents) - start_agents) / elapsed
        sample.sshd_pct = 100.0 * (benchlib.cpu_sum(sshd) - start_sshd) / elapsed
        sample.ranks_pct = 100.0 * (benchlib.cpu_sum(ranks) - start_ranks) / elapsed
        sample.threads = max(sample.threads or 0, benchlib.threads(proc.pid) or 0)
        if proc.poll() is not None:
            raise RuntimeError(f"exited during the window with {proc.returncode}")
        sample.ok = True
    except RuntimeError as exc:
        sample.error = str(exc)
    finally:
        # The launcher stops its ranks on TERM. parallel-ssh starts every ssh client in a
        # session of its own and leaves them running on TERM; on INT it kills each
        # client's group, the sshd sessions close, and each rank sees its stdout go.
        try:
            clients = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            clients = []
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM if tool == "fdl-fabric" else signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
        benchlib.stop(proc, grace=10)
        for client in clients:  # psutil checks pid *and* start time before signalling
            with contextlib.suppress(psutil.Error):
                client.kill()
        counter.thread.join(5)
        _wait_hosts_quiet(lab)
    return sample


def _wait_hosts_quiet(lab: Any, timeout: float = 30.0) -> None:
    """Wait until no rank of ours is left on the lab hosts (the next run starts clean)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        agents, _sshd, ranks = _host_side(lab)
        if not agents and not ranks:
            return
        time.sleep(0.2)


def _cells(got: list[Sample]) -> list[str]:
    """A shape's and tool's figures: all up, CPU, threads, largest slice, the hosts' side."""
    return [benchlib.fmt(benchlib.med([s.up_after for s in got]), 1),
            benchlib.fmt(benchlib.med([s.cpu_pct for s in got])),
            benchlib.fmt(benchlib.med([s.cpu_with_children_pct for s in got])),
            str(max((s.threads or 0) for s in got)) if got else "n/a",
            benchlib.fmt(max((max(s.slices) for s in got if s.slices), default=None)),
            benchlib.fmt(benchlib.med([s.agents_pct for s in got])),
            benchlib.fmt(benchlib.med([s.sshd_pct for s in got])),
            benchlib.fmt(benchlib.med([s.ranks_pct for s in got]))]


def report(samples: list[Sample], shapes: list[str], tools: list[str], out: TextIO,
           args: argparse.Namespace) -> None:
    out.write(f"\nIdle cost while every rank sleeps: medians over {args.repeat} round(s); "
              f"CPU = user+sys over a {args.window:g} s window, % of one core\n\n")
    rows = [["shape (hosts x ranks)", "tool", "all up s", "tool CPU %", "+ children %",
             "threads", "max 1 s slice %", "agents %", "sshd sessions %", "ranks %", "runs"]]
    for shape in shapes:
        for tool in tools:
            runs = [s for s in samples if s.shape == shape and s.tool == tool]
            got = [s for s in runs if s.ok]
            if runs:
                rows.append([shape, tool, *_cells(got),
                             benchlib.runs_cell(len(got), len(runs) - len(got))])
    out.write(benchlib.table(rows, [False, False] + [True] * 9) + "\n")
    big = [s for s in samples if s.ok and s.tool == "fdl-fabric" and s.shape == "32x8"]
    if big:
        cpu = benchlib.med([s.cpu_pct for s in big])
        out.write(f"\ntarget: launcher CPU <= 2 % of one core at 32x8: {benchlib.fmt(cpu)} % -> "
                  f"{'met' if cpu is not None and cpu <= 2.0 else 'NOT met'}\n")
    for s in samples:
        if not s.ok:
            out.write(f"  ! {s.shape} {s.tool} round {s.rep + 1}: {s.error}\n")


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = benchlib.arg_parser(__doc__)
    ap.add_argument("--shapes", default="8x8,8x32,32x8",
                    help="comma-separated HOSTSxRANKS shapes (default 8x8,8x32,32x8)")
    ap.add_argument("--window", type=float, default=10.0, help="sampling window, s (10)")
    ap.add_argument("--settle", type=float, default=2.0,
                    help="seconds between the last up line and the window (2)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds (default 1)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="longest wait for every up line, s (300)")
    ap.add_argument("--no-pssh", action="store_true", help="skip parallel-ssh")
    ap.add_argument("--wait-load", type=float, metavar="L",
                    help="first wait (up to 20 min) until the 1-minute load is <= L")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args(argv)
    try:
        args.shape_list = [tuple(int(x) for x in s.lower().split("x"))
                           for s in args.shapes.split(",") if s.strip()]
        assert all(len(s) == 2 and min(s) > 0 for s in args.shape_list)
    except (ValueError, AssertionError):
        ap.error("--shapes: HOSTSxRANKS[,HOSTSxRANKS...], e.g. 8x8,32x8")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    out = sys.stdout
    with benchlib.terminate_gracefully():
        tmp = Path(tempfile.mkdtemp(prefix="fdl-idle-"))
        lab = None
        try:
            load_start = benchlib.wait_for_quiet(args.wait_load, out)
            script = tmp / "rank_idle.py"
            script.write_text(RANK_SCRIPT)
            sleep = args.timeout + args.settle + args.window + 120
            cmd = f"{shlex.quote(sys.executable)} {shlex.quote(str(script))} {sleep:g}"
            lab = benchlib.start_lab(tmp / "lab", max(h for h, _ in args.shape_list), out)
            plans: list[tuple[str, str, list[str], int]] = []
            for hosts, per in args.shape_list:
                shape = f"{hosts}x{per}"
                world = hosts * per
                cluster = lab.write_cluster([lab.worker(h, nproc=per) for h in lab.hosts[:hosts]],
                                            filename=f"idle-{shape}.yml")
                plans.append((shape, "fdl-fabric", benchlib.inv_launch_argv(cluster, cmd), world))
                if not args.no_pssh and benchlib.pssh_path():
                    hf = tmp / f"hosts-{shape}"
                    hf.write_text("".join(f"{lab.user}@{h.addr}:{h.port}\n"
                                          for h in lab.hosts[:hosts] for _ in range(per)))
                    plans.append((shape, f"parallel-ssh -P -p {world}",
                                  benchlib.pssh_argv(lab, hf, world, cmd), world))
            samples: list[Sample] = []
            for rep in range(args.repeat):
                for shape, tool, run_argv, world in plans:
                    out.write(f"round {rep + 1}: {shape} {tool} (load {benchlib.loadavg()})... ")
                    out.flush()
                    s = measure(lab, shape, tool.split(" -")[0] if tool.startswith("fdl")
                                else tool, rep, run_argv, world, args)
                    samples.append(s)
                    out.write(f"{benchlib.fmt(s.cpu_pct)} %\n" if s.ok else f"FAILED: {s.error}\n")
                    out.flush()
            shapes = list(dict.fromkeys(p[0] for p in plans))
            tools = list(dict.fromkeys(("fdl-fabric" if p[1].startswith("fdl") else p[1])
                                       for p in plans))
            report(samples, shapes, tools, out, args)
            out.write("\nmachine:\n")
            notes = benchlib.machine_notes()
            notes["load average at start / end"] = f"{load_start} / {benchlib.loadavg()}"
            for k, v in notes.items():
                out.write(f"  {k}: {v}\n")
            return 0 if all(s.ok for s in samples) else 1
        finally:
            benchlib.stop_all()
            if lab is not None:
                lab.stop()
            if args.keep:
                out.write(f"kept {tmp}\n")
            else:
                shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
