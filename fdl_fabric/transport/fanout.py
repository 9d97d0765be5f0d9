"""Every host at once: connect, start agents, close. Below the launch, cleanup and stacks.

The commands need the same three things, so they live here and they never import each
other: every host connected in parallel (whatever its kind: `Transport.connect`), one
agent session per host (`session.AgentSession`), and closing everything in parallel.
A host that fails is named with its reason; the others are still served.
"""

from __future__ import annotations

import contextlib
import resource
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

from ..errors import FdlError
from .base import Transport, TransportError
from .session import AgentSession, OutputSink, Post

#: Hosts connected (or agents started) at once; each is mostly waiting on the network.
CONNECT_WORKERS = 32


def connect_each(transports: Iterable[Transport],
                 on_connect: Optional[Callable[[Transport], None]] = None, *,
                 check: bool = False) -> dict[str, str]:
    """Connect every host at once; why each host that failed failed, by host.
    ``check``: also ask each one whether the host itself answers (`Transport.answers`)."""
    pending = [t for t in transports if not t.connected]
    errors: dict[str, str] = {}
    if not pending:
        return errors

    def one(transport: Transport) -> None:
        try:
            transport.connect()
        except TransportError as exc:
            errors[transport.host] = exc.reason
            return
        why = transport.answers() if check else None
        if why is not None:
            errors[transport.host] = why
            return
        if on_connect is not None:
            on_connect(transport)

    with ThreadPoolExecutor(max_workers=min(CONNECT_WORKERS, len(pending))) as pool:
        list(pool.map(one, pending))
    return errors


def connect_all(transports: Mapping[str, Transport],
                on_connect: Optional[Callable[[Transport], None]] = None) -> None:
    """Connect every host at once; fail naming every host that failed (closing the rest)."""
    errors = connect_each(transports.values(), on_connect)
    if not errors:
        return
    close_all(transports.values())
    lines = tuple(f"cluster launcher: cannot connect to host {h!r}: {why}"
                  for h, why in errors.items())
    if len(lines) == 1:
        raise FdlError(lines[0] + " — nothing was started")
    raise FdlError(f"cluster launcher: cannot connect to {len(lines)} hosts "
                   f"({', '.join(errors)}) — nothing was started", details=lines)


def close_all(transports: Iterable[Transport]) -> None:
    """Close in parallel: paramiko joins each transport thread on close."""
    threads = [threading.Thread(target=t.close, daemon=True) for t in transports]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2.0)


def start_agents(transports: Mapping[str, Transport], post: Post,
                 on_output: Optional[OutputSink] = None) -> dict[str, AgentSession]:
    """One agent per host, started in parallel; a host that cannot start fails all."""
    sessions = {host: AgentSession(t, post, on_output=on_output)
                for host, t in transports.items()}
    ensure_fd_limit(len(sessions))
    errors: list[str] = []

    def start(session: AgentSession) -> None:
        try:
            session.start()
        except Exception as exc:
            errors.append(f"cluster launcher: host {session.host!r}: cannot start its agent: "
                          f"{describe_start_error(exc)}")

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


def start_each(transports: Sequence[Transport], post: Post
               ) -> tuple[dict[str, AgentSession], dict[str, str]]:
    """One agent per host for a short errand (a sweep, a listing): the sessions that
    started, and why the others did not, by host."""
    sessions: dict[str, AgentSession] = {}
    errors: dict[str, str] = {}
    for transport in transports:
        session = AgentSession(transport, post)
        try:
            session.start()
        except Exception as exc:
            errors[transport.host] = f"cannot start its agent: {describe_start_error(exc)}"
            continue
        sessions[transport.host] = session
    return sessions, errors


def describe_start_error(exc: BaseException) -> str:
    if isinstance(exc, TransportError):
        return exc.reason
    return f"{type(exc).__name__}: {exc}"


#: Descriptors one agent session holds in the launcher (three pipes for a local or srun
#: agent; a socket and channel for an SSH one), and a margin for everything else.
FDS_PER_HOST = 4
FDS_MARGIN = 256


def ensure_fd_limit(hosts: int) -> None:
    """Raise the soft RLIMIT_NOFILE (often 1,024) toward the hard limit when a launch of
    this many hosts needs more: 512 Slurm nodes hold 1,536 pipes."""
    need = FDS_PER_HOST * hosts + FDS_MARGIN
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if target > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
