"""The pre-flight across hosts, before the plan: does every host run the same Python,
libraries and NCCL (`versions.judge`)? Asked of each host's agent (a PROBE), after the
code is in place and ``setup:`` ran, so a venv that setup made is the one asked.

Asked only when it can matter and can be answered: two hosts or more, the ranks'
command starts with an interpreter (`planning.plan.is_interpreter`), the pre-flight is
on. A mismatch is a warning (each row said once); with ``strict_versions`` a FAIL, and
the launch ends before any rank starts.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from .. import reports
from ..clusterfile import ClusterSpec
from ..errors import FdlError
from ..events import EventBus, Name
from ..planning.plan import interpreted_argv, is_interpreter
from ..transport.session import AgentSession
from .report import Status
from .versions import judge

#: Seconds each host's interpreter may take to answer (importing a CUDA torch takes a
#: few; the agent kills it after this).
VERSIONS_TIMEOUT = 30.0
#: Beyond it, seconds the launcher waits for every answer.
ANSWER_MARGIN = 15.0


def wanted(cluster: ClusterSpec, argv: Sequence[str]) -> bool:
    return len(cluster.workers) > 1 and bool(argv) and is_interpreter(argv[0])


def check_versions(cluster: ClusterSpec, argv: Sequence[str],
                   sessions: Mapping[str, AgentSession],
                   inbox: queue.SimpleQueue[reports.Report], events: EventBus) -> None:
    """Ask every host, judge, say the rows; raise `FdlError` (exit 1) on a FAIL."""
    hosts = [w.host for w in cluster.workers if w.host in sessions]
    packages = list(cluster.versions.packages) if cluster.versions.packages is not None \
        else None
    for w in cluster.workers:
        if w.host not in sessions:
            continue
        python = interpreted_argv(cluster, w, argv)[0]
        sessions[w.host].send_probe({"versions": {
            "python": python, "cwd": w.path, "packages": packages,
            "timeout": VERSIONS_TIMEOUT, "env": {**cluster.env, **w.env}}})
    facts = _answers(hosts, inbox)
    rows = judge({h: facts[h] for h in hosts if h in facts}, cluster.versions)
    failures = []
    for row in rows:
        if row.status is Status.OK:
            events(Name.VERSIONS_AGREE, reason=row.reason)
        elif row.status is Status.WARN:
            events(Name.PREFLIGHT_WARNING, host=row.host, check=row.name, reason=row.reason)
        elif row.status is Status.FAIL:
            events(Name.PREFLIGHT_FAILED_CHECK, host=row.host, check=row.name,
                   reason=row.reason)
            failures.append(row.reason)
    if failures:
        raise FdlError(f"cluster launcher: the hosts' versions differ ({failures[0]}"
                       f"{'; and more above' if len(failures) > 1 else ''}; "
                       "strict_versions: true) — nothing was started")


def _answers(hosts: Sequence[str], inbox: queue.SimpleQueue[reports.Report]
             ) -> dict[str, dict[str, Any]]:
    facts: dict[str, dict[str, Any]] = {}
    kept: list[reports.Report] = []
    waiting = set(hosts)  # kept, not rebuilt per answer: 1,024 hosts made that O(n²)
    deadline = time.monotonic() + VERSIONS_TIMEOUT + ANSWER_MARGIN
    try:
        while waiting:
            try:
                report = inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                for host in waiting:  # its row says it did not answer
                    facts[host] = {"error": "no answer to the version probe within "
                                            f"{VERSIONS_TIMEOUT + ANSWER_MARGIN:g} s"}
                break
            versions: Optional[dict[str, Any]] = getattr(report, "versions", None)
            if isinstance(report, reports.Facts) and versions is not None:
                facts[report.host] = versions
                waiting.discard(report.host)
            elif isinstance(report, reports.AgentGone) and report.host in hosts:
                raise FdlError(f"cluster launcher: host {report.host!r}: {report.reason}")
            else:
                kept.append(report)
    finally:
        for report in kept:
            inbox.put(report)
    return facts
