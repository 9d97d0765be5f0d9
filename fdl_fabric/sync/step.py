"""The code step of a launch: which folder is sent (``sync:``, ``--sync``, ``--no-sync``),
its manifest and code id said before any host is contacted, then, in each attempt, the
tree put in place on every host before the plan, and the ranks' folder moved into it.

`commands.launch_settings` calls `sync_spec` while it resolves the flags, `CodeStep.announce`
once the run has its id, and `CodeStep.apply` after each attempt's agents started.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import time
from collections.abc import Mapping, Sequence
from typing import Optional

from .. import reports
from ..clusterfile import ClusterSpec
from ..clusterfile.code import default_sync
from ..clusterfile.model import SetupSpec, SyncSpec
from ..events import EventBus, Name
from ..transport.session import AgentSession
from . import manifest as manifests
from .push import Push, summary, tree_dir
from .setup import Setup


def sync_spec(cluster: ClusterSpec, choice: Optional[bool]) -> Optional[SyncSpec]:
    """What is sent: the file's ``sync:`` unless ``--no-sync``; ``--sync`` without one
    sends the cluster's folder (the cluster file's, or the current one for ``--hosts``
    and ``fdl-fabric run``)."""
    if choice is False:
        return None
    if cluster.sync is not None:
        return cluster.sync
    return default_sync(cluster.folder) if choice else None


class CodeStep:
    """One launch's code: built once, put in place on each attempt's hosts."""

    def __init__(self, spec: SyncSpec, events: EventBus, *, never: Sequence[str] = (),
                 setup: Optional[SetupSpec] = None) -> None:
        self.spec = spec
        self.setup = setup
        self.events = events
        self.never = tuple(never)
        self.manifest: Optional[manifests.Manifest] = None
        #: Each host's tree folder, once in place (absolute, as its agent said).
        self.dirs: dict[str, str] = {}

    def build(self) -> manifests.Manifest:
        """The manifest (local only; a refusal is exit 2)."""
        if self.manifest is None:
            self.manifest = manifests.build(self.spec, never=self.never)
        return self.manifest

    def announce(self) -> None:
        m = self.build()
        self.events(Name.CODE, code_id=m.code_id, tree=m.tree, src=m.src, files=m.files,
                    bytes=m.bytes, excluded=m.excluded)

    def planned(self, cluster: ClusterSpec) -> ClusterSpec:
        """The cluster as a dry run shows it: each worker's ranks in its tree, by the path
        as written (its agent would expand ``~``)."""
        tree = self.build().tree
        return dataclasses.replace(cluster, workers=tuple(
            dataclasses.replace(w, path=tree_dir(w.path, tree)) for w in cluster.workers))

    def dry_run(self) -> dict[str, object]:
        """What a sync would send, for ``--dry-run``: each host receives what it lacks of
        these (it is asked nothing: a dry run connects nowhere)."""
        m = self.build()
        return {"code_id": m.code_id, "tree": m.tree, "src": m.src, "files": m.files,
                "bytes": m.bytes, "excluded": m.excluded,
                "list": [[e.rel, e.size] for e in m.entries if e.kind == "f"]}

    def apply(self, cluster: ClusterSpec, sessions: Mapping[str, AgentSession],
              inbox: queue.SimpleQueue[reports.Report]) -> ClusterSpec:
        """Every host of ``cluster`` gets the tree; the cluster returned runs each
        worker's ranks in its tree. Raises `FdlError` (exit 1) naming a host that failed."""
        m = self.build()
        hosts = [w.host for w in cluster.workers if w.host in sessions]
        started = time.monotonic()
        push = Push(m, {h: sessions[h] for h in hosts},
                    {w.host: w.path for w in cluster.workers}, inbox, self.events)
        self.dirs.update(push.run())
        self.events(Name.CODE_IN_PLACE, **summary(push.hosts),
                    seconds=round(time.monotonic() - started, 3), code_id=m.code_id)
        if self.setup is not None:
            env = {w.host: {**cluster.env, **w.env} for w in cluster.workers}
            Setup(self.setup, m, self.events, inbox).run(
                {h: sessions[h] for h in hosts}, {h: self.dirs[h] for h in hosts},
                {h: push.hosts[h].root for h in hosts}, env)
        return dataclasses.replace(cluster, workers=tuple(
            dataclasses.replace(w, path=self.dirs.get(w.host, w.path))
            for w in cluster.workers))


def never_sent(*folders: Optional[str]) -> list[str]:
    """The folders a sync never sends (the run records, ``--log-dir``), absolute."""
    return [os.path.abspath(f) for f in folders if f]
