#!/usr/bin/env python3
"""Output throughput: how many rank lines per second reach the launcher's stdout, intact.

A script, not a test: it prints figures and ratios, never asserts them.

Every rank runs the same generator: rank R writes ``r<R> <i>`` for i in 0..N-1 (default
N = 1,000,000; ``--lines``) as fast as it can, in ``os.write`` calls of 8192 lines.
The benchmark reads the tool's stdout through a pipe (one thread, one selector, reads
of up to 1 MiB, a timestamp per read) and afterwards checks every line:

* fdl-fabric: each line must be ``[<host>:cpu:rR] rR <i>``, and for every rank the
  ``i`` must run 0..N-1 in order; **lost** = lines of a rank that never arrived,
  **merged** = lines that are not exactly one rank line behind its own prefix (two lines
  glued together, a line cut in two, a line behind another rank's prefix), **order** =
  ranks whose lines arrived out of order;
* OpenSSH reference: ``ssh host <python> gen.py N R``, one session per rank, read the
  same way (what ``ssh host ... | cat`` moves), checked the same way without prefix;
* floor: the generator on this machine into a pipe, no SSH, no launcher.

Figures: **stream lines/s** = lines / (arrival of the last stdout byte - arrival of the
first), i.e. the forwarding rate once output flows; **end-to-end s** = Popen to the last
process's exit; the launcher's own CPU over the run (``/proc/<pid>/stat``, % of one
core).

Scenarios: ``one``: 1 rank on 1 lab host; ``agg``: 8 ranks on 4 lab hosts (2 each), N
lines each. Tools run round-robin, ``--repeat`` measured runs after one warm-up (medians).
Run ``python3 bench/output.py --help``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TextIO

import benchlib
from outputlib import GEN_SCRIPT, Sample, check_plain, check_prefixed, run_streams

# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def _k(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value / 1000:.0f}k"


def _s(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.2f}"


#: Scenario label -> the issue's target in lines/s.
TARGETS = {"1 rank / 1 host": 300_000.0, "8 ranks / 4 hosts": 500_000.0}


def report(samples: list[Sample], rows: list[tuple[str, str]], out: TextIO,
           n: int) -> None:
    out.write(f"\nOutput throughput, {n:,} lines per rank; medians over the measured runs "
              "(warm-up dropped)\n\n")
    table = [["scenario", "tool", "stream lines/s", "x fdl", "end-to-end s", "lines/s e2e",
              "launcher CPU %", "lost", "merged", "out of order", "runs"]]
    base: dict[str, Optional[float]] = {}
    for scenario, tool in rows:
        got = [s for s in samples if s.scenario == scenario and s.tool == tool
               and not s.warmup]
        good = [s for s in got if s.ok]
        rate = benchlib.med([s.stream_rate for s in good])
        if tool.startswith("fdl-fabric"):
            base[scenario] = rate
        b = base.get(scenario)
        e2e = benchlib.med([s.done for s in good])
        table.append([scenario, tool, _k(rate),
                      benchlib.ratio(rate, b), _s(e2e),
                      _k(None if e2e is None else good[0].expected / e2e),
                      _s(benchlib.med([s.launcher_cpu_pct for s in good])),
                      str(sum(s.lost for s in got)), str(sum(s.merged for s in got)),
                      str(sum(s.out_of_order for s in got)),
                      benchlib.runs_cell(len(good), len(got) - len(good))])
    out.write(benchlib.table(table, [False, False] + [True] * 9) + "\n")
    _targets(samples, out)
    for s in samples:
        if not s.ok:
            out.write(f"  ! {s.scenario} / {s.tool} run {s.rep}: {s.error}\n")


def _target_row(scenario: str, target: float, samples: list[Sample]) -> list[str]:
    """fdl-fabric's stream rate beside OpenSSH's, and whether it met ``target`` with every
    line intact; [] if fdl-fabric did not run in ``scenario``."""
    runs = [s for s in samples if s.scenario == scenario and not s.warmup]
    fdl = [s for s in runs if s.tool.startswith("fdl")]
    if not fdl:
        return []
    rate = benchlib.med([s.stream_rate for s in fdl if s.ok])
    peer = benchlib.med([s.stream_rate for s in runs if s.tool.startswith("OpenSSH") and s.ok])
    intact = all(s.ok and not (s.lost or s.merged or s.out_of_order) for s in fdl)
    met = rate is not None and rate >= target and intact
    return [scenario, _k(rate), _k(peer), benchlib.ratio(rate, peer),
            f">= {target / 1000:.0f}k, intact", "yes" if met else "NO"]


def _targets(samples: list[Sample], out: TextIO) -> None:
    out.write("\nTargets (fdl-fabric stream lines/s, 0 lost, 0 merged)\n\n")
    trows = [["scenario", "fdl-fabric lines/s", "OpenSSH lines/s", "fdl / ssh", "target",
              "met"]]
    for scenario, target in TARGETS.items():
        row = _target_row(scenario, target, samples)
        if row:
            trows.append(row)
    out.write(benchlib.table(trows, [False, True, True, True, True, False]) + "\n")


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = benchlib.arg_parser(__doc__)
    ap.add_argument("--lines", type=int, default=1_000_000, help="lines per rank (1000000)")
    ap.add_argument("--repeat", type=int, default=3, help="measured runs per tool (3)")
    ap.add_argument("--only", action="append", choices=("one", "agg"),
                    help="scenario: one (1 rank, 1 host) or agg (8 ranks, 4 hosts)")
    ap.add_argument("--no-floor", action="store_true", help="skip the local generator floor")
    ap.add_argument("--timeout", type=float, default=300.0, help="per run, s (300)")
    ap.add_argument("--wait-load", type=float, metavar="L",
                    help="first wait (up to 20 min) until the 1-minute load is <= L")
    ap.add_argument("--json", metavar="FILE", help="also write the raw samples as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args(argv)
    args.scenarios = args.only or ["one", "agg"]
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    out = sys.stdout
    with benchlib.terminate_gracefully():
        tmp = Path(tempfile.mkdtemp(prefix="fdl-output-"))
        try:
            return _bench(args, tmp, out)
        finally:
            benchlib.stop_all()
            if args.keep:
                out.write(f"kept {tmp}\n")
            else:
                shutil.rmtree(tmp, ignore_errors=True)


#: (scenario, tool, kind, argvs, ranks)
Job = tuple[str, str, str, list[list[str]], list[int]]


def _jobs(args: argparse.Namespace, lab: Any, gen: Path,
          gen_cmd: Callable[..., str]) -> list[Job]:
    """fdl-fabric, OpenSSH and the floor, in each scenario asked for."""
    py, n = sys.executable, args.lines
    # (scenario, tool, kind, argvs, ranks)
    jobs: list[tuple[str, str, str, list[list[str]], list[int]]] = []
    if "one" in args.scenarios:
        sc = "1 rank / 1 host"
        cluster = lab.write_cluster([lab.worker(lab.hosts[0], nproc=1)],
                                    filename="one.yml")
        jobs.append((sc, "fdl-fabric (inv launch)", "fdl",
                     [benchlib.inv_launch_argv(cluster, gen_cmd())], [0]))
        jobs.append((sc, "OpenSSH (ssh host gen.py)", "plain",
                     [lab.ssh_argv(lab.hosts[0], gen_cmd(0))], [0]))
        if not args.no_floor:
            jobs.append((sc, "floor: gen.py into a pipe", "plain",
                         [[py, str(gen), str(n), "0"]], [0]))
    if "agg" in args.scenarios:
        sc = "8 ranks / 4 hosts"
        cluster = lab.write_cluster([lab.worker(h, nproc=2) for h in lab.hosts],
                                    filename="agg.yml")
        jobs.append((sc, "fdl-fabric (inv launch)", "fdl",
                     [benchlib.inv_launch_argv(cluster, gen_cmd())], list(range(8))))
        jobs.append((sc, "OpenSSH (8 x ssh host gen.py)", "plain",
                     [lab.ssh_argv(lab.hosts[r // 2], gen_cmd(r)) for r in range(8)],
                     list(range(8))))
        if not args.no_floor:
            jobs.append((sc, "floor: 8 x gen.py into pipes", "plain",
                         [[py, str(gen), str(n), str(r)] for r in range(8)],
                         list(range(8))))
    return jobs


def _measure(args: argparse.Namespace, sc: str, tool: str, kind: str,
             argvs: list[list[str]], ranks: list[int], rep: int) -> Sample:
    n = args.lines
    s = Sample(sc, tool, rep, rep == 0)
    stdouts, codes, s.first, s.last, s.done, cpu, s.error = run_streams(
        argvs, timeout=args.timeout, cpu_of_first=kind == "fdl")
    s.returncodes = codes
    s.launcher_cpu_pct = cpu
    s.bytes = sum(len(d) for d in stdouts)
    if kind == "fdl":
        check_prefixed(stdouts[0], ranks, n, s)
    else:
        for data, r in zip(stdouts, ranks):
            check_plain(data, r, n, s)
    s.ok = not s.error
    return s


def _bench(args: argparse.Namespace, tmp: Path, out: TextIO) -> int:
    load_start = benchlib.wait_for_quiet(args.wait_load, out)
    gen = tmp / "gen.py"
    gen.write_text(GEN_SCRIPT)
    py = sys.executable
    n = args.lines

    def gen_cmd(rank: Optional[int] = None) -> str:
        words = [py, str(gen), str(n)] + ([] if rank is None else [str(rank)])
        return " ".join(shlex.quote(w) for w in words)

    lab = benchlib.start_lab(tmp / "lab", 4, out)
    try:
        jobs = _jobs(args, lab, gen, gen_cmd)
        samples: list[Sample] = []
        for rep in range(args.repeat + 1):
            for sc, tool, kind, argvs, ranks in jobs:
                out.write(f"{'warm-up' if rep == 0 else f'run {rep}'}: {sc} / {tool} "
                          f"(load {benchlib.loadavg()})... ")
                out.flush()
                s = _measure(args, sc, tool, kind, argvs, ranks, rep)
                samples.append(s)
                rate = s.stream_rate
                out.write(f"{_k(rate)} lines/s, lost {s.lost}, merged {s.merged}"
                          + (f" FAILED: {s.error}" if s.error else "") + "\n")
                out.flush()
    finally:
        benchlib.stop_all()
        lab.stop()
    rows = list(dict.fromkeys((j[0], j[1]) for j in jobs))
    report(samples, rows, out, n)
    notes = benchlib.machine_notes()
    notes["load average at start / end"] = f"{load_start} / {benchlib.loadavg()}"
    notes["launcher stdout"] = ("a pipe read by this script (os.read of up to 1 MiB); "
                                "PYTHONUNBUFFERED=" + os.environ.get("PYTHONUNBUFFERED", "-"))
    out.write("\nmachine:\n" + "".join(f"  {k}: {v}\n" for k, v in notes.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"notes": notes, "lines": n,
                                               "samples": [asdict(s) for s in samples]},
                                              indent=2) + "\n")
    return 0 if all(s.ok for s in samples if not s.warmup) else 1


if __name__ == "__main__":
    sys.exit(main())
