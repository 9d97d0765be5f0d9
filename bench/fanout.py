#!/usr/bin/env python3
"""Issue 23's fan-out benchmark: the flat launch before and after the quick cuts, the
gateway tree against flat, and parallel-ssh, side by side in one run.

Every launch runs against real sshd lab hosts (``fdl_fabric.testing.SshdLab``: OpenSSH
``sshd`` listeners on loopback addresses of this machine), interleaved round-robin
(one discarded warm-up round, then ``--repeat`` rounds); nothing asserts a timing.

Tools, all started through the same small ``python -c`` wrapper (`WRAPPER`) that runs
``inv launch`` in-process, so each pays the same interpreter start:

* **flat, before**: the checkout's code with issue 23's two quick cuts undone in the
  launcher process only: paramiko's 0.1 s transport poll (``FdlTransport.
  _active_check_timeout = 0.1``) and ``TCP_NODELAY`` cleared before the SSH handshake
  and set only once ``Connection.open()`` returned (as ``ssh.open_connection`` did);
* **flat, after**: the checkout as it is (the wrapper only records, per handshake,
  whether the socket had ``TCP_NODELAY`` and its read timeout, to show what the code
  did);
* **tree, fanout F**: the checkout with ``--fanout F`` (default 4): beyond F hosts,
  ``min(F, ceil(sqrt(H)))`` gateways, whose relays start the leaves' agents with ssh;
* **parallel-ssh -P -p N** (Debian ``pssh``), in the completion scenario.

Scenarios:

* ``HxR`` for each H of ``--hosts`` (default 8,32; R = ``--per-host``, default 1):
  ranks print ``up <RANK>`` and then sleep (poll their stdout, no timer). Measured:
  time to all running (the last ``up`` line read from the launcher's stdout), the
  launcher's user+sys CPU from start to that moment (the whole process, every thread,
  ns resolution through ``clock_getcpuclockid``), then after ``--settle`` s its CPU
  over a ``--window`` s window as % of one core, its threads, its RSS, and the lab
  hosts it holds TCP connections to; for context, the CPU of everything the lab hosts
  run for the launch (sessions, agents, relays, ranks). Then it is stopped with SIGTERM.
* ``--rank-shape`` (default 8x4): the same, flat after only, with more ranks per host:
  what one rank more costs.
* ``completion AxB`` (default 4x2): ranks print ``up`` and exit at once: all running,
  completion (the tool's exit) and client CPU (``wait4``: pssh with its ssh clients).

Per-host costs are the slopes between the sizes (least squares over the medians), the
fixed costs their intercepts; ``--write-costs`` and ``--write-check`` hand them to
``bench/model.py``. Run ``python3 bench/fanout.py --help``; see bench/README.md.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence, TextIO

import benchlib
from fanoutlib import (
    AFTER,
    BEFORE,
    IDLE_RANK,
    PSSH,
    QUICK_RANK,
    TREE,
    WRAPPER,
    Job,
    Results,
    Sample,
    measure,
    write_outputs,
)

# -- report -------------------------------------------------------------------------------
_f, _ratio = benchlib.fmt, benchlib.ratio


def _idle_table(res: Results, idle_jobs: list[Job], args: argparse.Namespace,
                out: TextIO) -> None:
    rows = [["scenario", "tool", "SSH conns", "all running s", "launch CPU s",
             "CPU/host ms", "idle %", "idle %/host", "max 1 s %", "threads",
             "threads/host", "RSS MB", "hosts' side idle %", "runs"]]
    for j in idle_jobs:
        got = res.kept(j)
        fails = sum(1 for s in res.samples if s.tool == j.tool and
                    s.scenario == j.scenario and s.rep > 0 and not s.ok)
        cpu, idle = res.med(j, "cpu_running_s"), res.med(j, "idle_pct")
        thr = res.med(j, "threads")
        rows.append([j.scenario, j.tool, _f(res.med(j, "ssh_peers"), 0),
                     _f(res.med(j, "running_s")), _f(cpu),
                     _f(None if cpu is None else cpu / j.hosts, 1, 1000),
                     _f(idle, 3), _f(None if idle is None else idle / j.hosts, 4),
                     _f(max((s.max_slice_pct or 0 for s in got), default=None), 2),
                     _f(thr, 0), _f(None if thr is None else thr / j.hosts, 2),
                     _f(res.med(j, "rss_mb"), 1), _f(res.med(j, "hosts_idle_pct"), 2),
                     benchlib.runs_cell(len(got), fails)])
    benchlib.write_table(
        out, rows, [False, False] + [True] * 12,
        f"Launch and idle cost of the launcher (medians of {args.repeat} round(s) "
        f"after a warm-up; CPU = user+sys of the launcher process; idle over a "
        f"{args.window:g} s window, % of one core)")
    out.write("  hosts' side: every process under the lab's sshd listeners (session "
              "sshd, agents, a gateway's relay and ssh clients, ranks), for context\n")


def _ratio_table(res: Results, idle_jobs: list[Job], out: TextIO) -> None:
    rows = [["hosts", "compared", "all running", "launch CPU", "idle CPU", "threads",
             "RSS"]]
    for hosts in sorted({j.hosts for j in idle_jobs}):
        pairs = [("after / before", res.find(AFTER, hosts), res.find(BEFORE, hosts)),
                 ("tree / flat (after)", res.find(TREE, hosts), res.find(AFTER, hosts)),
                 ("tree / flat before", res.find(TREE, hosts), res.find(BEFORE, hosts))]
        for name, a, b in pairs:
            if a is None or b is None:
                continue
            rows.append([str(hosts), name] + [
                _ratio(res.med(a, attr), res.med(b, attr))
                for attr in ("running_s", "cpu_running_s", "idle_pct", "threads",
                             "rss_mb")])
    benchlib.write_table(out, rows, [True, False] + [True] * 5,
                         "Ratios of the medians (same run, round-robin)")


def _slope_table(res: Results, idle_jobs: list[Job], args: argparse.Namespace,
                 out: TextIO) -> None:
    sizes = sorted({j.hosts for j in idle_jobs if j.per_host == args.per_host})
    if len(sizes) <= 1:
        return
    rows = [["design", "launch CPU ms/host", "fixed launch CPU s", "idle %/host",
             "fixed idle %", "threads/host", "fixed threads", "RSS MB/host",
             "all running ms/host"]]
    for design, name in ((BEFORE, "flat, before"), (AFTER, "flat, after"),
                         (TREE, f"tree, fanout {args.tree_fanout}")):
        if not any(j.design == design for j in idle_jobs):
            continue
        fit = res.fits(design)
        rows.append([name, _f(fit["cpu_running_s"][0], 2, 1000),
                     _f(fit["cpu_running_s"][1], 3), _f(fit["idle_pct"][0], 4),
                     _f(fit["idle_pct"][1], 3), _f(fit["threads"][0], 2),
                     _f(fit["threads"][1], 1), _f(fit["rss_mb"][0], 3),
                     _f(fit["running_s"][0], 1, 1000)])
    pr = res.per_rank()
    if pr["cpu_running_s"] is not None:
        rows.append([f"per extra rank ({args.rank_shape}, flat after)",
                     _f(pr["cpu_running_s"], 2, 1000), "", _f(pr["idle_pct"], 4), "",
                     _f(pr["threads"], 2), "", _f(pr["rss_mb"], 3),
                     _f(pr["running_s"], 1, 1000)])
    benchlib.write_table(
        out, rows, [False] + [True] * 8,
        f"Per-host costs: least-squares slope over the medians at "
        f"{', '.join(map(str, sizes))} hosts (fixed = intercept at 0 hosts); "
        f"{args.per_host} rank(s) per host")
    if any(j.design == TREE for j in idle_jobs):
        out.write("  (tree: the slope mixes gateways and leaves: "
                  + ", ".join(f"{j.hosts} hosts = {j.gateways} gateways"
                              for j in idle_jobs if j.design == TREE) + ")\n")


def _completion_table(res: Results, done_jobs: list[Job], out: TextIO) -> None:
    rows = [["scenario", "tool", "all running", "completion", "x pssh completion",
             "completion min-max", "CPU to running s", "client CPU s", "runs"]]
    peer = next((j for j in done_jobs if j.design == PSSH), None)
    peer_done = res.med(peer, "completion_s")
    for j in done_jobs:
        got = res.kept(j)
        rows.append([j.scenario, j.tool, _f(res.med(j, "running_s"), 0, 1000),
                     _f(res.med(j, "completion_s"), 0, 1000),
                     _ratio(res.med(j, "completion_s"), peer_done),
                     benchlib.spread((s.completion_s for s in got), 0, 1000),
                     _f(res.med(j, "cpu_running_s")), _f(res.med(j, "cpu_total_s")),
                     str(len(got))])
    benchlib.write_table(
        out, rows, [False, False] + [True] * 7,
        "Completion: ranks print `up` and exit (medians, ms from Popen; client "
        "CPU from wait4: parallel-ssh with its ssh clients)")
    for j in done_jobs:
        mine = res.med(j, "completion_s")
        if j.design in (AFTER, BEFORE) and peer_done and mine is not None:
            verdict = "met" if mine / peer_done <= 0.7 else "NOT met"
            out.write(f"  target (issue 23): fdl-fabric / parallel-ssh completion "
                      f"<= 0.7x: {j.tool}: {mine / peer_done:.2f}x -> {verdict}\n")


def _handshakes(res: Results, out: TextIO) -> None:
    out.write("\nWhat the launcher's SSH handshakes saw (last measured run of each tool; "
              "the wrapper reads each socket as paramiko's handshake starts)\n\n")
    for j in res.jobs:
        runs = [s for s in res.samples if s.scenario == j.scenario and s.tool == j.tool]
        if j.design == PSSH or not runs:
            continue
        s = runs[-1]
        nodelay = sum(1 for n, _ in s.handshakes if n == "1")
        timeouts = sorted({t for _, t in s.handshakes})
        extra = f", TCP_NODELAY set after open on {s.after_open}" if j.design == BEFORE else ""
        out.write(f"  {j.scenario} / {j.tool}: {len(s.handshakes)} handshakes, "
                  f"{nodelay} with TCP_NODELAY on, socket timeout {', '.join(timeouts) or '?'}"
                  f" s{extra}\n")


def report(res: Results, args: argparse.Namespace, out: TextIO) -> None:
    """The tables of one run, from its samples: launch and idle, their ratios, the
    per-host slopes, completion beside parallel-ssh, the handshakes, failed runs."""
    idle_jobs = [j for j in res.jobs if j.mode == "idle"]
    if idle_jobs:
        _idle_table(res, idle_jobs, args, out)
        _ratio_table(res, idle_jobs, out)
        _slope_table(res, idle_jobs, args, out)
    done_jobs = [j for j in res.jobs if j.mode == "complete"]
    if done_jobs:
        _completion_table(res, done_jobs, out)
    _handshakes(res, out)
    bad = [s for s in res.samples if not s.ok or s.error]
    if bad:
        out.write("\nFailed or suspect runs (failed ones are not in the medians)\n\n")
        for s in bad:
            out.write(f"  {s.scenario} / {s.tool} round {s.rep}"
                      f"{' (warm-up)' if s.rep == 0 else ''}: {s.error}\n")


# -- main -----------------------------------------------------------------------------------
def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = benchlib.arg_parser(__doc__, epilog=True)
    ap.add_argument("--hosts", default="8,32",
                    help="comma-separated host counts of the launch/idle scenarios (8,32)")
    ap.add_argument("--per-host", type=int, default=1,
                    help="ranks per host in those scenarios (1)")
    ap.add_argument("--tree-fanout", type=int, default=4,
                    help="--fanout of the tree rows (4: at 32 hosts, 4 gateways)")
    ap.add_argument("--no-tree", action="store_true", help="skip the tree rows")
    ap.add_argument("--no-before", action="store_true",
                    help="skip the 'flat, before' rows (quick cuts undone)")
    ap.add_argument("--completion", default="4x2", metavar="HxR",
                    help="the completion scenario against parallel-ssh (4x2; 'none' skips)")
    ap.add_argument("--no-pssh", action="store_true", help="skip parallel-ssh")
    ap.add_argument("--rank-shape", default="8x4", metavar="HxR",
                    help="one more 'flat, after' launch with R ranks per host, for the cost "
                         "of a rank beyond --per-host (8x4; 'none' skips)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="measured rounds after one discarded warm-up round (3)")
    ap.add_argument("--window", type=float, default=10.0, help="idle window, s (10)")
    ap.add_argument("--settle", type=float, default=2.0,
                    help="s between all running and the idle window (2)")
    ap.add_argument("--timeout", type=float, default=180.0,
                    help="longest wait for all running, or for completion, s (180)")
    ap.add_argument("--wait-load", type=float, metavar="L",
                    help="first wait (up to 20 min) until the 1-minute load is <= L")
    ap.add_argument("--write-costs", metavar="FILE",
                    help="write the per-host costs as JSON for bench/model.py")
    ap.add_argument("--write-check", metavar="FILE",
                    help="write the measured launches as JSON for bench/model.py --check")
    ap.add_argument("--json", metavar="FILE", help="write every raw sample as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args(argv)
    try:
        args.host_list = sorted({int(x) for x in args.hosts.split(",") if x.strip()})
        assert all(h > 0 for h in args.host_list)
    except (ValueError, AssertionError):
        ap.error("--hosts: positive integers separated by commas, e.g. 8,32")
    args.rank_hosts = args.rank_per = 0
    if args.rank_shape.lower() != "none":
        try:
            args.rank_hosts, args.rank_per = (int(x) for x in args.rank_shape.lower().split("x"))
            assert args.rank_hosts > 0 and args.rank_per > 0
        except (ValueError, AssertionError):
            ap.error("--rank-shape: HOSTSxRANKS, e.g. 8x4, or none")
    if args.completion.lower() == "none":
        args.completion_shape = None
    else:
        try:
            a, b = (int(x) for x in args.completion.lower().split("x"))
            assert a > 0 and b > 0
            args.completion_shape = (a, b)
        except (ValueError, AssertionError):
            ap.error("--completion: HOSTSxRANKS, e.g. 4x2, or none")
    if args.repeat < 1 or args.per_host < 1 or args.tree_fanout < 1:
        ap.error("--repeat, --per-host and --tree-fanout must be at least 1")
    return args


def _launcher(mode: str, cluster: Path, command: str, *extra: str) -> list[str]:
    return [sys.executable, "-c", WRAPPER, mode, "--search-root", str(benchlib.ROOT),
            "launch", *extra, "--cluster", str(cluster), "--cmd", command]


def plan(args: argparse.Namespace, lab: Any, tmp: Path) -> list[Job]:
    idle_script, quick_script = tmp / "rank_idle.py", tmp / "rank_up.py"
    idle_script.write_text(IDLE_RANK)
    quick_script.write_text(QUICK_RANK)
    longest = args.timeout + args.settle + args.window + 300
    idle_cmd = f"{shlex.quote(sys.executable)} {shlex.quote(str(idle_script))} {longest:g}"
    quick_cmd = f"{shlex.quote(sys.executable)} {shlex.quote(str(quick_script))}"
    jobs: list[Job] = []
    for hosts in args.host_list:
        scen = f"{hosts}x{args.per_host}"
        cluster = lab.write_cluster([lab.worker(h, nproc=args.per_host)
                                     for h in lab.hosts[:hosts]], filename=f"{scen}.yml")
        flat = ("--fanout", str(max(64, hosts)))
        if not args.no_before:
            jobs.append(Job(scen, "flat, before", BEFORE, hosts, args.per_host,
                            _launcher("before", cluster, idle_cmd, *flat), "idle"))
        jobs.append(Job(scen, "flat, after", AFTER, hosts, args.per_host,
                        _launcher("after", cluster, idle_cmd, *flat), "idle"))
        if not args.no_tree and hosts > args.tree_fanout:
            gateways = min(args.tree_fanout, math.ceil(math.sqrt(hosts)))
            jobs.append(Job(scen, f"tree, fanout {args.tree_fanout} ({gateways} gw)", TREE,
                            hosts, args.per_host,
                            _launcher("after", cluster, idle_cmd, "--fanout",
                                      str(args.tree_fanout)), "idle", gateways))
    if args.rank_per and args.rank_per != args.per_host:
        hosts, per = args.rank_hosts, args.rank_per
        cluster = lab.write_cluster([lab.worker(h, nproc=per) for h in lab.hosts[:hosts]],
                                    filename=f"ranks-{hosts}x{per}.yml")
        jobs.append(Job(f"{hosts}x{per}", "flat, after", AFTER, hosts, per,
                        _launcher("after", cluster, idle_cmd, "--fanout",
                                  str(max(64, hosts))), "idle"))
    if args.completion_shape is not None:
        hosts, per = args.completion_shape
        scen = f"completion {hosts}x{per}"
        cluster = lab.write_cluster([lab.worker(h, nproc=per) for h in lab.hosts[:hosts]],
                                    filename=f"completion-{hosts}x{per}.yml")
        flat = ("--fanout", str(max(64, hosts)))
        if not args.no_before:
            jobs.append(Job(scen, "flat, before", BEFORE, hosts, per,
                            _launcher("before", cluster, quick_cmd, *flat), "complete"))
        jobs.append(Job(scen, "flat, after", AFTER, hosts, per,
                        _launcher("after", cluster, quick_cmd, *flat), "complete"))
        if not args.no_pssh and benchlib.pssh_path():
            hosts_file = tmp / f"pssh-hosts-{hosts}x{per}"
            hosts_file.write_text("".join(f"{lab.user}@{h.addr}:{h.port}\n"
                                          for h in lab.hosts[:hosts] for _ in range(per)))
            jobs.append(Job(scen, f"parallel-ssh -P -p {hosts * per}", PSSH, hosts, per,
                            benchlib.pssh_argv(lab, hosts_file, hosts * per, quick_cmd),
                            "complete"))
    return jobs


def bench(args: argparse.Namespace, tmp: Path, out: TextIO, state: dict[str, Any]) -> int:
    started = time.monotonic()
    load_start = benchlib.wait_for_quiet(args.wait_load, out)
    if not args.no_pssh and benchlib.pssh_path() is None:
        out.write("parallel-ssh not found (Debian: apt-get install pssh): its rows are "
                  "skipped\n")
    need = max([*args.host_list, *(args.completion_shape or (0,))[:1], args.rank_hosts])
    state["lab"] = lab = benchlib.start_lab(tmp / "lab", need, out)
    jobs = plan(args, lab, tmp)
    env = dict(os.environ)
    samples: list[Sample] = []
    for rep in range(args.repeat + 1):
        out.write(f"round {rep + 1}/{args.repeat + 1}{' (warm-up)' if rep == 0 else ''}, "
                  f"load {benchlib.loadavg()}:")
        out.flush()
        for job in jobs:
            s = measure(job, rep, lab, env, args)
            samples.append(s)
            out.write(" ." if s.ok else " x")
            out.flush()
        out.write("\n")
    res = Results(jobs, samples, args.per_host)
    report(res, args, out)
    write_outputs(res, samples, args, out)
    benchlib.write_machine_notes(out, load_start, started)
    out.write(f"  ranks: {sys.executable} <rank>.py; lab hosts: {need} sshd listeners on "
              f"loopback; per-host slopes from {', '.join(map(str, args.host_list))} hosts\n")
    return 0 if all(s.ok for s in samples if s.rep > 0) else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    state: dict[str, Any] = {"lab": None}

    def cleanup() -> None:
        benchlib.stop_all()
        if state["lab"] is not None:
            state["lab"].stop()

    return benchlib.run_in_scratch("fdl-fanout-", args,
                                   lambda a, tmp, out: bench(a, tmp, out, state), cleanup)


if __name__ == "__main__":
    sys.exit(main())
