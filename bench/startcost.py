#!/usr/bin/env python3
"""Issue 35, the small launch: what a launch pays around its work, piece by piece.

Prints medians (ms) of fresh processes on this machine, each beside its peer or floor,
measured interleaved in the same run; nothing here asserts a timing. No lab: 20-40 s.

* **a rank's spawn** (`fdl_fabric.agent.children.spawn` of ``true``, until the call
  returns): ``posix_spawn`` (what an agent on glibc 2.26+ uses) and the ``fork`` and
  ``exec`` fallback, beside `subprocess.Popen` (the peer: what torchrun's agent uses);
* **an agent's start**: ``/usr/bin/python3 -I -S`` with the bootstrap, the bundle on its
  stdin, until its handshake is read (what each host pays before it answers), beside
  the same interpreter running nothing (the floor);
* **the launcher's imports**: ``fdl_fabric.tasks`` and ``fdl_fabric.commands.launch`` in
  a fresh interpreter, beside ``import invoke`` (the program it runs under);
* **a command's exit**: from a program's last line to its exit, with the launcher's
  modules loaded and about 50,000 objects held, with `heap.left_to_the_os` (what every
  task does) and without it, beside ``python -c pass``'s exit (the floor).

Run ``python3 bench/startcost.py [--repeat N]``; see bench/README.md.
"""

from __future__ import annotations

import argparse
import os
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import benchlib  # noqa: E402

from fdl_fabric.agent import children  # noqa: E402
from fdl_fabric.transport import bundle  # noqa: E402

ENV = {"PATH": "/usr/bin:/bin"}
#: A program that loads the launcher, holds objects like a launch's, says when its last
#: line was written, and exits (with the heap left to the OS, or not).
EXIT_PROGRAM = """\
import sys, time
sys.path.insert(0, {root!r})
import fdl_fabric.tasks, fdl_fabric.commands.launch, fdl_fabric.transport.ssh
from fdl_fabric.commands.heap import left_to_the_os
held = [{{"rank": r, "env": {{"K%d" % i: str(i) for i in range(8)}}}} for r in range(4000)]
if {left}:
    left_to_the_os()
sys.stdout.write("%.6f\\n" % time.monotonic())
sys.stdout.flush()
"""


def _spawn(way: bool) -> Callable[[], float]:
    def run() -> float:
        saved = children.SPAWNS
        children.SPAWNS = way
        try:
            t0 = time.perf_counter()
            child = children.spawn(["true"], ENV, "/")
            took = time.perf_counter() - t0
        finally:
            children.SPAWNS = saved
        os.close(child.stdout)
        os.close(child.stderr)
        os.waitpid(child.pid, 0)
        return took * 1000
    return run


def _popen() -> float:
    t0 = time.perf_counter()
    proc = subprocess.Popen(["true"], env=ENV, cwd="/", stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, close_fds=True)
    took = time.perf_counter() - t0
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    proc.stderr.close()
    proc.wait()
    return took * 1000


def _agent_up() -> float:
    return benchlib.agent_up(["/usr/bin/python3", "-I", "-S", "-c", bundle.BOOTSTRAP]) * 1000


def _python_nothing() -> float:
    t0 = time.perf_counter()
    subprocess.run(["/usr/bin/python3", "-I", "-S", "-c", "pass"], check=True)
    return (time.perf_counter() - t0) * 1000


def _imports(modules: str) -> Callable[[], float]:
    code = (f"import sys, time\nsys.path.insert(0, {str(ROOT)!r})\nt = time.perf_counter()\n"
            f"import {modules}\nprint((time.perf_counter() - t) * 1000)\n")

    def run() -> float:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True)
        return float(out.stdout.split()[-1])
    return run


def _exit(code: str) -> Callable[[], float]:
    def run() -> float:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        assert proc.stdout is not None
        last = float(proc.stdout.readline())
        fd = os.pidfd_open(proc.pid)
        try:
            select.select([fd], [], [], 30)
            took = (time.monotonic() - last) * 1000
        finally:
            os.close(fd)
        proc.wait()
        return took
    return run


def _rows(repeat: int) -> list[tuple[str, str, list[float]]]:
    exit_code = "import sys, time\nsys.stdout.write('%.6f\\n' % time.monotonic())\n" \
                "sys.stdout.flush()\n"
    groups: list[list[tuple[str, str, Callable[[], float]]]] = [
        [("a rank's spawn (true)", "posix_spawn (agent, glibc 2.26+)", _spawn(True)),
         ("a rank's spawn (true)", "fork + exec (agent, older C library)", _spawn(False)),
         ("a rank's spawn (true)", "peer: subprocess.Popen", _popen)],
        [("an agent's start to its handshake", "fdl-fabric agent", _agent_up),
         ("an agent's start to its handshake", "floor: python3 -I -S -c pass", _python_nothing)],
        [("the launcher's imports", "fdl_fabric.tasks + commands.launch",
          _imports("fdl_fabric.tasks, fdl_fabric.commands.launch")),
         ("the launcher's imports", "peer: import invoke", _imports("invoke"))],
        [("a command's exit (last line -> gone)", "heap left to the OS (every task)",
          _exit(EXIT_PROGRAM.format(root=str(ROOT), left=True))),
         ("a command's exit (last line -> gone)", "heap collected at teardown",
          _exit(EXIT_PROGRAM.format(root=str(ROOT), left=False))),
         ("a command's exit (last line -> gone)", "floor: python -c (nothing loaded)",
          _exit(exit_code))],
    ]
    rows = []
    for group in groups:
        samples: list[list[float]] = [[] for _ in group]
        for _ in range(repeat):  # interleaved: one of each, then again
            for i, (_, _, measure) in enumerate(group):
                samples[i].append(measure())
        rows += [(what, how, values) for (what, how, _), values in zip(group, samples)]
    return rows


def _table(rows: Sequence[tuple[str, str, list[float]]]) -> str:
    out = [f"{'what':38s}  {'how':38s}  {'median ms':>9s}  {'min-max':>13s}  {'x first':>7s}"]
    first: Optional[float] = None
    last_what = ""
    for what, how, values in rows:
        med = statistics.median(values)
        if what != last_what:
            first, last_what = med, what
        ratio = med / first if first else float("nan")
        out.append(f"{what:38s}  {how:38s}  {med:9.2f}  "
                   f"{min(values):6.2f}-{max(values):6.2f}  {ratio:7.2f}")
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=21, help="samples of each (21)")
    args = ap.parse_args(argv)
    print(f"startcost: medians of {args.repeat} fresh runs each, interleaved "
          f"(python {sys.version.split()[0]}, {os.cpu_count()} cpus, load "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())})\n")
    print(_table(_rows(args.repeat)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
