"""Slurm: the allocation a launch runs in, and the ``srun`` step that starts each node's agent.

Inside an allocation (``salloc`` or an ``sbatch`` script: ``SLURM_JOB_ID`` is set) the
workers are the job's nodes, in ``SLURM_JOB_NODELIST`` order, each with the same ranks.
Each node's agent is started by one ``srun`` step of that job instead of an SSH session;
the step's stdin and stdout carry the agent protocol exactly as an SSH channel does, so
everything above the transport (pre-flight, supervisor, verdicts, logs) is unchanged.
Why one step per node rather than one step for all nodes: docs/design.md.

The options of an agent's step, and why (checked on Slurm 22.05; see docs/slurm.md):

* ``--nodes=1 --ntasks=1 --nodelist=NODE``, no ``-c``/``--exact``: a step that is not
  exact gets every CPU, all the memory and (if the job asked for GPUs) every GPU the job
  holds on the node, so the agent's ranks are not confined to one CPU. Variables that
  would make the step exact or shrink its one task's share (`STEP_SCRUBBED`) are removed
  from srun's environment.
* ``--overlap``: the step never waits for another step on the node (the previous
  attempt's, a cleanup's) to release it.
* ``--kill-on-bad-exit=0 --wait=0``: Slurm never ends the step or the job because a task
  failed or another ended first; the supervisor decides.
* ``--unbuffered``: without it, slurmstepd forwards a task's stdout a line at a time,
  holding back everything after the last newline; the agent's frames are binary and
  must arrive as written. (On 22.05 the task's stdout is then a pty in raw mode: bytes
  pass unchanged, checked with 20 MB of random data.)
* ``--mpi=none``: the agent is not an MPI program; no PMI set-up.
* ``--job-name=fdl-fabric-agent``: `cleanup` recognises the steps it may cancel, within
  this job only.

srun runs in a session of its own (``setsid``): a Ctrl-C at the terminal reaches the
launcher, which stops the run through the agents, not srun, which would kill the step.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..clusterfile import (
    ClusterSpec,
    ControllerSpec,
    SlurmSpec,
    SshSpec,
    WorkerSpec,
    load_cluster,
    parse_cluster,
)
from ..errors import EXIT_USAGE, FdlError
from ..events import EventBus, Name
from ..limits import RANKS_MAX
from ..shell import quote
from . import bundle, kinds
from .base import AgentProcess, ByteSink, ProbeResult, Transport, launcher_address
from .local import local_environment, start_local

ENV_JOB_ID = "SLURM_JOB_ID"
ENV_NODELIST = "SLURM_JOB_NODELIST"
#: The name of every agent step: `cleanup` cancels only steps of this job with it.
AGENT_STEP = "fdl-fabric-agent"
#: The name of a cleanup's own sweep steps.
CLEANUP_STEP = "fdl-fabric-cleanup"
#: Seconds a Slurm client command may take before the launch gives up on it.
CLIENT_TIMEOUT = 30.0
#: srun input variables that would make an agent's step exact (a share of the node) or
#: size its one task by a per-task or per-GPU figure meant for the job's own tasks.
STEP_SCRUBBED = (
    "SLURM_EXACT",
    "SRUN_CPUS_PER_TASK",
    "SLURM_CPUS_PER_TASK",
    "SLURM_TRES_PER_TASK",
    "SLURM_GPUS_PER_TASK",
    "SLURM_CPUS_PER_GPU",
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_NTASKS_PER_CORE",
    "SLURM_NTASKS_PER_SOCKET",
    "SLURM_NTASKS_PER_GPU",
    "SLURM_DISTRIBUTION",
    "SLURM_CPU_BIND",
)

Run = Callable[[Sequence[str]], str]


@dataclass(frozen=True)
class Allocation:
    """The job a launch runs in: its id and its nodes, in SLURM_JOB_NODELIST order."""

    job_id: str
    nodes: tuple[str, ...]
    #: Each node's NodeAddr: what ranks dial (MASTER_ADDR is the first node's).
    addrs: Mapping[str, str]


def job_id(environ: Mapping[str, str]) -> Optional[str]:
    """The allocation this process runs in, if any."""
    value = environ.get(ENV_JOB_ID, "").strip()
    return value or None


def client(argv: Sequence[str]) -> str:
    """Run a Slurm client command here; its stdout, or a FdlError naming it."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True,
                              timeout=CLIENT_TIMEOUT, stdin=subprocess.DEVNULL, check=False)
    except FileNotFoundError:
        raise FdlError(f"cluster launcher: {argv[0]} not found: a Slurm launch needs "
                          "Slurm's client commands on PATH", EXIT_USAGE) from None
    except subprocess.TimeoutExpired:
        raise FdlError(f"cluster launcher: `{' '.join(argv)}` did not answer within "
                          f"{CLIENT_TIMEOUT:g}s") from None
    if proc.returncode != 0:
        raise FdlError(f"cluster launcher: `{' '.join(argv)}` failed (status "
                          f"{proc.returncode}): {proc.stderr.strip()[:500]}")
    return proc.stdout


def allocation(environ: Mapping[str, str], *, run: Run = client,
               flag: str = "--slurm") -> Allocation:
    """The allocation this launch runs in: nodes from ``scontrol show hostnames``, each
    node's address from ``scontrol show node``. Outside one: exit 2, naming ``flag``."""
    job = job_id(environ)
    if job is None:
        raise FdlError(f"{flag}: not inside a Slurm allocation ({ENV_JOB_ID} is not set): "
                          "run it under salloc, or in an sbatch script", EXIT_USAGE)
    if not re.fullmatch(r"[0-9]+(_[0-9]+)?", job):
        raise FdlError(f"{flag}: {ENV_JOB_ID}={job!r} is not a job id", EXIT_USAGE)
    nodelist = environ.get(ENV_NODELIST, "").strip() or environ.get("SLURM_NODELIST", "").strip()
    if not nodelist:
        raise FdlError(f"{flag}: {ENV_NODELIST} is not set, so the allocation's nodes are "
                          "unknown", EXIT_USAGE)
    nodes = tuple(run(["scontrol", "show", "hostnames", nodelist]).split())
    if not nodes:
        raise FdlError(f"{flag}: `scontrol show hostnames {nodelist}` listed no node")
    return Allocation(job, nodes, node_addrs(nodes, run=run))


def node_addrs(nodes: Sequence[str], *, run: Run = client) -> dict[str, str]:
    """NodeAddr of each node (one ``scontrol`` call); a node without one is its name."""
    text = run(["scontrol", "--oneliner", "show", "node", ",".join(nodes)])
    addrs: dict[str, str] = {}
    for line in text.splitlines():
        name = re.search(r"(?:^|\s)NodeName=(\S+)", line)
        addr = re.search(r"(?:^|\s)NodeAddr=(\S+)", line)
        if name and addr:
            addrs[name.group(1)] = addr.group(1)
    return {n: addrs.get(n, n) for n in nodes}


def load(cluster_file: Optional[str], *, flag: str = "--slurm",
         nproc_per_node: Optional[int] = None,
         environ: Optional[Mapping[str, str]] = None) -> ClusterSpec:
    """The cluster of a Slurm launch or cleanup: ``--slurm`` alone reads no file (the flags
    say everything); a named file must say ``scheduler: slurm`` and list no workers."""
    if cluster_file is None:
        cluster = parse_cluster("scheduler: slurm\n", file=flag, folder=os.getcwd())
    else:
        cluster = load_cluster(cluster_file)
    if cluster.slurm is None:
        raise FdlError(f"{cluster.file}: {flag} takes the workers from the allocation, but "
                          "this file lists workers: leave out --cluster (the flags say "
                          "everything), or use a cluster file with `scheduler: slurm` and no "
                          "workers", EXIT_USAGE)
    return resolve(cluster, environ=environ, flag=flag, nproc_per_node=nproc_per_node)


def resolve(cluster: ClusterSpec, *, flag: str, nproc_per_node: Optional[int] = None,
            environ: Optional[Mapping[str, str]] = None) -> ClusterSpec:
    """A ``scheduler: slurm`` cluster with its workers: the nodes of this allocation."""
    alloc = allocation(os.environ if environ is None else environ, flag=flag)
    return cluster_for(cluster, alloc, nproc_per_node=nproc_per_node)


def cluster_for(cluster: ClusterSpec, alloc: Allocation, *,
                nproc_per_node: Optional[int] = None) -> ClusterSpec:
    """The cluster a Slurm launch runs: one worker per node, each with the same ranks.

    ``nproc_per_node`` (the flag) wins over the file's ``nproc_per_node`` or
    ``local_devices``. The coordinator listens on this machine's address toward the first
    node, unless the file names ``controller.host``.
    """
    spec = cluster.slurm or SlurmSpec()
    nproc = nproc_per_node if nproc_per_node is not None else spec.nproc_per_node
    devices = None if nproc_per_node is not None else spec.local_devices
    if nproc is None and devices is None:
        raise FdlError(f"{cluster.file}: a Slurm launch needs the ranks of each node: "
                          "--nproc-per-node N, or nproc_per_node / local_devices in the "
                          "cluster file", EXIT_USAGE)
    per_node = nproc if nproc is not None else (
        len(devices) if isinstance(devices, tuple) else 0)
    if per_node * len(alloc.nodes) > RANKS_MAX:
        raise FdlError(f"cluster launcher: {per_node} ranks on each of {len(alloc.nodes)} "
                          f"nodes is {per_node * len(alloc.nodes)}; at most {RANKS_MAX}",
                          EXIT_USAGE)
    min_hosts = cluster.elastic.min_hosts
    if min_hosts is not None and min_hosts > len(alloc.nodes):
        raise FdlError(f"{cluster.file}: elastic: min_hosts is {min_hosts}, but the allocation "
                       f"has {len(alloc.nodes)} node(s)", EXIT_USAGE)
    path = spec.path or cluster.folder
    workers = tuple(
        WorkerSpec(index=i, host=node, nproc=nproc, local_devices=devices, path=path,
                   addr=alloc.addrs[node], nccl_socket_ifname=None, ssh=SshSpec(),
                   tunnel=False, env={}, data_path=None, is_local=False, line=spec.line,
                   slurm_job=alloc.job_id, transport=SlurmTransport.kind)
        for i, node in enumerate(alloc.nodes))
    controller = cluster.controller
    if controller.host == ControllerSpec.host:  # not set in the file
        controller = dataclasses.replace(controller,
                                         host=launcher_address(alloc.addrs[alloc.nodes[0]]))
    return dataclasses.replace(cluster, workers=workers, controller=controller,
                               slurm=dataclasses.replace(spec, job_id=alloc.job_id),
                               key=f"slurm-{alloc.job_id}")


# -- the agent's step -------------------------------------------------------------------------

def srun_words(job: str, node: str, *, name: str = AGENT_STEP) -> list[str]:
    """srun and its options for a step of one task on ``node`` (see the module docstring)."""
    return ["srun", f"--jobid={job}", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
            "--overlap", "--unbuffered", "--kill-on-bad-exit=0", "--wait=0", "--mpi=none",
            f"--job-name={name}"]


def step_argv(job: str, node: str, *, name: str = AGENT_STEP) -> list[str]:
    """The srun command line that starts one node's agent, in a session of its own."""
    return ["setsid", *srun_words(job, node, name=name), "/bin/sh", "-c",
            bundle.remote_command()]


def step_command(job: str, node: str, *, name: str = AGENT_STEP) -> str:
    """`step_argv` as the shell line invoke runs, every word quoted."""
    return "exec " + " ".join(quote(w) for w in step_argv(job, node, name=name))


def step_env(environ: Mapping[str, str]) -> dict[str, str]:
    """srun's environment: the launcher's, without what would shrink the step."""
    return {k: v for k, v in environ.items() if k not in STEP_SCRUBBED}


# -- cleanup ----------------------------------------------------------------------------------

def agent_steps(job: str, *, run: Run = client) -> list[str]:
    """Step ids (``J.S``) of this job's agent steps that are still running."""
    text = run(["squeue", "--noheader", "--steps", f"--jobs={job}", "--format=%i %j"])
    steps = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1] == AGENT_STEP and parts[0].startswith(f"{job}."):
            steps.append(parts[0])
    return steps


def cancel_steps(steps: Sequence[str], *, run: Run = client) -> None:
    """Cancel steps by id (``J.S``): scoped to one job, never by user, name or node."""
    for step in steps:
        if not re.fullmatch(r"[0-9]+(_[0-9]+)?\.[0-9]+", step):
            raise ValueError(f"not a step id: {step!r}")
    if steps:
        run(["scancel", *steps])


# -- the transport ----------------------------------------------------------------------------

class SlurmTransport(Transport):
    """A node of the allocation this launch runs in: its agent is an srun step."""

    kind = kinds.SLURM
    #: srun to a node whose slurmd died waits for it: the agent's lease clears the node.
    sweep_after_loss = False

    @property
    def job(self) -> str:
        assert self.worker.slurm_job is not None
        return self.worker.slurm_job

    @property
    def step_name(self) -> str:
        return CLEANUP_STEP if self.purpose == "cleanup" else AGENT_STEP

    def start_agent(self, stdout: ByteSink, stderr: ByteSink) -> AgentProcess:
        return start_local(step_command(self.job, self.host, name=self.step_name),
                           step_env(local_environment()), stdout, stderr)

    def probe(self, script: str, *, timed: bool, tunnel: Optional[tuple[int, int]] = None,
              timeout: float = 60.0, clock_marker: str = "") -> ProbeResult:
        """The pre-flight script in a step of its own on the node (like the agent's)."""
        argv = [*srun_words(self.job, self.host, name=CLEANUP_STEP), "/bin/sh", "-c", script]
        result = ProbeResult(reach=f"srun step of job {self.job} on {self.host}")
        started = time.monotonic()
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, errors="replace",
                                  timeout=timeout, stdin=subprocess.DEVNULL, check=False,
                                  env=step_env(local_environment()))
            result.out, result.err, result.exit_status = proc.stdout, proc.stderr, \
                proc.returncode
        except (OSError, subprocess.TimeoutExpired) as exc:
            result.err, result.reach_status = str(exc), "FAIL"
            result.reach = f"srun step of job {self.job} on {self.host}: {exc}"
        result.probe_ms = (time.monotonic() - started) * 1000.0
        return result

    def describe(self) -> str:
        argv = step_argv(self.job, self.host, name=self.step_name)
        return ("Slurm node; its agent is an srun step of job "
                f"{self.job}:\n  " + " ".join(quote(w) for w in argv[:-1])
                + f" <the agent's bootstrap, {len(argv[-1])} bytes: the host's python3 "
                "-I -S reads the agent from stdin>")

    def details(self) -> dict[str, Any]:
        return {"transport": self.kind, "slurm_job": self.worker.slurm_job}

    @classmethod
    def after_sweep(cls, workers: tuple[WorkerSpec, ...], events: EventBus) -> None:
        """Agent steps of the job that outlived their launcher (the sweep stopped their
        ranks): cancelled by step id, so nothing of another job is touched."""
        jobs = sorted({w.slurm_job for w in workers if w.slurm_job is not None})
        for job in jobs:
            try:
                steps = agent_steps(job)
                if steps:
                    cancel_steps(steps)
                    events(Name.STEPS_CANCELLED, job=job, steps=steps)
            except FdlError as exc:
                events(Name.STEPS_NOT_CANCELLED, job=job, error=str(exc))
