"""The agent's part in a launch's code step: a sync (`codestore`) and ``setup:``
(`setupstep`), kept out of the agent's loop (`main`), which only hands them frames,
ready pipes, reaped children and the clock.

Why in the agent: the code travels on the agent's own session (no second login, no tool
the host may lack), and setup's process is the agent's child, so the leash that holds
the ranks holds setup too: when the launcher goes, the agent kills setup's group.
Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import selectors
from typing import Any, Callable, Dict, Optional

from fdl_fabric.agent import codestore, setupstep, wire
from fdl_fabric.agent.hostloop import read_ready

#: Sends a JSON frame up (the agent's `send`).
Send = Callable[[int, Optional[Dict[str, Any]]], None]
#: Queues a raw frame up (binary frames: setup's output).
Queue = Callable[[bytes], None]


class CodeOps:
    """One agent's store (its tree's lock lives as long as the agent) and setup."""

    def __init__(self, send: Send, queue: Queue, sel: selectors.BaseSelector) -> None:
        self.send = send
        self.queue = queue
        self.sel = sel
        self.store: Optional[codestore.Store] = None
        self.setup: Optional[setupstep.SetupRun] = None

    # -- sync --------------------------------------------------------------------------
    def on_sync(self, request: Dict[str, Any]) -> None:
        """The tree's id first: a host that has it is done in one round trip."""
        self.store = codestore.Store(str(request.get("path") or "."))
        try:
            have = self.store.ask(str(request.get("tree") or ""))
        except codestore.StoreError as exc:
            self._failed(str(exc), wire.SYNC_NEED)
            return
        if have:
            self._synced()
        else:
            self.send(wire.SYNC_NEED, {"manifest": True})

    def on_manifest(self, request: Dict[str, Any]) -> None:
        if self.store is None:
            return  # the sync failed already (said once)
        try:
            answer = self.store.begin(request)
        except codestore.StoreError as exc:
            self._failed(str(exc), wire.SYNC_NEED)
            return
        self.send(wire.SYNC_NEED, answer)
        if self.store.complete:
            self._synced()

    def on_sync_data(self, body: bytes) -> None:
        if self.store is None:
            return  # the sync failed already (said once); what was in flight is dropped
        try:
            done = self.store.receive(body)
        except codestore.StoreError as exc:
            self._failed(str(exc), wire.SYNCED)
            return
        if done:
            self._synced()

    def _synced(self) -> None:
        assert self.store is not None
        try:
            self.send(wire.SYNCED, self.store.finish())
        except (codestore.StoreError, OSError) as exc:
            self._failed(str(exc), wire.SYNCED)
            return
        with contextlib.suppress(OSError):  # after the answer: off the critical path
            self.store.collect()

    def _failed(self, reason: str, kind: int) -> None:
        self.store = None
        self.send(kind, {"error": reason})

    # -- setup -------------------------------------------------------------------------
    def on_setup(self, request: Dict[str, Any]) -> None:
        try:
            run = setupstep.SetupRun(request)
            done = run.reuse()
            if done is not None:
                if self.store is not None and done["made_in"] != run.tree:
                    self.store.hold_also(done["made_in"])
                self.send(wire.SETUP_DONE, done)
                return
            fds = run.start()
        except (OSError, KeyError, TypeError, ValueError) as exc:
            self.send(wire.SETUP_DONE, {"error": f"cannot start setup: {exc}"})
            return
        self.setup = run
        for fd in fds:
            self.sel.register(fd, selectors.EVENT_READ, self.on_ready)

    def on_ready(self, fd: int, events: int = 0) -> None:
        """Setup's pipe is ready (the loop's handler for it)."""
        self.read_setup(fd, read_ready(fd))

    def read_setup(self, fd: int, data: Optional[bytes]) -> None:
        """What setup wrote on ``fd`` (``b""``: its end of the pipe)."""
        run = self.setup
        if run is None or data is None:
            return
        if data:
            run.keep(data)
            self.queue(wire.frame(wire.SETUP_OUTPUT, bytes((run.fds[fd],)) + data))
            return
        self.sel.unregister(fd)
        os.close(fd)
        del run.fds[fd]
        self._setup_ended()

    def reaped(self, pid: int, status: int) -> bool:
        """Whether ``pid`` was setup's (then its end is noted)."""
        if self.setup is None or pid != self.setup.pid:
            return False
        self.setup.status = status
        self._setup_ended()
        return True

    def _setup_ended(self) -> None:
        run = self.setup
        if run is not None and run.ended:
            self.setup = None
            self.send(wire.SETUP_DONE, run.result())

    def deadline(self) -> Optional[float]:
        return None if self.setup is None else self.setup.deadline

    def on_time(self, now: float) -> None:
        """``setup_timeout`` is over: its group is killed (SETUP_DONE follows the reap)."""
        if self.setup is not None and self.setup.deadline is not None and \
                now >= self.setup.deadline:
            self.setup.expire()

    def leash(self) -> None:
        """The agent ends: setup's whole group goes with it."""
        if self.setup is not None:
            self.setup.kill()


__all__ = ["CodeOps"]
