"""Which kind reaches a worker the cluster file did not give a ``transport:``: the one
rule of inference, kept apart so that `sshconfig` and the kinds' registry
(`fdl_fabric.transport.kind_of`) read the same rule without importing each other.

A host whose name is this machine's (``localhost``, the host name) is this machine: its
agent is started here (``local``). Any other host is reached over SSH (``ssh``), which is
what a cluster file of host names has always meant. A Slurm node is never inferred: the
allocation names its nodes so (`transport.slurm`).
"""

from __future__ import annotations

from ..clusterfile import WorkerSpec

#: The built-in kinds' names (each class's ``kind``).
LOCAL = "local"
SSH = "ssh"
SLURM = "slurm"


def kind_name(worker: WorkerSpec) -> str:
    """The name of the kind that reaches ``worker``: the file's, else the inferred one."""
    if worker.transport:
        return worker.transport
    return LOCAL if worker.is_local else SSH
