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

What the lab needs and writes (programs, slurm.conf, gres.conf) is `slurmconf`'s; how
its processes are started, found and ended, `slurmprocs`'s.
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
from pathlib import Path
from typing import Any, Optional, Union

import psutil

from .processes import free_port, own_lineage, stop_at_exit, stopped, terminate
from .slurmconf import (
    CLIENTS,
    DAEMONS,
    INHERITED_PREFIXES,
    MARKER_ENV,
    MAX_SOCKET_DIR,
    SBIN_PATH,
    Ports,
    SlurmLabError,
    render_gres_conf,
    render_slurm_conf,
    require,
    slurm_missing,
)
from .slurmprocs import Daemon, JobProcesses, LabMarks, daemon_tree, end_jobs

__all__ = [
    "MARKER_ENV",
    "SlurmLab",
    "SlurmLabError",
    "slurm_missing",
]

#: Seconds between looks at munged's socket while it starts.
_POLL = 0.05


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
        self.ports: Optional[Ports] = None
        self._daemons: list[Daemon] = []
        self._started = False
        self._stopped = False

    @property
    def _marks(self) -> LabMarks:
        """What tells this lab's processes apart (the spool folder may have moved)."""
        return LabMarks(self.lab_id, self.cluster_name, (self.root / "log", self.spool_root))

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
        binaries = {name: require(name) for name in (*DAEMONS, *CLIENTS)}
        if len(str(self.root)) > MAX_SOCKET_DIR:
            self._short_dir = tempfile.mkdtemp(prefix="fdl-slurm-")
            self._set_runtime_dir(Path(self._short_dir))
        self._prepare_folders()
        self.env = self._client_env()
        munged = Daemon(
            "munged",
            [binaries["munged"], "--foreground", "--force", f"--socket={self.munge_socket}",
             f"--key-file={self.munge_key}", f"--pid-file={self.munge_dir / 'munged.pid'}",
             f"--seed-file={self.munge_dir / 'munged.seed'}",
             f"--log-file={self.root / 'log' / 'munged.log'}"],
            str(self.root / "log" / "munged.out"),
            None,
        )
        self._daemons.append(munged)
        munged.spawn(dict(self.env))
        self._wait_munge(munged)
        self._start_slurm(binaries)

    def _prepare_folders(self) -> None:
        """The lab's folders, fresh, and its munge key (kept from an earlier start)."""
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

    def _client_env(self) -> dict[str, str]:
        """Ours without inherited SLURM_* settings, with sbin on PATH, SLURM_CONF and the
        lab's marker: the daemons' environment and the clients'."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(INHERITED_PREFIXES)}
        env["PATH"] = env.get("PATH", "/usr/bin:/bin") + ":" + SBIN_PATH
        env["SLURM_CONF"] = str(self.conf_path)
        env[MARKER_ENV] = self.lab_id
        return env

    def _start_slurm(self, binaries: dict[str, str]) -> None:
        """slurmctld and every slurmd on free ports, until the nodes are idle; again on
        other ports (three tries) when another process took a port first."""
        for attempt in range(3):
            self.ports = Ports(
                slurmctld=free_port("127.0.0.1"),
                nodes=tuple(free_port("127.0.0.1") for _ in self.nodes),
            )
            self._write_confs(self.ports)
            slurm = self._slurm_daemons(binaries)
            self._daemons.extend(slurm)
            for daemon in slurm:
                daemon.spawn(dict(self.env))
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

    def _write_confs(self, ports: Ports) -> None:
        """slurm.conf, and gres.conf with the fake GPUs' links when there are GPUs."""
        self.conf_path.write_text(render_slurm_conf(self, ports))
        gres_path = self.root / "gres.conf"
        if self.gpus_per_node:
            (self.root / "dev").mkdir(exist_ok=True)
            for index in range(self.gpus_per_node):
                fake = self.root / "dev" / f"gpu{index}"
                if not fake.is_symlink():
                    fake.symlink_to(os.devnull)
            gres_path.write_text(render_gres_conf(self))
        elif gres_path.exists():
            gres_path.unlink()

    def _slurm_daemons(self, binaries: dict[str, str]) -> list[Daemon]:
        log = self.root / "log"
        conf = str(self.conf_path)
        daemons = [
            Daemon(
                "slurmctld",
                [binaries["slurmctld"], "-D", "-f", conf],
                str(log / "slurmctld.out"),
                str(log / "slurmctld.log"),
            )
        ]
        for node in self.nodes:
            daemons.append(
                Daemon(
                    f"slurmd {node}",
                    [binaries["slurmd"], "-D", "-f", conf, "-N", node],
                    str(log / f"slurmd-{node}.out"),
                    str(log / f"slurmd-{node}.log"),
                )
            )
        return daemons

    def _wait_munge(self, munged: Daemon) -> None:
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

    def _wait_idle(self, daemons: Sequence[Daemon],
                   nodes: Optional[Sequence[str]] = None) -> None:
        """Until ``sinfo`` reports ``nodes`` (default: every node) ``idle`` (registered,
        responding, usable) or, for a node named, in use by a job (``alloc``, ``mix``)."""
        usable = ("idle",) if nodes is None else ("idle", "alloc", "mix")
        nodes = self.nodes if nodes is None else nodes
        deadline = time.monotonic() + self.startup_timeout
        while True:
            _refuse_dead(daemons)
            states, last = self._node_states()
            if states is not None and all(states.get(node) in usable for node in nodes):
                return
            if time.monotonic() > deadline:
                details = "\n".join(d.tail() for d in self._daemons)
                raise SlurmLabError(
                    f"Slurm lab nodes not all idle after {self.startup_timeout:.0f} s "
                    f"(sinfo: {last or '<nothing>'}):\n{details}"
                )
            time.sleep(0.2)

    def _node_states(self) -> tuple[Optional[dict[str, str]], str]:
        """Each node's state as ``sinfo`` says it (None when sinfo failed), and what sinfo
        printed."""
        result = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=10)
        last = (result.stdout + result.stderr).strip()
        if result.returncode != 0:
            return None, last
        return dict(line.split(None, 1) for line in result.stdout.splitlines()
                    if " " in line), last

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
        skip = own_lineage() | daemon_tree(self._daemons)
        # Nothing is looked for when the lab has no daemon (never started): no job can
        # exist then.
        jobs = self._marks.job_processes(skip) if self._daemons else JobProcesses([], [], [])
        end_jobs(jobs, grace)
        self._stop_daemons(grace)
        if self._daemons:  # a last sweep, for what the first one missed
            late = self._marks.stragglers()
            if late:
                terminate(late, grace)
        if self._short_dir is not None:
            shutil.rmtree(self._short_dir, ignore_errors=True)
        stopped(self)

    def _stop_daemons(self, grace: float) -> None:
        """Each daemon by its Popen's pid, in reverse start order: every slurmd before
        slurmctld, and munged last, since the others authenticate through it."""
        for daemon in reversed(self._daemons):
            daemon.stop(grace)

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
        procs = [psutil.Process(pid) for pid in daemon_tree(self._daemons)]
        skip = own_lineage() | {p.pid for p in procs}
        procs += self._marks.stepds(skip)
        skip |= {p.pid for p in procs}
        return procs + self._marks.marked(skip)

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

    def _daemon(self, name: str) -> Daemon:
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


def _refuse_dead(daemons: Sequence[Daemon]) -> None:
    """SlurmLabError with their output when any of ``daemons`` exited during startup."""
    dead = [d for d in daemons if not d.alive()]
    if dead:
        details = "\n".join(d.tail() for d in dead)
        raise SlurmLabError(
            f"{', '.join(d.name for d in dead)} exited during startup:\n{details}"
        )


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
