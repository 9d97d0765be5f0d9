"""Asking every host of a cluster about its recorded runs, from another terminal.

``stacks`` and ``status`` need nothing from a running launcher: like a cleanup, they
start one agent on each host (exactly as a launch starts it), ask, and read the
answers, each host bounded by `ANSWER_TIMEOUT`. The runs are never touched.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Optional, Union

from .. import reports
from ..clusterfile import ClusterSpec
from ..errors import FdlError
from ..events import EventBus, Name
from ..transport import HostSettings, for_cluster, resolve_cluster, resolve_settings
from ..transport.fanout import close_all, connect_each, start_each
from ..transport.session import AgentSession
from .launch_settings import trusted_cluster

#: Seconds every host has to list its runs, and then to report its ranks' stacks.
ANSWER_TIMEOUT = 30.0

Asked = tuple[dict[str, AgentSession], "queue.SimpleQueue[reports.Report]", dict[str, str]]


def cluster_to_ask(cluster_file: Optional[str], cluster: Optional[ClusterSpec],
                   events: EventBus) -> Union[tuple[ClusterSpec, HostSettings], int]:
    """The cluster to ask and each host's settings, or the exit code once a refusal was
    said (a bad cluster file or flag: exit 2, nothing contacted)."""
    try:
        cluster = trusted_cluster(resolve_cluster(cluster_file, cluster), False)
        return cluster, resolve_settings(cluster, events)
    except FdlError as exc:
        events(Name.REFUSED, error=str(exc))
        return exc.exit_code


@contextlib.contextmanager
def asking_agents(cluster: ClusterSpec, settings: HostSettings
                  ) -> Iterator[Asked]:
    """An agent on every host that can be reached: the sessions, their one inbox, and why
    each other host could not be asked. Everything is closed on the way out."""
    inbox: queue.SimpleQueue[reports.Report] = queue.SimpleQueue()
    transports = for_cluster(cluster, dict(settings), purpose="cleanup")
    errors = connect_each(transports.values())
    sessions: dict[str, AgentSession] = {}
    try:
        sessions, failed = start_each([t for h, t in transports.items() if h not in errors],
                                      inbox.put)
        errors.update(failed)
        yield sessions, inbox, errors
    finally:
        for session in sessions.values():
            session.close_input()
        close_all(transports.values())


def collect(inbox: queue.SimpleQueue[reports.Report], hosts: set[str], kind: type,
             timeout: float) -> tuple[dict[str, Any], dict[str, str]]:
    """One report of ``kind`` per host (or why none came)."""
    found: dict[str, Any] = {}
    problems: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    pending = set(hosts)
    while pending:
        try:
            report = inbox.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            for host in pending:
                problems[host] = f"no answer within {timeout:g}s"
            break
        host = str(getattr(report, "host", ""))
        if host not in pending:
            continue
        if isinstance(report, kind):
            found[host] = report
            pending.discard(host)
        elif isinstance(report, reports.AgentGone):
            problems[host] = report.reason or "its agent ended"
            pending.discard(host)
    return found, problems


def newest_live_run(runs: Sequence[Mapping[str, Any]]) -> Optional[str]:
    """The live run started last, by its launcher's start time."""
    live = [r for r in runs if r.get("live")]
    if not live:
        return None

    def started(run: Mapping[str, Any]) -> float:
        launcher = run.get("launcher") or {}
        value = launcher.get("started") if isinstance(launcher, dict) else None
        value = value or run.get("started") or 0
        return float(value) if isinstance(value, (int, float)) else 0.0

    return str(max(live, key=started)["run"])


