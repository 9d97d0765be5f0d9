"""fanout.py's machinery: the launcher wrapper and rank programs, one watched launch
(`Watched`), a measured job (`measure`), the statistics over the rounds (`Results`) and
the costs handed to ``bench/model.py``."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TextIO

import benchlib
import psutil

#: Runs ``inv launch`` in this process after (``before``) undoing issue 23's quick cuts
#: or (``after``) only watching them. argv: ``-c WRAPPER MODE <invoke args...>``. One
#: stderr line per SSH handshake (``fanout-bench: handshake nodelay=N timeout=T``) and,
#: before, one per connection that got ``TCP_NODELAY`` after it opened, as the code
#: before the cut did. Patches are made on the classes the checkout uses at call time,
#: so they compose with whatever else its factory or Connection does.
WRAPPER = r'''
import os, socket, sys
mode = sys.argv.pop(1)
import paramiko
from fdl_fabric.transport import ssh as _ssh

def _say(text):
    os.write(2, ("fanout-bench: " + text + "\n").encode())

_tcls = getattr(_ssh, "FdlTransport", paramiko.Transport)
_ccls = getattr(_ssh, "FdlConnection", None)
if _ccls is None:
    from fabric import Connection as _ccls
if mode == "before":
    _tcls._active_check_timeout = 0.1
    _open = _ccls.open

    def _open_then_nodelay(self, *args, **kwargs):
        result = _open(self, *args, **kwargs)
        sock = getattr(getattr(self, "transport", None), "sock", None)
        if isinstance(sock, socket.socket):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _say("nodelay set after open")
        return result

    _ccls.open = _open_then_nodelay
_start = _tcls.start_client

def start_client(self, *args, **kwargs):
    sock = getattr(self, "sock", None)
    if isinstance(sock, socket.socket):
        if mode == "before":
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
        nodelay = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        _say("handshake nodelay=%d timeout=%s" % (bool(nodelay), sock.gettimeout()))
    else:
        _say("handshake sock=%s" % type(sock).__name__)
    return _start(self, *args, **kwargs)

_tcls.start_client = start_client
import runpy
sys.argv[0] = "invoke"
runpy.run_module("invoke", run_name="__main__", alter_sys=True)
'''


#: Prints ``up <RANK>``, then waits until its stdout's reader is gone (POLLHUP/POLLERR),
#: at most argv[1] seconds: costs nothing while idle and never outlives its launcher.
IDLE_RANK = """\
import os, select, sys
os.write(1, ("up " + os.environ.get("RANK", "?") + "\\n").encode())
p = select.poll()
p.register(1, 0)
p.poll(float(sys.argv[1]) * 1000)
"""


#: Prints ``up <RANK>`` in one write and exits 0 (launch.py's rank program).
QUICK_RANK = """\
import os
os.write(1, ("up " + os.environ.get("RANK", "?") + "\\n").encode())
"""


#: An ``up`` line, bare or behind fdl-fabric's ``[host:dev:rN] `` or parallel-ssh's
#: ``<addr>: ``.
UP_LINE = re.compile(rb"^(?:\[[^\]]*\] |[0-9A-Za-z.:\[\]-]+: )?up (\S+)\s*$")


HANDSHAKE = re.compile(rb"^fanout-bench: handshake nodelay=(\S+) timeout=(\S+)")


BEFORE, AFTER, TREE, PSSH = "flat_before", "flat", "tree", "pssh"


# -- the launcher's CPU -----------------------------------------------------------------
class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_LIBC: Any = None


def cpu_of(pid: int) -> Optional[float]:
    """User+sys CPU seconds of process ``pid`` (every thread, dead ones too) from its
    CPU-time clock (``clock_getcpuclockid``: ns, where ``/proc`` has 10 ms ticks);
    `benchlib.cpu_seconds` if that clock cannot be read."""
    global _LIBC
    with contextlib.suppress(OSError, AttributeError):
        if _LIBC is None:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        clock, ts = ctypes.c_int(), _Timespec()
        if (_LIBC.clock_getcpuclockid(pid, ctypes.byref(clock)) == 0
                and _LIBC.clock_gettime(clock.value, ctypes.byref(ts)) == 0):
            return ts.tv_sec + ts.tv_nsec / 1e9
    return benchlib.cpu_seconds(pid)


def rss_mb(pid: int) -> Optional[float]:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return None


# -- one watched process ------------------------------------------------------------------
class Watched:
    """A process started by `benchlib.start` (a group of its own), its stdout and stderr
    drained and its exit seen by one selector in this thread (a pidfd), so the moment
    of the last ``up`` line and the launcher's CPU then are taken together."""

    def __init__(self, argv: Sequence[str], need_up: int, env: dict[str, str]) -> None:
        self.need_up = need_up
        self.ups = 0
        self.running_at: Optional[float] = None
        self.cpu_at_running: Optional[float] = None
        self.kids: list[psutil.Process] = []
        self.exited_at: Optional[float] = None
        self.wait_cpu: Optional[float] = None  # wait4: the process and children it reaped
        self.handshakes: list[tuple[str, str]] = []
        self.after_open = 0
        self.tail: list[str] = []
        self._partial = {"out": b"", "err": b""}
        self.sel = selectors.DefaultSelector()
        self.t0 = time.monotonic()
        self.proc = benchlib.start(argv, env=env, bufsize=0)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.sel.register(self.proc.stdout, selectors.EVENT_READ, "out")
        self.sel.register(self.proc.stderr, selectors.EVENT_READ, "err")
        self.pidfd: Optional[int] = None
        with contextlib.suppress(OSError, AttributeError):
            self.pidfd = os.pidfd_open(self.proc.pid)
            self.sel.register(self.pidfd, selectors.EVENT_READ, "exit")

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def exited(self) -> bool:
        return self.exited_at is not None

    def _reap(self, flags: int) -> None:
        try:
            pid, status, usage = os.wait4(self.proc.pid, flags)
        except ChildProcessError:
            pid, status, usage = self.proc.pid, 0, None
        if pid == 0:
            return
        self.exited_at = time.monotonic() - self.t0
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        if usage is not None:
            self.wait_cpu = usage.ru_utime + usage.ru_stime
        benchlib.forget(self.proc)

    def _line(self, what: str, line: bytes) -> None:
        if what == "out" and UP_LINE.match(line):
            self.ups += 1
            if self.ups == self.need_up and self.running_at is None:
                self.running_at = time.monotonic() - self.t0
                self.cpu_at_running = cpu_of(self.proc.pid)
                with contextlib.suppress(psutil.Error):  # pssh's ssh clients
                    self.kids = psutil.Process(self.proc.pid).children(recursive=True)
                if self.kids and self.cpu_at_running is not None:
                    self.cpu_at_running += sum(cpu_of(k.pid) or 0.0 for k in self.kids)
            return
        if what == "err":
            found = HANDSHAKE.match(line)
            if found:
                self.handshakes.append((found.group(1).decode(), found.group(2).decode()))
                return
            if line.startswith(b"fanout-bench: nodelay set after open"):
                self.after_open += 1
                return
        self.tail = (self.tail + [line.decode(errors="replace")])[-15:]

    def pump(self, timeout: float) -> None:
        """One wait of at most ``timeout`` s for output or the exit, handled."""
        if not self.sel.get_map():
            time.sleep(max(0.0, timeout))
            return
        polling = self.pidfd is None and not self.exited
        for key, _ in self.sel.select(min(timeout, 0.01) if polling else max(0.0, timeout)):
            what = key.data
            if what == "exit":
                self.sel.unregister(key.fileobj)
                self._reap(0)
                continue
            data = os.read(key.fd, 65536)
            if not data:
                self.sel.unregister(key.fileobj)
                if self._partial[what]:
                    self._line(what, self._partial[what])
                    self._partial[what] = b""
                continue
            *lines, self._partial[what] = (self._partial[what] + data).split(b"\n")
            for line in lines:
                self._line(what, line)
        if polling:
            self._reap(os.WNOHANG)

    def run_until(self, done: Callable[[], bool], seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.pump(min(left, 0.25))
        return True

    def finish(self, sig: int = signal.SIGTERM, grace: float = 30.0) -> None:
        """``sig`` to its group if it still runs, its exit awaited while its pipes are
        drained, then KILL (`benchlib.stop`) if need be; parallel-ssh's ssh clients (in
        sessions of their own) by pid, psutil checking each is still the same process."""
        if not self.exited:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)
            self.run_until(lambda: self.exited, grace)
        if not self.exited:
            benchlib.stop(self.proc, grace=5.0)
        for kid in self.kids:
            with contextlib.suppress(psutil.Error):
                kid.kill()
        self.run_until(lambda: not self.sel.get_map() or
                       set(self.sel.get_map()) <= {self.pidfd}, 2.0)
        self.sel.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


# -- jobs and samples ---------------------------------------------------------------------
@dataclass
class Job:
    scenario: str
    tool: str
    design: str
    hosts: int
    per_host: int
    argv: list[str]
    mode: str  # "idle" (ranks sleep; window) or "complete" (ranks exit at once)
    gateways: int = 0


@dataclass
class Sample:
    scenario: str
    tool: str
    design: str
    hosts: int
    per_host: int
    rep: int
    ok: bool = False
    error: str = ""
    running_s: Optional[float] = None
    cpu_running_s: Optional[float] = None
    completion_s: Optional[float] = None
    cpu_total_s: Optional[float] = None
    idle_pct: Optional[float] = None
    max_slice_pct: Optional[float] = None
    threads: Optional[int] = None
    rss_mb: Optional[float] = None
    ssh_peers: Optional[int] = None
    hosts_idle_pct: Optional[float] = None  # every process under the lab's sshd listeners
    handshakes: list[tuple[str, str]] = field(default_factory=list)
    after_open: int = 0


def _ssh_peers(pid: int, lab: Any) -> Optional[int]:
    """How many lab hosts the process holds a TCP connection to."""
    where = {(h.addr, h.port) for h in lab.hosts}
    try:
        proc = psutil.Process(pid)
        conns = (proc.net_connections if hasattr(proc, "net_connections")
                 else proc.connections)(kind="tcp")
    except psutil.Error:
        return None
    return len({(c.raddr.ip, c.raddr.port) for c in conns
                if c.raddr and (c.raddr.ip, c.raddr.port) in where})


def lab_processes(lab: Any) -> list[psutil.Process]:
    """Everything the lab hosts run for us: sessions' sshd, shells, agents, relays and
    their ssh clients (a gateway's), ranks."""
    return [p for p, _ in benchlib.lab_processes(lab)]


def _cpu_sum(procs: Sequence[psutil.Process]) -> float:
    return benchlib.cpu_sum(procs)


def _wait_hosts_quiet(lab: Any, timeout: float = 60.0) -> bool:
    """Until no lab host's sshd listener has a child left (every session is closed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = False
        for host in lab.hosts:
            with contextlib.suppress(psutil.Error):
                if psutil.Process(host.sshd.pid).children():
                    busy = True
                    break
        if not busy:
            return True
        time.sleep(0.1)
    return False


def _idle_window(w: Watched, s: Sample, lab: Any, args: argparse.Namespace) -> None:
    """After ``--settle`` s, the launcher's CPU over ``--window`` s (and its largest 1 s
    slice), its threads, RSS and SSH peers, and the lab hosts' CPU meanwhile, into ``s``."""
    w.run_until(lambda: w.exited, args.settle)
    pid = w.pid
    s.ssh_peers = _ssh_peers(pid, lab)
    s.threads, s.rss_mb = benchlib.threads(pid), rss_mb(pid)
    on_hosts = lab_processes(lab)
    hosts_start = _cpu_sum(on_hosts)
    start = last = cpu_of(pid)
    began = last_t = time.monotonic()
    slices: list[float] = []
    while not w.exited and time.monotonic() - began < args.window:
        w.run_until(lambda: w.exited,
                    min(1.0, args.window - (time.monotonic() - began)))
        now, now_t = cpu_of(pid), time.monotonic()
        if now is not None and last is not None and now_t > last_t:
            slices.append(100.0 * (now - last) / (now_t - last_t))
        last, last_t = now, now_t
        s.threads = max(s.threads or 0, benchlib.threads(pid) or 0)
    if w.exited:
        raise benchlib.BenchError(f"exited during the window ({w.proc.returncode})")
    if start is not None and last is not None:
        s.idle_pct = 100.0 * (last - start) / (last_t - began)
    s.hosts_idle_pct = 100.0 * (_cpu_sum(on_hosts) - hosts_start) / (last_t - began)
    s.max_slice_pct = max(slices) if slices else None


def measure(job: Job, rep: int, lab: Any, env: dict[str, str],
            args: argparse.Namespace) -> Sample:
    s = Sample(job.scenario, job.tool, job.design, job.hosts, job.per_host, rep)
    world = job.hosts * job.per_host
    w = Watched(job.argv, world, env)
    try:
        if not w.run_until(lambda: w.running_at is not None or w.exited, args.timeout):
            raise benchlib.BenchError(f"only {w.ups} of {world} up lines after "
                                      f"{args.timeout:g} s")
        if w.running_at is None:
            raise benchlib.BenchError(f"exited ({w.proc.returncode}) after {w.ups} of "
                                      f"{world} up lines")
        s.running_s, s.cpu_running_s = w.running_at, w.cpu_at_running
        if job.mode == "complete":
            if not w.run_until(lambda: w.exited, args.timeout):
                raise benchlib.BenchError(f"still running after {args.timeout:g} s")
            s.completion_s, s.cpu_total_s = w.exited_at, w.wait_cpu
            if w.proc.returncode != 0:
                raise benchlib.BenchError(f"exit status {w.proc.returncode}")
        else:
            _idle_window(w, s, lab, args)
        s.ok = True
    except benchlib.BenchError as exc:
        s.error = str(exc) + ("\n      " + "\n      ".join(w.tail[-8:]) if w.tail else "")
    finally:
        w.finish(signal.SIGINT if job.design == PSSH else signal.SIGTERM)
        s.handshakes, s.after_open = w.handshakes, w.after_open
        if not _wait_hosts_quiet(lab):
            s.error += " (lab sessions still open 60 s after the run)"
    return s


# -- statistics ---------------------------------------------------------------------------
class Results:
    def __init__(self, jobs: list[Job], samples: list[Sample], per_host: int) -> None:
        self.jobs, self.samples, self.per_host = jobs, samples, per_host

    def kept(self, job: Job) -> list[Sample]:
        return [s for s in self.samples if s.scenario == job.scenario and s.tool == job.tool
                and s.rep > 0 and s.ok]

    def med(self, job: Optional[Job], attr: str) -> Optional[float]:
        if job is None:
            return None
        return benchlib.med(getattr(s, attr) for s in self.kept(job))

    def find(self, design: str, hosts: int, mode: str = "idle",
             per_host: Optional[int] = None) -> Optional[Job]:
        per_host = self.per_host if per_host is None and mode == "idle" else per_host
        for job in self.jobs:
            if (job.design == design and job.hosts == hosts and job.mode == mode
                    and (per_host is None or job.per_host == per_host)):
                return job
        return None

    def per_rank(self) -> dict[str, Optional[float]]:
        """Per extra rank on a host: the ``--rank-shape`` row against the same hosts'
        row with ``--per-host`` ranks (flat, after)."""
        many = next((j for j in self.jobs if j.mode == "idle" and j.design == AFTER
                     and j.per_host != self.per_host), None)
        few = None if many is None else self.find(AFTER, many.hosts)
        out: dict[str, Optional[float]] = {}
        for attr in ("cpu_running_s", "idle_pct", "threads", "rss_mb", "running_s"):
            a, b = self.med(many, attr), self.med(few, attr)
            extra = 0 if many is None or few is None else \
                many.hosts * (many.per_host - few.per_host)
            out[attr] = None if a is None or b is None or not extra else (a - b) / extra
        return out

    def fits(self, design: str) -> dict[str, tuple[Optional[float], Optional[float]]]:
        """Per-host slope and fixed intercept of each idle-scenario figure."""
        jobs = [j for j in self.jobs if j.design == design and j.mode == "idle"
                and j.per_host == self.per_host]
        out = {}
        for attr in ("cpu_running_s", "idle_pct", "threads", "rss_mb", "running_s"):
            pts = [(float(j.hosts), v) for j in jobs
                   if (v := self.med(j, attr)) is not None]
            out[attr] = benchlib.fit(pts)
        return out


# -- costs for the model ------------------------------------------------------------------
def model_schema(out: TextIO) -> Optional[dict[str, Any]]:
    """``bench/model.py --print-costs``'s JSON, if that script exists and prints JSON."""
    model = benchlib.ROOT / "bench" / "model.py"
    if not model.is_file():
        return None
    try:
        done = subprocess.run([sys.executable, str(model), "--print-costs"],
                              capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
        doc = json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        out.write(f"  note: bench/model.py --print-costs gave no JSON ({exc}); "
                  "writing this script's own keys\n")
        return None
    return doc if isinstance(doc, dict) else None


def costs(res: Results, args: argparse.Namespace) -> dict[str, Any]:
    def design_costs(design: str) -> dict[str, Optional[float]]:
        fit = res.fits(design)

        def r(v: Optional[float], k: int) -> Optional[float]:
            return None if v is None else round(v, k)

        return {
            "per_host_launch_cpu_ms": r(None if fit["cpu_running_s"][0] is None
                                        else fit["cpu_running_s"][0] * 1000, 3),
            "fixed_launch_cpu_s": r(fit["cpu_running_s"][1], 4),
            "idle_pct_per_host": r(fit["idle_pct"][0], 5),
            "fixed_idle_pct": r(fit["idle_pct"][1], 4),
            "threads_per_host": r(fit["threads"][0], 3),
            "fixed_threads": r(fit["threads"][1], 2),
            "rss_mb_per_host": r(fit["rss_mb"][0], 4),
            "fixed_rss_mb": r(fit["rss_mb"][1], 2),
            "all_running_ms_per_host": r(None if fit["running_s"][0] is None
                                         else fit["running_s"][0] * 1000, 2),
        }

    pr = res.per_rank()
    per_rank = {
        "per_rank_launch_cpu_ms": None if pr["cpu_running_s"] is None
        else round(pr["cpu_running_s"] * 1000, 3),
        "idle_pct_per_rank": None if pr["idle_pct"] is None else round(pr["idle_pct"], 5),
        "threads_per_rank": None if pr["threads"] is None else round(pr["threads"], 3),
        "rss_mb_per_rank": None if pr["rss_mb"] is None else round(pr["rss_mb"], 4),
    }
    doc: dict[str, Any] = {
        "source": "bench/fanout.py",
        "commit": benchlib.machine_notes()["fdl_fabric commit"],
        "measured_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rounds": args.repeat,
        "ranks_per_host": args.per_host,
        "hosts": args.host_list,
        "rtt_ms": 0.05,
        "note": "flat = the checkout (after the quick cuts); slopes over the medians of "
                "the sizes, fixed = intercept; CPU = the launcher process, start to all "
                "running; idle = % of one core",
        **design_costs(AFTER),
        **per_rank,
        "before": design_costs(BEFORE),
        "tree": {"fanout": args.tree_fanout, **design_costs(TREE)},
        "points": checks(res),
    }
    return doc


def checks(res: Results) -> list[dict[str, Any]]:
    rows = []
    for j in res.jobs:
        if j.design == PSSH or not res.kept(j):
            continue
        cpu = res.med(j, "cpu_running_s")
        row: dict[str, Any] = {
            "design": j.design, "hosts": j.hosts, "ranks_per_host": j.per_host,
            "rtt_ms": 0.05, "all_running_s": round(res.med(j, "running_s") or 0.0, 4),
            "cpu_s": None if cpu is None else round(cpu, 4), "cuts": j.design != BEFORE,
        }
        if j.design == TREE:
            row["gateways"] = j.gateways
        if j.mode == "complete":
            row["completion_s"] = round(res.med(j, "completion_s") or 0.0, 4)
            row["cpu_total_s"] = round(res.med(j, "cpu_total_s") or 0.0, 4)
        else:
            row["idle_pct"] = round(res.med(j, "idle_pct") or 0.0, 4)
            row["threads"] = res.med(j, "threads")
        rows.append(row)
    return rows


def write_outputs(res: Results, samples: list[Sample], args: argparse.Namespace,
                  out: TextIO) -> None:
    """The files asked for: ``--write-costs`` and ``--write-check`` for bench/model.py,
    ``--json`` for every raw sample."""
    if args.write_costs:
        schema = model_schema(out)
        doc = costs(res, args)
        if schema:
            missing = sorted(k for k in schema if k not in doc)
            if missing:
                out.write(f"  note: {len(missing)} of bench/model.py's {len(schema)} costs are "
                          "not measured here (they keep the model's defaults)\n")
        Path(args.write_costs).write_text(json.dumps(doc, indent=2) + "\n")
        out.write(f"\ncosts written to {args.write_costs}\n")
    if args.write_check:
        Path(args.write_check).write_text(json.dumps(checks(res), indent=2) + "\n")
        out.write(f"measured launches written to {args.write_check}\n")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(s) for s in samples], indent=2) + "\n")
        out.write(f"raw samples written to {args.json}\n")
