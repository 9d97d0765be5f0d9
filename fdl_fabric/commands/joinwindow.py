"""A launch's join window (``controller.join``, docs/join.md): listen, admit the
workers that dial in, decide by flodl's rules when the world forms or fails, and hand
the launch the world as a cluster.

Runs before any host is contacted, once the run has its id and record: a joiner is
told the run id, and a fresh token is kept in the record. A failed window ends the
launch with its own verdict (exit 1), and every joiner is told why. Ranks are numbered
by the rule `planning.joinwindow` documents: the roster's order, then walk-ins by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from ..clusterfile import JOIN_KIND, ClusterSpec, JoinSpec, SshSpec, WorkerSpec
from ..errors import EXIT_FAILURE, EXIT_USAGE, FdlError
from ..events import EventBus, Name, event
from ..joinwire import JoinError, new_token, parse_token, read_token_file, write_token_file
from ..planning.joinwindow import Decision, JoinLedger, WindowState
from ..supervision.records import RunResult
from ..supervision.verdict import Verdict
from ..transport import kind_of
from ..transport.joinport import Joined, JoinPort
from .joincli import WINDOW_NOTE

#: How often the window's rules are asked when nothing happens (a joiner's arrival or
#: an operator's start wakes it at once).
TURN_S = 0.2
#: The file of a token the launcher made, in the run's record (0600).
TOKEN_FILE = "join.token"


class Window:
    """One launch's join window: `open`, `wait`, then `world` (or the failure)."""

    def __init__(self, cluster: ClusterSpec, run_id: str, record: Optional[Path],
                 events: EventBus, scale: float = 1.0) -> None:
        join = cluster.controller.join
        assert join is not None
        self.spec: JoinSpec = join
        self.cluster = cluster
        self.run_id = run_id
        self.record = record
        self.events = events
        self.scale = scale
        roster = {w.host: w.known_ranks or 0 for w in cluster.workers
                  if kind_of(w).dials_in}
        self.ledger = JoinLedger(join, run_id, roster)
        self.port: Optional[JoinPort] = None
        self.token_file = ""
        self.opened_at = 0.0

    # -- the window --------------------------------------------------------------------
    def open(self) -> None:
        """Listen with the token (the operator's file, else a fresh one kept 0600 in the
        run's record); a token file others can read is refused, exit 2."""
        spec = self.spec
        token = self._token()
        bind = spec.bind or self.cluster.controller.host
        self.port = JoinPort(bind, spec.port, token, self.ledger, self.events, self.scale)
        self.port.open()
        self.opened_at = time.monotonic()
        self._note(f"{bind}:{self.port.port}")
        self.events(Name.JOIN_WINDOW_OPEN, address=f"{bind}:{self.port.port}",
                    quorum=spec.min_ranks, target=spec.target_ranks,
                    window=spec.join_timeout * self.scale,
                    cap=spec.max_join_timeout * self.scale, start=spec.start.value,
                    discovery=spec.discovery, token_file=self.token_file,
                    token_file_given=spec.token_file is not None, run_id=self.run_id)

    def _note(self, address: str) -> None:
        """Where the window listens and its token, for `fdl-fabric start` on this machine
        (the record is 0700, the note 0600)."""
        if self.record is None:
            return
        with contextlib.suppress(OSError):
            fd = os.open(self.record / WINDOW_NOTE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                         | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"address": address, "token_file": self.token_file}, f)

    def _token(self) -> bytes:
        spec = self.spec
        try:
            if spec.token_file is not None:
                self.token_file = spec.token_file
                return read_token_file(spec.token_file)
            # The run's record (0700), or a private folder of its own if it has none.
            folder = self.record if self.record is not None else Path(
                tempfile.mkdtemp(prefix="fdl-join-"))
            self.token_file = str(folder / TOKEN_FILE)
            text = new_token()
            write_token_file(self.token_file, text)
            return parse_token(text, self.token_file)
        except (JoinError, OSError) as exc:
            raise FdlError(f"controller.join.token_file: {exc}", EXIT_USAGE) from None

    def wait(self) -> Decision:
        """Until the window forms or fails (at most its cap); a stop signal ends it
        (`LaunchInterrupted`, raised in this thread by the launch's signals)."""
        port = self.port
        assert port is not None
        while True:
            elapsed = (time.monotonic() - self.opened_at) / self.scale
            with port.changed:
                decision = self.ledger.decide(elapsed)
                if decision.state is WindowState.OPEN:
                    port.changed.wait(TURN_S)
            port.flush()
            if decision.state is not WindowState.OPEN:
                break
        port.flush(force=True)
        after = time.monotonic() - self.opened_at
        if decision.state is WindowState.FORMED:
            self.events(Name.JOIN_WORLD_FORMED, ranks=self.ledger.ranks_in,
                        hosts=len(self.ledger.joined), after=after,
                        why=decision.why.value if decision.why else "",
                        missing=[h for h in self.ledger.roster if h not in self.ledger.joined])
        else:
            for joined in self._members():
                joined.send({"abort": self.failure_data(decision)["why"]})
        return decision

    def failure_data(self, decision: Decision) -> dict[str, Any]:
        return {"why": decision.why.value if decision.why else "failed",
                "ranks_in": self.ledger.ranks_in, "quorum": self.spec.min_ranks,
                "cap": self.spec.max_join_timeout * self.scale}

    def failed(self, decision: Decision) -> RunResult:
        """The launch's result when the window failed: nothing was started."""
        return RunResult(Verdict.FAILED, EXIT_FAILURE,
                         event(Name.JOIN_WINDOW_FAILED, **self.failure_data(decision)), ())

    def _members(self) -> list[Joined]:
        port = self.port
        if port is None:
            return []
        with port.changed:
            return list(port.members.values())

    # -- the world ---------------------------------------------------------------------
    def world(self) -> tuple[ClusterSpec, dict[str, Any]]:
        """The cluster the run is launched on: the roster in the file's order (a joining
        worker in its place if it joined, left out if not), then the walk-ins by host
        name; and each joiner's settings (its admission, for `JoinTransport`)."""
        members = {j.host: j for j in self._members()}
        workers: list[WorkerSpec] = []
        for w in self.cluster.workers:
            if not kind_of(w).dials_in:
                workers.append(w)
            elif w.host in members:
                workers.append(_joined_worker(w, members[w.host]))
        for host in self.ledger.ordered_hosts([w.host for w in self.cluster.workers]):
            if host not in {w.host for w in workers}:
                workers.append(_joined_worker(_walk_in(self.cluster, host), members[host]))
        workers = [dataclasses.replace(w, index=i) for i, w in enumerate(workers)]
        return dataclasses.replace(self.cluster, workers=tuple(workers)), dict(members)

    def close(self) -> None:
        if self.port is not None:
            self.port.close()


def _walk_in(cluster: ClusterSpec, host: str) -> WorkerSpec:
    """A walk-in's worker: the cluster's environment, nothing of SSH."""
    return WorkerSpec(index=0, host=host, nproc=None, local_devices=None, path="",
                      addr=host, nccl_socket_ifname=None, ssh=SshSpec(), tunnel=False,
                      env=dict(cluster.env), data_path=None, is_local=False, line=0,
                      env_forward=cluster.env_forward, transport=JOIN_KIND)


def _joined_worker(worker: WorkerSpec, joined: Joined) -> WorkerSpec:
    """A joining worker as its joiner offered it: the file's ranks if it gives them,
    else the offer's; its folder; the address it dialled from (``MASTER_ADDR`` when it
    holds rank 0)."""
    offer = joined.offer
    nproc, devices = worker.nproc, worker.local_devices
    if nproc is None and devices is None:
        nproc, devices = (None, offer.devices) if offer.devices is not None else \
            (offer.nproc, None)
    return dataclasses.replace(worker, nproc=nproc, local_devices=devices,
                               path=worker.path or offer.path or ".", addr=joined.peer)
