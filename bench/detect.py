#!/usr/bin/env python3
"""Failure-detection latency of `inv launch`, beside torchrun on the same scenario.

Prints medians (and min/max) over ``--repeat`` runs; it is a script, not a test, so no
timing is ever asserted.  Every time is measured from ``t0``, taken just before the
benchmark sends SIGKILL to one rank:

* **pre-formation** (the rank program writes its pid to a file and sleeps; it never
  joins the coordinator, so the first failure is fatal and every other rank is stopped):

  - ``death -> all peers stopped``: the last other rank exited (a pidfd per rank, polled
    by the kernel: no sampling interval; a zombie counts as stopped);
  - ``death -> victim reaped``: the killed rank's ``/proc`` entry vanished, i.e. its
    agent's ``waitpid`` collected it (sampled every 1 ms) — the agent's share;
  - the launcher's ``rank R of HOST exited with signal 9`` line, its ``peer failure``
    line, its verdict (the last line it prints) and its exit; and ``verdict -> launcher
    exited``, the teardown after the verdict.

  Topologies: ``pre-local`` one ``localhost`` worker x 4 ranks (rank 1 killed);
  ``pre-local-torchrun`` ``torchrun --standalone --nproc-per-node 4`` with the same
  program (defaults: ``--max-restarts 0``, ``--monitor-interval 0.1``), worker 1 killed;
  ``pre-remote`` 2 lab hosts x 2 ranks (rank 1 on lab1 killed); ``pre-remote-64`` 8 lab
  hosts x 8 ranks (rank 9, on lab2, killed; peers on all 8 hosts). After each measured
  8 x 8 run, **the machine's floor**: the same 64 rank programs, started by this script
  in groups of their own, SIGTERMed by one process with no launcher, SSH or agent, to
  the last one exited. ``death -> all peers stopped`` cannot go below it: it is what
  the kernel and the cores take to end 64 Python processes.

* **post-formation** (``examples/toy_train.py``; one local worker and one lab host, two
  ranks each; a death is a tolerated membership event): ``death -> the coordinator's
  "rank R declared dead" line``, ``death -> victim reaped`` and ``death -> the
  supervisor's "tolerating" line``; a local rank (1) or a remote rank (3) is killed, then
  the launch is stopped with SIGTERM.

Ranks are found through the pid files they write (lab hosts are this machine, so the
pids are ours to watch). Launcher lines are timestamped by reader threads the moment
they arrive on its pipes.  The kill comes 0.5 s plus a random 0-0.2 s after the last
rank is up, so it lands at a random phase of any periodic loop (the supervisor's 50 ms
tick, the coordinator's 50 ms tick, torchrun's 100 ms monitor).  One discarded warm-up
run per scenario comes first, then the scenarios run round-robin.

Run ``python3 bench/detect.py`` (``--help`` for options).  Everything the script starts
(launches, torchrun, rank processes, the sshd lab) is stopped before it exits.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Optional, TextIO

import benchlib
from detectlib import (
    ALL_KEYS,
    JITTER,
    MEASURES,
    PRE_LOCAL_TORCH,
    PRE_REMOTE_64,
    RANK_PROGRAM,
    REAP_POLL,
    SCENARIO,
    SETTLE,
    TARGETS,
    Bench,
    Sample,
    stop_everything,
    teardown_floor,
)

#: The machine's floor, measured after each 8 x 8 run (`detectlib.teardown_floor`), ms.
FLOORS: list[float] = []

# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def _values(samples: Sequence[Sample], key: str, measure: str) -> list[float]:
    return [v for s in samples if s.key == key and s.ok and not s.warmup
            for v in [s.ms.get(measure)] if v is not None]


def table(samples: Sequence[Sample], keys: Sequence[str]) -> str:
    rows = [["scenario", "tool", "measure", "median ms", "min", "max", "n"]]
    for key in keys:
        scenario, tool = SCENARIO[key][:2]
        for mkey, label in MEASURES[key]:
            values = _values(samples, key, mkey)
            if values:
                rows.append([scenario, tool, label, _fmt(statistics.median(values)),
                             _fmt(min(values)), _fmt(max(values)), str(len(values))])
            else:
                rows.append([scenario, tool, label, "-", "-", "-", "0"])
    return benchlib.table(rows, [False, False, False, True, True, True, True])


def targets_table(samples: Sequence[Sample], keys: Sequence[str]) -> str:
    rows = [["target", "fdl-fabric median ms", "bound ms", "met", "torchrun (local 1x4) ms"]]
    torch_peers = _values(samples, PRE_LOCAL_TORCH, "peers_stopped")
    torch_exit = _values(samples, PRE_LOCAL_TORCH, "tool_exited")
    for key, measure, bound in TARGETS:
        if key not in keys:
            continue
        med = benchlib.med(_values(samples, key, measure))
        label = dict(MEASURES[key])[measure]
        peer = torch_peers if measure == "peers_stopped" else torch_exit
        rows.append([f"{SCENARIO[key][0]}: {label}", _fmt(med), f"{bound:g}",
                     "n/a" if med is None else ("yes" if med <= bound else "NO"),
                     _fmt(benchlib.med(peer))])
    return benchlib.table(rows, [False, True, True, False, True])


def machine_notes(load_before: str) -> list[str]:
    notes = [f"{k}: {v}" for k, v in benchlib.machine_notes().items()]
    try:
        torch_version = __import__("importlib.metadata").metadata.version("torch")
    except Exception:
        torch_version = "not installed"
    notes.append(f"torch {torch_version}")
    intervals = []
    with contextlib.suppress(Exception):
        from fdl_fabric.supervision import connections, timing

        quiet = getattr(timing, "QUIET_TICKS", 1)
        intervals.append(f"supervisor tick {getattr(timing, 'TICK', float('nan')) * 1000:g}"
                         f" ms, up to {quiet}x when quiet (an inbox wait: reports wake it "
                         "at once)")
        intervals.append(f"coordinator tick {connections.TICK_INTERVAL * 1000:g} ms, up to "
                         f"{quiet}x when quiet (frames and wakes end its wait)")
    intervals.append("agents: no timer (SIGCHLD through set_wakeup_fd)")
    intervals.append("torchrun monitor interval 100 ms (default)")
    notes += [
        f"load average before {load_before}, after {benchlib.loadavg()}",
        "remote = sshd-lab hosts (real OpenSSH servers on 127.x loopback addresses, same "
        "machine); post-formation runs: localhost x 2 (r0-r1) + lab1 x 2 (r2-r3), "
        "examples/toy_train.py --step-time 0.2",
        "intervals: " + "; ".join(intervals),
        "measurement: peers and the tool through pidfds (exit wakes the poll; a zombie "
        f"counts as stopped); the victim's /proc entry every {REAP_POLL * 1000:g} ms; line "
        "times = arrival on the launcher's pipe in a reader thread; kill "
        f"{SETTLE * 1000:g} ms + uniform 0-{JITTER * 1000:g} ms after the last rank is up",
    ]
    return notes


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = benchlib.arg_parser(__doc__)
    ap.add_argument("--repeat", type=int, default=5,
                    help="measured runs per scenario, after the warm-up (default 5)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="discarded warm-up runs per scenario (default 1)")
    ap.add_argument("--only", action="append", choices=ALL_KEYS, metavar="SCENARIO",
                    help=f"run only this scenario (repeatable): {', '.join(ALL_KEYS)}")
    ap.add_argument("--no-torchrun", action="store_true", help="skip the torchrun baseline")
    ap.add_argument("--wait-load", type=float, metavar="L",
                    help="first wait (up to 20 min) until the 1-minute load is <= L")
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

    def cleanup() -> None:
        stop_everything()
        benchlib.stop_all()

    return benchlib.run_in_scratch("fdl-detect-", args, _bench, cleanup, report)


def _keys(args: argparse.Namespace, remarks: list[str]) -> list[str]:
    """The scenarios to run: those asked for, less what this machine cannot run."""
    from fdl_fabric.testing import sshd_available

    keys = [k for k in ALL_KEYS if not args.only or k in args.only]
    if PRE_LOCAL_TORCH in keys and (args.no_torchrun or importlib.util.find_spec("torch") is None):
        keys.remove(PRE_LOCAL_TORCH)
        remarks.append("torchrun baseline skipped (--no-torchrun or torch not installed)")
    needs_lab = [k for k in keys if SCENARIO[k][2]]
    if needs_lab and not sshd_available():
        keys = [k for k in keys if k not in needs_lab]
        remarks.append(f"skipped {', '.join(needs_lab)}: no sshd (install openssh-server)")
    return keys


def _rounds(args: argparse.Namespace, bench: Bench, keys: list[str],
            report: TextIO) -> list[Sample]:
    """The warm-up runs, then the measured ones, each scenario in turn."""
    samples: list[Sample] = []
    plan = [(rep, True) for rep in range(args.warmup)] + \
           [(rep, False) for rep in range(args.repeat)]
    for rep, warm in plan:
        for key in keys:
            sample = bench.run(key, rep, warm)
            samples.append(sample)
            value = sample.ms.get(MEASURES[key][0][0])
            status = (f"{value:.0f} ms" if sample.ok and value is not None
                      else f"FAILED: {sample.error}")
            if sample.ok and sample.error:
                status += f" ({sample.error})"
            report.write(f"  {'warm-up' if warm else f'run {rep + 1}'} {key}: {status}"
                         f"  (load {benchlib.loadavg()})\n")
            if key == PRE_REMOTE_64 and not warm:
                FLOORS.append(teardown_floor(bench.program, bench.tmp / f"floor-{rep}",
                                             SCENARIO[key][2] * SCENARIO[key][3]))
                report.write(f"  run {rep + 1} the machine's floor (64 rank programs "
                             f"SIGTERMed by one process): {FLOORS[-1]:.0f} ms\n")
            report.flush()
    return samples


def _report(args: argparse.Namespace, samples: list[Sample], keys: list[str],
            notes: list[str], report: TextIO) -> list[Sample]:
    """The tables, the verdict lines seen and the notes; the measured runs that failed."""
    failed = [s for s in samples if not s.ok and not s.warmup]
    report.write(
        f"\nfailure-detection latency, ms from SIGKILL of one rank (t0 = just before "
        f"os.kill); median, min, max over {args.repeat} run(s) after {args.warmup} warm-up "
        "run(s); first measure of each scenario is the headline\n\n")
    report.write(table(samples, keys) + "\n\n")
    if any(k in keys for k, _, _ in TARGETS):
        report.write("targets\n\n" + targets_table(samples, keys) + "\n\n")
    if FLOORS:
        ours = benchlib.med(_values(samples, PRE_REMOTE_64, "peers_stopped"))
        floor = benchlib.med(FLOORS)
        report.write(
            f"the machine's floor for 8 x 8: the same 64 rank programs SIGTERMed by one "
            f"process, no launcher, to the last exited: median {_fmt(floor)} ms "
            f"({min(FLOORS):.0f}-{max(FLOORS):.0f}, {len(FLOORS)} runs, each right after an "
            f"8 x 8 run); fdl-fabric's death -> all peers stopped is {_fmt(ours)} ms, "
            f"{_fmt(None if ours is None or floor is None else ours - floor)} ms above it\n\n")
    verdicts = sorted({s.verdict_line for s in samples if s.verdict_line})
    if verdicts:
        report.write("verdict lines seen: " + " | ".join(v[:120] for v in verdicts) + "\n\n")
    report.write("machine and method:\n")
    for note in notes:
        report.write(f"  - {note}\n")
    for s in failed:
        report.write(f"  ! {s.key} run {s.rep + 1}: {s.error}\n")
    return failed


def _write_json(args: argparse.Namespace, samples: list[Sample], keys: list[str],
                notes: list[str]) -> None:
    doc = {"repeat": args.repeat, "warmup": args.warmup,
           "scenarios": {k: {"scenario": SCENARIO[k][0], "tool": SCENARIO[k][1],
                             "measures": dict(MEASURES[k])} for k in keys},
           "notes": notes,
           "samples": [asdict(s) for s in samples]}
    text = json.dumps(doc, indent=2) + "\n"
    if args.json == "-":
        sys.stdout.write(text)
    else:
        Path(args.json).write_text(text)


def _bench(args: argparse.Namespace, tmp: Path, report: TextIO) -> int:
    remarks: list[str] = []
    keys = _keys(args, remarks)
    if not keys:
        report.write("nothing to run\n")
        return 2
    needs_lab = [k for k in keys if SCENARIO[k][2]]
    load_before = benchlib.wait_for_quiet(args.wait_load, report)
    random.seed(args.seed)
    program = tmp / "rank_program.py"
    program.write_text(RANK_PROGRAM)
    bench = Bench(tmp=tmp, program=program)
    started = time.monotonic()
    lab = None
    try:
        if needs_lab:
            lab = benchlib.start_lab(tmp / "lab", max(SCENARIO[k][2] for k in needs_lab),
                                     report)
            bench.lab = lab
        samples = _rounds(args, bench, keys, report)
    finally:
        stop_everything()
        if lab is not None:
            lab.stop()
    elapsed = time.monotonic() - started
    n_failed = sum(1 for s in samples if not s.ok and not s.warmup)
    failed = _report(args, samples, keys, [
        *machine_notes(load_before), *remarks,
        f"{len(samples)} runs in {elapsed:.0f} s; {n_failed} measured run(s) failed"], report)
    if args.json:
        _write_json(args, samples, keys, machine_notes(load_before) + remarks)
    return 0 if not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
