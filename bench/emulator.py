#!/usr/bin/env python3
"""The controller's cost for 1,024 hosts x 8 ranks: 32 real gateways, emulated leaves.

A script, not a test: it prints figures, never asserts them (issue 23, "a gateway
emulator"). Run ``python3 bench/emulator.py --help``.

What is real: the launcher process (``inv launch`` from this repository, unchanged but
for one swapped command, below), its Fabric/paramiko connections to ``--gateways`` sshd
lab hosts, each gateway's own agent session and its ``--ranks`` real ranks, the relay
session on each gateway's connection (a second SSH session, fed the agent payload as
always), `GatewayTransport`/`RelayedAgent` for every leaf, the sessions, the supervisor,
the coordinator, and the output path (every rank's ``up`` line is read on the launcher's
stdout). The cluster file lists ``G x (1 + L)`` SSH workers with ``fanout: G``, so the
tree (`fdl_fabric.planning.tree`) makes the G lab hosts the gateways and gives each L
leaves named ``leafNNNN`` whose ssh target ``leafNNNN.invalid`` never resolves: nothing
ever dials them.

What is emulated: the relay. The launcher runs under a small wrapper (this script with
``--as-launcher``) that replaces ``bundle.remote_command("relay")`` (what
`fdl_fabric.transport.gateway.Relay.start` runs on the gateway) by
``bench/emulated_relay.py``, which speaks the real relay's mux upward and emulates every
leaf's agent and ranks in one process: agent handshake, HELLO, PREFLIGHT (with a real
dial of the coordinator), SWEPT, SPAWNED, each rank's ``up`` line, heartbeats on pings,
exits on stop/kill/EOF or when the synthetic work ends, VERIFIED, DONE, CLOSED; batched
by the real relay's `Batcher`. In mode ``join`` each synthetic rank also joins the
launcher's coordinator for real (TCP from a loopback address of its leaf's own,
`fdl_fabric.rank` frames, a heartbeat a second); in mode ``no-join`` it does not, which
isolates the transport's cost. The gateways' real ranks run ``sh -c 'echo up $RANK;
exec sleep W'`` and do not join, so the cohort never forms (no staleness checks).

Measured on the launcher process (``/proc/<pid>``, all threads; ``wait4`` at its exit):
CPU seconds from its start to the last ``up`` line read (**CPU to all running**), time
to all running; in mode ``join`` also time and CPU to every synthetic rank joined (the
launcher holding that many more sockets); thread count (the most seen, sampled every
0.1 s); CPU % of one core over ``--window`` s starting ``--settle`` s after all running
(and all joined): **idle**; peak RSS (VmHWM); total CPU at its exit (after every rank
ended by itself and the verdict), its exit status and verdict. Beside it, for context:
the emulated relays' and the gateways' agents' CPU, and the synthetic ranks' join times
(first dial to ``welcome``) against `rank.join`'s 30 s default deadline.
Targets (issue 23): <= 3 s of controller CPU, <= 100 threads, idle <= 2 % of a core.

The launcher asks for about 25,000 open files at 1,024 x 8 and refuses to start below
that hard limit; where the limit cannot be raised (a container), its check is made to
warn instead (``--lenient-nofile``, said in the output).

Every process started here runs in a process group of its own and only those groups are
signalled; the lab and the temporary folder are removed on exit, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, TextIO

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RELAY_SCRIPT = os.path.join(HERE, "emulated_relay.py")
MODES = ("join", "no-join")


# -- the launcher, with the relay's command swapped ---------------------------------------------
def as_launcher(argv: list[str]) -> int:
    """``--as-launcher [--lenient-nofile] RELAY_ARGS -- <invoke args>``: run ``inv`` in
    this process with ``bundle.remote_command("relay")`` replaced by the emulated relay's
    command (with RELAY_ARGS, one shell-quoted string). Nothing else of the launcher is
    touched, except with ``--lenient-nofile`` (only when this machine's hard
    RLIMIT_NOFILE is below what the launcher asks for and cannot be raised): its
    open-file check then warns instead of refusing to start."""
    # bench/ (this script's folder) off the path: its profile.py shadows the stdlib's.
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
    sys.path.insert(0, ROOT)
    mine = argv[:argv.index("--")]
    relay_args = mine[-1]
    inv_args = argv[argv.index("--") + 1:]
    from fdl_fabric.shell import quote
    from fdl_fabric.transport import bundle

    real = bundle.remote_command
    python = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
    relay_cmd = (f"exec {quote(python)} -I -S {quote(RELAY_SCRIPT)} --payload-bytes "
                 f"{len(bundle.payload())} {relay_args}")

    def remote_command(mode: str = "agent") -> str:
        return relay_cmd if mode == "relay" else real(mode)

    bundle.remote_command = remote_command  # type: ignore[assignment]
    if "--lenient-nofile" in mine:
        from fdl_fabric.commands import launch
        from fdl_fabric.errors import FdlError

        strict = launch.check_open_files

        def check_open_files(cluster: Any, events: Any) -> None:
            try:
                strict(cluster, events)
            except FdlError as exc:
                if "RLIMIT_NOFILE" not in str(exc):
                    raise
                sys.stderr.write(f"emulator: {exc} -- going on regardless (--lenient-nofile)\n")

        launch.check_open_files = check_open_files  # type: ignore[assignment]
    from invoke.main import program

    sys.argv = ["inv", *inv_args]  # the launch reads ``-- prog args`` from sys.argv
    program.run(sys.argv)
    return 0


# -- the benchmark --------------------------------------------------------------------------------
def check_shape(gateways: int, leaves: int) -> Optional[str]:
    """None when ``gateways x (1 + leaves)`` hosts with ``fanout: gateways`` plan exactly
    that tree; else why not."""
    from fdl_fabric.planning.tree import plan_tree

    hosts = [f"gw{i}" for i in range(gateways)] + [f"leaf{i}" for i in range(gateways * leaves)]
    tree = plan_tree(hosts, gateways)
    got = [len(g.leaves) for g in tree.gateways]
    if len(got) == gateways and set(got) == {leaves}:
        return None
    least = next(n for n in range(1, gateways * gateways)
                 if len(plan_tree(hosts[:gateways] + [f"x{i}" for i in range(gateways * n)],
                                  gateways).gateways) == gateways)
    return (f"{gateways} gateways x {leaves} leaves is not a tree the launcher plans "
            f"(ceil(sqrt(hosts)) must reach the fanout): it gives {len(got)} gateways; "
            f"use at least {least} leaves per gateway, or fewer gateways")


UP_LINE = re.compile(rb"^(?:\[[^\]]*\] )?up (\d+)\s*$", re.M)


@dataclass
class Sample:
    mode: str
    rep: int
    ok: bool = False
    error: str = ""
    up_s: Optional[float] = None  # launcher start -> last up line read
    cpu_up: Optional[float] = None  # launcher CPU s at the last up line
    joined_s: Optional[float] = None  # launcher start -> every synthetic rank joined
    cpu_joined: Optional[float] = None
    cpu_total: Optional[float] = None  # launcher CPU s at its exit (wait4)
    threads_max: Optional[int] = None  # most threads seen (sampled every 0.1 s)
    threads_up: Optional[int] = None  # threads at all running
    idle_pct: Optional[float] = None  # % of one core over the window
    max_slice: Optional[float] = None  # largest 1 s slice of the window, %
    rss_mb: Optional[float] = None  # VmHWM at the end of the window
    sockets: Optional[int] = None  # the launcher's sockets during the window
    relays_cpu: Optional[float] = None  # emulated relays' CPU s, at the end of the window
    agents_cpu: Optional[float] = None  # the gateways' real agents, same moment
    join_p50: Optional[float] = None
    join_max: Optional[float] = None
    join_late: Optional[int] = None  # joins slower than rank.join's 30 s default
    joins: int = 0
    dials: int = 0
    retry_rejects: int = 0
    welcome_mb: Optional[float] = None
    exit_code: Optional[int] = None
    verdict: str = ""
    lines: int = 0
    profile: list[str] = field(default_factory=list)


class Lines:
    """Drains the launcher's stdout in a thread: counts distinct ``up`` ranks, notes when
    the last one arrived."""

    def __init__(self, stream: Any, world: int) -> None:
        self.world = world
        self.ranks: set[int] = set()
        self.done_at: Optional[float] = None
        self.tail = b""
        self._partial = b""
        self.thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self.thread.start()

    def _run(self, stream: Any) -> None:
        while True:
            data = os.read(stream.fileno(), 1 << 20)
            if not data:
                return
            data = self._partial + data
            cut = data.rfind(b"\n") + 1
            self._partial = data[cut:]
            for m in UP_LINE.finditer(data[:cut]):
                self.ranks.add(int(m.group(1)))
            if self.done_at is None and len(self.ranks) >= self.world:
                self.done_at = time.monotonic()
            self.tail = (self.tail + data)[-2000:]


def _vm(pid: int, key: str) -> Optional[float]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def _sockets(pid: int) -> int:
    """Sockets the process holds (its fds that are sockets: SSH, the coordinator's)."""
    n = 0
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return 0
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                n += 1
    return n


def _lab_processes(lab: Any) -> tuple[list[Any], list[Any]]:
    """(emulated relays, real agents) under the lab's sshd listeners."""
    import benchlib

    found = benchlib.lab_processes(lab)
    return ([p for p, cmd in found if "emulated_relay.py" in cmd],
            [p for p, cmd in found if "emulated_relay.py" not in cmd and "-I -S -c" in cmd])


def _py_spy() -> Optional[str]:
    """The py-spy binary (the pyenv shim is a bash script: prefer the interpreter's own)."""
    own = Path(sys.executable).parent / "py-spy"
    if own.exists():
        return str(own)
    return shutil.which("py-spy")


def _profile_summary(path: Path, top: int = 25) -> list[str]:
    """The functions with the most samples (own, and with callees) in a py-spy raw file."""
    own: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    try:
        text = path.read_text()
    except OSError as exc:
        return [f"py-spy: no profile ({exc})"]
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for f in set(frames):
            incl[f] = incl.get(f, 0) + n
    if not total:
        return ["py-spy: no samples"]
    out = [f"py-spy {path.name} (the launcher, the GIL holder; {total} samples):",
           "  own %  +callees %  function (file:line)"]
    for f, n in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        out.append(f"  {100.0 * n / total:5.1f}  {100.0 * incl[f] / total:9.1f}  {f[:150]}")
    return out


def _thread_names(pid: int) -> list[str]:
    """The launcher's threads by name (digits folded), from one ``py-spy dump``."""
    binary = _py_spy()
    if binary is None:
        return []
    try:
        text = subprocess.run([binary, "dump", "--nonblocking", "--pid", str(pid)],
                              capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return [f"py-spy dump failed: {exc}"]
    names: dict[str, int] = {}
    for m in re.finditer(r'^Thread \S+ \((?:idle|active)[^)]*\): "([^"]*)"', text, re.M):
        name = re.sub(r"\d+", "N", m.group(1))
        names[name] = names.get(name, 0) + 1
    total = sum(names.values())
    if not total:
        return ["threads by name: py-spy dump gave none (the launcher was busy; try again)"]
    return [f"threads at all running, by name ({total}): " + ", ".join(
        f"{n} x {k}" for k, n in sorted(names.items(), key=lambda kv: -kv[1]))]


def _read_stats(prefix: Path, s: Sample) -> None:
    joins: list[float] = []
    for path in prefix.parent.glob(prefix.name + "-*.json"):
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(path.read_text())
            joins += data["join_s"]
            s.dials += int(data["dials"])
            s.retry_rejects += int(data["retry_rejects"])
            s.welcome_mb = (s.welcome_mb or 0.0) + data["welcome_bytes"] / 1e6
    s.joins = len(joins)
    if joins:
        s.join_p50 = statistics.median(joins)
        s.join_max = max(joins)
        s.join_late = sum(1 for j in joins if j > 30.0)


def measure(args: argparse.Namespace, lab: Any, cluster: Path, tmp: Path, mode: str,
            rep: int, out: TextIO) -> Sample:
    import benchlib

    s = Sample(mode, rep)
    hosts = args.gateways * (1 + args.leaves_per_gateway)
    world = hosts * args.ranks
    synthetic = args.gateways * args.leaves_per_gateway * args.ranks
    stats = tmp / f"stats-{mode}-{rep}"
    relay_args = f"--work {args.work:g} --stats {shlex.quote(str(stats))}" + (
        " --no-join" if mode == "no-join" else "")
    cmd = f"sh -c {shlex.quote(f'echo up $RANK; exec sleep {args.work:g}')}"
    argv = [sys.executable, os.path.abspath(__file__), "--as-launcher",
            *(["--lenient-nofile"] if args.lenient_nofile else []), relay_args, "--",
            "--search-root", ROOT, "launch", "--cluster", str(cluster), "--cmd", cmd]
    err_path = tmp / f"launcher-{mode}-{rep}.err"
    t0 = time.monotonic()
    with err_path.open("wb") as err:
        proc = benchlib.start(argv, stdout=subprocess.PIPE, stderr=err, bufsize=0)
    pid = proc.pid
    lines = Lines(proc.stdout, world)
    spy = None
    spy_file = tmp / f"py-spy-{mode}-{rep}.raw" if args.py_spy else None
    if spy_file is not None:
        binary = _py_spy()
        if binary:
            time.sleep(0.3)
            # --gil: only the thread holding the GIL (what the launcher's Python does on
            # CPU); --nonblocking: never pause the launcher (160 threads, 2 cores).
            spy = benchlib.start([binary, "record", "--pid", str(pid), "--format", "raw",
                                  "--rate", "100", "--gil", "--nonblocking",
                                  "-o", str(spy_file)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rusage: Any = None

    def reap(block_for: float) -> bool:
        nonlocal rusage
        deadline = time.monotonic() + block_for
        while True:
            got, st, ru = os.wait4(pid, os.WNOHANG)
            if got == pid:
                rusage = ru
                proc.returncode = os.waitstatus_to_exitcode(st)
                benchlib.forget(proc)
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    try:
        most = 0
        deadline = t0 + args.timeout
        while lines.done_at is None:
            if reap(0):
                raise benchlib.BenchError(f"the launcher exited early ({proc.returncode}) "
                                          f"with {len(lines.ranks)} of {world} up lines: "
                                          f"{_last_line(err_path)}")
            if time.monotonic() > deadline:
                raise benchlib.BenchError(f"only {len(lines.ranks)} of {world} up lines "
                                          f"after {args.timeout:g}s")
            most = max(most, benchlib.threads(pid) or 0)
            time.sleep(0.1)
        s.cpu_up = benchlib.cpu_seconds(pid)
        s.up_s = lines.done_at - t0
        s.threads_up = benchlib.threads(pid)
        if args.py_spy:
            s.profile += _thread_names(pid)
        if mode == "join":
            # Every synthetic rank joined: the launcher holds a socket for each (and one
            # per gateway, and its listener).
            want = synthetic + args.gateways + 1
            while _sockets(pid) < want:
                if reap(0) or time.monotonic() > deadline:
                    raise benchlib.BenchError(f"only {_sockets(pid)} of {want} sockets (every "
                                              "synthetic rank joined) in time")
                most = max(most, benchlib.threads(pid) or 0)
                time.sleep(0.2)
            s.cpu_joined = benchlib.cpu_seconds(pid)
            s.joined_s = time.monotonic() - t0
        if spy is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(spy.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                spy.wait(60)
            benchlib.stop(spy)
        time.sleep(args.settle)
        most = max(most, benchlib.threads(pid) or 0)
        if spy_file is not None and _py_spy():
            spy = benchlib.start([str(_py_spy()), "record", "--pid", str(pid), "--format",
                                  "raw", "--rate", "100", "--gil", "--nonblocking",
                                  "--duration", f"{max(1, int(args.window))}",
                                  "-o", str(spy_file.with_suffix(".window.raw"))],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        start_cpu = benchlib.cpu_seconds(pid) or 0.0
        began = last_t = time.monotonic()
        last = start_cpu
        slices: list[float] = []
        while time.monotonic() - began < args.window - 1e-3:
            time.sleep(min(1.0, max(0.0, args.window - (time.monotonic() - began))))
            now_cpu, now_t = benchlib.cpu_seconds(pid) or 0.0, time.monotonic()
            slices.append(100.0 * (now_cpu - last) / (now_t - last_t))
            last, last_t = now_cpu, now_t
            most = max(most, benchlib.threads(pid) or 0)
        s.idle_pct = 100.0 * ((benchlib.cpu_seconds(pid) or 0.0) - start_cpu) / \
            (time.monotonic() - began)
        s.max_slice = max(slices) if slices else None
        s.threads_max = most
        s.rss_mb = _vm(pid, "VmHWM")
        s.sockets = _sockets(pid)
        relays, agents = _lab_processes(lab)
        s.relays_cpu, s.agents_cpu = benchlib.cpu_sum(relays), benchlib.cpu_sum(agents)
        if time.monotonic() - lines.done_at > args.work - 1.0:
            out.write(f"  note: the window may overlap the ranks' end (--work {args.work:g})\n")
        if not reap(args.work + 180.0):
            raise benchlib.BenchError("the launcher did not exit after the ranks' work ended")
        s.cpu_total = rusage.ru_utime + rusage.ru_stime
        s.exit_code = proc.returncode
        s.ok = s.exit_code == 0
        if not s.ok:
            s.error = f"exit status {s.exit_code}"
    except benchlib.BenchError as exc:
        s.error = str(exc)
    finally:
        if spy is not None:
            benchlib.stop(spy)
        if proc.returncode is None and not reap(0):
            benchlib.stop(proc, grace=30)
        lines.thread.join(5)
        s.lines = len(lines.ranks)
        s.verdict = _last_line(err_path)
        if spy_file is not None:
            s.profile += _profile_summary(spy_file)
            s.profile += _profile_summary(spy_file.with_suffix(".window.raw"))
        _wait_quiet(lab)
        _read_stats(stats, s)
    return s


def _last_line(path: Path) -> str:
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return ""
    return text.splitlines()[-1][:300] if text else ""


def _wait_quiet(lab: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        relays, agents = _lab_processes(lab)
        if not relays and not agents:
            return
        time.sleep(0.2)


def _fmt(value: Optional[float], digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def report(samples: list[Sample], args: argparse.Namespace, out: TextIO) -> None:
    import benchlib

    hosts = args.gateways * (1 + args.leaves_per_gateway)
    world = hosts * args.ranks
    out.write(f"\nThe controller for {hosts} hosts x {args.ranks} ranks ({world} ranks): "
              f"{args.gateways} real gateways (sshd lab) with {args.ranks} real ranks each, "
              f"{args.gateways * args.leaves_per_gateway} emulated leaves; ranks run "
              f"{args.work:g} s; idle = {args.window:g} s window, {args.settle:g} s after "
              f"all running (and, in mode join, all joined)\n")
    if getattr(args, "nofile_note", ""):
        out.write(f"note: {args.nofile_note}\n")
    for mode in args.mode_list:
        got = [s for s in samples if s.mode == mode]
        if not got:
            continue
        good = [s for s in got if s.up_s is not None]

        def med(attr: str, good: list[Sample] = good) -> Optional[float]:
            vals = [getattr(s, attr) for s in good if getattr(s, attr) is not None]
            return statistics.median(vals) if vals else None

        label = ("synthetic ranks join the coordinator" if mode == "join"
                 else "synthetic ranks do not join the coordinator (the transport alone)")
        out.write(f"\nmode {mode}: {label}; medians of {len(good)} run(s)\n\n")
        rows = [["the launcher process", *[f"run {s.rep + 1}" for s in got], "median",
                 "target", "met"]]

        def row(label: str, attr: str, digits: int, target: Optional[float] = None,
                unit: str = "", got: list[Sample] = got, rows: list[list[str]] = rows
                ) -> None:
            cells = [_fmt(getattr(s, attr), digits) for s in got]
            m = med(attr)
            met = "" if target is None else ("n/a" if m is None else
                                             ("met" if m <= target else "MISSED"))
            rows.append([label, *cells, _fmt(m, digits),
                         "" if target is None else f"<= {target:g}{unit}", met])

        row("time to all running, s", "up_s", 2)
        row("CPU to all running, s", "cpu_up", 2, 3.0, " s")
        if mode == "join":
            row("time to every rank joined, s", "joined_s", 2)
            row("CPU to every rank joined, s", "cpu_joined", 2)
        row("CPU in all (to its exit), s", "cpu_total", 2)
        row("threads (most seen)", "threads_max", 0, 100.0)
        row("threads at all running", "threads_up", 0)
        row("idle CPU, % of a core", "idle_pct", 2, 2.0, " %")
        row("largest 1 s slice of the window, %", "max_slice", 1)
        row("peak RSS, MB", "rss_mb", 0)
        row("sockets held in the window", "sockets", 0)
        row("emulated relays' CPU, s (sum)", "relays_cpu", 2)
        row("gateways' real agents' CPU, s (sum)", "agents_cpu", 2)
        if mode == "join":
            row("join time per rank, p50 s", "join_p50", 3)
            row("join time per rank, max s", "join_max", 2)
            row("joins over rank.join's 30 s", "join_late", 0)
            row("welcome bytes received, MB", "welcome_mb", 1)
            rows.append(["joins / dials / retry rejects",
                         *[f"{s.joins}/{s.dials}/{s.retry_rejects}" for s in got], "", "", ""])
        rows.append(["up lines read", *[str(s.lines) for s in got], "", f"{world}", ""])
        rows.append(["exit status", *[str(s.exit_code) for s in got], "", "0", ""])
        out.write(benchlib.table(rows, [False] + [True] * (len(got) + 1) + [False, False])
                  + "\n")
        for s in got:
            out.write(f"  run {s.rep + 1} verdict: {s.verdict}\n")
            if s.error:
                out.write(f"  ! run {s.rep + 1}: {s.error}\n")
            for line in s.profile:
                out.write(f"  {line}\n")


def bench(args: argparse.Namespace, tmp: Path, out: TextIO) -> int:
    import benchlib

    started = time.monotonic()
    load_start = benchlib.wait_for_quiet(args.wait_load, out)
    global _LAB
    lab = _LAB = benchlib.start_lab(tmp / "lab", args.gateways, out)
    leaf_path = tmp / "leaf-path"
    leaf_path.mkdir()
    workers = [lab.worker(h, nproc=args.ranks) for h in lab.hosts]
    for i in range(args.gateways * args.leaves_per_gateway):
        name = f"leaf{i + 1:04d}"
        workers.append({"host": name, "path": str(leaf_path), "nproc": args.ranks,
                        "ssh": {"target": f"{name}.invalid", "user": lab.user,
                                "identity_file": lab.identity_file,
                                "options": lab.ssh_options()}})
    cluster = lab.write_cluster(workers, filename="emulator.yml", fanout=args.gateways,
                                kill_grace=2)
    _raise_nofile(args, out, cluster)
    samples = []
    for rep in range(args.repeat):
        for mode in args.mode_list:
            out.write(f"run {rep + 1}, {mode}: {args.gateways} gateways x "
                      f"{args.leaves_per_gateway} leaves x {args.ranks} ranks (load "
                      f"{benchlib.loadavg()})... ")
            out.flush()
            s = measure(args, lab, cluster, tmp, mode, rep, out)
            samples.append(s)
            out.write(f"all running in {_fmt(s.up_s)} s, CPU {_fmt(s.cpu_up)} s, idle "
                      f"{_fmt(s.idle_pct)} %\n" if s.ok else f"FAILED: {s.error}\n")
            out.flush()
    report(samples, args, out)
    benchlib.write_machine_notes(out, load_start, started)
    return 0 if all(s.ok for s in samples) else 1


def _raise_nofile(args: argparse.Namespace, out: TextIO, cluster: Path) -> None:
    """The launcher checks its open-file limit against what the run needs
    (`fdl_fabric.transport.tunnel.open_files_needed`: about 25,000 for 1,024 x 8, mostly
    the coordinator's 8,192 ranks and its bound on pending connections) and refuses to
    start when the hard limit is lower. Raise it for the launcher we start (it inherits
    ours) when allowed; else `--lenient-nofile`."""
    import resource

    from fdl_fabric.clusterfile import load_cluster
    from fdl_fabric.transport.tunnel import open_files_needed

    args.lenient_nofile = False
    args.nofile_note = ""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = open_files_needed(load_cluster(str(cluster)))
    if hard != resource.RLIM_INFINITY and hard < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, want))
            args.nofile_note = f"open-file hard limit raised from {hard} to {want}"
        except (ValueError, OSError) as exc:
            args.lenient_nofile = True
            args.nofile_note = (
                f"the launcher asks for {want} open files (open_files_needed); this "
                f"machine's hard limit is {hard} and cannot be raised ({exc}): its "
                "open-file check warns instead of refusing (--lenient-nofile)")
        out.write(args.nofile_note + "\n")


_LAB: Any = None


def _cleanup() -> None:
    import benchlib

    benchlib.stop_all()
    if _LAB is not None:
        _LAB.stop()


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--gateways", type=int, default=32, help="real gateway hosts (32)")
    ap.add_argument("--leaves-per-gateway", type=int, default=31,
                    help="emulated leaves per gateway (31: 32 x 32 = 1,024 hosts)")
    ap.add_argument("--ranks", type=int, default=8, help="ranks per host (8)")
    ap.add_argument("--quick", action="store_true",
                    help="a small shape for quick checks: 8 gateways x 8 leaves x 8 ranks "
                    "(72 hosts, 576 ranks), --work 30, --window 5")
    ap.add_argument("--modes", default="join,no-join",
                    help="comma-separated: join (synthetic ranks join the coordinator), "
                    "no-join (they do not); run round-robin (default both)")
    ap.add_argument("--work", type=float, default=None,
                    help="seconds every rank runs (sleeps) before exiting 0 (120: every "
                    "synthetic rank must have joined and the window ended before)")
    ap.add_argument("--window", type=float, default=None, help="idle sampling window, s (10)")
    ap.add_argument("--settle", type=float, default=2.0,
                    help="seconds between all running (all joined) and the window (2)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds (1)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="longest wait for every up line and every join, s (300)")
    ap.add_argument("--py-spy", action="store_true",
                    help="also record the launcher with py-spy from its start to all running "
                    "(all joined), and print its busiest functions; perturbs the figures")
    ap.add_argument("--wait-load", type=float, metavar="L",
                    help="first wait (up to 20 min) until the 1-minute load is <= L")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args(argv)
    if args.quick:
        args.gateways, args.leaves_per_gateway = 8, 8
        args.work = 30.0 if args.work is None else args.work
        args.window = 5.0 if args.window is None else args.window
    args.work = 120.0 if args.work is None else args.work
    args.window = 10.0 if args.window is None else args.window
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.mode_list or any(m not in MODES for m in args.mode_list):
        ap.error(f"--modes: a comma-separated list of {', '.join(MODES)}")
    if min(args.gateways, args.leaves_per_gateway, args.ranks, args.repeat) < 1:
        ap.error("--gateways, --leaves-per-gateway, --ranks and --repeat must be >= 1")
    problem = check_shape(args.gateways, args.leaves_per_gateway)
    if problem:
        ap.error(problem)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] == ["--as-launcher"]:
        return as_launcher(raw[1:])
    sys.path.insert(0, ROOT)
    args = parse_args(raw)
    import benchlib

    return benchlib.run_in_scratch("fdl-emulator-", args, bench, _cleanup)


if __name__ == "__main__":
    sys.exit(main())
