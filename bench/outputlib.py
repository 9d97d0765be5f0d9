"""output.py's machinery: the line generator, a set of processes whose stdouts are read
by one selector (`run_streams`), and the checks that every line came through intact."""

from __future__ import annotations

import os
import re
import selectors
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

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


def _reap(procs: list[Any], deadline: float, cpu_of_first: bool,
          error: str) -> tuple[Optional[float], str]:
    """Reap each process (wait4 rather than Popen.wait: it also returns the child's CPU
    usage) until ``deadline``; the first one's CPU seconds if asked, and the error."""
    cpu = None
    for i, proc in enumerate(procs):
        while proc.returncode is None:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                benchlib.forget(proc)
                if i == 0 and cpu_of_first:
                    cpu = usage.ru_utime + usage.ru_stime
                break
            if time.perf_counter() > deadline:
                error = error or "still running"
                break
            time.sleep(0.002)
    return cpu, error


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
        cpu_pct, error = _reap(procs, deadline, cpu_of_first, error)
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
