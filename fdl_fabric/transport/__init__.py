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

Adding a kind is one module with one `Transport` subclass, registered by `register`
(a plug-in does the same from outside the package); a cluster file then names it
(``transport: NAME``, or ``transport: {kind: NAME, ...its settings}``). Nothing outside
this package names a kind: what the layers above need of a host is a capability of its
`Transport` (tests/test_architecture.py holds it).
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable, Mapping, MutableMapping, Sequence
from typing import Any, ContextManager, Optional

from ..clusterfile import ClusterSpec, ConfigError, Problem, WorkerSpec, load_cluster
from ..errors import EXIT_USAGE, FdlError
from ..events import EventBus
from .base import AgentProcess, ByteSink, ProbeResult, Transport, TransportError
from .kinds import kind_name
from .local import LocalTransport

#: Each host's settings, as its kind resolved them (`resolve_settings`), by host.
HostSettings = Mapping[str, Any]


def _kinds() -> dict[str, type[Transport]]:
    """The built-in kinds, by name. SSH and Slurm load only when a cluster has such a
    host: a launch with only local workers never imports Fabric's SSH stack."""
    from .joining import JoinTransport
    from .slurm import SlurmTransport
    from .ssh import SshTransport

    return {LocalTransport.kind: LocalTransport, SshTransport.kind: SshTransport,
            SlurmTransport.kind: SlurmTransport, JoinTransport.kind: JoinTransport}


#: Kinds registered beyond the built-in ones (a test's fake transport, a plug-in).
EXTRA_KINDS: dict[str, type[Transport]] = {}


def register(cls: type[Transport]) -> type[Transport]:
    """Make a kind known by its ``kind`` name (usable as a class decorator): the one
    registration a plug-in needs before a cluster file names it."""
    if not cls.kind:
        raise ValueError(f"{cls.__name__} has no kind name")
    EXTRA_KINDS[cls.kind] = cls
    return cls


def kind(name: str) -> type[Transport]:
    """The `Transport` class of a kind of host (KeyError when none is registered)."""
    if name == LocalTransport.kind:
        return LocalTransport
    if name in EXTRA_KINDS:
        return EXTRA_KINDS[name]
    return _kinds()[name]


def known_kinds() -> list[str]:
    """Every kind's name, built-in then registered."""
    return list(dict.fromkeys([*_kinds(), *EXTRA_KINDS]))


def kind_of(worker: WorkerSpec) -> type[Transport]:
    """The class that reaches ``worker``: the kind its file names, else the inferred one
    (`kinds.kind_name`); `check_kinds` has refused an unknown name before."""
    return kind(kind_name(worker))


def kinds_of(workers: Iterable[WorkerSpec]) -> list[type[Transport]]:
    """The kinds of these workers, each once, in roster order."""
    return list(dict.fromkeys(kind_of(w) for w in workers))


def _kind_problem(worker: WorkerSpec) -> Optional[str]:
    name = kind_name(worker)
    try:
        cls = kind(name)
    except KeyError:
        known = known_kinds()
        close = difflib.get_close_matches(name, known, n=1)
        return (f"unknown transport {name!r}" + (f" (did you mean {close[0]!r}?)" if close
                                                  else "") +
                f"; known: {', '.join(known)} (a plug-in registers its own with "
                "fdl_fabric.transport.register)")
    return cls.check_worker(worker)


def check_kinds(cluster: ClusterSpec) -> None:
    """Every worker's kind known and able to reach it as described: else one
    `ConfigError` (exit 2) naming each worker's ``transport`` key and line."""
    problems = [Problem(cluster.file, f"workers[{w.index}].transport",
                        w.transport_line or w.line or None, why)
                for w in cluster.workers if (why := _kind_problem(w)) is not None]
    if problems:
        raise ConfigError(problems)


def resolve_settings(cluster: ClusterSpec, events: Optional[EventBus] = None
                     ) -> dict[str, Any]:
    """Each host's settings, resolved by its kind before anything is contacted (an SSH
    host's through ~/.ssh/config); a bad one is a `ConfigError` (exit 2)."""
    check_kinds(cluster)
    settings: dict[str, Any] = {}
    for cls in kinds_of(cluster.workers):
        mine = tuple(w for w in cluster.workers if kind_of(w) is cls)
        settings.update(cls.resolve_settings(cluster, mine, events))
    return settings


def tree_of(cluster: ClusterSpec, fanout: Optional[int] = None,
            avoid: Collection[str] = frozenset()) -> Any:
    """The gateway tree of a cluster (`planning.tree.cluster_tree`) over the hosts whose
    kind may be in it (`Transport.tree_member`): what `for_cluster` builds, and what a
    dry run and a launch's events show."""
    from ..planning.tree import cluster_tree

    return cluster_tree(cluster, fanout, avoid, member=lambda w: kind_of(w).tree_member)


def for_worker(worker: WorkerSpec, settings: Optional[HostSettings] = None, *,
               purpose: str = "agent") -> Transport:
    """The transport of one worker (``settings``: each host's, by host)."""
    return kind_of(worker)(worker, (settings or {}).get(worker.host), purpose=purpose)


def for_cluster(cluster: ClusterSpec, settings: Optional[HostSettings] = None,
                *, purpose: str = "agent", fanout: Optional[int] = None,
                avoid: Collection[str] = frozenset()) -> dict[str, Transport]:
    """Every worker's transport, in roster order.

    Up to ``fanout`` tree members (``None``: the cluster file's ``fanout:``, 64 by
    default) each is connected directly, as always. Beyond that, the gateway tree
    (`tree_of`; the same call gives the dry run the tree): each gateway is an SSH host
    whose connection also carries the relay of its leaves (`gateway.GatewayHost`), and
    each leaf's agent starts through it (`gateway.GatewayTransport`). ``avoid``:
    gateways lost in an earlier attempt, connected directly this time: re-planning the
    tree around a lost gateway is this call with the gateways lost so far.
    """
    check_kinds(cluster)
    tree = tree_of(cluster, fanout, avoid)
    if tree.flat:
        made = {w.host: for_worker(w, settings, purpose=purpose) for w in cluster.workers}
    else:
        from .gateway import tree_transports

        made = tree_transports(cluster, tree, settings or {}, purpose=purpose,
                               direct=for_worker)
    if any(kind_of(w).tree_member for w in cluster.workers):  # local-only: no paramiko
        from . import connerrors

        # Where each host was named, for the words of a failed connect.
        connerrors.mark(made, connerrors.origins(cluster.workers, cluster.file,
                                                 flag=cluster.named_by))
    return made


def replan_tree(cluster: ClusterSpec, settings: Optional[HostSettings],
                transports: MutableMapping[str, Transport],
                avoid: Collection[str]) -> Any:
    """The gateway tree planned again without the gateways in ``avoid`` (lost in an
    earlier attempt): every tree member's transport closed and replaced by a fresh one
    from `for_cluster` (a lost gateway connected directly, its leaves through the
    gateways left; the membership rule keeps a host or leaves it out by whether it
    answers, like any host). Returns the new tree, for the launch to say."""
    from .fanout import close_all

    members = [w.host for w in cluster.workers if kind_of(w).tree_member]
    close_all([transports[h] for h in members if h in transports])
    fresh = for_cluster(cluster, settings, avoid=avoid)
    transports.update({h: fresh[h] for h in members})
    return tree_of(cluster, avoid=avoid)


def open_tunnel(transport: Transport, port: int, target: str,
                events: EventBus) -> ContextManager[None]:
    """``transport.tunnel(port, target)``, with what the tunnel has to say (turned-away
    connections, an exposed port) as events (`tunnel.open_tunnel`)."""
    from .tunnel import open_tunnel as opened

    return opened(transport, port, target, events)


def with_dialable_addrs(cluster: ClusterSpec) -> ClusterSpec:
    """The cluster with each worker's default ``addr`` replaced by the name its kind
    really dials (an ssh_config alias's ``HostName``), so MASTER_ADDR and the peers'
    addresses are names the ranks resolve; an ``addr`` written apart is kept."""
    from .sshconfig import with_dialable_addrs as dialable

    return dialable(cluster)


def for_connections(conns: Sequence[Any], flag: str = "-H") -> list[Transport]:
    """Transports over Fabric Connections someone else built (``fab -H``'s), each with
    our host-key policy and bounded waits before it opens; a failed connect names
    ``flag``."""
    from . import connerrors
    from .ssh import SshTransport, adhoc_worker

    made: list[Transport] = []
    for i, conn in enumerate(conns):
        transport = SshTransport.from_connection(adhoc_worker(i, conn.original_host), conn)
        transport.origin = connerrors.Origin(flag=flag)
        made.append(transport)
    return made


def open_files_needed(cluster: ClusterSpec) -> int:
    """Open files a launch of ``cluster`` may hold at once (`openfiles`), over its tree."""
    from .openfiles import open_files_needed as needed

    return needed(cluster, tree_of(cluster))


def check_open_files(cluster: ClusterSpec, events: EventBus) -> None:
    """RLIMIT_NOFILE against what the launch needs, before anything is contacted: raised
    when it can be, else exit 2 saying what to run (`openfiles.check_open_files`)."""
    from .openfiles import check_open_files as check

    check(cluster, events, tree_of(cluster))


def dialed_name(host: str, config_file: Optional[str] = None) -> str:
    """The name a host given on the command line is dialled by (the ``HostName`` of an
    ssh_config alias, read from ``config_file`` or ~/.ssh/config); ValueError saying why
    the file cannot be read."""
    from .sshconfig import SshOptionError, hostname_of

    try:
        return hostname_of(host, config_file)
    except SshOptionError as exc:
        raise ValueError(str(exc)) from None


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
    check_kinds(cluster)
    return cluster


__all__ = ["AgentProcess", "ByteSink", "EXTRA_KINDS", "HostSettings", "ProbeResult",
           "Transport", "TransportError", "check_kinds", "check_open_files", "dialed_name",
           "for_cluster",
           "for_connections", "for_worker", "kind", "kind_of", "kinds_of", "known_kinds",
           "open_files_needed", "open_tunnel", "register", "replan_tree", "resolve_cluster",
           "resolve_settings", "tree_of", "with_dialable_addrs"]
