"""The gateway tree: which SSH hosts the launcher connects to, and which it reaches
through them. Pure: names in, names out; nothing is contacted.

Up to ``fanout`` SSH hosts, the launcher connects to each (flat, as always). Beyond
that, ``g = min(fanout, ceil(sqrt(H)))`` of them become *gateways*, taken from the
hosts in the order given (the roster's): the launcher connects to the gateways only,
and each gateway starts the agents of a contiguous, near-equal block of the remaining
hosts (its *leaves*) with its own OpenSSH client (`fdl_fabric.agent.relay`). A gateway
is also a worker: its own agent runs its own ranks, like any host's. For 36 hosts with
fanout 4: 4 gateways of 8 leaves each; for 1,024 hosts with fanout 64: 32 gateways of
31 leaves. Local workers (and Slurm nodes) are never in the tree.

√H keeps both levels about equally wide, which is what minimises the slower of the two
(the launcher's connects, a gateway's ssh starts); capping it at ``fanout`` keeps the
launcher's own connections within the bound the user asked for.

After a gateway was lost, the next attempt re-plans the tree without it (``avoid``): the
gateways are the first hosts not avoided, and an avoided host is connected directly, so
the launcher's own connect timeout says whether it answers again (a leaf would only be
found dead when its agent failed to start).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from ..clusterfile import ClusterSpec, WorkerSpec


@dataclass(frozen=True)
class Gateway:
    """One gateway host and the leaves it starts, in roster order."""

    host: str
    leaves: tuple[str, ...]


@dataclass(frozen=True)
class Tree:
    """How every SSH host is reached: ``direct`` hosts by the launcher itself (the
    gateways, or every host when the tree is flat), each gateway's leaves through it."""

    fanout: int
    direct: tuple[str, ...]
    gateways: tuple[Gateway, ...] = ()

    @property
    def flat(self) -> bool:
        """No gateway: every SSH host is connected directly (today's behaviour)."""
        return not self.gateways

    def gateway_of(self, host: str) -> Optional[str]:
        """The gateway ``host`` is reached through; None for a host connected directly."""
        for gateway in self.gateways:
            if host in gateway.leaves:
                return gateway.host
        return None

    def leaves_of(self, host: str) -> tuple[str, ...]:
        """The leaves a gateway starts (empty for any other host)."""
        for gateway in self.gateways:
            if gateway.host == host:
                return gateway.leaves
        return ()

    def as_data(self) -> dict[str, Any]:
        """The tree as plain data (the dry run's JSON): ``{"fanout", "gateways":
        {gateway: [leaves]}}``; ``gateways`` is empty for a flat launch."""
        return {"fanout": self.fanout,
                "gateways": {g.host: list(g.leaves) for g in self.gateways}}


def gateway_count(hosts: int, fanout: int) -> int:
    """Gateways for ``hosts`` SSH hosts: none up to ``fanout``, else ⌈√hosts⌉ capped at
    ``fanout``."""
    if fanout < 1:
        raise ValueError(f"fanout must be at least 1, got {fanout}")
    if hosts <= fanout:
        return 0
    root = math.isqrt(hosts)
    return min(fanout, root if root * root == hosts else root + 1)


def plan_tree(hosts: Sequence[str], fanout: int,
              avoid: Collection[str] = frozenset()) -> Tree:
    """The tree for ``hosts`` (SSH hosts, in roster order); see the module docstring.

    The first ``g`` hosts not in ``avoid`` are the gateways; the other hosts not in
    ``avoid`` are split in order into ``g`` contiguous blocks whose sizes differ by at
    most one (the first blocks take the extra host), block ``i`` going to gateway ``i``.
    Hosts in ``avoid`` (gateways lost in an earlier attempt) are connected directly.
    ``g`` counts every host, avoided or not, so the tree's shape does not shrink with a
    loss.
    """
    names = tuple(hosts)
    if len(set(names)) != len(names):
        raise ValueError("a host is listed twice")
    g = gateway_count(len(names), fanout)
    if g == 0:
        return Tree(fanout, names)
    avoided = tuple(h for h in names if h in avoid)
    usable = tuple(h for h in names if h not in avoid)
    g = min(g, len(usable))
    if g == 0:
        return Tree(fanout, names)
    gateways, rest = usable[:g], usable[g:]
    size, extra = divmod(len(rest), g)
    blocks: list[Gateway] = []
    start = 0
    for i, gateway in enumerate(gateways):
        end = start + size + (1 if i < extra else 0)
        blocks.append(Gateway(gateway, rest[start:end]))
        start = end
    return Tree(fanout, gateways + avoided, tuple(blocks))


def tree_hosts(cluster: ClusterSpec, member: Callable[[WorkerSpec], bool]) -> list[str]:
    """The hosts a cluster's tree is planned over: those ``member`` admits (the transport
    package's answer: hosts a gateway's relay can reach, never this machine or a Slurm
    node), the roster's hosts in order, then its spares, so a gateway is a host that
    runs from the start."""
    hosts = [w for w in cluster.workers if member(w)]
    return [w.host for w in hosts if not w.spare] + [w.host for w in hosts if w.spare]


def cluster_tree(cluster: ClusterSpec, fanout: Optional[int] = None,
                 avoid: Collection[str] = frozenset(), *,
                 member: Callable[[WorkerSpec], bool]) -> Tree:
    """The tree of a cluster: ``fanout`` (a flag's), else the file's ``fanout:``;
    ``avoid``: gateways lost in an earlier attempt (`plan_tree`); ``member``: whether a
    worker may be in the tree (`fdl_fabric.transport.tree_of` asks its kind)."""
    return plan_tree(tree_hosts(cluster, member),
                     cluster.fanout if fanout is None else fanout, avoid)
