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
import re
import selectors
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence, TextIO

import benchlib

#: argv: N [R]; R defaults to $RANK. Lines ``r<R> <i>``, 8192 a write, all of them written
#: even when the pipe is full (os.write may write less than asked).
GEN_SCRIPT = """\
import os, sys
n = int(sys.argv[1])
r = int(sys.argv[2]) if len(sys.argv) > 2 else int(os.environ.get("RANK", "0"))
step = 8192
for a in range(0, n, step):
    buf = b"".join([b"r%d %d\\n" % (r, i) for i in range(a, min(n, a + step))])
    view = memoryview(buf)
    while view:
        view = view[os.write(1, view):]
"""

#: One of the launcher's prefixed lines: label, rank in the label, payload.
FDL_LINE = re.compile(rb"^\[([^\]:]+):[^\]:]+:r(\d+)\] (.*)$", re.M)


@dataclass
class Sample:
    scenario: str
    tool: str
    rep: int
    warmup: bool
    ok: bool = False
    error: str = ""
    lines: int = 0  # lines received on stdout
    expected: int = 0
    lost: int = 0
    merged: int = 0
    out_of_order: int = 0
    first: Optional[float] = None  # s from Popen to the first stdout byte
    last: Optional[float] = None  # ... to the last stdout byte
    done: Optional[float] = None  # ... to the last exit
    launcher_cpu_pct: Optional[float] = None
    bytes: int = 0
    returncodes: list[Optional[int]] = field(default_factory=list)

    @property
    def stream_rate(self) -> Optional[float]:
        if self.first is None or self.last is None or self.last <= self.first:
            return None
        return self.expected / (self.last - self.first)


def run_streams(argvs: Sequence[Sequence[str]], *, timeout: float,
                cpu_of_first: bool = False) -> tuple[list[bytes], list[Optional[int]],
                                                     Optional[float], Optional[float],
                                                     Optional[float], Optional[float], str]:
    """Start ``argvs`` at once; collect each one's stdout. Returns (stdouts, codes, first,
    last, done, cpu % of the first process, error)."""
    sel = selectors.DefaultSelector()
    procs = []
    chunks: list[list[bytes]] = []
    first = last = None
    error = ""
    t0 = time.perf_counter()
    for i, argv in enumerate(argvs):
        proc = benchlib.start(argv, stdout=benchlib.subprocess.PIPE,
                              stderr=benchlib.subprocess.PIPE, bufsize=0)
        procs.append(proc)
        chunks.append([])
        sel.register(proc.stdout, selectors.EVENT_READ, (i, "out"))
        sel.register(proc.stderr, selectors.EVENT_READ, (i, "err"))
    errs: list[list[bytes]] = [[] for _ in argvs]
    deadline = t0 + timeout
    try:
        while sel.get_map():
            now = time.perf_counter()
            if now > deadline:
                error = f"timed out after {timeout:g}s"
                break
            for key, _ in sel.select(deadline - now):
                i, what = key.data
                data = os.read(key.fd, 1 << 20)
                stamp = time.perf_counter() - t0
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                if what == "out":
                    chunks[i].append(data)
                    if first is None:
                        first = stamp
                    last = stamp
                else:
                    errs[i].append(data)
        codes = []
        cpu_pct = None
        for i, proc in enumerate(procs):
            while proc.returncode is None:
                # wait4 rather than Popen.wait: it also returns the child's CPU usage.
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    proc.returncode = os.waitstatus_to_exitcode(status)
                    benchlib.forget(proc)
                    if i == 0 and cpu_of_first:
                        cpu_of_launcher = usage.ru_utime + usage.ru_stime
                        cpu_pct = cpu_of_launcher
                    break
                if time.perf_counter() > deadline:
                    error = error or "still running"
                    break
                time.sleep(0.002)
        done = time.perf_counter() - t0
        if cpu_pct is not None:
            cpu_pct = 100.0 * cpu_pct / done
        codes = [proc.returncode for proc in procs]
    finally:
        sel.close()
        for proc in procs:
            benchlib.stop(proc)
    if any(c != 0 for c in codes) and not error:
        tails = b" | ".join(b"".join(e)[-300:] for e in errs if e)
        error = f"exit status {codes}: {tails.decode(errors='replace')}"
    return [b"".join(c) for c in chunks], codes, first, last, done, cpu_pct, error


def check_prefixed(data: bytes, ranks: Sequence[int], n: int, s: Sample) -> None:
    """fdl-fabric's stdout: every line one rank line behind its own prefix, all in order."""
    s.lines = data.count(b"\n") + (0 if data.endswith(b"\n") or not data else 1)
    per_rank: dict[int, list[bytes]] = {r: [] for r in ranks}
    foreign = 0
    for m in FDL_LINE.finditer(data):
        r = int(m.group(2))
        if r in per_rank:
            per_rank[r].append(m.group(3))
        else:
            foreign += 1
    matched = sum(len(v) for v in per_rank.values())
    s.merged = (s.lines - matched) + foreign  # lines without a prefix count as merged
    for r, got in per_rank.items():
        _check_rank(r, got, n, s)


def check_plain(data: bytes, rank: int, n: int, s: Sample) -> None:
    """One ssh session's stdout: the rank's lines, nothing else."""
    s.lines += data.count(b"\n") + (0 if data.endswith(b"\n") or not data else 1)
    got = data.split(b"\n")
    if got and got[-1] == b"":
        got.pop()
    _check_rank(rank, got, n, s)


def _check_rank(r: int, got: list[bytes], n: int, s: Sample) -> None:
    expected = [b"r%d %d" % (r, i) for i in range(n)]
    s.expected += n
    if got == expected:
        return
    pattern = re.compile(rb"^r%d (\d+)$" % r)
    values = []
    for payload in got:
        m = pattern.match(payload)
        if m is None:
            s.merged += 1
        else:
            values.append(int(m.group(1)))
    s.lost += n - len(set(values) & set(range(n)))
    if values != sorted(values):
        s.out_of_order += 1


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def _med(values: Sequence[Optional[float]]) -> Optional[float]:
    clean = [v for v in values if v is not None]
    return statistics.median(clean) if clean else None


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
        rate = _med([s.stream_rate for s in good])
        if tool.startswith("fdl-fabric"):
            base[scenario] = rate
        b = base.get(scenario)
        e2e = _med([s.done for s in good])
        table.append([scenario, tool, _k(rate),
                      "n/a" if rate is None or not b else f"{rate / b:.2f}", _s(e2e),
                      _k(None if e2e is None else good[0].expected / e2e),
                      _s(_med([s.launcher_cpu_pct for s in good])),
                      str(sum(s.lost for s in got)), str(sum(s.merged for s in got)),
                      str(sum(s.out_of_order for s in got)),
                      f"{len(good)}" + (f" ({len(got) - len(good)} failed)"
                                        if len(got) > len(good) else "")])
    out.write(benchlib.table(table, [False, False] + [True] * 9) + "\n")
    out.write("\nTargets (fdl-fabric stream lines/s, 0 lost, 0 merged)\n\n")
    trows = [["scenario", "fdl-fabric lines/s", "OpenSSH lines/s", "fdl / ssh", "target",
              "met"]]
    for scenario, target in TARGETS.items():
        fdl = [s for s in samples if s.scenario == scenario and s.tool.startswith("fdl")
               and not s.warmup]
        ssh = [s for s in samples if s.scenario == scenario and s.tool.startswith("OpenSSH")
               and not s.warmup and s.ok]
        if not fdl:
            continue
        rate = _med([s.stream_rate for s in fdl if s.ok])
        peer = _med([s.stream_rate for s in ssh])
        intact = all(s.ok and not s.lost and not s.merged and not s.out_of_order for s in fdl)
        met = rate is not None and rate >= target and intact
        trows.append([scenario, _k(rate), _k(peer),
                      "n/a" if rate is None or not peer else f"{rate / peer:.2f}",
                      f">= {target / 1000:.0f}k, intact", "yes" if met else "NO"])
    out.write(benchlib.table(trows, [False, True, True, True, True, False]) + "\n")
    bad = [s for s in samples if not s.ok]
    for s in bad:
        out.write(f"  ! {s.scenario} / {s.tool} run {s.rep}: {s.error}\n")


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
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
        samples: list[Sample] = []
        for rep in range(args.repeat + 1):
            for sc, tool, kind, argvs, ranks in jobs:
                out.write(f"{'warm-up' if rep == 0 else f'run {rep}'}: {sc} / {tool} "
                          f"(load {benchlib.loadavg()})... ")
                out.flush()
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
