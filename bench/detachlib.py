"""Helpers of bench/detach.py (issue 30) shared by its sections: the fdl-fabric command
line, the detached supervisors it caused, a pipe reader with timestamps, formatting.

A detached supervisor runs in a session of its own, started by fdl-fabric, not by this
script: it is stopped with ``fdl-fabric stop`` and waited for with ``fdl-fabric wait``;
if it is still there at the end, it is killed by pid checked with its start time
(psutil). Nothing here imports ``tests/``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence, TextIO

import benchlib
import psutil
from benchlib import med, runs_cell


def fdl(*words: str) -> list[str]:
    """fdl-fabric: the console script beside this interpreter (not a pyenv shim)."""
    beside = Path(sys.executable).parent / "fdl-fabric"
    if beside.exists():
        return [str(beside), *words]
    return [sys.executable, "-m", "fdl_fabric", *words]


def whatif(mode: str, *words: str) -> list[str]:
    """fdl-fabric ``words`` with a proposed change applied in that process only
    (bench/detach_whatif.py ``mode``)."""
    return [sys.executable, str(Path(__file__).resolve().parent / "detach_whatif.py"), mode,
            "--", *words]


def with_detach(argv: list[str]) -> list[str]:
    """``argv`` (from `fdl`) with ``--detach`` right after its command word."""
    at = next(i for i, w in enumerate(argv) if w in ("run", "launch")) + 1
    return argv[:at] + ["--detach"] + argv[at:]


def fmt(value: Optional[float], digits: int = 3) -> str:
    return benchlib.fmt(value, digits)


def fmt_k(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value / 1e3:.0f}k"


def json_records(lines: Sequence[tuple[float, str, bytes]]) -> list[tuple[float, dict[str, Any]]]:
    found = []
    for t, what, line in lines:
        if what == "out" and line.startswith(b"{"):
            with contextlib.suppress(ValueError):
                found.append((t, json.loads(line)))
    return found


def event_time(folder: Path, name: str) -> Optional[float]:
    """The wall time of the first ``name`` event in a record's events.jsonl."""
    with contextlib.suppress(OSError):
        for line in (folder / "events.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if rec.get("name") == name:
                    return float(rec["time"])
    return None


def started_since_boot(pid: int) -> Optional[float]:
    """When ``pid`` started, s since boot (CLOCK_BOOTTIME; /proc/<pid>/stat field 22, in
    clock ticks: 10 ms). psutil's create_time adds /proc/stat's btime, a whole second."""
    from fdl_fabric.agent.procs import stat_fields

    fields = stat_fields(pid)
    return None if fields is None else int(fields[19]) / os.sysconf("SC_CLK_TCK")


def run_quiet(argv: list[str], env: dict[str, str], timeout: float = 90.0) -> int:
    proc = benchlib.start(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout)
    return benchlib.stop(proc) or 0


class Supervisors:
    """Detached supervisors this script caused, each with its start time: stopped with
    ``fdl-fabric stop``, else killed (psutil checks pid and start time)."""

    def __init__(self) -> None:
        self.known: dict[str, psutil.Process] = {}
        self.env: dict[str, str] = {}

    def add(self, run_id: str, pid: int) -> None:
        with contextlib.suppress(psutil.Error):
            self.known[run_id] = psutil.Process(pid)

    def finish(self, run_id: str, stop: bool) -> int:
        """Wait for the run (``stop`` first: ``fdl-fabric stop``); its exit code."""
        if stop:
            run_quiet(fdl("stop", run_id), self.env)
        code = run_quiet(fdl("wait", run_id, "--timeout", "90"), self.env, 120.0)
        self.known.pop(run_id, None)
        return code

    def stop_all(self) -> None:
        for run_id in list(self.known):
            with contextlib.suppress(Exception):
                self.finish(run_id, stop=True)
            with contextlib.suppress(psutil.Error):
                self.known.pop(run_id).kill()


SUPERVISORS = Supervisors()


def detached_of(lines: Sequence[tuple[float, str, bytes]]) -> tuple[str, int]:
    for _t, rec in json_records(lines):
        if rec.get("name") == "detached":
            return rec["data"]["run_id"], int(rec["data"]["pid"])
    raise benchlib.BenchError("no `detached` record: " + b" | ".join(
        line for _t, _w, line in lines[-6:]).decode(errors="replace"))



# -- reading a follower's stdout ------------------------------------------------------------
class Reader:
    """Drains a pipe in a thread: complete lines with the wall time they were read
    (``keep``), or only how many lines hold ``mark`` and when the ``want``-th came."""

    def __init__(self, stream: Any, *, keep: bool = True, mark: bytes = b"",
                 want: int = 0) -> None:
        self.keep, self.mark, self.want = keep, mark, want
        self.lines: list[tuple[float, bytes]] = []
        self.newlines = 0
        self.marked = 0
        self.first_mark: Optional[float] = None
        self.done_at: Optional[float] = None
        self._partial = b""
        self.thread = threading.Thread(target=self._run, args=(stream.fileno(),), daemon=True)
        self.thread.start()

    def _run(self, fd: int) -> None:
        while True:
            data = os.read(fd, 1 << 20)
            now = time.time()
            if not data:
                return
            data = self._partial + data
            cut = data.rfind(b"\n") + 1
            self._partial = data[cut:]
            whole = data[:cut]
            self.newlines += whole.count(b"\n")
            if self.mark:
                found = whole.count(self.mark)
                if found and self.first_mark is None:
                    self.first_mark = now
                self.marked += found
                if self.done_at is None and self.want and self.marked >= self.want:
                    self.done_at = now
            if self.keep:
                self.lines.extend((now, line) for line in whole.splitlines())



def _prompt_rows(samples: list[Any], scenario: str, tools: list[str],
                 rows: list[list[str]]) -> dict[str, Optional[float]]:
    """One row a tool for ``scenario``; each tool's median prompt."""
    meds: dict[str, Optional[float]] = {}
    for tool in tools:
        got = [s for s in samples if s.scenario == scenario and s.tool == tool and s.ok]
        bad = sum(1 for s in samples if s.scenario == scenario and s.tool == tool
                  and not s.ok)
        m = meds[tool] = med([s.prompt for s in got])
        fg = meds["foreground"]
        rows.append([scenario, tool, fmt(m), fmt(m / fg if m and fg else None, 2),
                     fmt(med([s.supervisor_born for s in got])),
                     fmt(med([s.arr_event for s in got])),
                     fmt(med([s.relayed_arr for s in got])),
                     fmt(med([s.said for s in got])),
                     runs_cell(len(got), bad)])
    return meds


def report_prompt(res: dict[str, Any], out: TextIO, targets: list[list[str]]) -> None:
    samples = [s for s in res["samples"] if s.rep > 0]
    out.write("\n1. --detach -> prompt, beside the foreground -> every rank running "
              f"(s from Popen; medians of {len({s.rep for s in samples})} rounds)\n\n")
    rows = [["scenario", "tool", "prompt / ARR line", "x fg", "supervisor created",
             "launcher's ARR event", "ARR relayed", "`detached` read", "runs"]]
    for scenario in res["plans"]:
        meds = _prompt_rows(samples, scenario, res["tools"], rows)
        if meds["foreground"] and meds["detached"]:
            ratio = meds["detached"] / meds["foreground"]
            targets.append([f"--detach prompt / foreground ARR, {scenario}", f"{ratio:.2f}x",
                            "<= 1.1x", "met" if ratio <= 1.1 else "MISSED"])
    out.write(benchlib.table(rows, [False, False] + [True] * 7) + "\n")
    out.write("prompt / ARR line: foreground: its all_ranks_running record read; the others: "
              "the process exited\n")
    out.write(f"floor: `fdl-fabric run --help` to its exit (interpreter, imports, parse, the "
              f"help text) {fmt(res['floor'])} s\n")
    for s in res["samples"]:
        if not s.ok:
            out.write(f"  ! {s.scenario} {s.tool} round {s.rep + 1}: {s.error[:300]}\n")


def _attach_row(tool: str, samples: list[Any]) -> tuple[list[str], Optional[float]]:
    """A follower's row (first live line, `attached` line, latencies) and its p50."""
    got = [a for a in samples if a.tool == tool and a.ok]
    lat = sorted(x for a in got for x in a.latencies)
    firsts = [a.first_live for a in got if a.first_live is not None]
    p50 = med(firsts)
    return [tool, fmt(p50), fmt(min(firsts, default=None)),
            fmt(max(firsts, default=None)), fmt(med([a.said for a in got])),
            fmt(1000 * lat[len(lat) // 2], 1) if lat else "n/a",
            fmt(1000 * lat[int(len(lat) * 0.9)], 1) if lat else "n/a",
            runs_cell(len(got), sum(1 for a in samples if a.tool == tool and not a.ok))], p50


def report_attach(res: dict[str, Any], out: TextIO, targets: list[list[str]]) -> None:
    samples = [a for a in res["samples"] if a.rep > 0]
    out.write(f"\n2. attach -> first live line (s from Popen; {len({a.rep for a in samples})} "
              "rounds after a warm-up) and line latency (the rank's write -> read on the "
              "follower's stdout, ms)\n\n")
    rows = [["tool", "first live p50", "min", "max", "`attached` line", "latency p50 ms",
             "latency p90 ms", "runs"]]
    p50s = {}
    for tool in ("fdl-fabric attach", "tail -n 20 -f"):
        row, p50s[tool] = _attach_row(tool, samples)
        rows.append(row)
    out.write(benchlib.table(rows, [False] + [True] * 7) + "\n")
    out.write("latency: lines written after the follower's first live line (steady state); "
              f"the run, stopped with `fdl-fabric stop`: exit {res['stop_code']}\n")
    p50 = p50s.get("fdl-fabric attach")
    if p50 is not None:
        targets.append(["attach -> first live line, p50", f"{p50:.3f} s", "<= 0.3 s",
                        "met" if p50 <= 0.3 else "MISSED"])
    for a in res["samples"]:
        if not a.ok:
            out.write(f"  ! {a.tool} round {a.rep + 1}: {a.error[:300]}\n")
