"""What a Slurm lab needs and what it writes (`fdl_fabric.testing.slurm` runs it).

Which programs it needs (`slurm_missing`: a test suite skips with its reason, as Slurm is
not on every developer machine), the marker its processes carry (`MARKER_ENV`), and the
slurm.conf and gres.conf it writes from a lab's settings (`LabSettings`, which a
`SlurmLab` is), with why each choice that is not Slurm's default was made.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol

from .processes import LabError

#: Environment variable carried by every daemon of a lab and by every client started with
#: ``lab.env``; srun hands the client's environment to the tasks, so job processes carry
#: it too.  Its value is the lab's id.  ``stop()`` uses it to find processes that escaped
#: the daemons' process trees (slurmd double-forks slurmstepd, so slurmstepd and the tasks
#: are re-parented to init and are never descendants of slurmd).
MARKER_ENV = "FDL_FABRIC_SLURM_LAB"

#: Daemons live in sbin, which root's PATH may lack (``su`` without ``-``, cron, CI).
SBIN_PATH = "/usr/local/sbin:/usr/sbin:/sbin"
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sinfo", "scontrol", "srun", "salloc")

#: Environment variables a client must not inherit from whoever runs the tests: inside a
#: real Slurm job, SLURM_JOB_ID & co. would make the lab's srun try to join that job.
INHERITED_PREFIXES = ("SLURM_", "SALLOC_", "SBATCH_", "SRUN_", "SQUEUE_", "SINFO_", "SCANCEL_")

#: Unix socket paths are limited to 108 bytes (sun_path); slurmstepd puts
#: ``<spool>/<node>_<job>.<step>`` sockets in each node's spool folder.
MAX_SOCKET_DIR = 70


class SlurmLabError(LabError):
    """A daemon of the Slurm lab failed to start or the nodes never became idle."""


# -- discovery -------------------------------------------------------------------------
def _which(name: str) -> Optional[str]:
    return shutil.which(name) or shutil.which(name, path=SBIN_PATH)


def slurm_missing() -> Optional[str]:
    """Why this machine cannot run a Slurm lab (which programs are missing), or None.

    A test suite should skip with this reason, not fail: unlike sshd, Slurm is not
    something every developer machine has.  CI installs it, and there it is not None.
    """
    missing = [name for name in (*DAEMONS, *CLIENTS) if _which(name) is None]
    if not missing:
        return None
    return (
        f"the Slurm lab needs {', '.join(missing)}, not found: install the slurm-wlm "
        "and munge packages (e.g. `apt-get install slurm-wlm munge`)"
    )


def require(name: str) -> str:
    """The absolute path of program ``name``, or SlurmLabError saying what is missing."""
    found = _which(name)
    if found is None:
        raise SlurmLabError(slurm_missing() or f"{name} not found")
    return os.path.abspath(found)


# -- configuration ---------------------------------------------------------------------
class LabSettings(Protocol):
    """What the configuration files are written from: a `SlurmLab`'s settings."""

    root: Path
    n_nodes: int
    cpus_per_node: int
    real_memory: int
    gpus_per_node: int
    node_prefix: str
    partition: str
    task_plugin: str
    kill_wait: int
    slurmd_timeout: int
    message_timeout: int
    inactive_limit: int
    min_job_age: int
    debug: str
    extra_conf: tuple[str, ...]
    user: str
    cluster_name: str
    munge_socket: str
    spool_root: Path


@dataclass(frozen=True)
class Ports:
    slurmctld: int
    nodes: tuple[int, ...]


def render_slurm_conf(lab: LabSettings, ports: Ports) -> str:
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


def render_gres_conf(lab: LabSettings) -> str:
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
