"""Between attempts: how each host came out of the last one, which hosts the next one
runs on, and the tree planned again around a lost gateway.

The membership rule (`supervision.membership`) decides the hosts of each attempt from
how each host fared; this module gathers what it decides from (`host_fates`,
`LostGateways.cut_off`), connects the hosts it picks (`select_hosts`), and says what it
decided (`membership_event`). A launch that completed on fewer hosts than its roster
ends degraded (`degraded_if_fewer_hosts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Any, Optional

from ..clusterfile import ClusterSpec
from ..errors import EXIT_FAILURE
from ..events import EventBus, Name, event
from ..planning.plan import LaunchPlan
from ..states import RankState
from ..supervision.membership import HostFate, Membership, Selection
from ..supervision.records import RunResult
from ..supervision.verdict import Verdict
from ..transport import replan_tree, tree_of
from .launch_hosts import Hosts
from .launch_settings import Resolved


def host_fates(result: RunResult) -> dict[str, HostFate]:
    """How each host came out of an attempt: lost (its agent or link), failed (one of its
    ranks failed), or fine (its ranks ended well or were stopped for another's sake)."""
    fates: dict[str, HostFate] = {}
    for rank in result.ranks:
        if rank.state is RankState.FAILED:
            fates[rank.host] = HostFate.FAILED
    for host in result.faults:
        fates[host] = HostFate.LOST
    return fates


class LostGateways:
    """Gateways lost in some attempt: later attempts plan the tree without them."""

    def __init__(self, events: EventBus) -> None:
        self.events = events
        #: Every gateway lost so far.
        self.lost: set[str] = set()
        #: Gateways lost in the last attempt, until the next one's tree is planned.
        self.replan: list[str] = []

    def cut_off(self, cluster: ClusterSpec, result: RunResult) -> dict[str, HostFate]:
        """Gateways lost in this attempt: noted, so the next attempt's tree is planned
        without them (`replan_around_lost_gateways`); their leaves' losses are theirs,
        not the leaves', so each leaf is probed again through the gateways left
        (`HostFate.CUT_OFF`)."""
        tree = tree_of(cluster, avoid=self.lost)
        lost = {g.host for g in tree.gateways} & set(result.faults)
        if not lost:
            return {}
        self.lost |= lost
        self.replan = sorted(lost)
        return {leaf: HostFate.CUT_OFF for g in tree.gateways if g.host in lost
                for leaf in g.leaves if leaf in result.faults}

    def replan_around_lost_gateways(self, hosts: Hosts, r: Resolved, attempt: int) -> None:
        """The tree planned again without the gateways lost so far, with fresh transports
        for every host of the tree: the lost gateways' leaves start through the gateways
        that are left, and a lost gateway itself is connected directly (the membership
        rule keeps it or leaves it out by whether it answers, like any host)."""
        if not self.replan:
            return
        tree = replan_tree(r.cluster, r.settings, hosts.transports, self.lost)
        self.events(Name.TREE_REPLANNED, attempt=attempt, lost=self.replan,
                    tree=tree.as_data())
        self.replan = []


def select_hosts(membership: Membership, hosts: Hosts, cluster: ClusterSpec, attempt: int,
                 faulted: Collection[str]) -> Selection:
    """The hosts of ``attempt``, connected. Without ``min_hosts`` or spares, every attempt
    is the whole roster and a host that cannot be reached ends the launch, as it always
    did; with them, the hosts that answer (`Hosts.probe`)."""
    if not membership.elastic:
        selection = membership.select(attempt, lambda names: {})
        if attempt == 0:
            hosts.connect(selection.hosts)
        else:
            hosts.reconnect(cluster, faulted)
        return selection
    return membership.select(attempt, lambda names: hosts.probe(cluster, attempt, names))


def shortfall(membership: Membership, selection: Selection) -> Optional[RunResult]:
    """The attempt's result when the membership rule found too few hosts to run it (the
    launch then ends with that verdict); None when it can run."""
    if not membership.elastic or selection.enough:
        return None
    return RunResult(Verdict.FAILED, EXIT_FAILURE, event(
        Name.NOT_ENOUGH_HOSTS, hosts=list(selection.hosts), min_hosts=selection.min_hosts,
        left_out=dict(selection.left_out), attempt=selection.attempt), ())


def membership_data(selection: Selection, plan: LaunchPlan) -> dict[str, Any]:
    return {"hosts": list(selection.hosts), "world_size": plan.world_size,
            "roster": selection.target, "left_out": dict(selection.left_out),
            "readmitted": list(selection.readmitted), "spares": list(selection.spares)}


def membership_event(events: EventBus, selection: Selection, plan: LaunchPlan) -> None:
    """Which hosts this attempt runs on; on the first, which were left out."""
    events(Name.ATTEMPT_HOSTS, attempt=selection.attempt, **membership_data(selection, plan))
    if selection.attempt == 0 and selection.left_out:
        events(Name.HOSTS_LEFT_OUT, left_out=dict(selection.left_out),
               spares=list(selection.spares))


def degraded_if_fewer_hosts(results: Sequence[RunResult],
                            hosts_of: Sequence[tuple[str, ...]],
                            membership: Membership) -> Optional[RunResult]:
    """A run that completed on fewer hosts than the roster: exit 0, but said, as a run
    that lost ranks under max_failure is. The final result to put in its place, or None
    when it stands."""
    if not results or not hosts_of:
        return None
    final = results[-1]
    hosts = hosts_of[-1]
    roster = membership.target
    if final.verdict is not Verdict.OK or len(hosts) >= roster \
            or len(hosts_of) != len(results):
        return None
    last = membership.last
    left_out = {h: why for h, why in (last.left_out if last else {}).items()
                if h in membership.roster}
    return dataclasses.replace(final, verdict=Verdict.DEGRADED, cause=event(
        Name.COMPLETED_ON_FEWER_HOSTS, hosts=len(hosts), roster=roster,
        left_out=left_out, world_size=len(final.ranks)))
