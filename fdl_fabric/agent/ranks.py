"""The agent's ranks: each one started with its environment, its output forwarded as
whole lines, its exit turned into the EXITED frame, and its group signalled.

Kept apart from the agent's loop (`main`), which decides *when* (a START, a stop, a
signal, a reap) while this module knows *how*. A rank's pipes are registered on the
loop (`hostloop`) and read without blocking; when more than `HIGH_WATER` bytes wait for
the launcher, every rank pipe is left unread until they went, so a launcher that reads
slowly slows the ranks down instead of growing the agent.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
from typing import Any, Dict, List, Optional

from fdl_fabric.agent import children, lines, procs, wire
from fdl_fabric.agent.hostloop import HostLoop, read_ready
from fdl_fabric.rank import ENV_AGENT_SOCKET, ENV_CLUSTER_JSON

#: Frames waiting for the launcher beyond this many bytes pause reading rank output.
HIGH_WATER = 4 * 1024 * 1024
#: Reads of one rank pipe per wake-up: one chatty rank cannot starve the loop.
READS_PER_WAKE = 16

_INTERNAL_PREFIX = "FLODL_INTERNAL_"
#: What srun tells the agent about its own step's one task. Wrong for every rank (all
#: would be "task 0 of 1"), and frameworks that detect Slurm from them (Lightning reads
#: SLURM_NTASKS and SLURM_PROCID) would take them over RANK and WORLD_SIZE.
_STEP_TASK_VARS = frozenset({
    "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_NPROCS",
    "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
    "SLURM_GTIDS", "SLURM_TASK_PID", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NODELIST",
    "SLURM_NNODES", "SLURM_DISTRIBUTION", "SLURM_LAUNCH_NODE_IPADDR",
    "SLURM_SRUN_COMM_HOST", "SLURM_SRUN_COMM_PORT", "SLURM_STEP_LAUNCHER_PORT",
})


class RankProc:
    """One rank this agent started (plain classes here: `dataclasses` costs every agent's
    start 5 ms of imports)."""

    __slots__ = ("rank", "pid", "start", "status", "error_file", "kill_at")

    def __init__(self, rank: int, pid: int, start: int, error_file: str = "") -> None:
        self.rank, self.pid, self.start = rank, pid, start
        self.status: Optional[int] = None
        self.error_file = error_file
        #: When a stop of this rank alone (a rank the coordinator declared dead) turns to
        #: KILL.
        self.kill_at: Optional[float] = None

    @property
    def running(self) -> bool:
        return self.status is None


class Stream:
    """One of a rank's two pipes, cut into whole lines."""

    __slots__ = ("rank", "kind", "splitter")

    def __init__(self, rank: RankProc, kind: int) -> None:
        self.rank, self.kind = rank, kind
        self.splitter = lines.LineSplitter(wire.MAX_LINE_PIECE)


def base_env(spec: Dict[str, Any], agent_socket: Optional[str] = None) -> Dict[str, str]:
    """Every rank's environment before its own entries: the spec's defaults first, then
    this host's own environment (less the agent's internals and srun's one-task view),
    then the spec's, then the agent's socket when it has one (`cohortrelay`: a rank
    without it dials the coordinator itself)."""
    base = {str(k): str(v) for k, v in (spec.get("defaults") or {}).items()}
    base.update({k: v for k, v in os.environ.items()
                 if not k.startswith(_INTERNAL_PREFIX) and k not in _STEP_TASK_VARS})
    base.update(spec["env"])
    if spec.get("envelope"):
        base[ENV_CLUSTER_JSON] = str(spec["envelope"])
    if agent_socket:
        base[ENV_AGENT_SOCKET] = agent_socket
    return base


class Ranks:
    """The ranks of one agent, by rank, by pid and by pipe."""

    def __init__(self, loop: HostLoop) -> None:
        self.loop = loop
        self.procs: Dict[int, RankProc] = {}
        self.by_pid: Dict[int, RankProc] = {}
        self.streams: Dict[int, Stream] = {}
        self.paused = False

    # -- starting -------------------------------------------------------------------------
    def start(self, rank: int, argv: List[str], env: Dict[str, str], cwd: str,
              error_file: str) -> children.Child:
        """Start one rank (`children.spawn`, which raises `children.SpawnError`) and read
        its pipes from now on."""
        child = children.spawn(argv, env, cwd)
        proc = RankProc(rank=rank, pid=child.pid, start=child.start, error_file=error_file)
        self.procs[rank] = proc
        self.by_pid[child.pid] = proc
        for fd, kind in ((child.stdout, wire.STDOUT), (child.stderr, wire.STDERR)):
            os.set_blocking(fd, False)
            self.streams[fd] = Stream(proc, kind)
            if not self.paused:
                self.loop.sel.register(fd, selectors.EVENT_READ, self.on_ready)
        return child

    # -- what is running ------------------------------------------------------------------
    def any_running(self) -> bool:
        return any(p.running for p in self.procs.values())

    def live_groups(self) -> List[int]:
        """The process groups of the ranks still running (each rank leads its own)."""
        return [p.pid for p in self.procs.values() if p.running]

    def pids(self) -> List[int]:
        return [p.pid for p in self.procs.values()]

    def running_pids(self) -> Dict[int, int]:
        """rank -> pid of each running rank."""
        return {p.rank: p.pid for p in self.procs.values() if p.running}

    def record(self) -> List[Dict[str, int]]:
        """The ranks as the run registry keeps them."""
        return [{"rank": p.rank, "pid": p.pid, "start": p.start} for p in self.procs.values()]

    # -- output ---------------------------------------------------------------------------
    def keep_pace(self) -> None:
        """Read rank pipes only while the launcher keeps up (`HIGH_WATER`)."""
        pause = len(self.loop.out) > HIGH_WATER
        if pause == self.paused:
            return
        self.paused = pause
        for fd in self.streams:
            if pause:
                self.loop.sel.unregister(fd)
            else:
                self.loop.sel.register(fd, selectors.EVENT_READ, self.on_ready)

    def on_ready(self, fd: int, events: int = 0) -> None:
        """What a rank wrote on ``fd``, as OUTPUT frames of whole lines (bounded)."""
        stream = self.streams.get(fd)
        if stream is None:
            return
        for _ in range(READS_PER_WAKE):
            data = read_ready(fd)
            if data is None:
                return
            if not data:
                self._close_stream(fd, stream)
                return
            for chunk, partial in stream.splitter.feed(data):
                self._send_output(stream, chunk, partial)
            if len(self.loop.out) > HIGH_WATER:
                return

    def _send_output(self, stream: Stream, chunk: bytes, partial: bool) -> None:
        if self.loop.output_open:
            self.loop.out += wire.output(stream.rank.rank, stream.kind, chunk, partial)

    def _close_stream(self, fd: int, stream: Stream) -> None:
        for chunk, partial in stream.splitter.flush():
            self._send_output(stream, chunk, partial)
        if not self.paused:
            self.loop.sel.unregister(fd)
        del self.streams[fd]
        os.close(fd)

    def _drain(self, proc: RankProc) -> None:
        """Forward what the rank wrote before it exited, so its output precedes its exit."""
        for fd, stream in list(self.streams.items()):
            if stream.rank is proc:
                self.on_ready(fd)

    def drain_all(self) -> None:
        """At the end: what leftovers wrote before they were stopped, then every pipe
        closed."""
        for fd, stream in list(self.streams.items()):
            self.on_ready(fd)
            if fd in self.streams:
                self._close_stream(fd, stream)

    # -- exits and signals ----------------------------------------------------------------
    def exited(self, pid: int, status: int) -> Optional[Dict[str, Any]]:
        """The EXITED frame's body for a reaped rank (its output drained first), or None
        when ``pid`` is no rank."""
        proc = self.by_pid.get(pid)
        if proc is None:
            return None
        proc.status = status
        self._drain(proc)
        code: Optional[int] = None
        sig: Optional[int] = None
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
        else:
            code = os.WEXITSTATUS(status)
        exited: Dict[str, Any] = {"rank": proc.rank, "code": code, "signal": sig}
        if code != 0 and proc.error_file:
            error = procs.read_error_file(proc.error_file)
            if error:
                exited["error"] = error
        return exited

    def signal(self, sig: int, rank: Optional[Any] = None) -> None:
        """``sig`` to the group of every running rank, or of rank ``rank`` alone."""
        for proc in self.procs.values():
            if proc.running and (rank is None or rank == proc.rank):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)

    def stop_one(self, rank: int, kill_at: float) -> None:
        """One rank (declared dead by the coordinator, so frozen or cut off): TERM now,
        KILL at ``kill_at``; the others carry on."""
        proc = self.procs.get(rank)
        if proc is None or not proc.running or proc.kill_at is not None:
            return
        proc.kill_at = kill_at
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)

    def deadlines(self) -> List[float]:
        return [p.kill_at for p in self.procs.values() if p.kill_at is not None and p.running]

    def kill_past_grace(self, now: float) -> None:
        """KILL the group of each rank stopped alone whose own grace is over."""
        for proc in self.procs.values():
            if proc.kill_at is not None and proc.running and now >= proc.kill_at:
                proc.kill_at = None
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)


__all__ = ["HIGH_WATER", "RankProc", "Ranks", "Stream", "base_env"]
