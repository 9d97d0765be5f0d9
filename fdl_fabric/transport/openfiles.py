"""The open files a launch needs, checked against RLIMIT_NOFILE before anything starts.

A launch holds a connection per directly reached host, a pipe per relay, the connections
the coordinator's port may hold before their hello, and each tunnel up to its bound
(`forward_bound`; `fdl_fabric.transport.tunnel` says why a tunnel is bounded). Nothing per
rank: ranks reach the coordinator through their host's agent, on its session (issue 35),
so the count is per host.
`check_open_files` compares the soft limit with `open_files_needed`: one too low is raised
up to the hard limit, and a hard limit too low is refused with exit 2, in one line that
says what to run. `free_files` is what a tunnel asks before it opens one more socket.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Optional

from .. import limits
from ..errors import EXIT_USAGE, FdlError
from ..events import EventBus, Name

if TYPE_CHECKING:
    from ..clusterfile import ClusterSpec, WorkerSpec
    from ..planning.tree import Tree

#: Ranks counted for a ``local_devices: all`` host before its agent has said (a large GPU box).
ALL_DEVICES_GUESS = 16


def ranks_on(worker: WorkerSpec) -> int:
    """The ranks a worker runs, as far as the cluster file says."""
    known = worker.known_ranks  # nproc is at least 1; an empty device list still runs one
    return ALL_DEVICES_GUESS if known is None else max(1, known)


def forward_bound(worker: WorkerSpec) -> int:
    """Forwarded connections one worker's tunnel carries at once: not one per rank, as the
    launcher's ranks speak through their agent (`limits.TUNNEL_CONNECTIONS`)."""
    return limits.TUNNEL_CONNECTIONS


def open_files_needed(cluster: ClusterSpec, tree: Tree) -> int:
    """Open files a launch of ``cluster`` may hold at once: the fixed part, each directly
    connected host's connection (a gateway's leaves need none here, its relay a pipe),
    the connections the coordinator's port may hold before their hello (no rank's: ranks
    speak through their agents), and each tunnel at its bound. ``tree``: the cluster's
    gateway tree (`transport.tree_of`)."""
    workers = cluster.workers
    tunnels = sum(limits.TUNNEL_FDS_FIXED + limits.TUNNEL_FDS_PER_CONNECTION * forward_bound(w)
                  for w in workers if w.tunnel)
    leaves = sum(len(g.leaves) for g in tree.gateways)
    return (limits.NOFILE_BASE + limits.NOFILE_PER_HOST * (len(workers) - leaves)
            + limits.NOFILE_PER_RELAY * len(tree.gateways)
            + limits.NOFILE_PENDING_MIN + tunnels)


def check_open_files(cluster: ClusterSpec, events: EventBus, tree: Tree) -> None:
    """Before a launch contacts anything: RLIMIT_NOFILE against `open_files_needed`. A soft
    limit below it is raised (to twice the need, never above the hard limit); a hard limit
    below it is refused with exit 2, in one line that says what to run."""
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to check
        return
    needed = open_files_needed(cluster, tree)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise FdlError(_too_few_files(cluster, needed, soft, hard), EXIT_USAGE)
    for target in (2 * needed if hard == resource.RLIM_INFINITY else min(hard, 2 * needed),
                   needed):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):  # macOS caps the soft limit at OPEN_MAX
            continue
        events(Name.OPEN_FILES_RAISED, was=soft, now=target,
               hard=None if hard == resource.RLIM_INFINITY else hard, needed=needed)
        return
    raise FdlError(_too_few_files(cluster, needed, soft, hard), EXIT_USAGE)


def _too_few_files(cluster: ClusterSpec, needed: int, soft: int, hard: int) -> str:
    tunnels = sum(1 for w in cluster.workers if w.tunnel)
    ranks = sum(ranks_on(w) for w in cluster.workers)
    what = f"{len(cluster.workers)} host(s), {ranks} rank(s)" + (
        f", {tunnels} tunnel(s)" if tunnels else "")
    return (f"cluster launcher: this run needs about {needed} open files ({what}), but the "
            f"open-file limit (RLIMIT_NOFILE) here is {soft} and its hard limit {hard}: raise "
            f"the hard limit to at least {needed} (nofile in /etc/security/limits.conf, "
            f"LimitNOFILE= for a service, or `ulimit -Hn {needed}` as root), then run "
            f"`ulimit -n {needed}` in the shell that launches")


def free_files() -> Optional[int]:
    """Open files this process may still open under its soft limit (None: unlimited or
    unknown)."""
    try:
        import resource
    except ImportError:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    for folder in ("/proc/self/fd", "/dev/fd"):
        with contextlib.suppress(OSError):
            return soft - (len(os.listdir(folder)) - 1)  # listdir's own descriptor
    return None
