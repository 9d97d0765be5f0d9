"""The agent's STACKS requests: whose stacks, a collector started (`stacks.start`), and
its report read without blocking the agent's loop.

Apart from the loop (`main`): a collector is a child of the agent that runs py-spy (or
reads /proc) for seconds, and the loop only hands this module the request and the
collector's ready pipe. Standard library only.
"""

from __future__ import annotations

import os
import selectors
from typing import Any, Callable, Dict, List, Optional, Tuple

from fdl_fabric.agent import procs, stacks, wire
from fdl_fabric.agent.hostloop import read_ready

#: Sends a JSON frame up (the agent's `send`).
Send = Callable[[int, Optional[Dict[str, Any]]], None]


def recorded_ranks(run: Any, host: Any) -> Tuple[Dict[int, int], str]:
    """rank -> pid of a recorded run's ranks still alive on this host (``fdl-fabric
    stacks`` from another terminal), and why the registry could not be read."""
    pids: Dict[int, int] = {}
    try:
        records, _ = procs.read_records()
    except procs.RegistryError as exc:
        return pids, str(exc)
    for rec in records:
        if rec["run"] == run and host in (None, rec["host"]):
            pids.update({int(r["rank"]): int(r["pid"]) for r in rec["ranks"]
                         if procs.group_members(int(r["pid"]), int(r["start"]))})
    return pids, ""


class Collectors:
    """Stack collectors running: pid -> {fd, request id, run id, what was read}."""

    def __init__(self, send: Send, sel: selectors.BaseSelector) -> None:
        self.send = send
        self.sel = sel
        self.jobs: Dict[int, Dict[str, Any]] = {}

    def pids(self) -> List[int]:
        return list(self.jobs)

    def start(self, req_id: Any, run: Any, pids: Dict[int, int], error: str = "") -> None:
        """A collector for ``pids`` (rank -> pid), or the report saying why there is none."""
        if not pids:
            self.send(wire.STACKS_REPORT, {"id": req_id, "run": run, "ranks": {},
                                           "error": error or "no running rank here"})
            return
        started = stacks.start(pids)
        if started is None:
            self.send(wire.STACKS_REPORT, {"id": req_id, "run": run, "ranks": {},
                                           "error": "cannot start the stack collector"})
            return
        pid, fd = started
        os.set_blocking(fd, False)
        self.jobs[pid] = {"fd": fd, "id": req_id, "run": run, "buf": bytearray()}
        self.sel.register(fd, selectors.EVENT_READ, self.on_ready)

    def on_ready(self, fd: int, events: int = 0) -> None:
        """The collector's report, once its pipe ends."""
        pid = next((p for p, c in self.jobs.items() if c["fd"] == fd), None)
        if pid is None:
            return
        job = self.jobs[pid]
        while True:
            data = read_ready(fd)
            if data is None:
                return
            if not data:
                break
            job["buf"] += data
        self.sel.unregister(fd)
        os.close(fd)
        del self.jobs[pid]
        result = stacks.read_result(bytes(job["buf"]))
        self.send(wire.STACKS_REPORT, {"id": job["id"], "run": job["run"], **result})


__all__ = ["Collectors", "recorded_ranks"]
