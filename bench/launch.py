#!/usr/bin/env python3
"""Launch-overhead benchmark: `inv launch` beside torchrun, OpenSSH fan-out and parallel-ssh.

Prints medians and ratios (it is a script, not a test: nothing here asserts a timing).

Every tool starts the same trivial rank program, which prints ``up <RANK>`` (one
``os.write``) as its first act and then exits 0.  For each run two times are taken, both
measured from just before the first ``Popen`` of the tool:

* **all running**: when the last of the N ``up`` lines was read from the tool's stdout
  (so it includes the tool's own output forwarding);
* **completion**: when the last process the benchmark started exited;
* **client CPU**: user+system CPU seconds of what the benchmark started, from ``wait4``
  (the launcher process; pssh with the ssh clients it reaped; the sum of the ssh
  clients of a fan-out). The hosts' side (sshd, shells, agents, ranks) is not in it.

Scenarios (``--only``, repeatable):

* ``local``: 4 ranks on this machine: ``inv launch`` (one worker ``localhost, nproc: 4``,
  i.e. one local agent) beside ``torchrun --standalone --nproc-per-node 4``;
* ``remote``: 8 ranks on 4 sshd-lab hosts (``fdl_fabric.testing.SshdLab``, real OpenSSH
  servers on loopback addresses), 2 per host: ``inv launch`` (one agent per host, one
  SSH session each) beside 8 parallel ``ssh`` clients and ``parallel-ssh -P -p 8``;
* ``scale64``: 64 ranks on 8 lab hosts (8 per host), the same three tools
  (64 ``ssh`` clients, ``parallel-ssh -P -p 64``);
* ``scale256``: 256 ranks on 32 lab hosts (8 per host), likewise (``-p 256``);
* every remote scenario also runs ``inv launch --no-preflight`` (``--no-variants`` skips
  it): the same launch without the pre-flight barrier, to show what the barrier costs;
* ``scale``: both scale scenarios.  They are slow on a small machine, so they use
  ``--scale-repeat`` (default 3) instead of ``--repeat``.

Plus reference floors (one rank with no launcher, N ranks started at once with no
launcher and no SSH, one rank over one ssh session, the import-and-parse cost of ``inv
launch --help``), fdl-fabric's phases read from the timestamps of its ``-v`` event lines,
and a table of the issue's targets (fdl-fabric / peer ratios, met or not).

Run ``python3 bench/launch.py`` (``--help`` for options); see bench/README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import selectors
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, TextIO

from benchlib import stop as benchlib_stop
from benchlib import terminate_gracefully, tool_version

ROOT = Path(__file__).resolve().parent.parent

#: The rank program.  ``argv[1]``, if given, is a sleep in seconds after the ``up`` line.
#: One ``os.write`` per line: ranks that share a pipe (torchrun) cannot interleave inside
#: it, even under PYTHONUNBUFFERED=1, where ``print`` writes text and newline separately.
RANK_SCRIPT = """\
import os
import sys
import time

os.write(1, ("up " + os.environ.get("RANK", "?") + "\\n").encode())
if len(sys.argv) > 1 and float(sys.argv[1]) > 0:
    time.sleep(float(sys.argv[1]))
"""

#: An ``up`` line: bare (torchrun, ssh), behind fdl-fabric's ``[host:dev:rN] `` or behind
#: parallel-ssh -P's ``<addr>: ``.
UP_LINE = re.compile(rb"^(?:\[[^\]]*\] |[0-9A-Za-z.:\[\]-]+: )?up (\S+)\s*$")

#: Seconds one run may take before it is stopped and recorded as failed.
RUN_TIMEOUT = 60.0

#: fdl-fabric ``-v`` event lines -> phase milestone; the last matching line counts.
PHASES: tuple[tuple[str, str, Optional[re.Pattern[bytes]]], ...] = (
    ("planned", "config loaded, hosts connected, plan built (the `run ...` line)",
     re.compile(rb"^cluster launcher: run \S+: \d+ rank")),
    ("connected", "last host connected", re.compile(rb"^cluster launcher: connected to ")),
    ("started", "last rank reported spawned by its host's agent",
     re.compile(rb"^cluster launcher: started ")),
    ("all up", "last `up` line (all ranks running)", None),
    ("exits seen", "supervisor saw the last rank exit",
     re.compile(rb"^cluster launcher: rank \d+ of \S+ exited")),
    ("verdict", "verdict line printed", re.compile(rb"^cluster launcher: run (completed|failed)")),
    ("exit", "launcher process exited", None),
)


# --------------------------------------------------------------------------------------
# Running processes and timing them
# --------------------------------------------------------------------------------------

#: Every process this script started and has not reaped yet, by pid (= its pgid).
_LIVE: dict[int, subprocess.Popen[bytes]] = {}


def _stop(proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    """TERM the process group we created for ``proc``, KILL after ``grace``; reap it
    (`benchlib.stop`), then close its pipes."""
    benchlib_stop(proc, grace)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
    _LIVE.pop(proc.pid, None)


def stop_all() -> None:
    for proc in list(_LIVE.values()):
        _stop(proc)


@dataclass
class Sample:
    """One run of one tool in one scenario; times in seconds from just before Popen."""

    scenario: str
    tool: str
    rep: int
    warmup: bool
    running: Optional[float] = None
    done: Optional[float] = None
    ok: bool = False
    returncodes: list[Optional[int]] = field(default_factory=list)
    up_lines: int = 0
    error: str = ""
    milestones: dict[str, float] = field(default_factory=dict)
    #: user+sys CPU seconds of the processes the benchmark started (pssh: with its ssh
    #: clients; fdl-fabric: the launcher, plus a local agent if any), None if unknown.
    cpu: Optional[float] = None


@dataclass
class _Child:
    proc: subprocess.Popen[bytes]
    exited: Optional[float] = None
    cpu: Optional[float] = None  # user+sys s of the process and the children it reaped
    partial: dict[str, bytes] = field(default_factory=lambda: {"out": b"", "err": b""})
    lines: list[tuple[float, str, bytes]] = field(default_factory=list)


def _pidfd(pid: int) -> Optional[int]:
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        fd: int = opener(pid)
        return fd
    except OSError:
        return None


def run_timed(
    argvs: Sequence[Sequence[str]],
    *,
    expect_up: int,
    env: Optional[dict[str, str]] = None,
    cwd: Optional[str] = None,
    timeout: float = RUN_TIMEOUT,
) -> tuple[Optional[float], Optional[float], list[_Child], str]:
    """Start ``argvs`` at once and time them to the ``expect_up``-th up line and last exit.

    One thread, one selector over every stdout/stderr pipe and (Linux >= 5.3) a pidfd per
    process, so line and exit timestamps are taken the moment the kernel reports them,
    with no reader threads competing for the GIL on a small machine.  Returns (running,
    done, children, error); running is None when fewer than ``expect_up`` lines came.
    """
    sel = selectors.DefaultSelector()
    children: list[_Child] = []
    opened: list[int] = []
    error = ""
    t0 = time.perf_counter()
    try:
        for argv in argvs:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
            _LIVE[proc.pid] = proc
            child = _Child(proc)
            children.append(child)
            assert proc.stdout is not None and proc.stderr is not None
            sel.register(proc.stdout, selectors.EVENT_READ, (child, "out"))
            sel.register(proc.stderr, selectors.EVENT_READ, (child, "err"))
            pidfd = _pidfd(proc.pid)
            if pidfd is not None:
                opened.append(pidfd)
                sel.register(pidfd, selectors.EVENT_READ, (child, "exit"))

        deadline = t0 + timeout
        eof_grace: Optional[float] = None  # pipes held open by stray grandchildren
        while sel.get_map():
            now = time.perf_counter()
            if now > deadline:
                error = f"timed out after {timeout:.0f} s"
                break
            if eof_grace is not None and now > eof_grace:
                break
            polling = any(c.exited is None for c in children) and not opened
            wait = min(deadline, eof_grace or deadline) - now
            for key, _ in sel.select(0.005 if polling else max(0.0, wait)):
                child, what = key.data
                now = time.perf_counter() - t0
                if what == "exit":
                    sel.unregister(key.fileobj)
                    try:  # wait4, not Popen.wait: it also says how much CPU the tool used
                        _, status, usage = os.wait4(child.proc.pid, 0)
                        child.proc.returncode = os.waitstatus_to_exitcode(status)
                        child.cpu = usage.ru_utime + usage.ru_stime
                    except ChildProcessError:
                        child.proc.wait()
                    child.exited = now
                    continue
                data = os.read(key.fd, 65536)
                if not data:
                    sel.unregister(key.fileobj)
                    if child.partial[what]:
                        child.lines.append((now, what, child.partial[what]))
                        child.partial[what] = b""
                    continue
                *complete, child.partial[what] = (child.partial[what] + data).split(b"\n")
                child.lines.extend((now, what, line) for line in complete)
            if not opened:  # no pidfd support: poll for exits instead
                for child in children:
                    if child.exited is None and child.proc.poll() is not None:
                        child.exited = time.perf_counter() - t0
            if eof_grace is None and all(c.exited is not None for c in children):
                eof_grace = time.perf_counter() + 2.0
    finally:
        sel.close()
        for fd in opened:
            os.close(fd)
        for child in children:
            if child.proc.poll() is None:
                error = error or "still running"
            _stop(child.proc)
            if child.exited is None:
                child.exited = time.perf_counter() - t0

    ups = sorted(t for c in children for t, what, line in c.lines
                 if what == "out" and UP_LINE.match(line))
    running = ups[expect_up - 1] if 0 < expect_up <= len(ups) else None
    done = max(c.exited for c in children if c.exited is not None) if children else None
    return running, done, children, error


def measure(
    scenario: str,
    tool: str,
    rep: int,
    argvs: Sequence[Sequence[str]],
    *,
    expect_up: int,
    env: Optional[dict[str, str]] = None,
    cwd: Optional[str] = None,
    phases: bool = False,
    timeout: float = RUN_TIMEOUT,
) -> Sample:
    running, done, children, error = run_timed(argvs, expect_up=expect_up, env=env, cwd=cwd,
                                               timeout=timeout)
    ups = sum(1 for c in children for _, what, line in c.lines
              if what == "out" and UP_LINE.match(line))
    codes = [c.proc.returncode for c in children]
    if not error and any(code != 0 for code in codes):
        error = f"exit status {codes}"
    if not error and ups < expect_up:
        error = f"only {ups} of {expect_up} `up` lines"
    sample = Sample(scenario, tool, rep, warmup=rep == 0, running=running, done=done,
                    ok=not error, returncodes=codes, up_lines=ups, error=error)
    if children and all(c.cpu is not None for c in children):
        sample.cpu = sum(c.cpu or 0.0 for c in children)
    if error:
        tail = [line.decode(errors="replace") for c in children for _, _, line in c.lines][-12:]
        sample.error += "\n    " + "\n    ".join(tail)
    if phases and children:
        lines = children[0].lines
        for name, _, pattern in PHASES:
            if pattern is not None:
                hits = [t for t, what, line in lines if what == "err" and pattern.match(line)]
                if hits:
                    sample.milestones[name] = hits[-1]
        if running is not None:
            sample.milestones["all up"] = running
        if done is not None:
            sample.milestones["exit"] = done
    return sample


# --------------------------------------------------------------------------------------
# The tools
# --------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def inv_launch_argv(cluster: Path, command: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "invoke", "--search-root", str(ROOT), "launch",
            *extra, "--cluster", str(cluster), "--cmd", command]


def torch_installed() -> bool:
    """True if torch is importable by this interpreter (found, not imported: 1-2 s)."""
    return importlib.util.find_spec("torch") is not None


def torchrun_argv() -> list[str]:
    """torchrun of this interpreter; the console script itself, not a pyenv shim."""
    beside = Path(sys.executable).parent / "torchrun"
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside)]
    return [sys.executable, "-m", "torch.distributed.run"]


def pssh_dedups(tmp: Path) -> bool:
    """Does parallel-ssh collapse identical host-file lines?  Asked without a network:
    pssh's own parser reads a file listing one entry twice."""
    hosts = tmp / "pssh_probe_hosts"
    hosts.write_text("u@127.0.0.1:1\nu@127.0.0.1:1\n")
    code = ("import sys; sys.path.insert(0, '/usr/lib/python3/dist-packages');"
            "from psshlib import psshutil;"
            f"print(len(psshutil.read_host_files([{str(hosts)!r}], None)))")
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=20)
        return out.stdout.strip() != "2"
    except (OSError, subprocess.SubprocessError):
        return False


def machine_notes(pssh: Optional[str], have_torch: bool) -> dict[str, Any]:
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count() or 0
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    commit = tool_version(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", ".",
                            ":(exclude)bench"], capture_output=True, text=True).stdout.strip()
    return {
        "nproc": affinity,
        "cpu": platform.processor() or platform.machine(),
        "kernel": platform.release(),
        "python": f"{platform.python_version()} ({sys.executable})",
        "openssh": tool_version(["ssh", "-V"]),
        "parallel-ssh": tool_version([pssh, "--version"]) if pssh else "not installed",
        "torch": version("torch") if have_torch else "not installed",
        "fabric / invoke / paramiko": " / ".join(
            version(d) for d in ("fabric", "invoke", "paramiko")),
        "fdl_fabric commit": commit + (" (+ uncommitted changes)" if dirty else ""),
        "shell": os.environ.get("SHELL", "?"),
        "python env": " ".join(f"{k}={os.environ[k]}" for k in
                               ("PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED") if k in os.environ)
        or "-",
    }


# --------------------------------------------------------------------------------------
# Statistics and printing
# --------------------------------------------------------------------------------------


def _median(values: Sequence[Optional[float]]) -> Optional[float]:
    clean = [v for v in values if v is not None]
    return statistics.median(clean) if clean else None


def _ms(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value * 1000:.0f}"


def _ratio(value: Optional[float], base: Optional[float]) -> str:
    return "n/a" if value is None or not base else f"{value / base:.2f}"


def _cpu(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _spread(values: Sequence[Optional[float]]) -> str:
    clean = [v for v in values if v is not None]
    if not clean:
        return "n/a"
    return f"{min(clean) * 1000:.0f}-{max(clean) * 1000:.0f}"


def _table(rows: list[list[str]], out: TextIO, right: Sequence[bool]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for n, row in enumerate(rows):
        cells = [c.rjust(w) if right[i] else c.ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths))]
        out.write("  ".join(cells).rstrip() + "\n")
        if n == 0:
            out.write("  ".join("-" * w for w in widths) + "\n")


@dataclass
class Row:
    scenario: str
    tool: str
    note: str = ""


@dataclass(frozen=True)
class Target:
    """One of the issue's targets: fdl-fabric's median against a peer's, or a bound in s.

    ``measure`` is ``running`` or ``done``; ``peer`` None means ``limit`` is seconds.
    """

    scenario: str
    measure: str
    peer: Optional[str]
    limit: float
    #: Which fdl-fabric entry point is measured.
    tool: str = "fdl-fabric (inv launch)"


FDL_TOOL = "fdl-fabric (inv launch)"
RUN_TOOL = "fdl-fabric run"


def print_targets(targets: Sequence[Target], samples: Sequence[Sample], out: TextIO) -> None:
    """fdl-fabric / peer, side by side, from the medians of this very run."""

    def median_of(scenario: str, tool: str, measure: str) -> Optional[float]:
        got = [getattr(s, measure) for s in samples
               if s.scenario == scenario and s.tool == tool and not s.warmup and s.ok]
        return _median(got)

    out.write("\nTargets (fdl-fabric / peer from the medians above; same run, round-robin)\n\n")
    rows = [["scenario", "tool", "measure", "fdl-fabric", "peer", "peer figure", "ratio",
             "target", "met"]]
    for t in targets:
        mine = median_of(t.scenario, t.tool, t.measure)
        what = "all running" if t.measure == "running" else "completion"
        if t.peer is None:
            met = "n/a" if mine is None else ("yes" if mine <= t.limit else "NO")
            rows.append([t.scenario, t.tool, what, _ms(mine), "-", "-", "-",
                         f"<= {t.limit * 1000:.0f} ms", met])
            continue
        theirs = median_of(t.scenario, t.peer, t.measure)
        ratio = None if mine is None or not theirs else mine / theirs
        met = "n/a" if ratio is None else ("yes" if ratio <= t.limit else "NO")
        rows.append([t.scenario, t.tool, what, _ms(mine), t.peer, _ms(theirs),
                     "n/a" if ratio is None else f"{ratio:.2f}", f"<= {t.limit:g}x", met])
    _table(rows, out, [False, False, False, True, False, True, True, True, False])


def print_report(
    rows: list[Row],
    samples: list[Sample],
    floors: list[Sample],
    notes: dict[str, Any],
    remarks: list[str],
    out: TextIO,
    targets: Sequence[Target] = (),
) -> None:
    def kept(scenario: str, tool: str) -> list[Sample]:
        return [s for s in samples
                if s.scenario == scenario and s.tool == tool and not s.warmup and s.ok]

    def failed(scenario: str, tool: str) -> int:
        return sum(1 for s in samples
                   if s.scenario == scenario and s.tool == tool and not s.warmup and not s.ok)

    out.write("\nLaunch overhead: medians in ms from just before Popen (warm-up run dropped)\n\n")
    table = [["scenario", "tool", "all running", "completion", "x fdl running",
              "x fdl completion", "completion min-max", "client CPU s", "runs"]]
    base: dict[str, tuple[Optional[float], Optional[float]]] = {}
    for row in rows:
        got = kept(row.scenario, row.tool)
        running = _median([s.running for s in got])
        done = _median([s.done for s in got])
        if row.tool == FDL_TOOL:
            base[row.scenario] = (running, done)
        if row.note:  # a tool that was not run, or whose all-running is not measured
            running = None if "n/a" in row.note or "skipped" in row.note else running
        b_running, b_done = base.get(row.scenario, (None, None))
        fails = failed(row.scenario, row.tool)
        runs = f"{len(got)}" + (f" ({fails} failed)" if fails else "")
        if "skipped" in row.note:
            table.append([row.scenario, row.tool, "-", "-", "-", "-", "-", "-", "skipped"])
            continue
        table.append([row.scenario, row.tool, _ms(running), _ms(done),
                      _ratio(running, b_running), _ratio(done, b_done),
                      _spread([s.done for s in got]), _cpu(_median([s.cpu for s in got])),
                      runs])
    _table(table, out, [False, False, True, True, True, True, True, True, False])

    notes_rows = [r for r in rows if r.note]
    if notes_rows:
        out.write("\n")
        for r in notes_rows:
            out.write(f"  {r.tool}: {r.note}\n")

    if floors:
        out.write("\nReference floors (medians, ms)\n\n")
        ftable = [["what", "median", "min-max", "runs"]]
        for name in dict.fromkeys(s.tool for s in floors):
            got = [s for s in floors if s.tool == name and not s.warmup and s.ok]
            ftable.append([name, _ms(_median([s.done for s in got])),
                           _spread([s.done for s in got]), str(len(got))])
        _table(ftable, out, [False, True, True, False])

    phased = [s for s in samples if s.milestones and not s.warmup and s.ok]
    if phased:
        out.write("\nfdl-fabric phases (separate runs with -v; median ms since Popen of the "
                  "last line of each kind)\n\n")
        scenarios = list(dict.fromkeys(s.scenario for s in phased))
        ptable = [["milestone", *scenarios, "meaning"]]
        for name, meaning, _ in PHASES:
            cells = []
            for sc in scenarios:
                vals = [s.milestones.get(name) for s in phased if s.scenario == sc]
                cells.append(_ms(_median(vals)))
            if all(c == "n/a" for c in cells):
                continue
            ptable.append([name, *cells, meaning])
        _table(ptable, out, [False, *([True] * len(scenarios)), False])

    if targets:
        print_targets(targets, samples, out)

    out.write("\nMachine\n\n")
    for key, value in notes.items():
        out.write(f"  {key}: {value}\n")
    for remark in remarks:
        out.write(f"  note: {remark}\n")

    bad = [s for s in [*samples, *floors] if not s.ok]
    if bad:
        out.write("\nFailed runs (excluded from the medians)\n\n")
        for s in bad:
            out.write(f"  {s.scenario} / {s.tool} run {s.rep}: {s.error}\n")


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


#: ``--only`` values; ``scale`` means both scale scenarios.
SCENARIOS = ("local", "remote", "scale64", "scale256")


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5,
                    help="measured runs per tool, after one discarded warm-up run (default 5)")
    ap.add_argument("--scale-repeat", type=int, default=3,
                    help="measured runs per tool in the scale scenarios (default 3)")
    ap.add_argument("--only", action="append", choices=(*SCENARIOS, "scale"),
                    help="run this scenario only (repeatable; default: local and remote)")
    ap.add_argument("--sleep", type=float, default=0.0,
                    help="seconds each rank sleeps after its `up` line (default 0)")
    ap.add_argument("--no-torchrun", action="store_true", help="skip the torchrun baseline")
    ap.add_argument("--no-phases", action="store_true",
                    help="skip the extra `inv launch -v` runs that time fdl-fabric's phases")
    ap.add_argument("--no-floors", action="store_true", help="skip the reference floors")
    ap.add_argument("--no-variants", action="store_true",
                    help="skip the `inv launch --no-preflight` rows of the remote scenarios")
    ap.add_argument("--no-fanout", action="store_true",
                    help="skip the plain OpenSSH fan-out in the scale scenarios")
    ap.add_argument("--json", metavar="FILE",
                    help="also write raw samples as JSON to FILE ('-': JSON on stdout, "
                         "the report on stderr)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args(argv)
    if args.repeat < 1 or args.scale_repeat < 1:
        ap.error("--repeat and --scale-repeat must be at least 1")
    chosen = set(args.only or ("local", "remote"))
    if "scale" in chosen:
        chosen |= {"scale64", "scale256"}
    args.scenarios = [s for s in SCENARIOS if s in chosen]
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    report = sys.stderr if args.json == "-" else sys.stdout
    with terminate_gracefully():
        tmp = Path(tempfile.mkdtemp(prefix="fdl-bench-"))
        try:
            return _bench(args, tmp, report)
        finally:
            stop_all()
            if args.keep:
                report.write(f"\nkept {tmp}\n")
            else:
                shutil.rmtree(tmp, ignore_errors=True)


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def _progress(out: TextIO, text: str) -> None:
    out.write(text)
    out.flush()


@dataclass
class Job:
    """One tool in one scenario, run once per round for ``reps`` measured rounds."""

    scenario: str
    tool: str
    argvs: list[list[str]]
    expect_up: int
    phases: bool = False
    reps: int = 5
    timeout: float = RUN_TIMEOUT


#: scenario key -> (label, hosts, ranks per host, run timeout in s)
REMOTE_SHAPES = {
    "remote": ("remote 8 ranks / 4 hosts", 4, 2, RUN_TIMEOUT),
    "scale64": ("scale 64 ranks / 8 hosts", 8, 8, 120.0),
    "scale256": ("scale 256 ranks / 32 hosts", 32, 8, 300.0),
}


def pssh_argv(pssh: str, lab: Any, hosts_file: Path, sessions: int, command: str) -> list[str]:
    """parallel-ssh with one session per line of ``hosts_file``, all at once, streaming.

    ``-P`` prints each line as it arrives (``<addr>: up ?``), so pssh gets an all-running
    time too; ``-p`` is the number of sessions, so none waits for a slot.
    """
    extra = (f"-F /dev/null -i {lab.identity_file} -o IdentitiesOnly=yes "
             f"-o UserKnownHostsFile={lab.known_hosts} "
             "-o StrictHostKeyChecking=no -o BatchMode=yes -o LogLevel=ERROR")
    return [pssh, "-P", "-p", str(sessions), "-t", "300", "-h", str(hosts_file),
            "-x", extra, command]


def _bench(args: argparse.Namespace, tmp: Path, report: TextIO) -> int:
    script = tmp / "rank.py"
    script.write_text(RANK_SCRIPT)
    py = sys.executable
    rank_words = [py, str(script)] + ([f"{args.sleep:g}"] if args.sleep > 0 else [])
    rank_cmd = " ".join(shlex.quote(w) for w in rank_words)
    env = dict(os.environ)
    pssh = shutil.which("parallel-ssh") or shutil.which("pssh")
    have_torch = torch_installed() and not args.no_torchrun
    remarks: list[str] = []

    rows: list[Row] = []
    jobs: list[Job] = []  # one list, run round-robin
    floor_jobs: list[tuple[str, list[list[str]], int]] = []  # (what, argvs, expect_up)
    targets: list[Target] = []

    lab = None
    try:
        if "local" in args.scenarios:
            scen_local = "local 4 ranks"
            cluster = tmp / "local.yml"
            cluster.write_text(
                "controller:\n  host: 127.0.0.1\n"
                f"  port: {free_port()}\n"
                "kill_grace: 2\n"
                "workers:\n"
                f"  - host: localhost\n    nproc: 4\n    path: {json.dumps(str(tmp))}\n"
            )
            rows.append(Row(scen_local, FDL_TOOL))
            jobs.append(Job(scen_local, FDL_TOOL, [inv_launch_argv(cluster, rank_cmd)], 4,
                            reps=args.repeat))
            # The torchrun drop-in: torchrun's command line, the same script (issue 12).
            rows.append(Row(scen_local, RUN_TOOL))
            jobs.append(Job(scen_local, RUN_TOOL,
                            [[py, "-m", "fdl_fabric", "run", "--nproc-per-node", "4",
                              *rank_words[1:]]], 4, reps=args.repeat))
            if have_torch:
                rows.append(Row(scen_local, "torchrun --standalone"))
                jobs.append(Job(scen_local, "torchrun --standalone",
                                [[*torchrun_argv(), "--standalone", "--nproc-per-node", "4",
                                  *rank_words[1:]]], 4, reps=args.repeat))
                targets.append(Target(scen_local, "done", "torchrun --standalone", 0.3,
                                      tool=RUN_TOOL))
            else:
                why = ("--no-torchrun" if args.no_torchrun else "torch not installed")
                rows.append(Row(scen_local, "torchrun --standalone", f"skipped ({why})"))
                _progress(report, f"torchrun: skipped ({why})\n")
            if not args.no_phases:
                jobs.append(Job(scen_local, "fdl-fabric -v (phases)",
                                [inv_launch_argv(cluster, rank_cmd, "-v")], 4, True,
                                reps=args.repeat))
            floor_jobs.append(("1 rank, no launcher (<python> rank.py)", [rank_words], 1))
            floor_jobs.append(("fdl-fabric import + parse (inv launch --help)",
                               [[py, "-m", "invoke", "--search-root", str(ROOT), "launch",
                                 "--help"]], 0))
            bashrc = Path.home() / ".bashrc"
            if bashrc.is_file() and shutil.which("bash"):
                floor_jobs.append(("bash -c true", [["bash", "-c", "true"]], 0))
                floor_jobs.append(("bash -c '. ~/.bashrc' (what each SSH session sources)",
                                   [["bash", "-c", f". {shlex.quote(str(bashrc))}"]], 0))

        remote = [k for k in args.scenarios if k in REMOTE_SHAPES]
        if remote:
            from fdl_fabric.testing import SshdLab, sshd_available

            if not sshd_available():
                remarks.append("remote scenarios skipped: sshd/ssh-keygen not found "
                               "(install openssh-server)")
                remote = []
        if remote:
            n_hosts = max(REMOTE_SHAPES[k][1] for k in remote)
            _progress(report, f"starting {n_hosts} sshd lab hosts... ")
            # MaxStartups: 256 clients at once are 8 unauthenticated connections per
            # listener, under the default 10:30:100, but give every tool headroom.
            lab = SshdLab(tmp / "lab", n_hosts,
                          extra_sshd_config=["MaxStartups 100:30:300"]).start()
            _progress(report, "ok\n")
            # Pre-seed known_hosts so no run pays (or races on) first contact.
            Path(lab.known_hosts).write_text(
                "".join(h.known_hosts_line() + "\n" for h in lab.hosts))
            if pssh:
                if pssh_dedups(tmp):
                    remarks.append("parallel-ssh collapses identical host lines here: its "
                                   "figures cover one session per host only")
                else:
                    remarks.append("parallel-ssh keeps identical host-file lines (checked "
                                   "with its own parser): one invocation, each host listed "
                                   "once per rank")
        for key in remote:
            label, n_hosts, per_host, timeout = REMOTE_SHAPES[key]
            hosts = lab.hosts[:n_hosts]
            world = n_hosts * per_host
            reps = args.repeat if key == "remote" else args.scale_repeat
            cluster = lab.write_cluster([lab.worker(h, nproc=per_host) for h in hosts],
                                        filename=f"{key}.yml")
            rows.append(Row(label, FDL_TOOL))
            jobs.append(Job(label, FDL_TOOL, [inv_launch_argv(cluster, rank_cmd)], world,
                            reps=reps, timeout=timeout))
            if not args.no_variants:
                nopf = "fdl-fabric --no-preflight"
                rows.append(Row(label, nopf))
                jobs.append(Job(label, nopf,
                                [inv_launch_argv(cluster, rank_cmd, "--no-preflight")], world,
                                reps=reps, timeout=timeout))
            fanout = f"OpenSSH fan-out ({world} x ssh)"
            if key == "remote" or not args.no_fanout:
                rows.append(Row(label, fanout))
                jobs.append(Job(label, fanout,
                                [lab.ssh_argv(hosts[r // per_host], f"RANK={r} {rank_cmd}")
                                 for r in range(world)], world, reps=reps, timeout=timeout))
            peer = f"parallel-ssh -P -p {world}"
            if pssh:
                hosts_file = tmp / f"pssh_hosts_{key}"
                hosts_file.write_text("".join(f"{lab.user}@{h.addr}:{h.port}\n"
                                              for h in hosts for _ in range(per_host)))
                rows.append(Row(label, peer, "ranks print `up ?`: pssh cannot pass RANK per "
                                "session (PSSH_NODENUM needs SendEnv)"))
                jobs.append(Job(label, peer, [pssh_argv(pssh, lab, hosts_file, world, rank_cmd)],
                                world, reps=reps, timeout=timeout))
            else:
                rows.append(Row(label, peer, "skipped (parallel-ssh not installed)"))
            if not args.no_phases:
                jobs.append(Job(label, "fdl-fabric -v (phases)",
                                [inv_launch_argv(cluster, rank_cmd, "-v")], world, True,
                                reps=reps, timeout=timeout))
            if key == "remote":
                targets.append(Target(label, "done", peer, 0.8))
                targets.append(Target(label, "running", fanout, 1.0))
                floor_jobs.append(("1 rank over 1 ssh session (ssh host <python> rank.py)",
                                   [lab.ssh_argv(hosts[0], f"RANK=0 {rank_cmd}")], 1))
                floor_jobs.append(("1 ssh session, nothing (ssh host true)",
                                   [lab.ssh_argv(hosts[0], "true")], 0))
                floor_jobs.append(("1 ssh session, the agent's python (/usr/bin/python3 -I -S "
                                   "-c '')", [lab.ssh_argv(hosts[0], "/usr/bin/python3 -I -S "
                                                           "-c ''")], 0))
            else:
                targets.append(Target(label, "done", peer, 0.3 if world == 64 else 0.25))
                if not args.no_fanout:
                    targets.append(Target(label, "running", fanout, 1.0))
                if world == 256:
                    targets.append(Target(label, "running", None, 3.0))
                floor_jobs.append((f"{world} ranks at once, no launcher, no SSH "
                                   f"({world} x <python> rank.py)",
                                   [list(rank_words) for _ in range(world)], world))

        samples: list[Sample] = []
        floors: list[Sample] = []
        load_before = _loadavg()
        total = max([j.reps for j in jobs], default=args.repeat) + 1
        for rep in range(total):
            _progress(report, f"run {rep + 1}/{total}{' (warm-up)' if rep == 0 else ''}:")
            for job in jobs:
                if rep > job.reps:
                    continue
                s = measure(job.scenario, job.tool, rep, job.argvs, expect_up=job.expect_up,
                            env=env, cwd=str(ROOT), phases=job.phases, timeout=job.timeout)
                samples.append(s)
                _progress(report, " ." if s.ok else " x")
            if not args.no_floors and rep <= args.repeat:
                for name, argvs, ups in floor_jobs:
                    s = measure("floor", name, rep, argvs, expect_up=ups, env=env,
                                cwd=str(ROOT))
                    floors.append(s)
                    _progress(report, " ." if s.ok else " x")
            _progress(report, f"  (load {_loadavg()})\n")
    finally:
        stop_all()
        if lab is not None:
            lab.stop()

    notes = machine_notes(pssh, torch_installed())
    notes["load average (1/5/15 min) before / after"] = f"{load_before} / {_loadavg()}"
    notes["rank command"] = rank_cmd
    print_report(rows, samples, floors, notes, remarks, report, targets)
    if args.json:
        doc = {
            "machine": notes,
            "repeat": args.repeat,
            "scale_repeat": args.scale_repeat,
            "remarks": remarks,
            "samples": [asdict(s) for s in samples],
            "floors": [asdict(s) for s in floors],
        }
        text = json.dumps(doc, indent=2) + "\n"
        if args.json == "-":
            sys.stdout.write(text)
        else:
            Path(args.json).write_text(text)
            report.write(f"\nraw samples: {args.json}\n")
    return 0 if all(s.ok for s in samples if not s.warmup) else 1


if __name__ == "__main__":
    sys.exit(main())
