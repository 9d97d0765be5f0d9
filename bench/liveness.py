#!/usr/bin/env python3
"""Liveness of `inv launch` (issue 18): detection, hang to verdict, idle cost, Ctrl-C.

A script, not a test: it prints medians (min, max) over ``--repeat`` runs, beside peers
measured in the same run where there is one, and never asserts a timing. Scenarios
(``--only NAME``, repeatable; default all four, in this order):

* ``detect``: a frozen agent and a black-holed host against ``agent_timeout`` (``--agent-
  timeout``, 5 s). *Frozen agent*: 2 lab hosts x 1 rank (it writes ``up``, then sleeps);
  once both ranks are up, plus 0.5 s and a random 0-1 s (one heartbeat period: a random
  phase of the agent's heartbeats), the agent of rank 1 (the rank's parent) gets
  SIGSTOP. Measured from just before the SIGSTOP: the launcher's ``unresponsive`` line,
  its verdict (last stderr line) and its exit. Then SIGCONT; what is left of the run is
  waited for (the agent's lease stops its rank), then killed by pid and reported.
  *Black hole* (root only: `fdl_fabric.testing.NetnsLab`): localhost x 1 + one netns
  host x 1, the host's veth taken down (``link_down``: no FIN, no RST), timed the same
  way; the link comes back after the launcher exits. *Peer*: torchrun has no liveness
  check of its own; its nearest case on one machine is a frozen worker: ``torchrun
  --standalone --nproc-per-node 2`` with the same program, worker 1 SIGSTOPped, and
  whatever torchrun prints or does is watched for ``--torchrun-cap`` s (30). (An
  fdl-fabric *rank* frozen the same way is not a host fault: its agent still answers;
  only ``hang_timeout`` catches it. Not measured here.)
  Target: detected within ``agent_timeout`` + 1 s.

* ``hang``: ``--hosts`` x ``--per-host`` (8 x 8) lab ranks print ``up`` and sleep in
  ``stuck_here()``; ``--hang-timeout`` 5. From the launcher's ``run hung ...;
  collecting every rank's stack`` line (the timeout expired): its ``where each rank is
  (hang):`` line, its last grouped line, and its exit; also the last ``up`` line to the
  ``run hung`` line (the timeout plus the supervisor's reaction). Variants, round-robin:
  the agents' own py-spy (what ``FLODL_PY_SPY`` unset finds: on this machine a pyenv
  shim), the py-spy binary itself (only when the one found is a script, e.g. a pyenv
  shim), and no py-spy (``FLODL_PY_SPY=none``: what ``/proc`` says). The agents' value
  of ``FLODL_PY_SPY`` comes from a one-line file the lab's login shell reads
  (``SshdLab(login_shell_rc=...)``), rewritten before each launch. Target: <= 3 s from
  the hang timeout to the grouped view, with py-spy.

* ``idle``: the launcher's own CPU (user+sys of its process, all threads, from
  ``/proc/<pid>/stat``, % of one core) and thread count while every rank sleeps, over
  ``--window`` s (20) of steady state, 2 s after the last ``up``; shapes ``--idle-shapes``
  (``8x8,32x8``), round-robin. The measurement is `idle.measure` (bench/idle.py), reused
  as is: the agents (which now send a heartbeat every second when idle) and the
  per-session sshd processes are reported beside it. Peer, interleaved: the same
  launch by ``--baseline`` (b8c4ced, the last commit before heartbeats; ``git archive``
  into the temporary folder and imported first through PYTHONPATH, so its agents are
  the old ones too). Target: <= 2 % at 32 x 8 (1.6 % before heartbeats, measured by
  idle.py at another moment).

* ``ctrlc``: Ctrl-C on a real pty (80x24, the launcher's controlling terminal, a thread
  draining the master as fast as it can, or at ``--pty-rate`` MB/s): localhost x 1 + 2
  lab hosts x 1, each rank writing ``rN line i`` (one write per line) as fast as it
  can; once every rank's lines showed, plus 0.5 s and a random 0-0.2 s, ``\\x03`` is
  written to the master. Measured: the key to the launcher's exit and to every rank
  process gone (pidfds), its exit status, the terminal's last line, and anything of
  the run left 5 s later. Peer, interleaved: ``torchrun --standalone --nproc-per-node
  3`` with the same program on the same pty set-up, capped at ``--ctrlc-cap`` s (60;
  then its process group is killed and the run reported as not exited). Default 20
  runs each. The issue saw 0.18 s vs 29.5 s (tmux, whose reader is slower than this
  one).

Everything the script starts runs in a process group of its own (benchlib) and is
stopped by pid or group at exit; frozen processes get SIGCONT first; links taken down
come back up; labs are stopped. Run ``python3 bench/liveness.py --help``.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional, TextIO

import benchlib
from liveness_ctrlc import CtrlC, Idle
from liveness_faults import Detect, Hang
from livenesslib import BASELINE, FDL, LABS, SCENARIOS, Sample, cleanup, fmt


# ==========================================================================================
# main
# ==========================================================================================
def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = benchlib.arg_parser(__doc__)
    ap.add_argument("--only", action="append", choices=SCENARIOS, metavar="NAME",
                    help=f"run only this scenario (repeatable): {', '.join(SCENARIOS)}")
    ap.add_argument("--repeat", type=int, help="measured runs per case of every scenario "
                    "(default: detect 5, hang 5, idle 1, ctrlc 20)")
    ap.add_argument("--warmup", type=int, default=1, help="discarded warm-up rounds for "
                    "hang and ctrlc (default 1; detect and idle have none)")
    ap.add_argument("--agent-timeout", type=float, default=6.0,
                    help="detect: agent_timeout in the cluster files, s (5)")
    ap.add_argument("--torchrun-cap", type=float, default=30.0,
                    help="detect: how long a torchrun with a frozen worker is watched, s (30)")
    ap.add_argument("--no-netns", action="store_true",
                    help="detect: skip the black hole (it needs root and iproute2)")
    ap.add_argument("--hosts", type=int, default=8, help="hang: lab hosts (8)")
    ap.add_argument("--per-host", type=int, default=8, help="hang: ranks per host (8)")
    ap.add_argument("--hang-timeout", type=float, default=5.0, help="hang: hang_timeout, s (5)")
    ap.add_argument("--py-spy", metavar="PATH", help="hang: also run with FLODL_PY_SPY=PATH "
                    "(default: the py-spy next to this Python, when the one the agents find "
                    "is a script such as a pyenv shim)")
    ap.add_argument("--idle-shapes", default="8x8,32x8",
                    help="idle: comma-separated HOSTSxRANKS (8x8,32x8)")
    ap.add_argument("--window", type=float, default=20.0, help="idle: sampling window, s (20)")
    ap.add_argument("--baseline", metavar="REV", default=BASELINE,
                    help="idle: also measure the launcher of this git revision (`git archive "
                    "REV`, imported through PYTHONPATH; its agents too), interleaved "
                    f"(default {BASELINE}, the last commit before agent heartbeats; 'none': "
                    "skip)")
    ap.add_argument("--ctrlc-cap", type=float, default=60.0,
                    help="ctrlc: longest wait for an exit after Ctrl-C, s (60)")
    ap.add_argument("--pty-rate", type=float, default=0.0, metavar="MB/S",
                    help="ctrlc: the terminal reads at most this many MB/s, like a slow "
                         "terminal emulator or tmux (default 0: as fast as it can)")
    ap.add_argument("--kill-grace", type=float, default=10.0,
                    help="ctrlc: kill_grace of the cluster file, s (10, the default)")
    ap.add_argument("--no-torchrun", action="store_true", help="skip the torchrun peers")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="longest wait for every rank's up line, s (300)")
    ap.add_argument("--wait-load", type=float, metavar="L",
                    help="first wait (up to 20 min) until the 1-minute load is <= L")
    ap.add_argument("--seed", type=int, help="seed for the random pauses before each fault")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args(argv)
    if args.repeat is not None and args.repeat < 1:
        ap.error("--repeat must be at least 1")
    try:
        args.idle_shape_list = [tuple(int(x) for x in s.lower().split("x"))
                                for s in args.idle_shapes.split(",") if s.strip()]
        assert args.idle_shape_list and all(len(s) == 2 and min(s) > 0
                                            for s in args.idle_shape_list)
    except (ValueError, AssertionError):
        ap.error("--idle-shapes: HOSTSxRANKS[,HOSTSxRANKS...], e.g. 8x8,32x8")
    if args.hosts < 1 or args.per_host < 1:
        ap.error("--hosts and --per-host must be at least 1")
    return args


DEFAULT_REPEAT = {"detect": 5, "hang": 5, "idle": 1, "ctrlc": 20}


def main(argv: Optional[Sequence[str]] = None) -> int:
    return benchlib.run_in_scratch("fdl-liveness-", parse_args(argv), _bench, cleanup)


def _start_netns(tmp: Path, out: TextIO) -> Any:
    from fdl_fabric.testing import NetnsLab

    out.write("starting 1 netns lab host... ")
    out.flush()
    netns = NetnsLab(tmp / "netns", 1, client_alive_interval=1, client_alive_count_max=3)
    LABS.append(netns)
    netns.start()
    Path(netns.known_hosts).write_text(
        "".join(h.known_hosts_line() + "\n" for h in netns.hosts))
    out.write("ok\n")
    return netns


#: scenario -> the measure each run's progress line shows
HEADLINE = {"hang": "grouped", "idle": "cpu", "ctrlc": "exit"}


def _status(name: str, tool: str, s: Sample) -> str:
    """One run's progress line: its headline measure, or why it failed."""
    headline = HEADLINE.get(name) or ("unresponsive" if tool == FDL else "exit")
    value = s.s.get(headline)
    if not s.ok:
        return "FAILED: " + s.error
    status = (f"{headline}: not seen" if value is None else
              f"{headline} {fmt(value)}" + (" %" if name == "idle" else " s"))
    if s.notes or s.info:
        status += "  [" + "; ".join(s.info + s.notes) + "]"
    return status


def _scenario(name: str, bench: Any, args: argparse.Namespace, out: TextIO) -> int:
    """Every case of one scenario, round-robin, then its report; how many measured runs
    failed."""
    repeat = args.repeat or DEFAULT_REPEAT[name]
    warmup = args.warmup if name in ("hang", "ctrlc") else 0
    samples: list[Sample] = []
    failed = 0
    t_scn = time.monotonic()
    out.write(f"\n== {name}: {repeat} run(s) per case"
              f"{f' after {warmup} warm-up round(s)' if warmup else ''}, round-robin\n")
    for rnd in range(warmup + repeat):
        for case, tool in bench.cases():
            s = bench.run(case, tool, rnd - warmup if rnd >= warmup else rnd)
            s.warmup = rnd < warmup
            samples.append(s)
            label = "warm-up" if s.warmup else f"run {s.rep + 1}"
            out.write(f"  {label} {case} ({tool}): {_status(name, tool, s)}  "
                      f"(load {benchlib.loadavg()})\n")
            out.flush()
            failed += not s.ok and not s.warmup
    bench.report(samples, out)
    out.write(f"  ({name}: {time.monotonic() - t_scn:.0f} s)\n")
    return failed


def _bench(args: argparse.Namespace, tmp: Path, out: TextIO) -> int:
    from fdl_fabric.testing import netns_available, sshd_available

    names = [n for n in SCENARIOS if not args.only or n in args.only]
    remarks: list[str] = []
    if not sshd_available():
        out.write("no sshd (install openssh-server): nothing to run\n")
        return 2
    if not args.no_torchrun and not Path(sys.executable).with_name("torchrun").exists():
        args.no_torchrun = True
        remarks.append("torchrun peers skipped: no torchrun next to this Python")
    load_start = benchlib.wait_for_quiet(args.wait_load, out)
    random.seed(args.seed)
    need = {"detect": 2, "hang": args.hosts, "idle": max(h for h, _ in args.idle_shape_list),
            "ctrlc": 2}
    mode_file = tmp / "py-spy-mode"
    mode_file.write_text("\n")
    # Every session's login shell reads FLODL_PY_SPY from mode_file (one line, empty:
    # unset, the agent looks for py-spy itself); only the hang scenario changes it.
    lab = benchlib.start_lab(tmp / "lab", max(need[n] for n in names), out,
                             login_shell_rc=f"read -r FLODL_PY_SPY < {mode_file} || true; "
                                            "export FLODL_PY_SPY")
    LABS.append(lab)
    netns = None
    why = "" if "detect" not in names or args.no_netns else netns_available()
    if why is None:
        netns = _start_netns(tmp, out)
    elif why:
        remarks.append(f"black hole skipped: {why}")
    started = time.monotonic()
    makers: dict[str, Callable[[], Any]] = {
        "detect": lambda: Detect(args, tmp, lab, netns),
        "hang": lambda: Hang(args, tmp, lab, mode_file),
        "idle": lambda: Idle(args, tmp, lab),
        "ctrlc": lambda: CtrlC(args, tmp, lab)}
    failed = 0
    for name in names:
        failed += _scenario(name, makers[name](), args, out)
        mode_file.write_text("\n")  # FLODL_PY_SPY unset again for what follows
    benchlib.write_machine_notes(out, load_start, started)
    with contextlib.suppress(Exception):
        from fdl_fabric.agent import stacks, wire

        out.write(f"  intervals: agent heartbeat {wire.HEARTBEAT_INTERVAL:g} s, launcher ping "
                  f"{wire.PING_INTERVAL:g} s, stack collector's CPU window "
                  f"{stacks.CPU_WINDOW:g} s\n")
    for r in remarks:
        out.write(f"  - {r}\n")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
