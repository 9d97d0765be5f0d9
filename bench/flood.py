#!/usr/bin/env python3
"""Issue 22: heartbeat latency and join time while 300 idle peers flood the coordinator.

Prints, per tree and scenario, the medians, p99 and max over every heartbeat of every
run; it is a script, not a test, so no timing is ever asserted. Scenarios, round-robin
over ``--repeat`` rounds:

* **quiet**: ``--ranks`` rank processes join a coordinator and send heartbeats;
* **flood**: the same, while a flooder process (``--threads`` threads; connect() releases
  the GIL) opens TCP connections to the coordinator's port as fast as it can, holding the
  last ``--hold`` (300) and sending nothing. It starts ``--warm`` s before the ranks, so
  the join happens under the flood too;
* **cpu hog**: the control: as many processes spinning in ``while True: pass`` as the
  flooder has threads, and no connection. A flooder on the same machine takes CPU from
  the ranks and the coordinator; this scenario shows what that alone costs.

``--pin`` puts the flooder (or the hog) on the last CPU and the coordinator and the ranks
on the others (``taskset``), as for a flooder on another machine.

Measured:

* **heartbeat latency**: when the coordinator handled a heartbeat (its `_handle`, the
  same call that refreshes the rank's liveness) minus when the rank sent it (just before
  `_Client.send` framed it; only frames that send wrote count); both are
  ``time.monotonic()``, CLOCK_MONOTONIC, one clock for every process of the machine.
  Frames are matched by rank and sequence number. It
  includes the loopback transfer and the rank's own scheduling after the timestamp; the
  coordinator's "one tick late" bound is 50 ms. Ranks beat every ``--interval`` s (0.1;
  a real rank beats every 1 s: more samples, the same path). **lost** = heartbeats sent
  and never handled;
* **join**: from the rank's call of `rank.join()` to its return (dials, hello, welcome;
  redials when turned away);
* the flooder's connects per second, what the coordinator refused or dropped (its
  events' counts), the coordinator process's CPU while the ranks ran (% of one core),
  and ranks declared dead (``heartbeat_timeout`` 30 s: none expected).

The coordinator runs alone in a process of its own (`Coordinator` with a `_handle` that
notes heartbeats), not inside a whole launch: `tests/test_flood_lab.py` covers the
launch. ``--baseline REF`` runs the same rounds against the coordinator and rank client
of an older commit too (``git archive`` into the scratch folder; processes started with
``PYTHONPATH`` on it, checked before use), e.g. the last commit before issue 22's fix.

Run ``python3 bench/flood.py`` (``--help`` for options). Every process it starts runs in
a process group of its own, and only those are stopped.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional, TextIO

import benchlib
from floodlib import ROOT, SCENARIOS, Sample, run_once

from fdl_fabric.testing.flood import HOLD


def _ms(x: Optional[float]) -> str:
    return benchlib.fmt(x, 1, 1000, none="-")


def _row(tree: str, scenario: str, samples: Sequence[Sample]) -> list[str]:
    got = [s for s in samples if s.tree == tree and s.scenario == scenario and s.ok]
    lat = [x for s in got for x in s.latencies]
    joins = [x for s in got for x in s.joins]
    failed = sum(1 for s in samples if s.tree == tree and s.scenario == scenario and not s.ok)
    return [tree, scenario, str(len(lat)), str(sum(s.lost for s in got)),
            _ms(benchlib.med(lat)), _ms(benchlib.percentile(lat, 0.99) if lat else None),
            _ms(max(lat, default=None)), _ms(benchlib.med(joins)),
            _ms(max(joins, default=None)),
            benchlib.fmt(benchlib.med(s.connects_per_s for s in got), 0, none="-"),
            str(sum(s.refused for s in got)),
            benchlib.fmt(benchlib.med(s.cpu for s in got), 0, none="-"),
            str(sum(len(s.dead) for s in got)),
            f"{len(got)}" + (f" (+{failed} failed)" if failed else "")]


def _p99(tree: str, scenario: str, samples: Sequence[Sample]) -> Optional[float]:
    lat = [x for s in samples if s.tree == tree and s.scenario == scenario and s.ok
           for x in s.latencies]
    return benchlib.percentile(lat, 0.99) if lat else None


def report(args: argparse.Namespace, samples: Sequence[Sample], trees: Sequence[str],
           out: TextIO) -> None:
    head = ["tree", "scenario", "beats", "lost", "latency p50 ms", "p99 ms", "max ms",
            "join p50 ms", "join max ms", "connects/s", "refused", "coord CPU %", "dead",
            "runs"]
    rows = [head] + [_row(tree, scenario, samples) for tree in trees for scenario in SCENARIOS]
    out.write(f"\nHeartbeat latency (coordinator handled - rank sent) and join time: "
              f"{args.ranks} ranks beating every {args.interval:g} s for {args.seconds:g} s "
              f"a run; flood = {args.threads}-thread flooder holding the last {args.hold} "
              f"idle connections, from {args.warm:g} s before the ranks start\n\n")
    out.write(benchlib.table(rows, [False, False] + [True] * (len(head) - 2)) + "\n")
    for tree in trees:
        quiet, flood = _p99(tree, "quiet", samples), _p99(tree, "flood", samples)
        if quiet and flood:
            verdict = "met" if flood <= 2 * quiet else "NOT met"
            out.write(f"\n{tree}: target p99 under flood <= 2 x quiet p99: {_ms(flood)} ms vs "
                      f"2 x {_ms(quiet)} ms: {verdict} ({flood / quiet:.2f}x)")
        elif quiet:
            out.write(f"\n{tree}: no heartbeat handled under flood")
    out.write("\n")
    for s in samples:
        if not s.ok:
            out.write(f"\n{s.tree} {s.scenario} run {s.rep + 1} FAILED: {s.error}")
    out.write("\n")


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = benchlib.arg_parser(__doc__)
    ap.add_argument("--repeat", type=int, default=3, help="rounds of every scenario (3)")
    ap.add_argument("--ranks", type=int, default=4, help="rank processes (4)")
    ap.add_argument("--seconds", type=float, default=20.0,
                    help="how long each rank beats after joining (20)")
    ap.add_argument("--interval", type=float, default=0.1,
                    help="the ranks' heartbeat interval in s (0.1; a real rank: 1)")
    ap.add_argument("--hold", type=int, default=HOLD, help=f"idle connections held ({HOLD})")
    ap.add_argument("--threads", type=int, default=2, help="flooder threads (2)")
    ap.add_argument("--warm", type=float, default=1.0,
                    help="seconds of flood before the ranks start (1)")
    ap.add_argument("--pin", action="store_true",
                    help="flooder (or hog) on the last CPU, coordinator and ranks on the "
                         "others: what the flood costs the coordinator, not the CPU it takes")
    ap.add_argument("--accept-per-turn", type=int, metavar="N",
                    help="set the coordinator's ACCEPT_PER_TURN (this tree; to explore)")
    ap.add_argument("--baseline", metavar="REF",
                    help="also run the coordinator and rank client of this commit")
    ap.add_argument("--wait-load", type=float, metavar="L",
                    help="wait until the 1-minute load average is at most L")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args(argv)
    if args.repeat < 1 or args.ranks < 1 or args.threads < 1:
        ap.error("--repeat, --ranks and --threads must be at least 1")
    return args


def _bench(args: argparse.Namespace, tmp: Path, out: TextIO) -> int:
    trees: dict[str, Path] = {"this tree": ROOT}
    if args.baseline:
        old = tmp / "baseline"
        old.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.baseline],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        commit = benchlib.tool_version(["git", "-C", str(ROOT), "rev-parse", "--short",
                                        args.baseline])
        trees[f"baseline {commit}"] = old
    load_start = benchlib.wait_for_quiet(args.wait_load, out)
    started = time.monotonic()
    samples: list[Sample] = []
    for rep in range(args.repeat):
        for name, tree in trees.items():
            for scenario in SCENARIOS:
                s = run_once(args, name, tree, scenario, rep)
                samples.append(s)
                if s.ok:
                    p99 = benchlib.percentile(s.latencies, 0.99) if s.latencies else None
                    status = (f"p99 {_ms(p99)} ms, "
                              f"join max {_ms(max(s.joins, default=None))} ms, "
                              f"lost {s.lost}, dead {len(s.dead)}")
                else:
                    status = "FAILED: " + s.error
                out.write(f"  round {rep + 1} {name} {scenario}: {status}  "
                          f"(load {benchlib.loadavg()})\n")
                out.flush()
    report(args, samples, list(trees), out)
    benchlib.write_machine_notes(out, load_start, started)
    return 0 if all(s.ok for s in samples if s.tree == "this tree") else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    return benchlib.run_in_scratch("fdl-flood-", parse_args(argv), _bench, benchlib.stop_all)


if __name__ == "__main__":
    sys.exit(main())
