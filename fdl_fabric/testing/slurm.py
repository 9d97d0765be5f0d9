"""The Slurm lab: a real, private Slurm cluster on this machine, for tests.

Why real daemons rather than a fake ``srun`` on PATH: what the launcher has to get right
under Slurm (how steps share an allocation, what ``scancel`` sends and when, what srun
prints when a node dies, which processes belong to which job) is behaviour of slurmctld,
slurmd and slurmstepd themselves, and a fake would agree with whatever we assumed.  The
lab therefore runs genuine daemons: its own ``munged``, one ``slurmctld`` and N ``slurmd``
on one host, each slurmd posing as a node (``slurmd -N n1``) with its own port, spool
folder and log, all on 127.0.0.1.

Public API::

    with SlurmLab(tmp_path, n_nodes=3) as lab:
        out = lab.run(lab.salloc_argv(3, "scontrol show hostnames"))

or, in pytest, with ``pytest_plugins = ["fdl_fabric.testing.fixtures"]`` in a conftest::

    def test_something(slurm_lab):
        lab = slurm_lab(n_nodes=3)

The lab is private in every way that matters on a shared machine: it writes nothing under
/etc and never talks to a system munged or slurmctld.  Its munged has its own key, socket,
pid and seed files under ``root`` (slurm.conf ``AuthInfo=socket=...`` points the daemons
and clients at it), its ports are picked free at start, and its ``ClusterName`` is unique.
Clients must run with ``lab.env`` (``SLURM_CONF`` names the lab's slurm.conf).  ``stop()``
ends only the processes the lab started or that carry its marker (see ``MARKER_ENV``).

It needs Slurm's daemons and clients (Debian/Ubuntu packages ``slurm-wlm``, i.e.
``slurmctld`` + ``slurmd`` + ``slurm-client``) and ``munge``; it runs them as the current
user (our CI runs as root).  ``sacct`` does not work: there is no slurmdbd.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import psutil

from .processes import (
    LabError,
    free_port,
    gone,
    log_tail,
    own_lineage,
    stop_at_exit,
    stopped,
    terminate,
    tree_levels,
    wait_gone,
)

__all__ = [
    "MARKER_ENV",
    "SlurmLab",
    "SlurmLabError",
    "slurm_missing",
]

#: Environment variable carried by every daemon of a lab and by every client started with
#: ``lab.env``; srun hands the client's environment to the tasks, so job processes carry
#: it too.  Its value is the lab's id.  ``stop()`` uses it to find processes that escaped
#: the daemons' process trees (slurmd double-forks slurmstepd, so slurmstepd and the tasks
#: are re-parented to init and are never descendants of slurmd).
MARKER_ENV = "FDL_FABRIC_SLURM_LAB"

#: Daemons live in sbin, which root's PATH may lack (``su`` without ``-``, cron, CI).
_SBIN_PATH = "/usr/local/sbin:/usr/sbin:/sbin"
_DAEMONS = ("munged", "slurmctld", "slurmd")
_CLIENTS = ("sinfo", "scontrol", "srun", "salloc")

#: Environment variables a client must not inherit from whoever runs the tests: inside a
#: real Slurm job, SLURM_JOB_ID & co. would make the lab's srun try to join that job.
_INHERITED_PREFIXES = ("SLURM_", "SALLOC_", "SBATCH_", "SRUN_", "SQUEUE_", "SINFO_", "SCANCEL_")

#: Unix socket paths are limited to 108 bytes (sun_path); slurmstepd puts
#: ``<spool>/<node>_<job>.<step>`` sockets in each node's spool folder.
_MAX_SOCKET_DIR = 70

_POLL = 0.05


class SlurmLabError(LabError):
    """A daemon of the Slurm lab failed to start or the nodes never became idle."""


# --------------------------------------------------------------------------------------
# Discovery
# --------------------------------------------------------------------------------------


def _which(name: str) -> Optional[str]:
    return shutil.which(name) or shutil.which(name, path=_SBIN_PATH)


def slurm_missing() -> Optional[str]:
    """Why this machine cannot run a Slurm lab (which programs are missing), or None.

    A test suite should skip with this reason, not fail: unlike sshd, Slurm is not
    something every developer machine has.  CI installs it, and there it is not None.
    """
    missing = [name for name in (*_DAEMONS, *_CLIENTS) if _which(name) is None]
    if not missing:
        return None
    return (
        f"the Slurm lab needs {', '.join(missing)}, not found: install the slurm-wlm "
        "and munge packages (e.g. `apt-get install slurm-wlm munge`)"
    )


def _require(name: str) -> str:
    found = _which(name)
    if found is None:
        raise SlurmLabError(slurm_missing() or f"{name} not found")
    return os.path.abspath(found)


# --------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ports:
    slurmctld: int
    nodes: tuple[int, ...]


def _render_slurm_conf(lab: SlurmLab, ports: _Ports) -> str:
    """slurm.conf for the lab; every path absolute, every file under the lab's folders.

    Choices that are not Slurm defaults, and why:

    * ``SlurmctldHost=localhost(127.0.0.1)`` and ``NodeHostname=localhost`` for all nodes:
      slurmctld accepts "localhost" as its own name, and each slurmd is told which node it
      is with ``-N``; per-node ``Port=`` keeps them apart.
    * ``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none`` by default: no
      cgroups (containers and CI rarely let us write them) and no CPU binding, so the
      tasks of N fake nodes are not all pinned to the same real core.
    * ``SlurmdParameters=config_overrides``: nodes are what slurm.conf says (CPUs,
      memory), whatever this machine has; otherwise a 3-node lab with 4 CPUs per node on
      a 2-core machine would be drained for "Low CPU count".
    * ``ReturnToService=2``: a slurmd killed and started again by a test comes back
      into service by itself instead of staying DOWN.
    * ``SchedulerType=sched/builtin``: jobs start as soon as nodes are free, without the
      backfill scheduler's periodic passes.
    * Short ``KillWait``/``SlurmdTimeout``/``MessageTimeout`` (see the constructor): a
      lab is for tests, where waiting 30 s for SIGKILL or 300 s for a dead node to be
      noticed is only slowness.
    """
    n = lab.n_nodes
    nodes = f"{lab.node_prefix}[1-{n}]" if n > 1 else f"{lab.node_prefix}1"
    node_ports = (
        f"{ports.nodes[0]}-{ports.nodes[-1]}"
        if list(ports.nodes) == list(range(ports.nodes[0], ports.nodes[0] + n))
        else ",".join(str(p) for p in ports.nodes)
    )
    gres = f" Gres=gpu:{lab.gpus_per_node}" if lab.gpus_per_node else ""
    lines = [
        "# Written by fdl_fabric.testing.slurm; regenerated on every start.",
        f"ClusterName={lab.cluster_name}",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={ports.slurmctld}",
        f"SlurmdPort={ports.nodes[0]}",
        f"SlurmUser={lab.user}",
        f"SlurmdUser={lab.user}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={lab.munge_socket}",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "ProctrackType=proctrack/linuxproc",
        f"TaskPlugin={lab.task_plugin}",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/builtin",
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "JobAcctGatherType=jobacct_gather/none",
        f"StateSaveLocation={lab.root / 'state'}",
        f"SlurmctldPidFile={lab.root / 'run' / 'slurmctld.pid'}",
        f"SlurmctldLogFile={lab.root / 'log' / 'slurmctld.log'}",
        f"SlurmdSpoolDir={lab.spool_root}/%n",
        f"SlurmdPidFile={lab.root / 'run' / 'slurmd-%n.pid'}",
        f"SlurmdLogFile={lab.root / 'log' / 'slurmd-%n.log'}",
        f"SlurmctldDebug={lab.debug}",
        f"SlurmdDebug={lab.debug}",
        f"KillWait={lab.kill_wait}",
        f"SlurmdTimeout={lab.slurmd_timeout}",
        f"MessageTimeout={lab.message_timeout}",
        f"InactiveLimit={lab.inactive_limit}",
        f"MinJobAge={lab.min_job_age}",
    ]
    if lab.gpus_per_node:
        lines.append("GresTypes=gpu")
    lines += [
        *lab.extra_conf,
        f"NodeName={nodes} NodeHostname=localhost NodeAddr=127.0.0.1 Port={node_ports} "
        f"CPUs={lab.cpus_per_node} RealMemory={lab.real_memory}{gres} State=UNKNOWN",
        f"PartitionName={lab.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


def _render_gres_conf(lab: SlurmLab) -> str:
    """gres.conf for fake GPUs: ``<root>/dev/gpu<i>``, symlinks to /dev/null.

    Slurm drops GPUs declared without ``File=`` ("Removing file-less GPU") and complains
    about files that are not devices, so each fake GPU is a link to a character device;
    the index in its name is what Slurm hands out (CUDA_VISIBLE_DEVICES, SLURM_STEP_GPUS).
    With ``task/none`` nothing is constrained: Slurm only allocates and accounts for the
    GPUs as it would for real ones, which is what launcher tests look at.
    """
    last = lab.gpus_per_node - 1
    files = f"{lab.root / 'dev' / 'gpu'}[0-{last}]" if last else f"{lab.root / 'dev' / 'gpu'}0"
    return f"AutoDetect=off\nName=gpu File={files}\n"


# --------------------------------------------------------------------------------------
# Daemons
# --------------------------------------------------------------------------------------


@dataclass
class _Daemon:
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


def _marked(lab_id: str, cluster: str, exclude: set[int]) -> list[psutil.Process]:
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


def _stepds(lab_id: str, folders: Sequence[Path], exclude: set[int]) -> list[psutil.Process]:
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
class _JobProcesses:
    """What ``SlurmLab.stop()`` ends before the daemons, grouped by how it is ended."""

    #: The lab's slurmstepds, left to exit once their tasks are gone.
    stepds: list[psutil.Process]
    #: The slurmstepds' descendants by depth (children first), to end deepest first.
    levels: list[list[psutil.Process]]
    #: Marked processes outside those trees: clients, and tasks that left with setsid.
    others: list[psutil.Process]


def _stepd_trees(stepds: Sequence[psutil.Process],
                 skip: set[int]) -> tuple[list[list[psutil.Process]], set[int]]:
    """The descendants of every slurmstepd merged by depth, and all their pids.

    Merged by depth because `_end_jobs` ends them level by level, deepest first, across
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


def _end_jobs(jobs: _JobProcesses, grace: float) -> None:
    """End the job processes while the daemons still run: the tasks deepest first, then
    the other marked processes, then the slurmstepds, given ``grace`` to exit by
    themselves (they report to slurmd as they go) before they are terminated too."""
    for level in reversed(jobs.levels):
        terminate(level, grace)
    terminate(jobs.others, grace)
    lingering = wait_gone(jobs.stepds, grace)
    terminate(lingering, grace)


# --------------------------------------------------------------------------------------
# The lab
# --------------------------------------------------------------------------------------

class SlurmLab:
    """One slurmctld and ``n_nodes`` slurmd (nodes ``n1..nN``) with a private munged.

    Everything lives under ``root``: ``slurm.conf`` (and ``gres.conf``), ``munge/`` (key,
    socket, pid and seed files), ``state/`` (slurmctld's StateSaveLocation), ``spool/<node>``,
    ``run/`` (pid files) and ``log/`` (``slurmctld.log``, ``slurmd-<node>.log``, and
    ``<daemon>.out`` for what a daemon printed before opening its log).  When ``root`` is
    too long for Unix socket paths, the munge socket and spool folders go to a short
    private folder under the system temp folder instead, removed by ``stop()``.

    Timing knobs are Slurm's, with test-friendly defaults: ``kill_wait`` (seconds between
    SIGTERM and SIGKILL when a job is cancelled or times out; Slurm's default is 30),
    ``slurmd_timeout`` (how long slurmctld waits for an unresponsive slurmd before marking
    the node DOWN; default 300), ``message_timeout`` (round trip of one RPC; default 10),
    ``inactive_limit`` (seconds after which a job whose srun/salloc vanished is killed;
    0 = never, Slurm's default) and ``min_job_age`` (how long finished jobs stay visible
    to ``scontrol show job``).  ``gpus_per_node`` declares that many counted, fake GPUs
    (gres ``gpu``) per node; ``task_plugin`` may be ``task/affinity`` to have Slurm bind
    tasks to CPUs (every node's CPU 0 is this machine's CPU 0).  ``extra_conf`` appends
    lines to slurm.conf before the node and partition lines; for a key that the lab
    already sets (e.g. ``SelectTypeParameters=CR_Core_Memory``) the later line wins.

    A lab is started once: ``stop()`` is final (idempotent), make a new lab to start over.
    """

    def __init__(
        self,
        root: Union[str, os.PathLike[str]],
        n_nodes: int = 3,
        cpus_per_node: int = 2,
        *,
        real_memory: int = 2000,
        gpus_per_node: int = 0,
        node_prefix: str = "n",
        partition: str = "debug",
        task_plugin: str = "task/none",
        kill_wait: int = 2,
        slurmd_timeout: int = 30,
        message_timeout: int = 5,
        inactive_limit: int = 0,
        min_job_age: int = 300,
        debug: str = "info",
        extra_conf: Sequence[str] = (),
        startup_timeout: float = 30.0,
        kill_grace: float = 2.0,
    ) -> None:
        """Prepare (but do not start) a lab; see ``start()``."""
        self.root = Path(os.path.abspath(root))
        if re.search(r"[\s\"'\\%#=,]", str(self.root)):
            # slurm.conf has no quoting for paths, and %n is expanded in SlurmdSpoolDir.
            raise ValueError(f"lab root must not contain whitespace, quotes, %, # = or ,: "
                             f"{self.root}")
        if n_nodes < 1:
            raise ValueError("n_nodes must be at least 1")
        if cpus_per_node < 1:
            raise ValueError("cpus_per_node must be at least 1")
        if not re.fullmatch(r"[a-z][a-z_]*", node_prefix):
            raise ValueError(f"node_prefix must be lowercase letters: {node_prefix!r}")
        self.n_nodes = n_nodes
        self.cpus_per_node = cpus_per_node
        self.real_memory = real_memory
        self.gpus_per_node = gpus_per_node
        self.node_prefix = node_prefix
        self.partition = partition
        self.task_plugin = task_plugin
        self.kill_wait = kill_wait
        self.slurmd_timeout = slurmd_timeout
        self.message_timeout = message_timeout
        self.inactive_limit = inactive_limit
        self.min_job_age = min_job_age
        self.debug = debug
        self.extra_conf = tuple(extra_conf)
        self.startup_timeout = startup_timeout
        self.kill_grace = kill_grace
        self.user = psutil.Process().username()

        #: Distinguishes this lab's processes from any other lab's (see MARKER_ENV).
        self.lab_id = secrets.token_hex(6)
        #: Unique too: Slurm puts it in every job's environment (SLURM_CLUSTER_NAME).
        self.cluster_name = f"fdl{self.lab_id}"
        self.nodes: list[str] = [f"{node_prefix}{i + 1}" for i in range(n_nodes)]
        self.conf_path = self.root / "slurm.conf"
        self._short_dir: Optional[str] = None
        self._set_runtime_dir(self.root)
        self.munge_key = str(self.root / "munge-key" / "munge.key")
        #: Environment for client commands (complete, not a diff): ours without inherited
        #: SLURM_* settings, plus SLURM_CONF and the lab marker.  Filled by ``start()``.
        self.env: dict[str, str] = {}
        self.ports: Optional[_Ports] = None
        self._daemons: list[_Daemon] = []
        self._started = False
        self._stopped = False

    def _set_runtime_dir(self, runtime: Path) -> None:
        """Where the Unix sockets go: the munge socket and the slurmd spool folders."""
        self.munge_dir = runtime / "munge"
        self.munge_socket = str(self.munge_dir / "munge.socket")
        self.spool_root = runtime / "spool"

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> SlurmLab:
        """Write the configs, start munged, slurmctld and every slurmd; wait until idle.

        Raises SlurmLabError (with the daemons' log tails) when a daemon exits or the
        nodes are not all idle within ``startup_timeout``.  On any failure everything
        already started is stopped before the error propagates.
        """
        if self._stopped:
            raise SlurmLabError("a stopped lab cannot be started again; make a new SlurmLab")
        if self._started:
            return self
        self._started = True
        stop_at_exit(self)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        binaries = {name: _require(name) for name in (*_DAEMONS, *_CLIENTS)}
        if len(str(self.root)) > _MAX_SOCKET_DIR:
            self._short_dir = tempfile.mkdtemp(prefix="fdl-slurm-")
            self._set_runtime_dir(Path(self._short_dir))
        # A fresh cluster every start: slurmctld refuses state saved under another
        # ClusterName (and every lab has its own), and old logs would mislead error tails.
        for stale in (self.root / "state", self.root / "log", self.root / "run", self.spool_root):
            shutil.rmtree(stale, ignore_errors=True)
        for sub in ("state", "run", "log", "munge-key"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "munge-key").chmod(0o700)
        # munged wants the socket's folder and every folder above it to be searchable by
        # all users, so that any user's client can reach it; pytest's tmp_path is below a
        # 0700 folder.  Our clients and daemons all run as us, so ``--force`` (which turns
        # that error into a warning) is safe here.  The key must be readable only by us.
        self.munge_dir.mkdir(parents=True, exist_ok=True)
        self.munge_dir.chmod(0o755)
        for node in self.nodes:
            (self.spool_root / node).mkdir(parents=True, exist_ok=True)
        key = Path(self.munge_key)
        if not key.exists():
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(os.urandom(128))  # what `mungekey --create` writes: 1024 bits

        base_env = {
            k: v for k, v in os.environ.items() if not k.startswith(_INHERITED_PREFIXES)
        }
        base_env["PATH"] = base_env.get("PATH", "/usr/bin:/bin") + ":" + _SBIN_PATH
        base_env["SLURM_CONF"] = str(self.conf_path)
        base_env[MARKER_ENV] = self.lab_id
        self.env = dict(base_env)

        munged = _Daemon(
            "munged",
            [binaries["munged"], "--foreground", "--force", f"--socket={self.munge_socket}",
             f"--key-file={self.munge_key}", f"--pid-file={self.munge_dir / 'munged.pid'}",
             f"--seed-file={self.munge_dir / 'munged.seed'}",
             f"--log-file={self.root / 'log' / 'munged.log'}"],
            str(self.root / "log" / "munged.out"),
            None,
        )
        self._daemons.append(munged)
        munged.spawn(base_env)
        self._wait_munge(munged)

        for attempt in range(3):
            self.ports = _Ports(
                slurmctld=free_port("127.0.0.1"),
                nodes=tuple(free_port("127.0.0.1") for _ in self.nodes),
            )
            self.conf_path.write_text(_render_slurm_conf(self, self.ports))
            gres_path = self.root / "gres.conf"
            if self.gpus_per_node:
                (self.root / "dev").mkdir(exist_ok=True)
                for index in range(self.gpus_per_node):
                    fake = self.root / "dev" / f"gpu{index}"
                    if not fake.is_symlink():
                        fake.symlink_to(os.devnull)
                gres_path.write_text(_render_gres_conf(self))
            elif gres_path.exists():
                gres_path.unlink()
            slurm = self._slurm_daemons(binaries)
            self._daemons.extend(slurm)
            for daemon in slurm:
                daemon.spawn(base_env)
            try:
                self._wait_idle(slurm)
                return
            except SlurmLabError as exc:
                lost_port = "Address already in use" in str(exc)
                if not lost_port or attempt == 2:
                    raise
                # Lost the race for a port probed by free_port: again, on other ports.
                for daemon in reversed(slurm):
                    daemon.stop(self.kill_grace)
                    self._daemons.remove(daemon)

    def _slurm_daemons(self, binaries: dict[str, str]) -> list[_Daemon]:
        log = self.root / "log"
        conf = str(self.conf_path)
        daemons = [
            _Daemon(
                "slurmctld",
                [binaries["slurmctld"], "-D", "-f", conf],
                str(log / "slurmctld.out"),
                str(log / "slurmctld.log"),
            )
        ]
        for node in self.nodes:
            daemons.append(
                _Daemon(
                    f"slurmd {node}",
                    [binaries["slurmd"], "-D", "-f", conf, "-N", node],
                    str(log / f"slurmd-{node}.out"),
                    str(log / f"slurmd-{node}.log"),
                )
            )
        return daemons

    def _wait_munge(self, munged: _Daemon) -> None:
        """Until munged accepts connections on its socket (or exits: its output says why)."""
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if not munged.alive():
                raise SlurmLabError(f"munged exited during startup:\n{munged.tail()}")
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                try:
                    sock.connect(self.munge_socket)
                    return
                except OSError:
                    pass
            if time.monotonic() > deadline:
                raise SlurmLabError(
                    f"munged not answering on {self.munge_socket} after "
                    f"{self.startup_timeout:.0f} s:\n{munged.tail()}"
                )
            time.sleep(_POLL)

    def _wait_idle(self, daemons: Sequence[_Daemon],
                   nodes: Optional[Sequence[str]] = None) -> None:
        """Until ``sinfo`` reports ``nodes`` (default: every node) ``idle`` (registered,
        responding, usable) or, for a node named, in use by a job (``alloc``, ``mix``)."""
        usable = ("idle",) if nodes is None else ("idle", "alloc", "mix")
        nodes = self.nodes if nodes is None else nodes
        deadline = time.monotonic() + self.startup_timeout
        states: dict[str, str] = {}
        last = ""
        while True:
            dead = [d for d in daemons if not d.alive()]
            if dead:
                details = "\n".join(d.tail() for d in dead)
                raise SlurmLabError(
                    f"{', '.join(d.name for d in dead)} exited during startup:\n{details}"
                )
            result = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=10)
            last = (result.stdout + result.stderr).strip()
            if result.returncode == 0:
                states = dict(line.split(None, 1) for line in result.stdout.splitlines()
                              if " " in line)
                if all(states.get(node) in usable for node in nodes):
                    return
            if time.monotonic() > deadline:
                details = "\n".join(d.tail() for d in self._daemons)
                raise SlurmLabError(
                    f"Slurm lab nodes not all idle after {self.startup_timeout:.0f} s "
                    f"(sinfo: {last or '<nothing>'}):\n{details}"
                )
            time.sleep(0.2)

    def stop(self) -> None:
        """Stop every job process, then the daemons; only what this lab started.

        Order matters.  First the job processes: slurmstepd's descendants (the tasks),
        deepest first, and any process carrying the lab's marker (clients run with
        ``lab.env``, tasks that left their slurmstepd's tree with ``setsid``); then the
        slurmstepds, which exit by themselves once their tasks are gone but are killed if
        they linger; then slurmd, slurmctld and munged, each by its Popen's pid.  Daemons
        go last so that slurmstepd can still report to slurmd while it winds down, instead
        of hanging on retries to a dead daemon.  Processes are found by our marker and
        ``SLURM_CLUSTER_NAME`` in their environment, and slurmstepds by the lab files they
        hold open, never by name alone: another engineer's Slurm on the same machine runs
        slurmstepd too.  Idempotent.
        """
        if self._started:
            self._stopped = True
        grace = self.kill_grace
        # Daemons and their helpers (slurmctld's slurmscriptd) stop with their daemon.
        skip = own_lineage() | self._daemon_tree()
        _end_jobs(self._job_processes(skip), grace)
        self._stop_daemons(grace)
        self._end_stragglers(grace)
        if self._short_dir is not None:
            shutil.rmtree(self._short_dir, ignore_errors=True)
        stopped(self)

    def _job_processes(self, skip: set[int]) -> _JobProcesses:
        """This lab's job processes, apart from ``skip`` (ours and the daemons' trees).

        Nothing is looked for when the lab has no daemon (never started): no job can
        exist then.  A slurmstepd that also carries the marker counts as a slurmstepd
        only, since slurmstepds are given time to exit by themselves.
        """
        if not self._daemons:
            return _JobProcesses([], [], [])
        marked = _marked(self.lab_id, self.cluster_name, skip)
        stepds = self._stepds(skip)
        stepd_pids = {p.pid for p in stepds}
        marked = [p for p in marked if p.pid not in stepd_pids]
        levels, in_tree = _stepd_trees(stepds, skip)
        others = [p for p in marked if p.pid not in in_tree and p.pid not in stepd_pids]
        return _JobProcesses(stepds, levels, others)

    def _stop_daemons(self, grace: float) -> None:
        """Each daemon by its Popen's pid, in reverse start order: every slurmd before
        slurmctld, and munged last, since the others authenticate through it."""
        for daemon in reversed(self._daemons):
            daemon.stop(grace)

    def _end_stragglers(self, grace: float) -> None:
        """A last sweep once the daemons are gone, for any marked process or slurmstepd
        that the first sweep missed (one started while it ran); only our own lineage is
        spared now, since the daemons' trees have ended."""
        if not self._daemons:
            return
        late = _marked(self.lab_id, self.cluster_name, own_lineage())
        late += self._stepds(own_lineage() | {p.pid for p in late})
        if late:
            terminate(late, grace)

    def __enter__(self) -> SlurmLab:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- inspection and fault injection -----------------------------------------------

    def daemon_pids(self) -> dict[str, int]:
        """Pid of each live daemon: ``munged``, ``slurmctld``, ``slurmd n1``, ..."""
        return {d.name: d.proc.pid for d in self._daemons if d.proc is not None and d.alive()}

    def processes(self) -> list[psutil.Process]:
        """Every live process of the lab: daemons and their helpers, slurmstepds, tasks
        and marked clients."""
        procs = [psutil.Process(pid) for pid in self._daemon_tree()]
        skip = own_lineage() | {p.pid for p in procs}
        procs += self._stepds(skip)
        skip |= {p.pid for p in procs}
        return procs + _marked(self.lab_id, self.cluster_name, skip)

    def _daemon_tree(self) -> set[int]:
        """Pids of the live daemons and of all their descendants."""
        pids = set()
        for daemon in self._daemons:
            if daemon.proc is None or not daemon.alive():
                continue
            pids.add(daemon.proc.pid)
            with contextlib.suppress(psutil.Error):
                pids.update(p.pid for p in psutil.Process(daemon.proc.pid).children(True))
        return pids

    def _stepds(self, exclude: set[int]) -> list[psutil.Process]:
        return _stepds(self.lab_id, [self.root / "log", self.spool_root], exclude)

    def kill_slurmd(self, node: str, sig: int = signal.SIGKILL) -> None:
        """Signal ``node``'s slurmd (default SIGKILL: a node whose daemon died).

        As on a real node, the node's running steps survive: their slurmstepd is not a
        child of slurmd.  slurmctld marks the node DOWN after ``slurmd_timeout`` (to
        ~1.5 times that) and kills the job's other steps, but nothing kills the steps on
        this node until ``restart_slurmd`` (the new slurmd reports them and is told to
        kill them) or ``stop()``.
        """
        daemon = self._daemon(f"slurmd {node}")
        if daemon.proc is not None and daemon.alive():
            daemon.proc.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                daemon.proc.wait(10)

    def restart_slurmd(self, node: str) -> None:
        """Start ``node``'s slurmd again (after ``kill_slurmd``); waits until it serves again
        (idle, or still in a job that outlived the node's failure)."""
        daemon = self._daemon(f"slurmd {node}")
        if daemon.alive():
            raise SlurmLabError(f"slurmd {node} is still running")
        daemon.spawn(self.env)
        self._wait_idle([daemon], [node])

    def _daemon(self, name: str) -> _Daemon:
        for daemon in self._daemons:
            if daemon.name == name:
                return daemon
        raise KeyError(name)

    def log_text(self, daemon: str = "slurmctld") -> str:
        """The log of ``slurmctld`` or of node ``nX``'s slurmd."""
        name = "slurmctld.log" if daemon == "slurmctld" else f"slurmd-{daemon}.log"
        path = self.root / "log" / name
        return path.read_text(errors="replace") if path.exists() else ""

    # -- client-side helpers -----------------------------------------------------------

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run a client command (``sinfo``, ``srun``...) against the lab; never raises on rc.

        Defaults: ``env=self.env``, captured text output, a 60 s timeout and no stdin;
        any ``subprocess.run`` keyword overrides them.
        """
        options: dict[str, Any] = {
            "env": self.env,
            "capture_output": True,
            "text": True,
            "timeout": 60,
            "check": False,
        }
        if "input" not in kwargs:
            options["stdin"] = subprocess.DEVNULL
        options.update(kwargs)
        result: subprocess.CompletedProcess[str] = subprocess.run(list(argv), **options)
        return result

    def salloc_argv(
        self, n_nodes: int, command: Union[str, Sequence[str]], *options: str
    ) -> list[str]:
        """``salloc`` allocating ``n_nodes`` whole nodes of the lab and running ``command``.

        A string ``command`` runs under ``bash -c``; a sequence is run as is.  salloc
        runs it here, on the submitting host (as on a login node), with SLURM_JOB_ID and
        SLURM_JOB_NODELIST set; ``srun`` inside it starts steps on the nodes.
        ``--exclusive`` gives the job every CPU of each node, so a step per node can use
        them all.  ``options`` go before the command (e.g. ``"--time=1"``).
        """
        cmd = ["bash", "-c", command] if isinstance(command, str) else list(command)
        return ["salloc", f"--nodes={n_nodes}", "--exclusive",
                f"--partition={self.partition}", *options, *cmd]


# --------------------------------------------------------------------------------------
# Interactive use: python -m fdl_fabric.testing slurm DIR [N_NODES]
# --------------------------------------------------------------------------------------


def main(argv: Sequence[str]) -> int:
    """Start a lab, print how to use it, keep it up until SIGINT/SIGTERM, then stop it."""
    if not argv or len(argv) > 2:
        print("usage: python -m fdl_fabric.testing slurm DIR [N_NODES]", file=sys.stderr)
        return 2
    n_nodes = int(argv[1]) if len(argv) > 1 else 3
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with SlurmLab(argv[0], n_nodes) as lab:
        print(f"export SLURM_CONF={lab.conf_path} {MARKER_ENV}={lab.lab_id}", flush=True)
        print(f"nodes {' '.join(lab.nodes)}; Ctrl-C or SIGTERM to stop", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            stop.wait()
    return 0
