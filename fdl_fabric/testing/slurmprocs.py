"""The processes of a Slurm lab: the daemons it started, and the job processes it finds.

A daemon (`Daemon`) is started in the foreground in a session of its own and stopped by
its Popen's pid only. Job processes are not the daemons' descendants (slurmd
double-forks slurmstepd), so they are found by what marks them as this lab's: the
lab's marker or ``SLURM_CLUSTER_NAME`` in their environment (`find_marked`), or, for the
slurmstepds, the lab files they hold open (`find_stepds`); never by name alone, since another
engineer's Slurm on the same machine runs slurmstepd too. `end_jobs` ends them in the
order `SlurmLab.stop` needs.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil

from .processes import gone, log_tail, own_lineage, terminate, tree_levels, wait_gone
from .slurmconf import MARKER_ENV


@dataclass
class Daemon:
    """One daemon the lab started: its argv, its Popen (pid = the daemon's) and logs."""

    name: str
    argv: list[str]
    out_path: str
    log_path: Optional[str]
    proc: Optional[subprocess.Popen[bytes]] = None

    def spawn(self, env: dict[str, str]) -> None:
        """Start in the foreground (no daemonizing: the Popen pid stays the daemon's).

        Own session: Ctrl-C in the test terminal must not reach the daemons before the
        fixture gets to stop them in order.  stdout/stderr go to ``out_path`` because
        errors before a daemon opens its log file (bad config) only appear there.
        """
        with open(self.out_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=env,
                start_new_session=True,
                close_fds=True,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self) -> str:
        parts = [f"--- {self.name} output {self.out_path}:\n{log_tail(self.out_path, 2000)}"]
        if self.log_path is not None and os.path.exists(self.log_path):
            parts.append(f"--- {self.name} log {self.log_path}:\n{log_tail(self.log_path)}")
        return "\n".join(parts)

    def stop(self, grace: float) -> None:
        """SIGTERM, then SIGKILL after ``grace``; by pid, through our own Popen only."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()


def _environ_entries(pid: int) -> set[bytes]:
    """The ``NAME=value`` entries of /proc/<pid>/environ, read tolerantly.

    psutil's ``environ()`` stops at the first empty entry, and daemons that set a process
    title (slurmstepd shows ``slurmstepd: [1.0]``) zero the start of that memory, so a
    marker further on would be missed.  Unreadable or vanished processes give nothing.
    """
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return {entry for entry in fh.read().split(b"\0") if entry}
    except OSError:
        return set()


def find_marked(lab_id: str, cluster: str, exclude: set[int]) -> list[psutil.Process]:
    """Live processes whose environment names this lab.

    Two markers: ``MARKER_ENV`` (daemons, clients run with ``lab.env``, their tasks) and
    ``SLURM_CLUSTER_NAME``, which Slurm itself sets in every job's environment (for tasks
    whose srun was started with some other environment).
    """
    tokens = {f"{MARKER_ENV}={lab_id}".encode(), f"SLURM_CLUSTER_NAME={cluster}".encode()}
    found = []
    for proc in psutil.process_iter():
        if proc.pid in exclude:
            continue
        if tokens & _environ_entries(proc.pid) and not gone(proc):
            found.append(proc)
    return found


def find_stepds(lab_id: str, folders: Sequence[Path], exclude: set[int]) -> list[psutil.Process]:
    """The slurmstepd processes of one lab.

    slurmd double-forks them (their parent is init) and their environment may be blanked
    by the process title, so they are recognised by what they hold open: their node's
    slurmd log (under the lab's ``log/``) or their step socket (under its spool folder).
    """
    marker = f"{MARKER_ENV}={lab_id}".encode()
    prefixes = tuple(str(folder) + os.sep for folder in folders)
    found = []
    for proc in psutil.process_iter(["name"]):
        if proc.pid in exclude or proc.info["name"] != "slurmstepd" or gone(proc):
            continue
        try:
            paths = [f.path for f in proc.open_files()]
            paths += [str(c.laddr) for c in proc.net_connections(kind="unix")]
        except (psutil.Error, OSError):
            paths = []
        if any(path.startswith(prefixes) for path in paths) or marker in _environ_entries(
            proc.pid
        ):
            found.append(proc)
    return found


@dataclass
class JobProcesses:
    """What ``SlurmLab.stop()`` ends before the daemons, grouped by how it is ended."""

    #: The lab's slurmstepds, left to exit once their tasks are gone.
    stepds: list[psutil.Process]
    #: The slurmstepds' descendants by depth (children first), to end deepest first.
    levels: list[list[psutil.Process]]
    #: Marked processes outside those trees: clients, and tasks that left with setsid.
    others: list[psutil.Process]


def stepd_trees(stepds: Sequence[psutil.Process],
                 skip: set[int]) -> tuple[list[list[psutil.Process]], set[int]]:
    """The descendants of every slurmstepd merged by depth, and all their pids.

    Merged by depth because `end_jobs` ends them level by level, deepest first, across
    all steps at once.  The pids tell which marked processes these trees already cover.
    Pids in ``skip`` (ours, the daemons') are left out.
    """
    levels: list[list[psutil.Process]] = []
    in_tree: set[int] = set()
    for stepd in stepds:
        for depth, level in enumerate(tree_levels(stepd.pid)):
            while len(levels) <= depth:
                levels.append([])
            fresh = [p for p in level if p.pid not in skip]
            levels[depth].extend(fresh)
            in_tree.update(p.pid for p in fresh)
    return levels, in_tree


def end_jobs(jobs: JobProcesses, grace: float) -> None:
    """End the job processes while the daemons still run: the tasks deepest first, then
    the other marked processes, then the slurmstepds, given ``grace`` to exit by
    themselves (they report to slurmd as they go) before they are terminated too."""
    for level in reversed(jobs.levels):
        terminate(level, grace)
    terminate(jobs.others, grace)
    lingering = wait_gone(jobs.stepds, grace)
    terminate(lingering, grace)


@dataclass(frozen=True)
class LabMarks:
    """What tells one lab's processes apart: its id (`MARKER_ENV`), its cluster name
    (``SLURM_CLUSTER_NAME``) and the folders its slurmstepds hold files in."""

    lab_id: str
    cluster: str
    folders: tuple[Path, ...]

    def marked(self, exclude: set[int]) -> list[psutil.Process]:
        return find_marked(self.lab_id, self.cluster, exclude)

    def stepds(self, exclude: set[int]) -> list[psutil.Process]:
        return find_stepds(self.lab_id, self.folders, exclude)

    def job_processes(self, skip: set[int]) -> JobProcesses:
        """The lab's job processes, apart from ``skip`` (ours and the daemons' trees). A
        slurmstepd that also carries the marker counts as a slurmstepd only, since
        slurmstepds are given time to exit by themselves."""
        marked = self.marked(skip)
        stepds = self.stepds(skip)
        stepd_pids = {p.pid for p in stepds}
        marked = [p for p in marked if p.pid not in stepd_pids]
        levels, in_tree = stepd_trees(stepds, skip)
        others = [p for p in marked if p.pid not in in_tree and p.pid not in stepd_pids]
        return JobProcesses(stepds, levels, others)

    def stragglers(self) -> list[psutil.Process]:
        """Once the daemons are gone: any marked process or slurmstepd the first sweep
        missed (one started while it ran); only our own lineage is spared now, since the
        daemons' trees have ended."""
        late = self.marked(own_lineage())
        late += self.stepds(own_lineage() | {p.pid for p in late})
        return late


def daemon_tree(daemons: Sequence[Daemon]) -> set[int]:
    """Pids of the live ``daemons`` and of all their descendants."""
    pids = set()
    for daemon in daemons:
        if daemon.proc is None or not daemon.alive():
            continue
        pids.add(daemon.proc.pid)
        with contextlib.suppress(psutil.Error):
            pids.update(p.pid for p in psutil.Process(daemon.proc.pid).children(True))
    return pids
