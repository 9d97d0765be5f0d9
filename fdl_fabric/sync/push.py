"""A sync, on the launcher: the manifest to every host's agent, then to each host only
the objects it lacks, until every host says its tree is in place.

It rides the agents' own sessions (docs/code-and-environment.md says why: no tool the
host may lack, no second login, and a host that drops mid-transfer is the same lost
agent the supervisor already knows). A host the launcher reaches directly gets its
objects from the launcher, each on its own thread (a slow host slows only itself). A
leaf of the gateway tree gets them from its gateway, once the gateway's own tree is in
place: the launcher sends each gateway one copy, and the gateway's relay reads the
objects from its store for each leaf (`fdl_fabric.agent.feeder`).

Every wait is bounded: a host that neither answers nor takes bytes for
`SYNC_IDLE_TIMEOUT` seconds fails the sync, naming it. Any failure ends the launch
before a rank starts (exit 1, one line naming the host and what to do).
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from .. import reports
from ..agent import wire
from ..agent.codestore import DATA_HEAD, LAST, STORE
from ..errors import FdlError
from ..events import EventBus, Name
from ..transport.session import AgentSession
from .manifest import Manifest

#: Seconds a host may go without an answer while nothing is being sent to it.
SYNC_IDLE_TIMEOUT = 60.0
#: Bytes of a file in one SYNC_DATA frame.
CHUNK = 256 * 1024


def tree_dir(path: str, tree: str) -> str:
    """Where a host's agent puts ``tree`` under the worker's ``path`` (the ranks' cwd)."""
    return os.path.join(path, STORE, "trees", tree)


@dataclass
class HostSync:
    """One host's part of a sync, as the launcher sees it."""

    host: str
    path: str
    asked: bool = False
    #: It had the tree: it was never asked for the manifest.
    have: bool = True
    need: list[int] = field(default_factory=list)
    root: str = ""
    dir: Optional[str] = None
    received: int = 0
    error: Optional[str] = None
    sending: bool = False
    heard: float = field(default_factory=time.monotonic)


class Push:
    """One sync of ``manifest`` to the hosts of ``sessions``; `run` returns each host's
    tree folder, or raises `FdlError` naming the first host that failed."""

    def __init__(self, manifest: Manifest, sessions: Mapping[str, AgentSession],
                 paths: Mapping[str, str], inbox: queue.SimpleQueue[reports.Report],
                 events: EventBus) -> None:
        self.manifest = manifest
        self.sessions = sessions
        self.inbox = inbox
        self.events = events
        self.hosts = {h: HostSync(h, paths[h]) for h in sessions}
        self.kept: list[reports.Report] = []
        self.stop = threading.Event()
        self.started = time.monotonic()
        self._frame: Optional[bytes] = None

    def run(self) -> dict[str, str]:
        """The tree's id to every host first: one that has it is done in one round trip,
        and only the others get the manifest (one frame, built once)."""
        for host, state in self.hosts.items():
            self.sessions[host].send(wire.SYNC, {"tree": self.manifest.tree,
                                                 "path": state.path})
        try:
            while any(s.dir is None for s in self.hosts.values()):
                self._step()
        finally:
            self.stop.set()
            for report in self.kept:
                self.inbox.put(report)
        return {h: s.dir for h, s in self.hosts.items() if s.dir is not None}

    # -- the loop ------------------------------------------------------------------------
    def _step(self) -> None:
        try:
            report = self.inbox.get(timeout=1.0)
        except queue.Empty:
            self._check_idle()
            return
        if isinstance(report, reports.SyncAnswer) and report.host in self.hosts:
            self._answer(self.hosts[report.host], report)
        elif isinstance(report, reports.AgentGone) and report.host in self.hosts:
            self._fail(report.host, f"the host dropped during the sync ({report.reason})")
        else:
            self.kept.append(report)
        self._check_idle()

    def _answer(self, state: HostSync, report: reports.SyncAnswer) -> None:
        info = report.info
        state.heard = time.monotonic()
        if info.get("error"):
            self._fail(state.host, str(info["error"]))
        if report.done:
            self._synced(state, info)
        elif info.get("manifest"):
            state.have = False
            self.sessions[state.host].write_shared(self._manifest_frame())
        else:
            self._asked(state, info)

    def _asked(self, state: HostSync, info: Mapping[str, Any]) -> None:
        """The host read the manifest and says which objects it lacks: they go from here,
        or from its gateway once the gateway's tree is in place (else when it is)."""
        state.asked = True
        state.need = [int(i) for i in info.get("need") or []]
        state.root = str(info.get("root") or "")
        if not state.need:
            return
        gateway = self.gateway_of(state.host)
        if gateway is None:
            self._send(state)
        elif gateway in self.hosts and self.hosts[gateway].dir is not None:
            self._serve(self.hosts[gateway], state)

    def _synced(self, state: HostSync, info: Mapping[str, Any]) -> None:
        """The host's tree is in place: say so, and feed the leaves that waited for it."""
        state.dir = str(info.get("dir") or tree_dir(state.path, self.manifest.tree))
        state.root = str(info.get("root") or state.root)  # a gateway that had the tree
        state.received = int(info.get("received") or 0)
        self.events(Name.CODE_SYNCED, host=state.host, files=len(state.need),
                    bytes=state.received, had=state.have, dir=state.dir,
                    seconds=round(time.monotonic() - self.started, 3))
        for leaf in self.hosts.values():
            if leaf.need and leaf.asked and leaf.dir is None and not leaf.sending and \
                    self.gateway_of(leaf.host) == state.host:
                self._serve(state, leaf)

    def _manifest_frame(self) -> bytes:
        if self._frame is None:
            body = json.dumps({"entries": self.manifest.wire()}, separators=(",", ":"),
                              ensure_ascii=False).encode("utf-8", "surrogateescape")
            self._frame = wire.frame(wire.SYNC_MANIFEST, body)
        return self._frame

    def gateway_of(self, host: str) -> Optional[str]:
        process = self.sessions[host].process
        return None if process is None else process.served_by

    def _check_idle(self) -> None:
        now = time.monotonic()
        for state in self.hosts.values():
            heard = max(state.heard, self.sessions[state.host].last_heard)
            if state.dir is None and now - heard > SYNC_IDLE_TIMEOUT:
                waiting = "its answer to the manifest" if not state.asked else "its tree"
                self._fail(state.host, f"no word from its agent for {SYNC_IDLE_TIMEOUT:g} s "
                                       f"(waiting for {waiting})")

    def _fail(self, host: str, reason: str) -> None:
        self.stop.set()
        raise FdlError(f"cluster launcher: sync to {host}: {reason} — nothing was "
                       "started")

    # -- sending -------------------------------------------------------------------------
    def _send(self, state: HostSync) -> None:
        state.sending = True
        thread = threading.Thread(target=self._send_all, args=(state,),
                                  name=f"fdl-sync-{state.host}", daemon=True)
        thread.start()

    def _send_all(self, state: HostSync) -> None:
        """Every object ``state`` lacks, each read from ``src`` as it goes (the host checks
        each against its hash, so a file changed meanwhile is refused, never stored)."""
        session = self.sessions[state.host]
        try:
            for index in state.need:
                if self.stop.is_set():
                    return
                entry = self.manifest.entries[index]
                self._send_file(session, index, os.path.join(self.manifest.src, entry.rel),
                                entry.size, state)
        except OSError as exc:
            self.inbox.put(reports.SyncAnswer(state.host, True, {
                "error": f"cannot read {exc.filename or 'a file'} here: {exc.strerror}"}))
        finally:
            state.heard = time.monotonic()
            state.sending = False

    def _send_file(self, session: AgentSession, index: int, path: str, size: int,
                   state: HostSync) -> None:
        left = size
        with open(path, "rb") as f:
            while True:
                chunk = f.read(min(CHUNK, left)) if left > 0 else b""
                left -= len(chunk)
                last = left <= 0 or not chunk
                session.write(wire.frame(wire.SYNC_DATA,
                                         DATA_HEAD.pack(index, LAST if last else 0) + chunk))
                state.heard = time.monotonic()
                if last or self.stop.is_set():
                    return

    def _serve(self, gateway: HostSync, leaf: HostSync) -> None:
        """Ask ``gateway``'s relay to feed ``leaf`` from the gateway's store."""
        process = self.sessions[leaf.host].process
        assert process is not None
        leaf.sending = True  # the relay feeds it; its agent's heartbeats say it lives
        leaf.heard = time.monotonic()
        process.serve(gateway.root, leaf.need)


def summary(states: Mapping[str, HostSync]) -> dict[str, Any]:
    """What `Name.CODE_IN_PLACE` carries."""
    return {"hosts": len(states), "had": sum(1 for s in states.values() if s.have),
            "bytes": sum(s.received for s in states.values())}
