#!/usr/bin/env python3
"""Issue 33: the collective smoke test at 8 lab hosts x 8 ranks on CPU (gloo), beside a
bare torchrun of the same all-reduce program on the same hosts.

A script, not a test: it prints medians (min-max) over ``--repeat`` runs, interleaved
round-robin, and never asserts a timing.

* **fdl-fabric smoke**: ``--hosts`` x ``--per-host`` sshd lab hosts (``nproc``), the
  cluster's ``python:`` this interpreter (torch 2.13 CPU). Per run, from just before the
  first connection: every host connected and its agent started (``agents up``), then
  `fdl_fabric.preflight.smoke.run_smoke` over those sessions (``smoke``: the part a
  launch with ``--smoke`` adds, its agents being up anyway), then every agent dismissed
  (``total``: connect + agents + smoke + dismissal). Also the slowest slot (its start
  to its answer, on its host) and the slowest init + all-reduce + barrier inside one.
* **torchrun**: one ``ssh`` per lab host (OpenSSH, the lab's options) running ``cd
  PATH && torchrun --nnodes H --nproc-per-node N --node-rank I --master-addr <host 1's
  address> --master-port P smoke.py ...``, all started at once; ``smoke.py`` is
  `fdl_fabric.agent.smokerun.PROGRAM`, byte for byte, so both run the same
  init + all-reduce + barrier. ``total``: first ``ssh`` started to the last one exited;
  the slowest init + all-reduce + barrier as its workers report it. torchrun gets the
  same bound (its workers' collective timeout and alarm; the agent under ``timeout -s
  KILL``), so a failed run ends too.

What is compared: the same work (64 interpreters importing torch, one gloo group of 64,
one all-reduce, one barrier) started two ways over real SSH sessions on one machine.
Every lab host shares this machine's cores, so with 2 cores both are bound by the 64
imports of torch (``import torch`` is measured alone too: its CPU seconds, times the
ranks, over the cores, is the floor); on real hosts each host imports on its own cores.

Everything the script starts runs in a process group of its own (benchlib) and is
stopped by group; the lab is stopped and the temporary folder removed on exit, Ctrl-C or
SIGTERM. Run ``python3 bench/smoke_bench.py --help``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, TextIO

import benchlib as bl

from fdl_fabric import reports
from fdl_fabric.agent import smokerun
from fdl_fabric.clusterfile import load_cluster
from fdl_fabric.planning.plan import build_plan
from fdl_fabric.preflight import smoke
from fdl_fabric.preflight.report import Status
from fdl_fabric.testing.processes import free_port

SALT = bytes(range(16))


def _import_torch_cpu() -> float:
    """CPU seconds (user + system) of one ``python -c 'import torch'``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _fdl_run(cluster_file: Path, timeout: float) -> dict[str, Any]:
    """One smoke test through freshly started agents; its figures and rows."""
    from fdl_fabric.transport import for_cluster, resolve_settings
    from fdl_fabric.transport.fanout import close_all, connect_each
    from fdl_fabric.transport.session import AgentSession

    t0 = time.monotonic()
    cluster = load_cluster(str(cluster_file))
    plan = build_plan(cluster, argv=["python3", "train.py"], run_id="smoke-bench", salt=SALT)
    transports = for_cluster(cluster, resolve_settings(cluster))
    inbox: queue.SimpleQueue[reports.Report] = queue.SimpleQueue()
    sessions: dict[str, AgentSession] = {}
    figures: dict[str, Any] = {}
    try:
        errors = connect_each(transports.values())
        if errors:
            raise bl.BenchError(f"could not connect: {errors}")
        for host, transport in transports.items():
            sessions[host] = AgentSession(transport, inbox.put)
            sessions[host].start()
        figures["agents"] = time.monotonic() - t0
        t1 = time.monotonic()
        facts: list[dict[str, Any]] = []
        rows = smoke.run_smoke(plan, sessions, _Spy(inbox, facts), timeout=timeout)
        figures["smoke"] = time.monotonic() - t1
        figures["rows"] = rows
        slots = [s for f in facts for s in f.get("slots") or []]
        figures["slot_max"] = max((float(s["seconds"]) for s in slots), default=None)
        figures["collective_max"] = max((float(s["collective"]) for s in slots
                                         if s.get("collective") is not None), default=None)
    finally:
        for session in sessions.values():
            session.close_input()
        for session in sessions.values():
            session.join(10)
        close_all(transports.values())
    figures["total"] = time.monotonic() - t0
    return figures


class _Spy:
    """The inbox as `run_smoke` reads it, keeping a copy of each smoke answer."""

    def __init__(self, inbox: queue.SimpleQueue[reports.Report],
                 facts: list[dict[str, Any]]) -> None:
        self.inbox, self.facts = inbox, facts

    def get(self, timeout: Optional[float] = None) -> reports.Report:
        report = self.inbox.get(timeout=timeout)
        if isinstance(report, reports.Facts) and report.smoke is not None:
            self.facts.append(report.smoke)
        return report

    def put(self, report: reports.Report) -> None:
        self.inbox.put(report)


def _torchrun_run(lab: Any, script: Path, per_host: int, timeout: float) -> dict[str, Any]:
    """One bare torchrun per lab host over ssh, the same program; its figures."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    port = free_port("127.0.0.1")
    deadline = time.time() + timeout
    procs = []
    t0 = time.monotonic()
    for i, host in enumerate(lab.hosts):
        command = (f"cd {shlex.quote(host.path)} && OMP_NUM_THREADS=1 timeout -s KILL "
                   f"{int(timeout) + 5} {shlex.quote(torchrun)} --nnodes {len(lab.hosts)} "
                   f"--nproc-per-node {per_host} --node-rank {i} --master-addr "
                   f"{lab.hosts[0].addr} --master-port {port} {shlex.quote(str(script))} "
                   f"gloo {deadline!r} {smokerun.COLLECTIVE_SLACK!r} {smokerun.NO_TORCH}")
        procs.append(bl.start(lab.ssh_argv(host, command)))
    outs = []
    codes = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout + 30)
        except subprocess.TimeoutExpired:
            bl.stop(proc)
            out = b""
        bl.forget(proc)
        outs.append(out.decode("utf-8", "replace"))
        codes.append(proc.returncode)
    total = time.monotonic() - t0
    said = [json.loads(line.partition(smokerun.MARK)[2]) for out in outs
            for line in out.splitlines() if smokerun.MARK in line]
    ok = sum(1 for s in said if s.get("ok"))
    return {"total": total, "ok": ok, "codes": codes,
            "collective_max": max((float(s["collective"]) for s in said if s.get("ok")),
                                  default=None)}


def bench(args: argparse.Namespace, tmp: Path, out: TextIO) -> int:
    started = time.monotonic()
    load_start = bl.wait_for_quiet(args.wait_load, out)
    per_import = _import_torch_cpu()
    lab = bl.start_lab(tmp / "lab", args.hosts, out)
    try:
        cluster_file = lab.write_cluster(
            [lab.worker(h, nproc=args.per_host) for h in lab.hosts],
            master_port=free_port("127.0.0.1"), python=sys.executable)
        script = tmp / "smoke.py"
        script.write_text(smokerun.PROGRAM)
        fdl: list[dict[str, Any]] = []
        tr: list[dict[str, Any]] = []
        for n in range(args.repeat):
            out.write(f"run {n + 1}/{args.repeat}: fdl-fabric smoke... ")
            out.flush()
            fdl.append(_fdl_run(cluster_file, args.timeout))
            bad = [r for r in fdl[-1]["rows"] if r.status is not Status.OK]
            out.write(f"{fdl[-1]['total']:.1f} s ({len(bad)} rows not ok); torchrun... ")
            out.flush()
            tr.append(_torchrun_run(lab, script, args.per_host, args.timeout))
            out.write(f"{tr[-1]['total']:.1f} s ({tr[-1]['ok']} ranks ok); "
                      f"load {bl.loadavg()}\n")
            out.flush()
            for r in bad[:3]:
                out.write(f"  {r.host}: {r.reason}\n")
        _report(out, args, fdl, tr, per_import)
    finally:
        lab.stop()
    bl.write_machine_notes(out, load_start, started,
                           **{"import torch alone": f"{per_import:.2f} CPU s"})
    return 0


def _report(out: TextIO, args: argparse.Namespace, fdl: list[dict[str, Any]],
            tr: list[dict[str, Any]], per_import: float) -> None:
    ranks = args.hosts * args.per_host
    fdl_ok = sum(1 for f in fdl if all(r.status is Status.OK for r in f["rows"]))
    tr_ok = sum(1 for t in tr if t["ok"] == ranks)

    def cell(values: list[Optional[float]]) -> str:
        return f"{bl.fmt(bl.med(values), 1)} ({bl.spread(values, 1)})"

    rows = [["", "fdl-fabric smoke", "torchrun over ssh"],
            ["runs passed", bl.runs_cell(fdl_ok, len(fdl) - fdl_ok),
             bl.runs_cell(tr_ok, len(tr) - tr_ok)],
            ["agents up, s", cell([f.get("agents") for f in fdl]), "-"],
            ["smoke alone, s", cell([f.get("smoke") for f in fdl]), "-"],
            ["total, s", cell([f.get("total") for f in fdl]), cell([t["total"] for t in tr])],
            ["slowest slot, s", cell([f.get("slot_max") for f in fdl]), "-"],
            ["init+all-reduce+barrier, s", cell([f.get("collective_max") for f in fdl]),
             cell([t["collective_max"] for t in tr])]]
    bl.write_table(out, rows, [False, True, True],
                   f"{args.hosts} hosts x {args.per_host} ranks, gloo on CPU, medians "
                   f"(min-max) of {len(fdl)}")
    cores = os.cpu_count() or 1
    out.write(f"\nfloor from the imports alone: {ranks} x {per_import:.2f} CPU s / {cores} "
              f"cores = {ranks * per_import / cores:.1f} s\n")
    out.write(f"total fdl-fabric / torchrun: "
              f"{bl.ratio(bl.med([f['total'] for f in fdl]), bl.med([t['total'] for t in tr]))}"
              "\n")


def main() -> int:
    parser = bl.arg_parser(__doc__)
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--per-host", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=240.0,
                        help="the smoke test's bound, and torchrun's (s; 2 cores need more "
                             "than the default 30 s at 8 x 8)")
    parser.add_argument("--wait-load", type=float, default=None)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    return bl.run_in_scratch("fdl-smoke-bench-", args, bench, bl.stop_all)


if __name__ == "__main__":
    sys.exit(main())
