"""Small helpers shared by the newer benchmark scripts (idle.py, output.py, detect.py,
liveness.py).

Only the benchmark scripts import this (they run as ``python3 bench/<script>.py``, so
``bench/`` is on ``sys.path``). It uses the public lab from ``fdl_fabric.testing`` and
nothing from ``tests/``.

Every process started through `start` runs in a process group of its own and is
remembered until it is reaped; `stop_all` stops those groups and no others.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Optional, TextIO

ROOT = Path(__file__).resolve().parent.parent

#: Processes this script started and has not reaped, by pid (= their process group).
_LIVE: dict[int, subprocess.Popen[bytes]] = {}


def start(argv: Sequence[str], *, stdout: Any = subprocess.PIPE, stderr: Any = subprocess.PIPE,
          env: Optional[dict[str, str]] = None, cwd: Optional[str] = None,
          bufsize: int = -1) -> subprocess.Popen[bytes]:
    """Popen in a new session (its own process group), remembered for `stop_all`."""
    proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                            env=env, cwd=cwd or str(ROOT), start_new_session=True,
                            bufsize=bufsize)
    _LIVE[proc.pid] = proc
    return proc


def adopt(proc: subprocess.Popen[Any]) -> subprocess.Popen[Any]:
    """Remember for `stop_all` a process started elsewhere in a session of its own
    (``start_new_session=True``: its pid is its process group), e.g. by
    ``fdl_fabric.testing.LiveProcess`` or on a pty."""
    assert os.getpgid(proc.pid) == proc.pid or proc.poll() is not None
    _LIVE[proc.pid] = proc
    return proc


def stop(proc: subprocess.Popen[bytes], grace: float = 10.0,
         sig: int = signal.SIGTERM) -> Optional[int]:
    """``sig`` to the group we created for ``proc``, KILL after ``grace``; reap it.

    Only groups whose leader we started and have not reaped yet are signalled, so a
    recycled pid or pgid is never hit.
    """
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(grace)
    forget(proc)
    return proc.returncode


def forget(proc: subprocess.Popen[bytes]) -> None:
    """``proc`` was reaped: never signal its pid again."""
    _LIVE.pop(proc.pid, None)


def stop_all() -> None:
    for proc in list(_LIVE.values()):
        with contextlib.suppress(Exception):
            stop(proc, grace=5.0)


@contextlib.contextmanager
def terminate_gracefully() -> Iterator[None]:
    """SIGTERM/SIGHUP unwind through ``finally`` blocks like Ctrl-C does."""

    def bye(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, bye) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# -- the lab --------------------------------------------------------------------------------
def start_lab(root: Path, n_hosts: int, out: TextIO, **options: Any) -> Any:
    """An sshd lab of ``n_hosts`` with known_hosts pre-seeded (no run pays first contact).

    ``options`` go to `SshdLab` (``login_shell_rc=...``)."""
    from fdl_fabric.testing import SshdLab

    out.write(f"starting {n_hosts} sshd lab hosts... ")
    out.flush()
    options.setdefault("extra_sshd_config", ["MaxStartups 100:30:300"])
    lab = SshdLab(root, n_hosts, **options).start()
    Path(lab.known_hosts).write_text("".join(h.known_hosts_line() + "\n" for h in lab.hosts))
    out.write("ok\n")
    out.flush()
    return lab


def agent_up(argv: Sequence[str]) -> float:
    """Seconds from starting ``argv`` (a command that runs the agent's bootstrap, locally
    or over ssh) with the bundle on its stdin to the agent's handshake on its stdout;
    then its stdin is closed (the leash: the agent goes on EOF) and it is waited for."""
    from fdl_fabric.agent import wire
    from fdl_fabric.transport import bundle

    payload = bundle.payload()
    t0 = time.perf_counter()
    proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(payload)
    proc.stdin.flush()
    got = b""
    while wire.HANDSHAKE not in got:
        chunk = os.read(proc.stdout.fileno(), 65536)
        if not chunk:
            break
        got += chunk
    took = time.perf_counter() - t0
    proc.stdin.close()
    proc.wait(10)
    return took


def seed_known_hosts(path: str | Path, n: int) -> None:
    """``n`` more lines in the known_hosts at ``path``, for hosts that never resolve
    (``nodeNNNN.invalid``), each with a key of its own: a user who launches on 1,024
    hosts has them all there, and every connection the launcher makes reads the file."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    with open(path, "a") as fh:
        for i in range(n):
            public = Ed25519PrivateKey.generate().public_key().public_bytes(
                serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
            fh.write(f"node{i:04d}.invalid {public.decode()}\n")


def inv_launch_argv(cluster: Path, command: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "invoke", "--search-root", str(ROOT), "launch",
            *extra, "--cluster", str(cluster), "--cmd", command]


def pssh_path() -> Optional[str]:
    return shutil.which("parallel-ssh") or shutil.which("pssh")


def pssh_argv(lab: Any, hosts_file: Path, sessions: int, command: str,
              timeout: int = 0) -> list[str]:
    """``parallel-ssh -P``: every session at once (``-p``, so none waits for a slot), each
    line printed as it arrives (``<addr>: up ?``); ``timeout`` s per session (0: none)."""
    pssh = pssh_path()
    assert pssh is not None
    extra = (f"-F /dev/null -i {lab.identity_file} -o IdentitiesOnly=yes "
             f"-o UserKnownHostsFile={lab.known_hosts} "
             "-o StrictHostKeyChecking=no -o BatchMode=yes -o LogLevel=ERROR")
    return [pssh, "-P", "-p", str(sessions), "-t", str(timeout), "-h", str(hosts_file),
            "-x", extra, command]


# -- /proc ----------------------------------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> Optional[float]:
    """user + system CPU seconds of one process (its threads included), or None."""
    from fdl_fabric.agent.procs import stat_fields

    fields = stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK


def threads(pid: int) -> Optional[int]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def wait_for_quiet(limit: Optional[float], out: TextIO, *, patience: float = 1200.0) -> str:
    """Wait (60 s at a time, up to ``patience``) until the 1-minute load is <= ``limit``.

    Returns the load average seen when the wait ended.
    """
    if limit is None:
        return loadavg()
    deadline = time.monotonic() + patience
    while os.getloadavg()[0] > limit and time.monotonic() < deadline:
        out.write(f"load {loadavg()} > {limit:g}: waiting 60 s\n")
        out.flush()
        time.sleep(60)
    return loadavg()


def arg_parser(doc: Optional[str], *, epilog: bool = False) -> argparse.ArgumentParser:
    """A script's parser: its docstring's first paragraph as the description and, with
    ``epilog``, the rest after the options (kept as written)."""
    text = doc or ""
    return argparse.ArgumentParser(
        description=text.split("\n\n")[0],
        epilog=text.split("\n\n", 1)[1] if epilog else None,
        formatter_class=argparse.RawDescriptionHelpFormatter)


# -- reporting ------------------------------------------------------------------------------
def table(rows: list[list[str]], right: Sequence[bool]) -> str:
    """``rows`` (the first is the header, underlined) in columns two spaces apart,
    ``right[i]`` saying which columns are right-aligned (numbers)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [c.rjust(w) if right[i] else c.ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_table(out: TextIO, rows: list[list[str]], right: Sequence[bool],
                title: Optional[str] = None) -> None:
    """`table` written to ``out``, after ``title`` (a blank line either side) if any."""
    if title is not None:
        out.write(f"\n{title}\n\n")
    out.write(table(rows, right) + "\n")


def med(values: Iterable[Optional[float]]) -> Optional[float]:
    """The median of the values that are not None; None when there are none."""
    clean = [v for v in values if v is not None]
    return statistics.median(clean) if clean else None


def fmt(value: Optional[float], digits: int = 2, scale: float = 1.0,
        none: str = "n/a") -> str:
    """``value * scale`` with ``digits`` decimals, or ``none`` for a missing value."""
    return none if value is None else f"{value * scale:.{digits}f}"


def ratio(a: Optional[float], b: Optional[float], digits: int = 2) -> str:
    """``a / b`` as text; "n/a" when either is missing or ``b`` is 0."""
    return "n/a" if a is None or not b else f"{a / b:.{digits}f}"


def spread(values: Iterable[Optional[float]], digits: int = 2, scale: float = 1.0) -> str:
    """``min-max`` of the values that are not None (times ``scale``), or "n/a"."""
    clean = [v * scale for v in values if v is not None]
    if not clean:
        return "n/a"
    return f"{min(clean):.{digits}f}-{max(clean):.{digits}f}"


def mean_se(values: Sequence[float], digits: int = 3) -> str:
    """``mean +- standard error`` of ``values``; "n/a" for fewer than two."""
    if len(values) < 2:
        return "n/a"
    se = statistics.stdev(values) / len(values) ** 0.5
    return f"{statistics.fmean(values):.{digits}f} +- {se:.{digits}f}"


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of non-empty ``values``."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def fit(points: Sequence[tuple[float, float]]) -> tuple[Optional[float], Optional[float]]:
    """Least-squares (slope, intercept); None when fewer than two distinct x."""
    if len({x for x, _ in points}) < 2:
        return None, None
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    slope = (sum((x - mx) * (y - my) for x, y in points)
             / sum((x - mx) ** 2 for x, _ in points))
    return slope, my - slope * mx


def runs_cell(ok: int, failed: int) -> str:
    """A table's "runs" cell: how many counted, and how many failed if any did."""
    return f"{ok}" + (f" ({failed} failed)" if failed else "")


def dist_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def tool_version(argv: Sequence[str]) -> str:
    """The first line a tool prints for ``argv`` (``ssh -V``, ``git rev-parse``...)."""
    try:
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=20,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"
    text = (out.stdout + out.stderr).strip().splitlines()
    return text[0] if text else "unknown"


def checkout_commit() -> tuple[str, bool]:
    """The checkout's short commit, and whether anything outside bench/ is uncommitted."""
    commit = tool_version(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", ".",
                            ":(exclude)bench"], capture_output=True, text=True).stdout.strip()
    return commit, bool(dirty)


def machine_notes() -> dict[str, str]:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    commit, dirty = checkout_commit()
    pssh = pssh_path()
    return {
        "cpus": f"{os.cpu_count()} x {cpu}; kernel {platform.release()}",
        "python": f"{platform.python_version()} ({sys.executable})",
        "openssh": tool_version(["ssh", "-V"]),
        "parallel-ssh": tool_version([pssh, "--version"]) if pssh else "not installed",
        "fabric / invoke / paramiko": " / ".join(dist_version(d) for d in
                                                 ("fabric", "invoke", "paramiko")),
        "fdl_fabric commit": commit + (" (+ uncommitted changes outside bench/)"
                                       if dirty else ""),
    }


class BenchError(RuntimeError):
    """One run went wrong (a timeout, a missing line): the sample is recorded as failed."""


def wait_until(predicate: Callable[[], Any], what: str, timeout: float,
               interval: float = 0.02) -> Any:
    """``predicate()``'s first true value, polled every ``interval``; a `BenchError`
    naming ``what`` once ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def run_in_scratch(prefix: str, args: Any, bench: Callable[[Any, Path, TextIO], int],
                   cleanup: Callable[[], None], out: Optional[TextIO] = None) -> int:
    """``bench(args, folder, out)`` in a scratch folder that is removed afterwards
    (unless ``args.keep``), with ``cleanup()`` run whatever happens and TERM/INT turned
    into an orderly stop (`terminate_gracefully`). ``out``: where the report goes
    (stdout unless given: stderr when ``--json -`` takes stdout)."""
    import tempfile

    out = out or sys.stdout
    with terminate_gracefully():
        tmp = Path(tempfile.mkdtemp(prefix=prefix))
        try:
            return bench(args, tmp, out)
        finally:
            cleanup()
            if args.keep:
                out.write(f"kept {tmp}\n")
            else:
                shutil.rmtree(tmp, ignore_errors=True)


def kill_run(run_id: str) -> list[int]:
    """SIGKILL what is still there of a run (by pid; psutil checks it is the same
    process); the pids it found."""
    import psutil

    from fdl_fabric.testing import processes_of_run

    left = processes_of_run(run_id)
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    return [p.pid for p in left]


def write_machine_notes(out: TextIO, load_start: str, started: float,
                        **extra: str) -> None:
    """The closing block of a benchmark's report: the machine (and ``extra`` notes), the
    load at start and end, and how long it took (``started``: time.monotonic() at the
    start)."""
    out.write("\nmachine and method:\n")
    notes = {**machine_notes(), **extra}
    notes["load average at start / end"] = f"{load_start} / {loadavg()}"
    notes["elapsed"] = f"{time.monotonic() - started:.0f} s"
    for k, v in notes.items():
        out.write(f"  {k}: {v}\n")


def lab_processes(lab: Any) -> list[tuple[Any, str]]:
    """Every process under the lab's sshd listeners (sessions, agents, relays, ranks),
    each with its command line; those that vanish while listed are left out."""
    import psutil

    found: list[tuple[Any, str]] = []
    for host in lab.hosts:
        try:
            kids = psutil.Process(host.sshd.pid).children(recursive=True)
        except psutil.Error:
            continue
        for p in kids:
            try:
                found.append((p, " ".join(p.cmdline())))
            except psutil.Error:
                continue
    return found


def cpu_sum(procs: Sequence[Any]) -> float:
    """User+system CPU seconds of ``procs`` together (those already gone count 0)."""
    return sum(cpu_seconds(p.pid) or 0.0 for p in procs)
