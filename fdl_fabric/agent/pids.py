"""Which processes are there, and which belong to a run: read from /proc, by pid *and*
start time (a recycled pid is never mistaken for the process it was), and stopping them.

The part of `procs` that knows processes rather than the registry: the agent's leash,
its watchdog and a cleanup's sweep all find and stop processes through it. Only this
user's processes are ever looked at, and this process and its ancestors never. Nothing
is ever selected by command line here (see `procs` for ``--pattern``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set

from fdl_fabric.rank import ENV_HOST_NAME, ENV_RUN_ID

#: The attempt a rank belongs to (torchrun's name; the plan sets it for every rank).
ENV_ATTEMPT = "TORCHELASTIC_RESTART_COUNT"

#: Seconds a sweep keeps sending KILL before it calls what survives a leftover.
KILL_WAIT = 2.0
#: How often a stop looks again at what is left.
STOP_POLL = 0.02


def stat_fields(pid: int) -> Optional[List[bytes]]:
    """The fields of /proc/<pid>/stat after the command name (state first, as field 3 of
    proc(5)); None when the process is gone. The name is skipped by its last ``)``: it
    may hold spaces and parentheses."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    return data[data.rindex(b")") + 2:].split()


def proc_stat(pid: int) -> Optional[tuple]:  # type: ignore[type-arg]
    """(pgid, start time in clock ticks since boot, state letter) of a process, or None."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    return int(fields[2]), int(fields[19]), fields[0].decode("ascii", "replace")


def start_time(pid: int) -> Optional[int]:
    st = proc_stat(pid)
    return None if st is None else int(st[1])


def alive(pid: int) -> bool:
    st = proc_stat(pid)
    return st is not None and st[2] not in ("Z", "X")


def _environ(pid: int) -> Optional[List[bytes]]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return fh.read().split(b"\0")
    except OSError:
        return None


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def own_pids() -> List[int]:
    """Pids of this user's processes, except this process and its ancestors."""
    uid = os.getuid()
    skip = _lineage()
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid in skip:
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
        except OSError:
            continue
        pids.append(pid)
    return pids


def boot_id() -> str:
    """This machine's boot id: equal on two processes means their pids name the same
    processes (one kernel, one boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def lineage() -> Dict[str, Any]:
    """This process and its ancestors, as ``{"boot", "pids": [[pid, start], ...]}``: what
    a cleanup sends so that an agent on the same machine spares it (`spared`)."""
    return {"boot": boot_id(),
            "pids": [[p, start_time(p)] for p in sorted(_lineage()) if start_time(p)]}


def spared(given: Any) -> Set[int]:
    """The pids of a `lineage` sent from this same machine that are still those
    processes (pid and start time both match); empty from another machine."""
    if not isinstance(given, dict) or not given.get("boot") or given["boot"] != boot_id():
        return set()
    out = set()
    for item in given.get("pids") or []:
        try:
            pid, start = int(item[0]), int(item[1])
        except (TypeError, ValueError, IndexError):
            continue
        if start_time(pid) == start:
            out.add(pid)
    return out


def _lineage() -> Set[int]:
    pids = {os.getpid()}
    pid = os.getppid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                data = fh.read()
            pid = int(data[data.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def carriers(run_id: str, host: str, attempt: Optional[int] = None) -> List[int]:
    """Live processes carrying this run's id and no other host's name (see the docstring);
    with ``attempt``, only that attempt's (``TORCHELASTIC_RESTART_COUNT``): two attempts
    of one run can meet on a host (one cut off by a partition, the next re-admitted), and
    what stops one must never touch the other."""
    run = f"{ENV_RUN_ID}={run_id}".encode()
    mine = f"{ENV_HOST_NAME}={host}".encode()
    prefix = f"{ENV_HOST_NAME}=".encode()
    turn = f"{ENV_ATTEMPT}=".encode()
    this_turn = turn + str(attempt).encode()
    found = []
    for pid in own_pids():
        env = _environ(pid)
        if env is None or run not in env:
            continue
        other = [e for e in env if e.startswith(prefix)]
        if other and mine not in other:
            continue
        if attempt is not None and this_turn not in env and any(e.startswith(turn) for e in env):
            continue
        if alive(pid):
            found.append(pid)
    return found


def group_members(pgid: int, leader_start: int) -> List[int]:
    """Live members of a rank's process group while its leader is still the one we started."""
    leader = proc_stat(pgid)
    if leader is None or leader[1] != leader_start or leader[2] in ("Z", "X"):
        return []
    found = []
    for pid in own_pids():
        st = proc_stat(pid)
        if st is not None and st[0] == pgid and st[2] not in ("Z", "X"):
            found.append(pid)
    return found


def descendants(roots: Iterable[int]) -> List[int]:
    """Live processes of this user below ``roots`` (the roots included), found through
    their parent pids: what a daemon started, whatever its group or environment."""
    parent: Dict[int, int] = {}
    for pid in own_pids():
        st = stat_fields(pid)
        if st is not None and st[0] not in (b"Z", b"X"):
            parent[pid] = int(st[1])
    wanted = set(roots)
    found: Set[int] = {p for p in wanted if p in parent}
    grew = True
    while grew:
        grew = False
        for pid, ppid in parent.items():
            if ppid in found and pid not in found:
                found.add(pid)
                grew = True
    return sorted(found)


def adopted(agent: int, keep: Iterable[int]) -> List[int]:
    """Processes reparented to ``agent`` (a child subreaper) and everything below them,
    except ``keep`` (its ranks, its watchdog, its helpers): a daemon that left its rank's
    group and cleared its environment still ends up here once its parent exits."""
    skip = set(keep)
    children = []
    for pid in own_pids():
        st = stat_fields(pid)
        if st is not None and int(st[1]) == agent and pid not in skip \
                and st[0] not in (b"Z", b"X"):
            children.append(pid)
    return descendants(children) if children else []


# -- stopping -------------------------------------------------------------------------------
def signal_pids(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def stop(current: Callable[[], List[int]], grace: float,
         wait: Callable[[float], None] = time.sleep) -> List[int]:
    """TERM what ``current()`` names, KILL what is still there after ``grace``.

    ``current`` is asked again at every step: a process being stopped may start others
    (a TERM handler that uploads a checkpoint), and those belong to the run too. Returns
    what survived KILL for `KILL_WAIT` seconds (stuck in the kernel, for example).
    ``wait`` lets the agent keep serving its event loop instead of sleeping.
    """
    termed: Set[int] = set()
    deadline = time.monotonic() + grace
    while True:
        pids = current()
        if not pids:
            return []
        fresh = [p for p in pids if p not in termed]
        signal_pids(fresh, signal.SIGTERM)
        termed.update(fresh)
        if time.monotonic() >= deadline:
            break
        wait(STOP_POLL)
    deadline = time.monotonic() + KILL_WAIT
    while True:
        pids = current()
        if not pids:
            return []
        signal_pids(pids, signal.SIGKILL)
        if time.monotonic() >= deadline:
            return pids
        wait(STOP_POLL)


def describe(pids: Sequence[int]) -> List[Dict[str, Any]]:
    return [{"pid": p, "cmdline": cmdline(p)[:200]} for p in pids]



__all__ = ["KILL_WAIT", "STOP_POLL", "adopted", "alive", "carriers", "cmdline", "describe",
           "descendants", "group_members", "own_pids", "proc_stat", "signal_pids", "start_time",
           "stat_fields", "stop"]


def pgid(pid: int) -> int:
    """``pid``'s process group, or -1 when it is gone."""
    try:
        return os.getpgid(pid)
    except OSError:
        return -1


def become_subreaper() -> None:
    """Adopt orphans (a rank's double-forked daemons) instead of letting init have them."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except Exception:
        pass
