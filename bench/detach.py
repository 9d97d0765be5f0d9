#!/usr/bin/env python3
"""Issue 30: runs that outlive the terminal: ``--detach``, ``attach``, ``logs -f``.

A script, not a test: it prints medians and ratios against a peer measured in the same
run (interleaved round-robin), never asserts a timing. Run ``python3 bench/detach.py
--help``. Every record goes to ``FDL_FABRIC_RUNS_DIR`` in a scratch folder.

Sections (``--only``, repeatable):

* ``prompt``: ``fdl-fabric run --detach --nproc-per-node 4`` (local) and ``fdl-fabric
  launch --detach`` on 4 sshd-lab hosts x 2 (remote): Popen -> the process exits (the
  prompt is back), beside the same command in the foreground: Popen -> its
  ``all_ranks_running`` JSON record (``--json``) read on its stdout. Both with
  ``--json``; ranks print ``up`` and sleep 0.5 s; a detached run is then waited for
  (``fdl-fabric wait``). From each run's record (events.jsonl, state.json): when the
  launcher (the supervisor) saw every rank running, and when the supervisor process
  was created. Target: detached / foreground <= 1.1.
* ``attach``: one detached run whose one rank writes ``tick <time.time()>`` every 20 ms.
  ``fdl-fabric attach RUN`` (default ``--tail`` 20) is started; **first live line** =
  Popen -> the first line on its stdout that the rank wrote after that Popen (its
  timestamp says so; lines written while attach starts come in its first ``--tail``
  read). Beside it: Popen -> attach's ``attached to run`` line on stderr. **line
  latency** = the rank's write -> the line read on the follower's stdout, for lines
  written after the first live line was read (steady state). Ctrl-C (SIGINT) then
  detaches it (exit 0 and "goes on" are checked). Peer: ``tail -n 20 -f console.log``.
  Target: first live line <= 0.3 s at p50.
* ``logs``: ``fdl-fabric logs RUN -f`` beside ``tail -n +1 -f`` of the same
  console.log. *synthetic*: a writer process (the record's launcher: state.json names
  its pid) appends ``--lines`` console lines (``[localhost:cpu:r0] r0 <i>``) at full
  speed in 256 KiB writes, never rotating, then writes result.json (``logs -f`` ends
  there); each follower alone, once it showed the record's first line. *run*: a
  detached run whose rank prints ``--run-lines`` lines at full speed once both
  followers (started together) have shown the console so far. **lines/s** = lines /
  (go -> the last line read on the follower's stdout); **stream** = lines / (the first
  data line read -> the last). Target: logs -f / tail -f >= 0.9 (lines/s).
* ``idle``: ``--hosts`` x ``--per-host`` (32 x 8) sshd-lab hosts (bench/idle.py's
  way: real OpenSSH ``sshd`` per host on loopback addresses of this machine) whose
  ranks print ``up`` and sleep (idle.py's rank, ``poll`` on stdout, no timer). The
  detached supervisor's user+system CPU (``/proc/<pid>/stat``) over ``--window`` s,
  starting ``--settle`` s after every ``up`` line is in the record, beside the
  foreground ``fdl-fabric launch`` of the same cluster. Target: the same within noise
  (|difference| <= 2 x the combined standard error of the 1-second slices, or 0.1 %,
  the tick's resolution over 10 s).

Rows marked "what-if" apply one proposed change in the measured process only
(bench/detach_whatif.py: ``os._exit`` at the end, the supervisor started before the
front's imports, a 10 ms poll for ``logs -f``); they are never counted against a target.
Sections 3 and 4 live in bench/detach_follow.py, the shared helpers in bench/detachlib.py.

Every process started here runs in a process group of its own and only those groups are
signalled; a detached supervisor (a session of its own, started by fdl-fabric) is
stopped with ``fdl-fabric stop`` and, if it is still there, killed by pid checked with
its start time (psutil). The lab and the scratch folder are removed on exit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TextIO

import benchlib
from detach_follow import idle_section, logs_section, report_idle, report_logs
from detachlib import (
    SUPERVISORS,
    Reader,
    detached_of,
    event_time,
    fdl,
    fmt,
    json_records,
    med,
    report_attach,
    report_prompt,
    run_quiet,
    started_since_boot,
    whatif,
    with_detach,
)
from launchlib import run_timed

SECTIONS = ("prompt", "attach", "logs", "idle")
#: What-if rows of the prompt section: a proposed change, applied in the front process
#: only by bench/detach_whatif.py (never counted against a target).
WHATIF = {"what-if: os._exit": "exit", "what-if: early spawn + os._exit": "early"}

PROMPT_RANK = """\
import os, sys, time
os.write(1, ("up " + os.environ.get("RANK", "?") + "\\n").encode())
time.sleep(float(sys.argv[1]))
"""
TICK_RANK = """\
import os, sys, time
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    os.write(1, ("tick %.6f\\n" % time.time()).encode())
    time.sleep(float(sys.argv[2]))
"""

# -- 1. prompt -------------------------------------------------------------------------------
@dataclass
class Launched:
    scenario: str
    tool: str
    rep: int
    ok: bool = False
    error: str = ""
    prompt: Optional[float] = None  # detached: Popen -> exit; foreground: -> ARR line read
    arr_event: Optional[float] = None  # Popen -> the launcher's all_ranks_running event
    supervisor_born: Optional[float] = None  # Popen -> the supervisor process created
    relayed_arr: Optional[float] = None  # detached: Popen -> the relayed ARR record read
    said: Optional[float] = None  # detached: Popen -> its `detached` record read


def measure_prompt(scenario: str, tool: str, argv: list[str], rep: int,
                   env: dict[str, str], runs: Path) -> Launched:
    s = Launched(scenario, tool, rep)
    detached = tool != "foreground"
    wall0, boot0 = time.time(), time.clock_gettime(time.CLOCK_BOOTTIME)
    _running, _done, children, error = run_timed([argv], expect_up=0, env=env,
                                                 cwd=str(benchlib.ROOT), timeout=90.0)
    child = children[0]
    recs = json_records(child.lines)
    arr = [t for t, r in recs if r.get("name") == "all_ranks_running"]
    try:
        if error or child.proc.returncode != 0:
            raise benchlib.BenchError(f"{error or 'exit ' + str(child.proc.returncode)}: "
                                      + b" | ".join(ln for _t, _w, ln in child.lines[-5:])
                                      .decode(errors="replace"))
        if detached:
            run_id, pid = detached_of(child.lines)
            SUPERVISORS.add(run_id, pid)
            born = started_since_boot(pid)
            s.supervisor_born = None if born is None else born - boot0
            s.prompt = child.exited
            s.relayed_arr = arr[0] if arr else None
            s.said = next((t for t, r in recs if r.get("name") == "detached"), None)
            code = SUPERVISORS.finish(run_id, stop=False)
            if code != 0:
                raise benchlib.BenchError(f"fdl-fabric wait {run_id}: exit {code}")
        else:
            if not arr:
                raise benchlib.BenchError("no all_ranks_running record")
            s.prompt = arr[0]
            run_id = next(r["data"]["run_id"] for _t, r in recs if r.get("name") == "launch")
        got = event_time(runs / run_id, "all_ranks_running")
        s.arr_event = None if got is None else got - wall0
        s.ok = True
    except (benchlib.BenchError, OSError, ValueError, KeyError, StopIteration) as exc:
        s.error = str(exc)
    return s


def prompt_section(args: argparse.Namespace, tmp: Path, env: dict[str, str], lab: Any,
                   out: TextIO) -> dict[str, Any]:
    rank = tmp / "prompt_rank.py"
    rank.write_text(PROMPT_RANK)
    plans: list[tuple[str, list[str]]] = [
        ("local 1 x 4 (fdl-fabric run)",
         ["run", "--json", "--nproc-per-node", "4", str(rank), "0.5"])]
    if lab is not None:
        cluster = lab.write_cluster([lab.worker(h, nproc=2) for h in lab.hosts[:4]],
                                    filename="prompt.yml")
        plans.append(("remote 4 x 2 (fdl-fabric launch)",
                      ["launch", "--json", "--cluster", str(cluster), "--cmd",
                       f"{sys.executable} {rank} 0.5"]))
    tools = ["foreground", "detached"] + ([] if args.no_whatif else list(WHATIF))
    samples: list[Launched] = []
    floors: list[float] = []
    for rep in range(args.prompt_repeat + 1):
        out.write(f"prompt round {rep + 1}/{args.prompt_repeat + 1}"
                  f"{' (warm-up)' if rep == 0 else ''}:")
        for scenario, words in plans:
            for tool in (tools if rep % 2 == 0 else tools[::-1]):
                if tool == "foreground":
                    argv = fdl(*words)
                elif tool == "detached":
                    argv = fdl(*with_detach(words))
                else:
                    argv = whatif(WHATIF[tool], *with_detach(words))
                s = measure_prompt(scenario, tool, argv, rep, env, args.runs)
                samples.append(s)
                out.write(f" {fmt(s.prompt, 2)}" if s.ok else " x")
                out.flush()
        t0 = time.perf_counter()
        run_quiet(fdl("run", "--help"), env)
        floors.append(time.perf_counter() - t0)
        out.write(f"  (load {benchlib.loadavg()})\n")
    return {"samples": samples, "plans": [p[0] for p in plans], "tools": tools,
            "floor": med(floors[1:])}


# -- 2. attach -------------------------------------------------------------------------------
@dataclass
class Attached:
    tool: str
    rep: int
    ok: bool = False
    error: str = ""
    first_live: Optional[float] = None
    said: Optional[float] = None  # Popen -> attach's "attached to run" line (stderr)
    latencies: list[float] = field(default_factory=list)


def _tick_time(line: bytes) -> Optional[float]:
    head, _, value = line.rpartition(b" tick ")
    try:
        return float(value) if head else None
    except ValueError:
        return None


def measure_attach(tool: str, argv: list[str], rep: int, env: dict[str, str],
                   follow_s: float) -> Attached:
    a = Attached(tool, rep)
    t0 = time.time()
    proc = benchlib.start(argv, env=env, bufsize=0)
    reader = Reader(proc.stdout)
    err = Reader(proc.stderr)
    try:
        def live() -> list[tuple[float, float]]:
            return [(t, w) for t, line in list(reader.lines)
                    if (w := _tick_time(line)) is not None and w >= t0]
        first = benchlib.wait_until(live, "a live line", 10.0, 0.005)
        a.first_live = first[0][0] - t0
        time.sleep(follow_s)
        # steady state: lines written once the follower reads (not the first catch-up)
        a.latencies = [t - w for t, w in live() if w >= first[0][0]]
        a.said = next((t - t0 for t, ln in err.lines if b"attached to run" in ln), None)
        if tool == "fdl-fabric attach":
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: detaches, the run goes on
            code = proc.wait(10)
            if code != 0 or b"goes on" not in b"\n".join(ln for _t, ln in err.lines):
                raise benchlib.BenchError(f"Ctrl-C: exit {code}, stderr "
                                          f"{[ln for _t, ln in err.lines][-2:]}")
        a.ok = True
    except (benchlib.BenchError, subprocess.TimeoutExpired) as exc:
        a.error = str(exc)
    finally:
        benchlib.stop(proc, grace=5)
    return a


def attach_section(args: argparse.Namespace, tmp: Path, env: dict[str, str],
                   out: TextIO) -> dict[str, Any]:
    rank = tmp / "tick_rank.py"
    rank.write_text(TICK_RANK)
    reps = args.attach_repeat + 1
    duration = reps * 2 * (args.follow + 4) + 30
    _r, _d, children, error = run_timed(
        [fdl("run", "--detach", "--json", "--nproc-per-node", "1", str(rank),
             f"{duration:g}", "0.02")], expect_up=0, env=env, timeout=90.0)
    run_id, pid = detached_of(children[0].lines)
    SUPERVISORS.add(run_id, pid)
    console = args.runs / run_id / "console.log"
    benchlib.wait_until(lambda: console.exists() and console.read_bytes().count(b" tick ") > 25,
                        "25 tick lines in console.log", 30.0)
    tail = shutil.which("tail") or "tail"
    tools = [("fdl-fabric attach", fdl("attach", run_id)),
             ("tail -n 20 -f", [tail, "-n", "20", "-f", str(console)])]
    samples: list[Attached] = []
    out.write(f"attach: run {run_id}, rank ticks every 20 ms; rounds:")
    for rep in range(reps):
        for tool, argv in (tools if rep % 2 == 0 else tools[::-1]):
            a = measure_attach(tool, argv, rep, env, args.follow)
            samples.append(a)
            out.write(f" {fmt(a.first_live, 2)}" if a.ok else " x")
            out.flush()
    code = SUPERVISORS.finish(run_id, stop=True)
    out.write(f"  (stopped: exit {code}; load {benchlib.loadavg()})\n")
    return {"samples": samples, "stop_code": code}


# -- the whole -------------------------------------------------------------------------------
def bench(args: argparse.Namespace, tmp: Path, out: TextIO) -> int:
    global _LAB
    started = time.monotonic()
    load_start = benchlib.wait_for_quiet(args.wait_load, out)
    args.runs = tmp / "runs"
    args.runs.mkdir(mode=0o700)
    env = dict(os.environ, FDL_FABRIC_RUNS_DIR=str(args.runs))
    SUPERVISORS.env = env
    out.write(f"records in {args.runs} (FDL_FABRIC_RUNS_DIR)\n")
    n_hosts = max(4 if "prompt" in args.only and not args.no_remote else 0,
                  args.hosts if "idle" in args.only else 0)
    lab = _LAB = benchlib.start_lab(tmp / "lab", n_hosts, out) if n_hosts else None
    targets: list[list[str]] = []
    reports: list[Callable[[], None]] = []
    if "prompt" in args.only:
        res = prompt_section(args, tmp, env, None if args.no_remote else lab, out)
        reports.append(lambda: report_prompt(res, out, targets))
    if "attach" in args.only:
        ares = attach_section(args, tmp, env, out)
        reports.append(lambda: report_attach(ares, out, targets))
    if "logs" in args.only:
        lres = logs_section(args, tmp, env, out)
        reports.append(lambda: report_logs(lres, out, targets))
    if "idle" in args.only:
        ires = idle_section(args, tmp, env, lab, out)
        reports.append(lambda: report_idle(ires, args, out, targets))
    for write in reports:
        write()
    out.write("\nTargets (issue 30)\n\n")
    out.write(benchlib.table([["measure", "got", "target", ""], *targets],
                             [False, True, False, False]) + "\n")
    benchlib.write_machine_notes(out, load_start, started)
    return 0


_LAB: Any = None


def _cleanup() -> None:
    SUPERVISORS.stop_all()
    benchlib.stop_all()
    if _LAB is not None:
        _LAB.stop()


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = benchlib.arg_parser(__doc__, epilog=True)
    ap.add_argument("--only", action="append", choices=SECTIONS,
                    help="run only this section (repeatable; default all)")
    ap.add_argument("--quick", action="store_true",
                    help="fewer rounds, shorter windows: about 3 minutes on 2 cores")
    ap.add_argument("--prompt-repeat", type=int, help="measured rounds after a warm-up (7)")
    ap.add_argument("--no-remote", action="store_true", help="prompt: local only, no lab")
    ap.add_argument("--no-whatif", action="store_true",
                    help="skip the what-if rows (bench/detach_whatif.py: a proposed change "
                    "applied in the measured process only)")
    ap.add_argument("--attach-repeat", type=int, help="measured rounds after a warm-up (15)")
    ap.add_argument("--follow", type=float, default=0.5,
                    help="seconds a follower is read after its first live line (0.5)")
    ap.add_argument("--lines", type=int, help="synthetic logs: lines written (5,000,000)")
    ap.add_argument("--logs-repeat", type=int, help="synthetic logs: measured rounds (5)")
    ap.add_argument("--run-lines", type=int, help="lines the printing run prints (1,000,000)")
    ap.add_argument("--run-repeat", type=int, help="printing runs (3)")
    ap.add_argument("--hosts", type=int, default=32, help="idle: lab hosts (32)")
    ap.add_argument("--per-host", type=int, default=8, help="idle: sleeping ranks per host (8)")
    ap.add_argument("--idle-repeat", type=int, help="idle rounds (3)")
    ap.add_argument("--window", type=float, help="idle sampling window, s (20)")
    ap.add_argument("--settle", type=float, default=2.0,
                    help="idle: seconds between every up line and the window (2)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="idle: longest wait for every up line, s (300)")
    ap.add_argument("--wait-load", type=float, metavar="L",
                    help="first wait (up to 20 min) until the 1-minute load is <= L")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder")
    args = ap.parse_args(argv)
    args.only = args.only or list(SECTIONS)
    quick = {"prompt_repeat": 3, "attach_repeat": 5, "lines": 3_000_000, "logs_repeat": 3,
             "run_lines": 300_000, "run_repeat": 1, "idle_repeat": 1, "window": 10.0}
    full = {"prompt_repeat": 7, "attach_repeat": 15, "lines": 5_000_000, "logs_repeat": 5,
            "run_lines": 1_000_000, "run_repeat": 3, "idle_repeat": 3, "window": 20.0}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.run_lines * 32 > (64 << 20):
        ap.error("--run-lines: a run's console.log rotates past 64 MiB: at most 2,000,000")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    return benchlib.run_in_scratch("fdl-detach-", args, bench, _cleanup)


if __name__ == "__main__":
    sys.exit(main())
