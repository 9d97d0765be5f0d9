"""Process helpers the labs share: free ports, log tails, stopping process trees.

Every lab stops only what it started: processes are found from the daemons it spawned
(their process trees, level by level) or by an environment marker it set, and signalled
by pid, never by name.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import psutil

#: How often a wait for processes to go looks again.
POLL = 0.01


class LabError(RuntimeError):
    """A lab daemon failed to start or restart; the message carries its log."""


def free_port(addr: str) -> int:
    """A TCP port nobody listens on at ``addr``, found by letting the kernel pick one.

    There is a window between closing this socket and sshd binding the port; start()
    retries on "Address already in use", and the random per-lab addresses make even that
    practically impossible.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((addr, 0))
        port: int = sock.getsockname()[1]
        return port


def master_port() -> int:
    """The ``master_port`` (torch's store) of this test process's lab runs.

    Not `free_port`: torch binds it only once its ranks are up, seconds later, and a
    port the kernel picked is in the ephemeral range that every outgoing connection of
    the other tests draws its source port from. Not 29500 for all: two pytest-xdist
    workers run lab tests at once. So 29500 plus ten per worker (``gw3``: 29530), below
    the ephemeral range; one worker's tests run one after another, as the serial suite's
    all did on 29500."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    return 29500 + 10 * index


def log_tail(path: str, limit: int = 4000) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
    return text if len(text) <= limit else "...\n" + text[-limit:]


def gone(proc: psutil.Process) -> bool:
    """Dead or a zombie.

    Zombies count as gone: orphans are re-parented to pid 1, and some container inits
    (including the one on our CI machines) reap them late or never.
    """
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def wait_gone(procs: Iterable[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Poll until every process is gone; return the survivors.

    psutil.wait_procs is not usable here: for non-children it polls pid existence, and a
    zombie that init does not reap "exists" forever.
    """
    alive = [p for p in procs if not gone(p)]
    deadline = time.monotonic() + timeout
    while alive and time.monotonic() < deadline:
        time.sleep(POLL)
        alive = [p for p in alive if not gone(p)]
    return alive


def terminate(procs: Sequence[psutil.Process], grace: float) -> None:
    """SIGTERM, wait up to ``grace`` seconds, then SIGKILL the survivors.

    psutil checks for pid reuse before signalling, so a process that exited while we
    waited cannot make us signal an unrelated newcomer with the same pid.
    """
    alive = [p for p in procs if not gone(p)]
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    survivors = wait_gone(alive, grace)
    for proc in survivors:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    wait_gone(survivors, 1.0)


def own_lineage() -> set[int]:
    """Our pid and our ancestors': never candidates for cleanup, whatever their env says."""
    pids = {0, 1, os.getpid()}
    with contextlib.suppress(psutil.Error):
        pids.update(p.pid for p in psutil.Process().parents())
    return pids


def tree_levels(root_pid: int) -> list[list[psutil.Process]]:
    """Descendants of ``root_pid`` grouped by depth (children first), zombies excluded."""
    try:
        frontier = [psutil.Process(root_pid)]
    except psutil.Error:
        return []
    levels: list[list[psutil.Process]] = []
    seen = {root_pid}
    while frontier:
        level = []
        for proc in frontier:
            try:
                kids = proc.children()
            except psutil.Error:
                continue
            for kid in kids:
                if kid.pid not in seen and not gone(kid):
                    seen.add(kid.pid)
                    level.append(kid)
        if level:
            levels.append(level)
        frontier = level
    return levels




class Stoppable(Protocol):
    def stop(self) -> None: ...


_LIVE_LABS: set[Stoppable] = set()
_LIVE_LOCK = threading.Lock()


def stop_at_exit(lab: Stoppable) -> None:
    """Stop ``lab`` when the interpreter exits, if nobody stopped it before (a script
    crashed, forgot ``with``): a lab's daemons must never outlive the test run."""
    with _LIVE_LOCK:
        _LIVE_LABS.add(lab)


def stopped(lab: Stoppable) -> None:
    """``lab`` stopped itself: nothing left to do for it at exit."""
    with _LIVE_LOCK:
        _LIVE_LABS.discard(lab)


@atexit.register
def _stop_live_labs() -> None:
    with _LIVE_LOCK:
        labs = list(_LIVE_LABS)
    for lab in labs:
        with contextlib.suppress(Exception):
            lab.stop()
