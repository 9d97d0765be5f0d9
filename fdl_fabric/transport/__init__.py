"""How the launcher reaches hosts: one `Transport` per kind of host, picked by one lookup.

* `base`: the `Transport` interface, `AgentProcess`, `ProbeResult`, `TransportError`;
* `local`: this machine (an invoke process); `ssh`: an SSH server (a Fabric Connection,
  one session per agent; host keys, `FdlTransport`); `slurm`: a node of the allocation
  (an srun step), and the allocation itself;
* `session`: the launcher's end of one agent (the protocol, over any transport);
* `fanout`: every host at once (connect, start agents, close);
* `sshconfig`: each SSH worker's settings, through ~/.ssh/config; `keepalive`: SSH
  liveness; `runners`: invoke runners that pass bytes; `bundle`: what starts an agent;
* `gateway`: the gateway tree (beyond ``fanout`` SSH hosts): a gateway's relay, and the
  leaves whose agents start through it (`for_cluster` picks them).

Adding a kind is one module with one `Transport` subclass and its line in `KINDS`;
nothing outside this package branches on the kind of a host.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Optional

from ..clusterfile import ClusterSpec, WorkerSpec, load_cluster
from ..errors import EXIT_USAGE, FdlError
from .base import AgentProcess, ByteSink, ProbeResult, Transport, TransportError
from .local import LocalTransport

if TYPE_CHECKING:
    from .sshconfig import SshSettings


def _kinds() -> dict[str, type[Transport]]:
    """The kinds, by name. SSH and Slurm load only when a cluster has such a host:
    a launch with only local workers never imports Fabric's SSH stack."""
    from .slurm import SlurmTransport
    from .ssh import SshTransport

    return {LocalTransport.kind: LocalTransport, SshTransport.kind: SshTransport,
            SlurmTransport.kind: SlurmTransport}


#: Kinds registered beyond the built-in ones (a test's fake transport, a plug-in).
EXTRA_KINDS: dict[str, type[Transport]] = {}


def kind(name: str) -> type[Transport]:
    """The `Transport` class of a kind of host."""
    if name == LocalTransport.kind:
        return LocalTransport
    if name in EXTRA_KINDS:
        return EXTRA_KINDS[name]
    return _kinds()[name]


def for_worker(worker: WorkerSpec, settings: Optional[Mapping[str, SshSettings]] = None, *,
               purpose: str = "agent") -> Transport:
    """The transport of one worker (``settings``: each SSH worker's, by host)."""
    return kind(worker.transport)(worker, (settings or {}).get(worker.host),
                                  purpose=purpose)


def for_cluster(cluster: ClusterSpec, settings: Optional[Mapping[str, SshSettings]] = None,
                *, purpose: str = "agent", fanout: Optional[int] = None,
                avoid: Collection[str] = frozenset()) -> dict[str, Transport]:
    """Every worker's transport, in roster order.

    Up to ``fanout`` SSH hosts (``None``: the cluster file's ``fanout:``, 64 by default)
    each is connected directly, as always. Beyond that, the gateway tree of
    `fdl_fabric.planning.tree.cluster_tree` (the same call gives the dry run the tree):
    each gateway is an SSH host whose connection also carries the relay of its leaves
    (`gateway.GatewayHost`), and each leaf's agent starts through it
    (`gateway.GatewayTransport`). Local workers and Slurm nodes are never in the tree.
    ``avoid``: gateways lost in an earlier attempt, connected directly this time.
    """
    from ..planning.tree import cluster_tree

    tree = cluster_tree(cluster, fanout, avoid)
    if tree.flat:
        made = {w.host: for_worker(w, settings, purpose=purpose) for w in cluster.workers}
    else:
        from .gateway import tree_transports

        made = tree_transports(cluster, tree, settings or {}, purpose=purpose)
    if any(w.transport == "ssh" for w in cluster.workers):  # local-only: no paramiko
        from . import connerrors

        # Where each host was named, for the words of a failed connect.
        connerrors.mark(made, connerrors.origins(cluster.workers, cluster.file,
                                                 flag=cluster.named_by))
    return made


def resolve_cluster(cluster_file: Optional[str], cluster: Optional[ClusterSpec] = None, *,
                    slurm: bool = False, nproc_per_node: Optional[int] = None) -> ClusterSpec:
    """The cluster a command runs on: ``cluster`` (built in code), the cluster file, or
    (``slurm``, or ``scheduler: slurm`` in the file) the nodes of the allocation this
    runs in (`fdl_fabric.transport.slurm`)."""
    if slurm:
        from . import slurm as slurm_

        return slurm_.load(cluster_file, nproc_per_node=nproc_per_node)
    cluster = cluster or load_cluster(cluster_file or "cluster.yml")
    if cluster.slurm is not None:
        from . import slurm as slurm_

        return slurm_.resolve(cluster, flag=f"{cluster.file}: scheduler: slurm",
                              nproc_per_node=nproc_per_node)
    if nproc_per_node is not None:
        raise FdlError("--nproc-per-node: only for a Slurm launch (--slurm, or "
                       "`scheduler: slurm` in the cluster file); SSH workers set nproc "
                       "in the cluster file", EXIT_USAGE)
    return cluster


__all__ = ["AgentProcess", "ByteSink", "EXTRA_KINDS", "ProbeResult", "Transport",
           "TransportError", "for_cluster", "for_worker", "kind", "resolve_cluster"]
