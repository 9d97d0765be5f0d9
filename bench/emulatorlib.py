"""emulator.py's measurement: one launch through the emulated relays (`measure`), the
launcher's figures on the way (`_Launch`), py-spy around it, the relays' join statistics."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TextIO

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: The script whose ``--as-launcher`` mode runs the launcher with the relay swapped.
EMULATOR = os.path.join(HERE, "emulator.py")


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
    fds: Optional[int] = None  # the launcher's open files in the window (/proc/<pid>/fd)
    formation_s: Optional[float] = None  # last hello (any rank) -> first ``formed`` read
    hellos_s: Optional[float] = None  # first synthetic hello -> last synthetic hello
    welcomes_after_s: Optional[float] = None  # last synthetic hello -> last welcome read
    real_hello_late_s: Optional[float] = None  # last synthetic hello -> last real rank's
    #: A synthetic join's two legs, by the launcher's ``rank_joined`` record (events.jsonl):
    #: hello sent -> the coordinator took it (up), and -> its welcome read (down).
    up_p50: Optional[float] = None
    spawn_p50: Optional[float] = None  # hello sent -> the launcher's rank_started record
    up_max: Optional[float] = None
    down_p50: Optional[float] = None
    down_max: Optional[float] = None
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


def _fds(pid: int) -> Optional[int]:
    with contextlib.suppress(OSError):
        return len(os.listdir(f"/proc/{pid}/fd"))
    return None


def _fd_kinds(pid: int) -> str:
    """The launcher's open files by kind (socket, pipe, anon_inode, or a file's path
    with every number as N: ``.../attempt_N/rN/stdout.log``), most first: what the
    open-file count is made of."""
    kinds: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                kind = target.split(":")[0] if ":[" in target or target.startswith(
                    "anon_inode:") else re.sub(r"\d+", "N", target)
                kinds[kind] = kinds.get(kind, 0) + 1
    return ", ".join(f"{k} {n}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1])[:8])


def _joined(prefix: Path) -> int:
    """Synthetic ranks welcomed so far, by the relays' ``.joined`` notes."""
    total = 0
    for path in prefix.parent.glob(prefix.name + "-*.joined"):
        with contextlib.suppress(OSError, ValueError):
            total += int(path.read_text() or 0)
    return total


def _joined_records(since: float, name: str = "rank_joined") -> dict[str, float]:
    """When the launcher recorded each rank's ``name`` event (its events.jsonl in the
    newest run record made since ``since``), by rank."""
    from fdl_fabric.runs import place

    folders = [f for f in place.records(place.runs_root(create=False))
               if (f / "events.jsonl").exists() and f.stat().st_mtime >= since]
    if not folders:
        return {}
    newest = max(folders, key=lambda f: f.stat().st_ctime)
    out: dict[str, float] = {}
    with contextlib.suppress(OSError), open(newest / "events.jsonl", encoding="utf-8") as fh:
        for line in fh:
            if f'"{name}"' in line:
                with contextlib.suppress(ValueError, KeyError):
                    rec = json.loads(line)
                    out[str(rec["rank"])] = float(rec["time"])
    return out


def _legs(s: Sample, hello_at: dict[str, float], welcome_at: dict[str, float],
          since: float) -> None:
    """Split each synthetic join at the launcher's record of it (one machine's clock)."""
    joined = _joined_records(since)
    started = _joined_records(since, "rank_started")  # its spawn, sent just before
    up = [joined[r] - t for r, t in hello_at.items() if r in joined]
    down = [t - joined[r] for r, t in welcome_at.items() if r in joined]
    spawn = [started[r] - t for r, t in hello_at.items() if r in started]
    if spawn:
        s.spawn_p50 = statistics.median(spawn)
    if up:
        s.up_p50, s.up_max = statistics.median(up), max(up)
    if down:
        s.down_p50, s.down_max = statistics.median(down), max(down)


def _read_stats(prefix: Path, s: Sample, since: float = 0.0) -> None:
    joins: list[float] = []
    hello_at: dict[str, float] = {}
    welcome_at: dict[str, float] = {}
    #: Each relay's wall-clock moments, by its stats' key.
    seen: dict[str, list[float]] = {k: [] for k in ("first_hello", "last_hello",
                                                    "last_welcome", "formed_at")}
    for path in prefix.parent.glob(prefix.name + "-*.json"):
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(path.read_text())
            joins += data["join_s"]
            s.dials += int(data["dials"])
            s.retry_rejects += int(data["retry_rejects"])
            s.welcome_mb = (s.welcome_mb or 0.0) + data["welcome_bytes"] / 1e6
            for key, moments in seen.items():
                if data.get(key):
                    moments.append(float(data[key]))
            hello_at.update(data.get("hello_at") or {})
            welcome_at.update(data.get("welcome_at") or {})
    real: list[float] = []
    for path in prefix.parent.glob(prefix.name + "-hello-*"):  # the gateways' real ranks
        with contextlib.suppress(OSError, ValueError):
            real.append(float(path.read_text()))
    hellos = seen["last_hello"] + real
    if hellos and seen["formed_at"]:
        s.formation_s = min(seen["formed_at"]) - max(hellos)
    if seen["first_hello"] and seen["last_hello"]:
        last = max(seen["last_hello"])
        s.hellos_s = last - min(seen["first_hello"])
        if seen["last_welcome"]:
            s.welcomes_after_s = max(seen["last_welcome"]) - last
        if real:
            s.real_hello_late_s = max(real) - last
    s.joins = len(joins)
    if joins:
        s.join_p50 = statistics.median(joins)
        s.join_max = max(joins)
        s.join_late = sum(1 for j in joins if j > 30.0)
    if hello_at:
        _legs(s, hello_at, welcome_at, since)


_SPY_ARGS = ("--format", "raw", "--rate", "100", "--gil", "--nonblocking", "--threads")


class _Launch:
    """One launch through the emulated relays: the launcher process (started by
    `benchlib.start`), its stdout's up lines, the most threads seen, its wait4 usage."""

    def __init__(self, args: argparse.Namespace, argv: list[str], err_path: Path,
                 world: int) -> None:
        import benchlib

        self.args, self.err_path, self.world = args, err_path, world
        self.t0 = time.monotonic()
        self.started_wall = time.time() - 5.0  # a record made since then is this run's
        with err_path.open("wb") as err:
            self.proc = benchlib.start(argv, stdout=subprocess.PIPE, stderr=err, bufsize=0)
        self.pid = self.proc.pid
        self.lines = Lines(self.proc.stdout, world)
        self.most = 0
        self.rusage: Any = None
        self.spy: Any = None  # py-spy recording it, if asked for

    def note_threads(self) -> None:
        import benchlib

        self.most = max(self.most, benchlib.threads(self.pid) or 0)

    def reap(self, block_for: float) -> bool:
        import benchlib

        deadline = time.monotonic() + block_for
        while True:
            got, st, ru = os.wait4(self.pid, os.WNOHANG)
            if got == self.pid:
                self.rusage = ru
                self.proc.returncode = os.waitstatus_to_exitcode(st)
                benchlib.forget(self.proc)
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def wait_up(self) -> None:
        """Until the last up line, sampling the threads; a BenchError on an early exit or
        after ``--timeout``."""
        from benchlib import BenchError

        deadline = self.t0 + self.args.timeout
        while self.lines.done_at is None:
            if self.reap(0):
                raise BenchError(f"the launcher exited early ({self.proc.returncode}) "
                                 f"with {len(self.lines.ranks)} of {self.world} up lines: "
                                 f"{_last_line(self.err_path)}")
            if time.monotonic() > deadline:
                raise BenchError(f"only {len(self.lines.ranks)} of {self.world} up lines "
                                 f"after {self.args.timeout:g}s")
            self.note_threads()
            time.sleep(0.1)

    def wait_sockets(self, want: int) -> None:
        """Until the launcher holds ``want`` sockets (every synthetic rank joined)."""
        from benchlib import BenchError

        deadline = self.t0 + self.args.timeout
        while _sockets(self.pid) < want:
            if self.reap(0) or time.monotonic() > deadline:
                raise BenchError(f"only {_sockets(self.pid)} of {want} sockets (every "
                                 "synthetic rank joined) in time")
            self.note_threads()
            time.sleep(0.2)

    def wait_joined(self, stats: Path, want: int) -> None:
        """Until the relays say ``want`` synthetic ranks are welcomed."""
        from benchlib import BenchError

        deadline = self.t0 + self.args.timeout
        while _joined(stats) < want:
            if self.reap(0) or time.monotonic() > deadline:
                raise BenchError(f"only {_joined(stats)} of {want} synthetic ranks joined "
                                 "in time")
            self.note_threads()
            time.sleep(0.2)

    def wait_formed(self, stats: Path) -> None:
        """Until a relay read ``formed``: every rank joined, the gateways' real ranks too
        (with ``--pin`` they start on the lab's own cores, after the synthetic ranks)."""
        from benchlib import BenchError

        deadline = self.t0 + self.args.timeout
        while not any(stats.parent.glob(stats.name + "-*.formed")):
            if self.reap(0) or time.monotonic() > deadline:
                raise BenchError("the cohort did not form in time")
            self.note_threads()
            time.sleep(0.2)

    def window(self, s: Sample) -> None:
        """The launcher's CPU over ``--window`` s (and its largest 1 s slice) into ``s``,
        and that CPU by thread."""
        import benchlib
        import threadcpu

        start_cpu = benchlib.cpu_seconds(self.pid) or 0.0
        threads = threadcpu.tasks_cpu(self.pid)
        began = last_t = time.monotonic()
        last = start_cpu
        slices: list[float] = []
        while time.monotonic() - began < self.args.window - 1e-3:
            time.sleep(min(1.0, max(0.0, self.args.window - (time.monotonic() - began))))
            now_cpu, now_t = benchlib.cpu_seconds(self.pid) or 0.0, time.monotonic()
            slices.append(100.0 * (now_cpu - last) / (now_t - last_t))
            last, last_t = now_cpu, now_t
            self.note_threads()
        s.idle_pct = 100.0 * ((benchlib.cpu_seconds(self.pid) or 0.0) - start_cpu) / \
            (time.monotonic() - began)
        s.max_slice = max(slices) if slices else None
        s.profile.append(threadcpu.idle_by_thread(
            self.pid, threads, threadcpu.tasks_cpu(self.pid), time.monotonic() - began))


def _start_spy(pid: int, spy_file: Optional[Path], *extra: str) -> Any:
    """py-spy recording the launcher (--gil: only the thread holding the GIL, what the
    launcher's Python does on CPU; --nonblocking: never pause it), or None."""
    import benchlib
    import threadcpu

    binary = threadcpu.py_spy() if spy_file is not None else None
    if binary is None or spy_file is None:
        return None
    return benchlib.start([binary, "record", "--pid", str(pid), *_SPY_ARGS, *extra,
                           "-o", str(spy_file)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop_spy(spy: Any) -> None:
    import benchlib

    with contextlib.suppress(ProcessLookupError):
        os.kill(spy.pid, signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        spy.wait(60)
    benchlib.stop(spy)


def _after_up(run: _Launch, s: Sample, lab: Any, spy_file: Optional[Path],
              stats: Path, out: TextIO) -> None:
    """From all running to the launcher's exit: all joined (mode join), the idle window,
    the launcher's and the hosts' figures."""
    import benchlib

    args, pid = run.args, run.pid
    synthetic = args.gateways * args.leaves_per_gateway * args.ranks
    if s.mode == "join-tcp":
        # Every synthetic rank joined: the launcher holds a socket for each (and one
        # per gateway, and its listener).
        run.wait_sockets(synthetic + args.gateways + 1)
    elif s.mode == "join":
        run.wait_joined(stats, synthetic)  # through their agents: no socket to count
        if args.real_ranks == "join":  # with `sleep` they never join: it never forms
            run.wait_formed(stats)  # and the gateways' real ranks: the window is after both
    if s.mode != "no-join":
        s.cpu_joined = benchlib.cpu_seconds(pid)
        s.joined_s = time.monotonic() - run.t0
    if run.spy is not None:
        _stop_spy(run.spy)
    time.sleep(args.settle)
    run.note_threads()
    run.spy = _start_spy(pid, None if spy_file is None else spy_file.with_suffix(".window.raw"),
                     "--duration", f"{max(1, int(args.window))}")
    run.window(s)
    s.threads_max = run.most
    s.rss_mb = _vm(pid, "VmHWM")
    s.sockets = _sockets(pid)
    s.fds = _fds(pid)
    s.profile.append(f"the launcher's open files in the window, by kind: {_fd_kinds(pid)}")
    relays, agents = _lab_processes(lab)
    s.relays_cpu, s.agents_cpu = benchlib.cpu_sum(relays), benchlib.cpu_sum(agents)
    assert run.lines.done_at is not None
    if time.monotonic() - run.lines.done_at > args.work - 1.0:
        out.write(f"  note: the window may overlap the ranks' end (--work {args.work:g})\n")
    if not run.reap(args.work + 180.0):
        raise benchlib.BenchError("the launcher did not exit after the ranks' work ended")
    s.cpu_total = run.rusage.ru_utime + run.rusage.ru_stime
    s.exit_code = run.proc.returncode
    s.ok = s.exit_code == 0
    if not s.ok:
        s.error = f"exit status {s.exit_code}"


def measure(args: argparse.Namespace, lab: Any, cluster: Path, tmp: Path, mode: str,
            rep: int, out: TextIO) -> Sample:
    import benchlib
    import threadcpu

    s = Sample(mode, rep)
    world = args.gateways * (1 + args.leaves_per_gateway) * args.ranks
    stats = tmp / f"stats-{mode}-{rep}"
    join = {"join": "agent", "join-tcp": "tcp", "no-join": "none"}[mode]
    relay_args = f"--work {args.work:g} --stats {shlex.quote(str(stats))} --join {join}"
    argv = [sys.executable, EMULATOR, "--as-launcher", relay_args, "--",
            "--search-root", ROOT, "launch", "--cluster", str(cluster),
            "--cmd", _gateway_cmd(args, mode, stats)]
    err_path = tmp / f"launcher-{mode}-{rep}.err"
    run = _Launch(args, argv, err_path, world)
    spy_file = tmp / f"py-spy-{mode}-{rep}.raw" if args.py_spy else None
    if spy_file is not None and threadcpu.py_spy():
        time.sleep(0.3)
        run.spy = _start_spy(run.pid, spy_file)
    try:
        run.wait_up()
        s.cpu_up = benchlib.cpu_seconds(run.pid)
        s.up_s = (run.lines.done_at or 0.0) - run.t0
        s.threads_up = benchlib.threads(run.pid)
        s.profile += threadcpu.thread_names(run.pid)
        _after_up(run, s, lab, spy_file, stats, out)
    except benchlib.BenchError as exc:
        s.error = str(exc)
    finally:
        if run.spy is not None:
            benchlib.stop(run.spy)
        if run.proc.returncode is None and not run.reap(0):
            benchlib.stop(run.proc, grace=30)
        run.lines.thread.join(5)
        s.lines = len(run.lines.ranks)
        s.verdict = _last_line(err_path)
        if spy_file is not None:
            s.profile += _profile_summary(spy_file)
            s.profile += _profile_summary(spy_file.with_suffix(".window.raw"))
        _wait_quiet(lab)
        _read_stats(stats, s, since=run.started_wall)
    return s


def _gateway_cmd(args: argparse.Namespace, mode: str, stats: Path) -> str:
    """What the gateways' real ranks run. In mode ``join`` a real `rank.join()` through
    their real agent (the cohort forms, so its formation is measured), after noting the
    time of their hello; else ``echo up; sleep`` (no rank of theirs joins: the cohort
    never forms)."""
    if mode != "join" or args.real_ranks == "sleep":
        return f"sh -c {shlex.quote(f'echo up $RANK; exec sleep {args.work:g}')}"
    code = (f"import os, sys, time; sys.path.insert(0, {ROOT!r}); "
            "print('up', os.environ['RANK'], flush=True); "
            "from fdl_fabric import rank; "
            f"open({str(stats) + '-hello-'!r} + os.environ['RANK'], 'w')"
            ".write(repr(time.time())); "
            f"rank.join(); time.sleep({args.work:g})")
    return f"{shlex.quote(sys.executable)} -I -S -c {shlex.quote(code)}"


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
