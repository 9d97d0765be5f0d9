"""Where each rank is, on request: its Python stack (py-spy) and what /proc says.

Nothing here runs until the launcher asks (a hung run, Ctrl-\\, ``fdl-fabric stacks``):
collecting stacks costs the training nothing before that. The agent forks one
collector process per request (`start`), so its own loop, heartbeats included, goes on
while py-spy works; the collector writes one JSON document to a pipe and exits.

With ``py-spy`` on the host (``pip install fdl-fabric[stacks]``), every thread of each
rank's Python process is dumped (``py-spy dump --json``: the process is paused for a
few milliseconds). Without it, or for a process py-spy cannot read, the report holds
what /proc tells: the state letter, the kernel function it waits in (``wchan``), the
system call, and the CPU time it used while the collector looked (`CPU_WINDOW`).
Standard library only, Python 3.8+, like the rest of the agent.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from typing import Any, Dict, List, Optional, Tuple

from fdl_fabric.agent.forked import fork_with_pipe

#: Seconds py-spy may take for one process before it is given up.
PY_SPY_TIMEOUT = 10.0
#: Seconds over which a rank's CPU time is measured (while py-spy runs, or alone).
CPU_WINDOW = 1.0
#: Bounds of one rank's report: threads, frames per thread.
MAX_THREADS = 64
MAX_FRAMES = 64

#: Common x86_64 system calls, by number (/proc/<pid>/syscall gives only the number).
_X86_64_SYSCALLS = {
    0: "read", 1: "write", 7: "poll", 23: "select", 35: "nanosleep", 43: "accept",
    45: "recvfrom", 47: "recvmsg", 61: "wait4", 202: "futex", 230: "clock_nanosleep",
    232: "epoll_wait", 270: "pselect6", 271: "ppoll", 281: "epoll_pwait", 288: "accept4",
    441: "epoll_pwait2",
}


#: Names the py-spy to use (a path), or ``none`` for none, over the search below.
ENV_PY_SPY = "FLODL_PY_SPY"


def find_py_spy() -> Optional[str]:
    """The host's py-spy: `ENV_PY_SPY`, on PATH, or where pip puts scripts for this user
    or this Python."""
    chosen = os.environ.get(ENV_PY_SPY, "").strip()
    if chosen:
        return None if chosen.lower() == "none" else chosen
    found = shutil.which("py-spy")
    if found:
        return _past_shim(found)
    import sys

    for folder in (os.path.expanduser("~/.local/bin"), os.path.dirname(sys.executable),
                   "/usr/local/bin"):
        candidate = os.path.join(folder, "py-spy")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def _past_shim(path: str) -> str:
    """The py-spy binary behind a pyenv shim (a shell script that costs ~0.1 s of start-up
    per call, times every rank on a busy host), else ``path`` itself."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(512)
    except OSError:
        return path
    if not head.startswith(b"#!") or b"pyenv" not in head:
        return path
    import glob

    root = os.path.dirname(os.path.dirname(os.path.realpath(path)))
    for candidate in sorted(glob.glob(os.path.join(root, "versions", "*", "bin", "py-spy")),
                            reverse=True):
        with contextlib.suppress(OSError), open(candidate, "rb") as fh:
            if fh.read(4) == b"\x7fELF" and os.access(candidate, os.X_OK):
                return candidate
    return path


def _read(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read(4096).decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _cpu_ticks(pid: int) -> Optional[int]:
    text = _read(f"/proc/{pid}/stat")
    if not text or ")" not in text:
        return None
    fields = text[text.rindex(")") + 2:].split()
    try:
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (IndexError, ValueError):
        return None


def proc_facts(pid: int) -> Dict[str, Any]:
    """State, wchan and system call of a process, as /proc tells them."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return {"state": "gone"}
    state = stat[stat.rindex(")") + 2:].split()[0] if ")" in stat else "?"
    facts: Dict[str, Any] = {"state": state}
    wchan = _read(f"/proc/{pid}/wchan")
    if wchan and wchan != "0":
        facts["wchan"] = wchan
    call = _read(f"/proc/{pid}/syscall").split()
    if call:
        if call[0].isdigit():
            number = int(call[0])
            name = _X86_64_SYSCALLS.get(number) if os.uname().machine == "x86_64" else None
            facts["syscall"] = name or f"syscall {number}"
        else:
            facts["syscall"] = call[0]  # "running"
    facts["cmdline"] = _read(f"/proc/{pid}/cmdline").replace("\0", " ").strip()[:200]
    return facts


def _group(pgid: int) -> List[int]:
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        text = _read(f"/proc/{name}/stat")
        if ")" not in text:
            continue
        fields = text[text.rindex(")") + 2:].split()
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            members.append(int(name))
    return sorted(members)


def _is_python(pid: int) -> bool:
    try:
        exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return False
    return exe.startswith("python")


def python_target(pid: int) -> int:
    """The process to dump for a rank: its leader, or the first Python process of its
    group when the leader is not Python (``bash -c "python train.py"``)."""
    if _is_python(pid):
        return pid
    for member in _group(pid):
        if member != pid and _is_python(member):
            return member
    return pid


def _threads(data: Any) -> List[Dict[str, Any]]:
    """py-spy's JSON, cut to `MAX_THREADS` threads of `MAX_FRAMES` frames (innermost first),
    the main thread first."""
    threads: List[Dict[str, Any]] = []
    if not isinstance(data, list):
        return threads
    for item in data[:MAX_THREADS]:
        if not isinstance(item, dict):
            continue
        frames = []
        for f in (item.get("frames") or [])[:MAX_FRAMES]:
            if isinstance(f, dict):
                frames.append({"name": str(f.get("name", "?")),
                               "file": str(f.get("short_filename") or f.get("filename", "?")),
                               "path": str(f.get("filename", "")),
                               "line": f.get("line") if isinstance(f.get("line"), int) else 0})
        threads.append({"name": str(item.get("thread_name") or "?"),
                        "id": item.get("os_thread_id"), "active": bool(item.get("active")),
                        "frames": frames})
    threads.sort(key=lambda t: t["name"] != "MainThread")
    return threads


def collect(ranks: Dict[int, int], py_spy: Optional[str] = None) -> Dict[str, Any]:
    """Every rank's stack (``rank -> pid``): ``{"py_spy": path | None, "ranks": {...}}``."""
    py_spy = py_spy if py_spy is not None else find_py_spy()
    targets = {rank: python_target(pid) for rank, pid in ranks.items()}
    before = {rank: _cpu_ticks(pid) for rank, pid in targets.items()}
    started = time.monotonic()
    errors: Dict[int, str] = {}
    running = _start_dumps(py_spy, targets, errors) if py_spy else {}
    dumps = _finish_dumps(running, started + PY_SPY_TIMEOUT, errors)
    window = _end_cpu_window(started)
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    report: Dict[str, Any] = {}
    for rank, pid in targets.items():
        facts = _facts_over_window(pid, before[rank], tick, window)
        entry: Dict[str, Any] = {"pid": ranks[rank], "target": pid, "proc": facts}
        if rank in dumps:
            entry["threads"] = _threads(dumps[rank])
        if rank in errors:
            entry["error"] = errors[rank]
        elif not py_spy:
            entry["error"] = "py-spy is not installed on this host"
        report[str(rank)] = entry
    return {"py_spy": py_spy, "ranks": report}


def _start_dumps(py_spy: str, targets: Dict[int, int],
                 errors: Dict[int, str]) -> Dict[int, subprocess.Popen[bytes]]:
    """Start one ``py-spy dump`` per rank at once, so every dump runs within the same
    `PY_SPY_TIMEOUT`, however many ranks; a rank whose py-spy cannot start gets an error."""
    running: Dict[int, subprocess.Popen[bytes]] = {}
    for rank, pid in targets.items():
        try:
            running[rank] = subprocess.Popen(
                [py_spy, "dump", "--json", "--pid", str(pid)], stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as exc:
            errors[rank] = f"py-spy: {exc}"
    return running


def _finish_dumps(running: Dict[int, subprocess.Popen[bytes]], deadline: float,
                  errors: Dict[int, str]) -> Dict[int, Any]:
    """Each started dump's JSON by rank; why a rank has none goes to ``errors``. One
    ``deadline`` bounds them all, not one timeout per rank: a request for many hung ranks
    still answers within about `PY_SPY_TIMEOUT`."""
    dumps: Dict[int, Any] = {}
    for rank, proc in running.items():
        dump, error = _finish_dump(proc, deadline)
        if error is not None:
            errors[rank] = error
        else:
            dumps[rank] = dump
    return dumps


def _finish_dump(proc: subprocess.Popen[bytes], deadline: float) -> Tuple[Any, Optional[str]]:
    """(py-spy's JSON, None) or (None, why there is none). The error tells success apart,
    not the JSON, which may be ``null``. A py-spy still running at ``deadline`` (a target
    it cannot pause) is killed and reaped, so the collector leaves nothing behind."""
    try:
        out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None, f"py-spy gave no stack within {PY_SPY_TIMEOUT:g}s"
    if proc.returncode != 0:
        text = (err or out).decode("utf-8", "replace").strip().splitlines()
        return None, "py-spy: " + (text[-1][:300] if text else
                                   f"exit status {proc.returncode}")
    try:
        return json.loads(out.decode("utf-8", "replace")), None
    except ValueError:
        return None, "py-spy: unreadable output"


def _end_cpu_window(started: float) -> float:
    """Sleep out what is left of `CPU_WINDOW` since ``started`` (py-spy may have used it
    all) and return the window's length: CPU time over too short a window says little."""
    left = CPU_WINDOW - (time.monotonic() - started)
    if left > 0:
        time.sleep(left)
    return time.monotonic() - started


def _facts_over_window(pid: int, before: Optional[int], tick: int,
                       window: float) -> Dict[str, Any]:
    """`proc_facts` of ``pid``, with the CPU seconds it used over the window when both
    ends of it could be read (the process may have ended meanwhile)."""
    facts = proc_facts(pid)
    after = _cpu_ticks(pid)
    if before is not None and after is not None:
        facts["cpu"] = round((after - before) / tick, 2)
        facts["window"] = round(window, 2)
    return facts


def start(ranks: Dict[int, int]) -> Optional[Tuple[int, int]]:
    """Fork a collector for ``ranks``; (its pid, the read end of its result pipe), or None.

    The agent is single-threaded, so forking is safe; the child resets the agent's
    signal set-up, writes JSON to the pipe and exits without touching the agent's stdio.
    """
    forked = fork_with_pipe(lambda read_fd, write_fd: _collector(ranks, read_fd, write_fd))
    if forked is None:
        return None
    pid, read_fd, write_fd = forked
    os.close(write_fd)
    return pid, read_fd


def _collector(ranks: Dict[int, int], read_fd: int,
               write_fd: int) -> None:  # pragma: no cover - the collector; via the agent
    os.close(read_fd)
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGHUP, signal.SIGTERM, signal.SIGINT,
                signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    try:
        result = collect(ranks)
    except Exception as exc:
        result = {"error": f"collector failed: {exc!r}", "ranks": {}}
    data = json.dumps(result).encode("utf-8")
    while data:
        data = data[os.write(write_fd, data):]


def read_result(data: bytes) -> Dict[str, Any]:
    """The collector's JSON, or an error report when it died without writing it."""
    with contextlib.suppress(ValueError, UnicodeDecodeError):
        obj = json.loads(data.decode("utf-8"))
        if isinstance(obj, dict):
            return obj
    return {"error": "the stack collector ended without a report", "ranks": {}}
