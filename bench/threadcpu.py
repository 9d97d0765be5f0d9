"""The launcher's CPU by thread, each named by one ``py-spy dump`` (Python's threads
have no names the kernel knows): to all running, and over the idle window (issue 35)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional


def py_spy() -> Optional[str]:
    """The py-spy binary (the pyenv shim is a bash script: prefer the interpreter's own)."""
    own = Path(sys.executable).parent / "py-spy"
    if own.exists():
        return str(own)
    return shutil.which("py-spy")


def named_tids(pid: int) -> dict[str, str]:
    """The launcher's threads' ids and names (digits folded), from one ``py-spy dump``;
    empty when it cannot be had (no py-spy, or the launcher too busy to be dumped)."""
    binary = py_spy()
    if binary is None:
        return {}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        text = subprocess.run([binary, "dump", "--nonblocking", "--pid", str(pid)],
                              capture_output=True, text=True, timeout=60).stdout
        return {m.group(1): re.sub(r"\d+", "N", m.group(2)) for m in re.finditer(
            r'^Thread (\S+) \((?:idle|active)[^)]*\): "([^"]*)"', text, re.M)}
    return {}


def thread_names(pid: int) -> list[str]:
    """The launcher's threads by name, and each name's CPU so far (user, system)."""
    names: dict[str, int] = {}
    cpu: dict[str, list[float]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid, name in named_tids(pid).items():
        names[name] = names.get(name, 0) + 1
        user, system = thread_cpu(pid, tid, tick)
        sums = cpu.setdefault(name, [0.0, 0.0])
        sums[0] += user
        sums[1] += system
    total = sum(names.values())
    if not total:
        return ["threads by name: py-spy dump gave none (the launcher was busy; try again)"]
    return [f"threads at all running, by name ({total}): " + ", ".join(
        f"{n} x {k}" for k, n in sorted(names.items(), key=lambda kv: -kv[1])),
        "CPU to all running, by thread (user + system s, from /proc; live threads): " + ", ".join(
        f"{k} {u:.2f} + {s:.2f}" for k, (u, s) in sorted(cpu.items(), key=lambda kv: -sum(kv[1]))
        if u + s >= 0.005)]


def idle_by_thread(pid: int, before: dict[int, float], after: dict[int, float],
                    seconds: float) -> str:
    """The window's CPU by thread name, % of a core (threads named by `named_tids`)."""
    shares: dict[str, float] = {}
    for tid, name in named_tids(pid).items():
        with contextlib.suppress(ValueError):
            t = int(tid, 0)
            shares[name] = shares.get(name, 0.0) + after.get(t, 0.0) - before.get(t, 0.0)
    if not shares:
        return "idle CPU by thread: py-spy dump gave none"
    return "idle CPU in the window, by thread (% of a core): " + ", ".join(
        f"{k} {100.0 * v / seconds:.2f}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1])
        if v > 0)


def tasks_cpu(pid: int) -> dict[int, float]:
    """Every thread's user + system CPU so far, s, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    with contextlib.suppress(OSError):
        return {int(t): sum(thread_cpu(pid, t, tick)) for t in os.listdir(f"/proc/{pid}/task")}
    return {}


def thread_cpu(pid: int, tid: str, tick: int) -> tuple[float, float]:
    """One thread's user and system CPU so far, s (0 when it is gone or not a tid)."""
    try:
        fields = Path(f"/proc/{pid}/task/{int(tid, 0)}/stat").read_text().rpartition(")")[2]
    except (OSError, ValueError):
        return 0.0, 0.0
    utime, stime = fields.split()[11:13]
    return int(utime) / tick, int(stime) / tick
