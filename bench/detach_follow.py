"""bench/detach.py's sections 3 and 4 (issue 30): ``logs -f`` beside ``tail -f``, and the
detached supervisor's idle CPU beside a foreground launch. See bench/detach.py."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TextIO

import benchlib
import psutil
from detachlib import SUPERVISORS, Reader, detached_of, fdl, fmt, fmt_k, med, runs_cell, whatif
from launchlib import run_timed

#: A what-if row: ``logs -f`` with `reading.follow` polling every 10 ms instead of 50 ms
#: (bench/detach_whatif.py; never counted against a target).
WHATIF_LOGS = "what-if: logs -f, 10 ms poll"
MARK = b":r0] r0 "  # a data line of the logs section: ``[host:cpu:r0] r0 <i>``

BURST_RANK = """\
import os, sys, time
n, go = int(sys.argv[1]), sys.argv[2]
end = time.monotonic() + 120
while not os.path.exists(go) and time.monotonic() < end:
    time.sleep(0.01)
for s in range(0, n, 8192):
    data = "".join("r0 %d\\n" % i for i in range(s, min(n, s + 8192))).encode()
    while data:
        data = data[os.write(1, data):]
"""
#: The record's launcher in the synthetic logs case: writes state.json naming itself,
#: console.log's first line, ``ok``; on a line on stdin the payload file at full speed
#: (writes of 256 KiB; it never rotates the file, unlike a launcher past 64 MiB), then
#: result.json; prints when it wrote.
WRITER = """\
import json, os, sys, time
from pathlib import Path
from fdl_fabric.runs.record import who, write_json
folder, payload = Path(sys.argv[1]), Path(sys.argv[2]).read_bytes()
folder.mkdir(mode=0o700)
fd = os.open(folder / "console.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
os.write(fd, b"cluster launcher: ready\\n")
write_json(folder / "state.json", {"run_id": folder.name, "state": "running",
           "attempt": 0, "launcher": who(), "detached": True, "started": time.time()})
print("ok", flush=True)
sys.stdin.readline()
t_go = time.time()
view = memoryview(payload)
while view:
    view = view[os.write(fd, view[:1 << 18]):]
t_written = time.time()
write_json(folder / "result.json", {"run_id": folder.name, "verdict": "ok",
           "exit_code": 0, "message": "cluster launcher: run completed"})
print(json.dumps({"go": t_go, "written": t_written}), flush=True)
"""




# -- 3. logs -f ------------------------------------------------------------------------------
@dataclass
class Followed:
    case: str
    tool: str
    rep: int
    lines: int
    ok: bool = False
    error: str = ""
    rate: Optional[float] = None  # lines/s from go to the last line read
    stream: Optional[float] = None  # lines/s from the first data line read to the last
    cpu: Optional[float] = None  # the follower's user+sys CPU s, start to the last line
    producer_rate: Optional[float] = None  # lines/s the writer itself took (synthetic)


def _done(f: Followed, reader: Reader, t_go: float, pid: int) -> None:
    assert reader.done_at is not None and reader.first_mark is not None
    f.rate = f.lines / (reader.done_at - t_go)
    f.stream = f.lines / max(1e-6, reader.done_at - reader.first_mark)
    f.cpu = benchlib.cpu_seconds(pid)


def _followers(run_id: str, console: Path) -> list[tuple[str, list[str]]]:
    tail = shutil.which("tail") or "tail"
    return [("fdl-fabric logs -f", fdl("logs", run_id, "-f")),
            ("tail -f", [tail, "-n", "+1", "-f", str(console)]),
            (WHATIF_LOGS, whatif("poll=0.01", "logs", run_id, "-f"))]


def follow_synthetic(tool: str, n: int, rep: int, env: dict[str, str], runs: Path,
                     script: Path, payload: Path) -> Followed:
    f = Followed("synthetic", tool, rep, n)
    run_id = time.strftime("%Y%m%d-%H%M%S-") + os.urandom(4).hex()
    folder = runs / run_id
    writer = benchlib.adopt(subprocess.Popen(
        [sys.executable, str(script), str(folder), str(payload)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, env=env, cwd=str(benchlib.ROOT), start_new_session=True))
    proc = None
    try:
        assert writer.stdout is not None and writer.stdin is not None
        if writer.stdout.readline().strip() != b"ok":
            raise benchlib.BenchError("the writer did not start")
        argv = dict(_followers(run_id, folder / "console.log"))[tool]
        proc = benchlib.start(argv, env=env, stderr=subprocess.DEVNULL, bufsize=0)
        reader = Reader(proc.stdout, keep=False, mark=MARK, want=n)
        benchlib.wait_until(lambda: reader.newlines >= 1, "the follower's first line", 20.0,
                            0.005)
        writer.stdin.write(b"go\n")
        writer.stdin.flush()
        said = json.loads(writer.stdout.readline())
        benchlib.wait_until(lambda: reader.done_at, f"{n} lines on the follower", 60.0, 0.005)
        _done(f, reader, said["go"], proc.pid)
        f.producer_rate = n / (said["written"] - said["go"])
        f.ok = True
    except (benchlib.BenchError, ValueError, OSError) as exc:
        f.error = str(exc)
    finally:
        if proc is not None:
            benchlib.stop(proc, grace=5)
        benchlib.stop(writer, grace=5)
        shutil.rmtree(folder, ignore_errors=True)
    return f


def follow_run(n: int, rep: int, env: dict[str, str], runs: Path, tmp: Path) -> list[Followed]:
    """Both followers at once on a detached run's console.log while its rank prints."""
    rank = tmp / "burst_rank.py"
    rank.write_text(BURST_RANK)
    go = tmp / f"go-{rep}"
    got = [Followed("run", tool, rep, n) for tool in ("fdl-fabric logs -f", "tail -f")]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        _r, _d, children, error = run_timed(
            [fdl("run", "--detach", "--json", "--nproc-per-node", "1", str(rank), str(n),
                 str(go))], expect_up=0, env=env, timeout=90.0)
        run_id, pid = detached_of(children[0].lines)
        SUPERVISORS.add(run_id, pid)
        console = runs / run_id / "console.log"
        readers = []
        for _tool, argv in _followers(run_id, console)[:2]:
            procs.append(benchlib.start(argv, env=env, stderr=subprocess.DEVNULL, bufsize=0))
            readers.append(Reader(procs[-1].stdout, keep=False, mark=MARK, want=n))
        base = console.read_bytes().count(b"\n")
        benchlib.wait_until(lambda: all(r.newlines >= base for r in readers),
                            "both followers caught up", 20.0, 0.005)
        t_go = time.time()
        go.touch()
        benchlib.wait_until(lambda: all(r.done_at for r in readers), f"{n} lines on both",
                            120.0, 0.01)
        for f, r, proc in zip(got, readers, procs):
            _done(f, r, t_go, proc.pid)
            f.ok = True
        if SUPERVISORS.finish(run_id, stop=False) != 0:
            raise benchlib.BenchError("the printing run did not end ok")
    except (benchlib.BenchError, OSError) as exc:
        for f in got:
            f.error = f.error or str(exc)
            f.ok = False
    finally:
        for proc in procs:
            benchlib.stop(proc, grace=5)
    return got


def logs_section(args: argparse.Namespace, tmp: Path, env: dict[str, str],
                 out: TextIO) -> list[Followed]:
    script = tmp / "writer.py"
    script.write_text(WRITER)
    payload = tmp / "payload"
    with payload.open("wb") as fh:
        for start in range(0, args.lines, 8192):
            fh.write("".join(f"[localhost:cpu:r0] r0 {i}\n"
                             for i in range(start, min(args.lines, start + 8192))).encode())
    samples: list[Followed] = []
    out.write(f"logs -f: {args.lines} lines appended at full speed; rounds (k lines/s):")
    for rep in range(args.logs_repeat + 1):
        tools = ["fdl-fabric logs -f", "tail -f"] + ([] if args.no_whatif else [WHATIF_LOGS])
        for tool in (tools if rep % 2 == 0 else tools[::-1]):
            f = follow_synthetic(tool, args.lines, rep, env, args.runs, script, payload)
            samples.append(f)
            out.write(f" {fmt(f.rate and f.rate / 1e3, 0)}" if f.ok else " x")
            out.flush()
    out.write(f"\nlogs -f: a run printing {args.run_lines} lines, both followers at once:")
    for rep in range(1, args.run_repeat + 1):
        pair = follow_run(args.run_lines, rep, env, args.runs, tmp)
        samples += pair
        out.write(" " + "/".join(fmt(f.rate and f.rate / 1e3, 0) if f.ok else "x" for f in pair))
        out.flush()
    out.write(f"  (load {benchlib.loadavg()})\n")
    return samples


def _kept(samples: list[Followed], case: str, tool: str) -> list[Followed]:
    """The runs of one case and tool that count (not the synthetic warm-up round)."""
    return [f for f in samples if f.case == case and f.tool == tool and f.ok
            and (case == "run" or f.rep > 0)]


def _logs_row(case: str, tool: str, fs: list[Followed], bad: int,
              tail_rate: Optional[float], tail_stream: Optional[float],
              rows: list[list[str]]) -> Optional[float]:
    """One follower's row beside tail -f's rates; its throughput / tail -f's."""
    rate = med([f.rate for f in fs])
    ratio = rate / tail_rate if rate and tail_rate else None
    stream = med([f.stream for f in fs])
    rows.append([case, tool, str(fs[0].lines) if fs else "n/a",
                 fmt_k(rate), fmt(ratio, 2), fmt_k(stream),
                 fmt(stream / tail_stream if stream and tail_stream else None, 2),
                 fmt(med([f.cpu for f in fs]), 2),
                 fmt_k(med([f.producer_rate for f in fs])) if case == "synthetic" else "",
                 runs_cell(len(fs), bad)])
    return ratio


def report_logs(samples: list[Followed], out: TextIO, targets: list[list[str]]) -> None:
    out.write("\n3. logs -f beside tail -f of the same console.log (lines/s from go to the "
              "last line read; medians; the synthetic warm-up round left out)\n\n")
    rows = [["case", "tool", "lines", "lines/s", "x tail -f", "stream lines/s", "x tail -f",
             "CPU s", "writer's own lines/s", "runs"]]
    for case in ("synthetic", "run"):
        got = {tool: _kept(samples, case, tool)
               for tool in ("fdl-fabric logs -f", "tail -f", WHATIF_LOGS)}
        tail_rate = med([f.rate for f in got["tail -f"]])
        tail_stream = med([f.stream for f in got["tail -f"]])
        for tool, fs in got.items():
            if not fs and tool == WHATIF_LOGS:
                continue
            bad = sum(1 for f in samples if f.case == case and f.tool == tool and not f.ok)
            ratio = _logs_row(case, tool, fs, bad, tail_rate, tail_stream, rows)
            if tool == "fdl-fabric logs -f" and ratio is not None:
                targets.append([f"logs -f / tail -f throughput, {case}", f"{ratio:.2f}x",
                                ">= 0.9x", "met" if ratio >= 0.9 else "MISSED"])
    out.write(benchlib.table(rows, [False, False] + [True] * 8) + "\n")
    for f in samples:
        if not f.ok:
            out.write(f"  ! {f.case} {f.tool} round {f.rep}: {f.error[:300]}\n")


# -- 4. idle ---------------------------------------------------------------------------------
@dataclass
class Idle:
    tool: str
    rep: int
    ok: bool = False
    error: str = ""
    up_after: Optional[float] = None
    cpu_pct: Optional[float] = None
    slices: list[float] = field(default_factory=list)
    threads: Optional[int] = None


def _sample_cpu(pid: int, s: Idle, window: float) -> None:
    start = benchlib.cpu_seconds(pid) or 0.0
    began = last_t = time.monotonic()
    last = start
    s.threads = benchlib.threads(pid)
    while time.monotonic() - began < window - 1e-3:
        time.sleep(1.0)
        now_cpu, now_t = benchlib.cpu_seconds(pid) or 0.0, time.monotonic()
        s.slices.append(100.0 * (now_cpu - last) / (now_t - last_t))
        last, last_t = now_cpu, now_t
    s.cpu_pct = 100.0 * ((benchlib.cpu_seconds(pid) or 0.0) - start) / (time.monotonic() - began)


def measure_idle(tool: str, argv: list[str], world: int, rep: int, env: dict[str, str],
                 args: argparse.Namespace, lab: Any) -> Idle:
    import idle

    s = Idle(tool, rep)
    t0 = time.monotonic()
    proc = None
    run_id = None
    try:
        if tool == "foreground":
            proc = benchlib.start(argv, env=env, stderr=subprocess.DEVNULL, bufsize=0)
            counter = idle.UpCounter(proc.stdout)
            benchlib.wait_until(lambda: counter.count >= world or proc.poll() is not None,
                                "every up line", args.timeout, 0.05)
            if counter.count < world:
                raise benchlib.BenchError(f"exited {proc.returncode}: {counter.tail[-300:]!r}")
            pid = proc.pid
        else:
            _r, _d, children, error = run_timed([argv], expect_up=0, env=env,
                                                timeout=args.timeout)
            run_id, pid = detached_of(children[0].lines)
            SUPERVISORS.add(run_id, pid)
            console = args.runs / run_id / "console.log"
            benchlib.wait_until(
                lambda: len(idle.UP_LINE.findall(console.read_bytes())) >= world,
                "every up line in console.log", args.timeout, 0.2)
        s.up_after = time.monotonic() - t0
        time.sleep(args.settle)
        _sample_cpu(pid, s, args.window)
        s.threads = max(s.threads or 0, benchlib.threads(pid) or 0)
        s.ok = (proc.poll() is None) if proc is not None else psutil.pid_exists(pid)
        if not s.ok:
            s.error = "the launcher ended during the window"
    except (benchlib.BenchError, OSError) as exc:
        s.error = str(exc)
    finally:
        if proc is not None:
            benchlib.stop(proc, grace=30)
        if run_id is not None:
            SUPERVISORS.finish(run_id, stop=True)
        idle._wait_hosts_quiet(lab)
    return s


def idle_section(args: argparse.Namespace, tmp: Path, env: dict[str, str], lab: Any,
                 out: TextIO) -> list[Idle]:
    import idle

    script = tmp / "rank_idle.py"
    script.write_text(idle.RANK_SCRIPT)
    world = args.hosts * args.per_host
    sleep = args.timeout + args.settle + args.window + 120
    cmd = f"{sys.executable} {script} {sleep:g}"
    cluster = lab.write_cluster([lab.worker(h, nproc=args.per_host)
                                 for h in lab.hosts[:args.hosts]], filename="idle.yml")
    argv = fdl("launch", "--cluster", str(cluster), "--cmd", cmd)
    detached = fdl("launch", "--detach", "--json", "--cluster", str(cluster), "--cmd", cmd)
    samples: list[Idle] = []
    for rep in range(args.idle_repeat):
        for tool in (("foreground", "detached") if rep % 2 == 0 else ("detached", "foreground")):
            out.write(f"idle round {rep + 1}: {args.hosts}x{args.per_host} {tool} "
                      f"(load {benchlib.loadavg()})... ")
            out.flush()
            s = measure_idle(tool, detached if tool == "detached" else argv, world, rep, env,
                             args, lab)
            samples.append(s)
            out.write(f"{fmt(s.cpu_pct, 2)} %\n" if s.ok else f"FAILED: {s.error}\n")
    return samples


def _idle_row(tool: str, samples: list[Idle]) -> tuple[list[str],
                                                         Optional[tuple[float, float]]]:
    """A launcher's idle row, and its median CPU with the standard error of its slices."""
    got = [s for s in samples if s.tool == tool and s.ok]
    slices = [x for s in got for x in s.slices]
    cpu = med([s.cpu_pct for s in got])
    sd = statistics.stdev(slices) if len(slices) > 1 else 0.0
    name = "fdl-fabric launch (foreground)" if tool == "foreground" else "detached supervisor"
    row = [name, fmt(med([s.up_after for s in got]), 1), fmt(cpu, 2),
           fmt(statistics.mean(slices) if slices else None, 2), fmt(sd, 2),
           fmt(max(slices, default=None), 1),
           str(max((s.threads or 0 for s in got), default=0)),
           runs_cell(len(got), sum(1 for s in samples if s.tool == tool and not s.ok))]
    return row, None if cpu is None else (cpu, sd / math.sqrt(max(1, len(slices))))


def report_idle(samples: list[Idle], args: argparse.Namespace, out: TextIO,
                targets: list[list[str]]) -> None:
    out.write(f"\n4. idle CPU at {args.hosts} hosts x {args.per_host} sleeping ranks: the "
              f"launcher process, % of one core over {args.window:g} s (medians of "
              f"{args.idle_repeat} round(s))\n\n")
    rows = [["launcher", "all up s", "CPU %", "1 s slices: mean", "stdev", "max", "threads",
             "runs"]]
    stats: dict[str, tuple[float, float]] = {}
    for tool in ("foreground", "detached"):
        row, stat = _idle_row(tool, samples)
        rows.append(row)
        if stat is not None:
            stats[tool] = stat
    out.write(benchlib.table(rows, [False] + [True] * 7) + "\n")
    if len(stats) == 2:
        (fg, fg_se), (dt, dt_se) = stats["foreground"], stats["detached"]
        noise = max(0.1, 2 * math.hypot(fg_se, dt_se))
        out.write(f"difference {dt - fg:+.2f} % of a core; noise (2 x combined standard "
                  f"error of the slices, at least 0.1 %) {noise:.2f} %\n")
        targets.append([f"idle CPU at {args.hosts}x{args.per_host}: detached - foreground",
                        f"{dt - fg:+.2f} % ({dt:.2f} vs {fg:.2f})", f"within {noise:.2f} %",
                        "met" if abs(dt - fg) <= noise else "MISSED"])
    for s in samples:
        if not s.ok:
            out.write(f"  ! idle {s.tool} round {s.rep + 1}: {s.error[:300]}\n")

