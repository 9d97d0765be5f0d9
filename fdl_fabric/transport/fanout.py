"""Hosts: connecting to them and starting their agents, below the launcher and cleanup.

Both `launcher` and `cleanup` need the same three things, so they live here and those
two never import each other: every remote host connected in parallel (one Fabric
Connection each, our host-key policy and timeouts, a Config of its own), one agent
session per host (`sessions.AgentSession`: through Fabric for remote hosts, through
invoke for local ones).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Optional

from ..clusterfile import WorkerSpec
from ..errors import FdlError
from .session import AgentSession, OutputSink, Post, local_environment
from .sshconfig import SshSettings

if TYPE_CHECKING:  # Fabric's SSH stack loads only when a host is remote
    from .ssh import FdlConnection

#: Hosts connected at once; each connect is mostly waiting on the network.
CONNECT_WORKERS = 32


def connect_each(settings: Mapping[str, SshSettings],
                 on_connect: Optional[Callable[[str, SshSettings], None]] = None,
                 ) -> tuple[dict[str, FdlConnection], dict[str, str]]:
    """Connect every host at once: (connections, why each failed host failed)."""
    opened: dict[str, FdlConnection] = {}
    errors: dict[str, str] = {}
    if not settings:
        return opened, errors
    from .ssh import SshConnectError, open_connection
    with ThreadPoolExecutor(max_workers=min(CONNECT_WORKERS, len(settings))) as pool:
        futures = {host: pool.submit(open_connection, s) for host, s in settings.items()}
        for host, fut in futures.items():
            try:
                opened[host] = fut.result()
            except SshConnectError as exc:
                errors[host] = exc.reason
                continue
            if on_connect is not None:
                on_connect(host, settings[host])
    return opened, errors


def connect_all(settings: Mapping[str, SshSettings],
                on_connect: Optional[Callable[[str, SshSettings], None]] = None,
                ) -> dict[str, FdlConnection]:
    """Connect every host at once; fail naming every host that failed (closing the rest)."""
    opened, errors = connect_each(settings, on_connect)
    if errors:
        close_all(opened.values())
        lines = tuple(f"cluster launcher: cannot connect to host {h!r}: {why}"
                      for h, why in errors.items())
        if len(lines) == 1:
            raise FdlError(lines[0] + " — nothing was started")
        raise FdlError(f"cluster launcher: cannot connect to {len(lines)} hosts "
                          f"({', '.join(errors)}) — nothing was started", details=lines)
    return opened


def close_all(connections: Iterable[FdlConnection]) -> None:
    """Close connections in parallel: paramiko joins each transport thread on close."""
    threads = [threading.Thread(target=_close, args=(c,), daemon=True) for c in connections]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2.0)


def _close(conn: FdlConnection) -> None:
    with contextlib.suppress(Exception):  # best effort: the process is about to exit
        conn.close()


def start_agents(workers: Iterable[WorkerSpec], connections: Mapping[str, FdlConnection],
                 post: Post, on_output: Optional[OutputSink] = None
                 ) -> dict[str, AgentSession]:
    """One agent per worker host, started in parallel; a host that cannot start fails all."""
    sessions = {w.host: agent_session(w, connections, post, on_output=on_output)
                for w in workers}
    ensure_fd_limit(len(sessions))
    errors: list[str] = []

    def start(session: AgentSession) -> None:
        try:
            session.start()
        except Exception as exc:
            errors.append(f"cluster launcher: host {session.host!r}: cannot start its agent: "
                          f"{type(exc).__name__}: {exc}")

    with ThreadPoolExecutor(max_workers=max(1, min(CONNECT_WORKERS, len(sessions)))) as pool:
        list(pool.map(start, sessions.values()))
    if errors:
        for s in sessions.values():
            s.abandon()
        errors.sort()
        if len(errors) == 1:
            raise FdlError(errors[0])
        raise FdlError(f"cluster launcher: {len(errors)} hosts cannot start their agents",
                          details=tuple(errors))
    return sessions


#: Descriptors one agent session holds in the launcher (three pipes for a local or srun
#: agent; a socket and channel for an SSH one), and a margin for everything else.
FDS_PER_HOST = 4
FDS_MARGIN = 256


def ensure_fd_limit(hosts: int) -> None:
    """Raise the soft RLIMIT_NOFILE (often 1,024) toward the hard limit when a launch of
    this many hosts needs more: 512 Slurm nodes hold 1,536 pipes."""
    import resource

    need = FDS_PER_HOST * hosts + FDS_MARGIN
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if target > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def agent_session(worker: WorkerSpec, connections: Mapping[str, FdlConnection],
                  post: Post, *, step_name: Optional[str] = None,
                  on_output: Optional[OutputSink] = None) -> AgentSession:
    """How this worker's agent is reached: an srun step of its Slurm job, a process here,
    or an SSH session on its connection."""
    if worker.slurm_job is not None:
        from . import slurm

        command = slurm.step_command(worker.slurm_job, worker.host,
                                     name=step_name or slurm.AGENT_STEP)
        return AgentSession(worker.host, post, command=command,
                            env=slurm.step_env(local_environment()), on_output=on_output)
    if worker.is_local:
        return AgentSession(worker.host, post, on_output=on_output)
    return AgentSession(worker.host, post, connection=connections[worker.host],
                        on_output=on_output)
