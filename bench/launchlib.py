"""launch.py's machinery: the rank program, `run_timed` (a set of processes timed to
their ``up`` lines and exits by one selector), one measured run (`measure`), the tools'
command lines and the machine notes. detach.py and detach_follow.py use `run_timed` too.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import selectors
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TextIO

import benchlib

ROOT = benchlib.ROOT


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


def _stop(proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    """TERM the process group we created for ``proc``, KILL after ``grace``; reap it
    (`benchlib.stop`), then close its pipes."""
    benchlib.stop(proc, grace)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


stop_all = benchlib.stop_all


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
class Child:
    """One process of a timed run: its lines (time, "out"/"err", bytes) and its exit."""

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


class _TimedRun:
    """The processes of one timed run, their pipes and (pidfds) exits watched by one
    selector; times in seconds from ``t0``."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.sel = selectors.DefaultSelector()
        self.children: list[Child] = []
        self.opened: list[int] = []

    def spawn(self, argv: Sequence[str], env: Optional[dict[str, str]],
              cwd: Optional[str]) -> None:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env, cwd=cwd,
                                start_new_session=True)
        benchlib.adopt(proc)
        child = Child(proc)
        self.children.append(child)
        assert proc.stdout is not None and proc.stderr is not None
        self.sel.register(proc.stdout, selectors.EVENT_READ, (child, "out"))
        self.sel.register(proc.stderr, selectors.EVENT_READ, (child, "err"))
        pidfd = _pidfd(proc.pid)
        if pidfd is not None:
            self.opened.append(pidfd)
            self.sel.register(pidfd, selectors.EVENT_READ, (child, "exit"))

    def _exit(self, key: selectors.SelectorKey, child: Child, now: float) -> None:
        self.sel.unregister(key.fileobj)
        try:  # wait4, not Popen.wait: it also says how much CPU the tool used
            _, status, usage = os.wait4(child.proc.pid, 0)
            child.proc.returncode = os.waitstatus_to_exitcode(status)
            child.cpu = usage.ru_utime + usage.ru_stime
        except ChildProcessError:
            child.proc.wait()
        child.exited = now

    def _read(self, key: selectors.SelectorKey, child: Child, what: str, now: float) -> None:
        data = os.read(key.fd, 65536)
        if not data:
            self.sel.unregister(key.fileobj)
            if child.partial[what]:
                child.lines.append((now, what, child.partial[what]))
                child.partial[what] = b""
            return
        *complete, child.partial[what] = (child.partial[what] + data).split(b"\n")
        child.lines.extend((now, what, line) for line in complete)

    def _step(self, wait: float) -> None:
        polling = any(c.exited is None for c in self.children) and not self.opened
        for key, _ in self.sel.select(0.005 if polling else max(0.0, wait)):
            child, what = key.data
            now = time.perf_counter() - self.t0
            if what == "exit":
                self._exit(key, child, now)
            else:
                self._read(key, child, what, now)
        if not self.opened:  # no pidfd support: poll for exits instead
            for child in self.children:
                if child.exited is None and child.proc.poll() is not None:
                    child.exited = time.perf_counter() - self.t0

    def follow(self, timeout: float) -> str:
        """Until every pipe is closed (or 2 s after the last exit: pipes held open by
        stray grandchildren); "timed out ..." after ``timeout`` s, else ""."""
        deadline = self.t0 + timeout
        eof_grace: Optional[float] = None
        while self.sel.get_map():
            now = time.perf_counter()
            if now > deadline:
                return f"timed out after {timeout:.0f} s"
            if eof_grace is not None and now > eof_grace:
                break
            self._step(min(deadline, eof_grace or deadline) - now)
            if eof_grace is None and all(c.exited is not None for c in self.children):
                eof_grace = time.perf_counter() + 2.0
        return ""

    def close(self, error: str) -> str:
        """Stop what still runs (then ``error`` says "still running" if it was empty)."""
        self.sel.close()
        for fd in self.opened:
            os.close(fd)
        for child in self.children:
            if child.proc.poll() is None:
                error = error or "still running"
            _stop(child.proc)
            if child.exited is None:
                child.exited = time.perf_counter() - self.t0
        return error


def run_timed(
    argvs: Sequence[Sequence[str]],
    *,
    expect_up: int,
    env: Optional[dict[str, str]] = None,
    cwd: Optional[str] = None,
    timeout: float = RUN_TIMEOUT,
) -> tuple[Optional[float], Optional[float], list[Child], str]:
    """Start ``argvs`` at once and time them to the ``expect_up``-th up line and last exit.

    One thread, one selector over every stdout/stderr pipe and (Linux >= 5.3) a pidfd per
    process, so line and exit timestamps are taken the moment the kernel reports them,
    with no reader threads competing for the GIL on a small machine.  Returns (running,
    done, children, error); running is None when fewer than ``expect_up`` lines came.
    """
    run = _TimedRun(time.perf_counter())
    error = ""
    try:
        for argv in argvs:
            run.spawn(argv, env, cwd)
        error = run.follow(timeout)
    finally:
        error = run.close(error)
    children = run.children
    ups = sorted(t for c in children for t, what, line in c.lines
                 if what == "out" and UP_LINE.match(line))
    running = ups[expect_up - 1] if 0 < expect_up <= len(ups) else None
    done = max(c.exited for c in children if c.exited is not None) if children else None
    return running, done, children, error


def _milestones(lines: list[tuple[float, str, bytes]], running: Optional[float],
                done: Optional[float]) -> dict[str, float]:
    """The phases of a ``-v`` launch: the last line of each kind, all up, the exit."""
    got: dict[str, float] = {}
    for name, _, pattern in PHASES:
        if pattern is not None:
            hits = [t for t, what, line in lines if what == "err" and pattern.match(line)]
            if hits:
                got[name] = hits[-1]
    if running is not None:
        got["all up"] = running
    if done is not None:
        got["exit"] = done
    return got


def _judge(children: list[Child], expect_up: int,
           error: str) -> tuple[int, list[Optional[int]], str]:
    """The ``up`` lines counted, the exit statuses, and what went wrong ("" if nothing)."""
    ups = sum(1 for c in children for _, what, line in c.lines
              if what == "out" and UP_LINE.match(line))
    codes = [c.proc.returncode for c in children]
    if not error and any(code != 0 for code in codes):
        error = f"exit status {codes}"
    if not error and ups < expect_up:
        error = f"only {ups} of {expect_up} `up` lines"
    return ups, codes, error


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
    ups, codes, error = _judge(children, expect_up, error)
    sample = Sample(scenario, tool, rep, warmup=rep == 0, running=running, done=done,
                    ok=not error, returncodes=codes, up_lines=ups, error=error)
    if children and all(c.cpu is not None for c in children):
        sample.cpu = sum(c.cpu or 0.0 for c in children)
    if error:
        tail = [line.decode(errors="replace") for c in children for _, _, line in c.lines][-12:]
        sample.error += "\n    " + "\n    ".join(tail)
    if phases and children:
        sample.milestones = _milestones(children[0].lines, running, done)
    return sample


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


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
    commit, dirty = benchlib.checkout_commit()
    return {
        "nproc": affinity,
        "cpu": platform.processor() or platform.machine(),
        "kernel": platform.release(),
        "python": f"{platform.python_version()} ({sys.executable})",
        "openssh": benchlib.tool_version(["ssh", "-V"]),
        "parallel-ssh": benchlib.tool_version([pssh, "--version"]) if pssh else "not installed",
        "torch": benchlib.dist_version("torch") if have_torch else "not installed",
        "fabric / invoke / paramiko": " / ".join(
            benchlib.dist_version(d) for d in ("fabric", "invoke", "paramiko")),
        "fdl_fabric commit": commit + (" (+ uncommitted changes)" if dirty else ""),
        "shell": os.environ.get("SHELL", "?"),
        "python env": " ".join(f"{k}={os.environ[k]}" for k in
                               ("PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED") if k in os.environ)
        or "-",
    }


# -- the report -----------------------------------------------------------------------------
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


def _ms(value: Optional[float]) -> str:
    return benchlib.fmt(value, 0, 1000)


def _kept(samples: Sequence[Sample], scenario: str, tool: str) -> list[Sample]:
    return [s for s in samples
            if s.scenario == scenario and s.tool == tool and not s.warmup and s.ok]


def print_targets(targets: Sequence[Target], samples: Sequence[Sample], out: TextIO) -> None:
    """fdl-fabric / peer, side by side, from the medians of this very run."""

    def median_of(scenario: str, tool: str, measure: str) -> Optional[float]:
        return benchlib.med(getattr(s, measure) for s in _kept(samples, scenario, tool))

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
                     benchlib.fmt(ratio), f"<= {t.limit:g}x", met])
    benchlib.write_table(
        out, rows, [False, False, False, True, False, True, True, True, False],
        "Targets (fdl-fabric / peer from the medians above; same run, round-robin)")


def _overhead_table(rows: list[Row], samples: list[Sample], out: TextIO) -> None:
    table = [["scenario", "tool", "all running", "completion", "x fdl running",
              "x fdl completion", "completion min-max", "client CPU s", "runs"]]
    base: dict[str, tuple[Optional[float], Optional[float]]] = {}
    for row in rows:
        got = _kept(samples, row.scenario, row.tool)
        running = benchlib.med(s.running for s in got)
        done = benchlib.med(s.done for s in got)
        if row.tool == FDL_TOOL:
            base[row.scenario] = (running, done)
        if "skipped" in row.note:
            table.append([row.scenario, row.tool, "-", "-", "-", "-", "-", "-", "skipped"])
            continue
        if "n/a" in row.note:  # a tool whose all-running is not measured
            running = None
        b_running, b_done = base.get(row.scenario, (None, None))
        fails = sum(1 for s in samples if s.scenario == row.scenario and s.tool == row.tool
                    and not s.warmup and not s.ok)
        table.append([row.scenario, row.tool, _ms(running), _ms(done),
                      benchlib.ratio(running, b_running), benchlib.ratio(done, b_done),
                      benchlib.spread((s.done for s in got), 0, 1000),
                      benchlib.fmt(benchlib.med(s.cpu for s in got)),
                      benchlib.runs_cell(len(got), fails)])
    benchlib.write_table(
        out, table, [False, False, True, True, True, True, True, True, False],
        "Launch overhead: medians in ms from just before Popen (warm-up run dropped)")
    notes_rows = [r for r in rows if r.note]
    if notes_rows:
        out.write("\n")
        for r in notes_rows:
            out.write(f"  {r.tool}: {r.note}\n")


def _floors_table(floors: list[Sample], out: TextIO) -> None:
    ftable = [["what", "median", "min-max", "runs"]]
    for name in dict.fromkeys(s.tool for s in floors):
        got = [s for s in floors if s.tool == name and not s.warmup and s.ok]
        ftable.append([name, _ms(benchlib.med(s.done for s in got)),
                       benchlib.spread((s.done for s in got), 0, 1000), str(len(got))])
    benchlib.write_table(out, ftable, [False, True, True, False],
                         "Reference floors (medians, ms)")


def _phases_table(phased: list[Sample], out: TextIO) -> None:
    scenarios = list(dict.fromkeys(s.scenario for s in phased))
    ptable = [["milestone", *scenarios, "meaning"]]
    for name, meaning, _ in PHASES:
        cells = [_ms(benchlib.med(s.milestones.get(name) for s in phased if s.scenario == sc))
                 for sc in scenarios]
        if any(c != "n/a" for c in cells):
            ptable.append([name, *cells, meaning])
    benchlib.write_table(out, ptable, [False, *([True] * len(scenarios)), False],
                         "fdl-fabric phases (separate runs with -v; median ms since Popen of "
                         "the last line of each kind)")


def print_report(
    rows: list[Row],
    samples: list[Sample],
    floors: list[Sample],
    notes: dict[str, Any],
    remarks: list[str],
    out: TextIO,
    targets: Sequence[Target] = (),
) -> None:
    """The tables of one run: overhead beside the peers, floors, phases, targets, the
    machine and the failed runs."""
    _overhead_table(rows, samples, out)
    if floors:
        _floors_table(floors, out)
    phased = [s for s in samples if s.milestones and not s.warmup and s.ok]
    if phased:
        _phases_table(phased, out)
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
