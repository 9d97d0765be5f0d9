"""Answers to a request sent to every host's agent at once (the fleet check, the smoke
test): one per host, under one bound, and nothing else on the inbox lost."""

from __future__ import annotations

import queue
import time
from collections.abc import Sequence
from typing import Any, Callable, Optional

from .. import reports


def collect(hosts: Sequence[str], inbox: queue.SimpleQueue[reports.Report], timeout: float,
            pick: Callable[[reports.Report], Optional[dict[str, Any]]]
            ) -> dict[str, dict[str, Any]]:
    """One answer per host, what ``pick`` takes from a `reports.Facts`, under ``timeout``
    (the one way the fleet steps wait: bounded, and nothing else is lost)."""
    got: dict[str, dict[str, Any]] = {}
    kept: list[reports.Report] = []
    deadline = time.monotonic() + timeout
    try:
        while set(hosts) - set(got):
            try:
                report = inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                for host in set(hosts) - set(got):
                    got[host] = {"error": f"no answer within {timeout:g} s"}
                break
            answer = pick(report) if isinstance(report, reports.Facts) else None
            if isinstance(report, reports.Facts) and answer is not None \
                    and report.host in hosts:
                got.setdefault(report.host, answer)
            elif isinstance(report, reports.AgentGone) and report.host in hosts:
                got.setdefault(report.host, {"error": "its agent ended before answering" + (
                    f" ({report.reason})" if report.reason else "")})
                kept.append(report)
            else:
                kept.append(report)
    finally:
        for report in kept:
            inbox.put(report)
    return got
