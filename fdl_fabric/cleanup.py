"""Cleanup around launches and on demand: sweep every host in parallel.

The per-host work is `sweep.sweep` (standard library only). Here we run it
on all hosts at once: directly for the local host, and through a Fabric
`ThreadingGroup` for remote ones, so sweeping 16 hosts takes about as long
as sweeping one. Each host answers with a JSON report of what it stopped and
of anything that survived; a survivor makes the cleanup fail loudly.
"""

from __future__ import annotations

import shlex
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from fabric import ThreadingGroup

from . import sweep
from .ssh import FdlConnection


@dataclass
class HostReport:
    host: str
    stopped: list[dict[str, Any]] = field(default_factory=list)
    leftovers: list[dict[str, Any]] = field(default_factory=list)
    error: Optional[str] = None

    @property
    def clean(self) -> bool:
        return self.error is None and not self.leftovers

    def summary(self) -> str:
        if self.error:
            return f"{self.host}: cleanup FAILED: {self.error}"
        parts = []
        if self.stopped:
            ranks = []
            for s in self.stopped:
                if "pattern" in s:
                    ranks.append(f"{len(s['pids'])} process(es) matching {s['pattern']!r}")
                else:
                    ranks.append(f"run {s['run']} rank {s['rank']} (pids {s['pids']})")
            parts.append("stopped " + ", ".join(ranks))
        else:
            parts.append("nothing to stop")
        if self.leftovers:
            parts.append(f"LEFTOVER: {self.leftovers}")
        return f"{self.host}: " + "; ".join(parts)


def sweep_args(*, runs: Sequence[str] = (), cluster: Optional[str] = None,
               all_runs: bool = False, pattern: Optional[str] = None) -> list[str]:
    args: list[str] = []
    for r in runs:
        args += ["--run", r]
    if cluster:
        args += ["--cluster", cluster]
    if all_runs:
        args.append("--all")
    if pattern:
        args += ["--pattern", pattern]
    return args


def remote_command(host: str, args: Sequence[str]) -> str:
    """``python3 -c <sweep source> --host H ...``: no file needs to exist remotely."""
    words = ["python3", "-c", sweep.module_source(), "--host", host, *args]
    return " ".join(shlex.quote(w) for w in words)


def _local(host: str, args: Sequence[str]) -> HostReport:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--run", action="append", default=[])
    parser.add_argument("--cluster")
    parser.add_argument("--all", action="store_true")
    parser.add_argument("--pattern")
    ns = parser.parse_args(list(args))
    rep = sweep.sweep(host=host, runs=set(ns.run), cluster=ns.cluster, all_runs=ns.all,
                      pattern=ns.pattern)
    return HostReport(host, rep.stopped, rep.leftovers,
                      "; ".join(rep.errors) if rep.errors else None)


def _from_output(host: str, stdout: str, stderr: str) -> HostReport:
    data = sweep.parse_report(stdout)
    if data is None:
        reason = (stderr.strip().splitlines() or ["no report (is python3 on its PATH?)"])[-1]
        return HostReport(host, error=reason)
    errors = data.get("errors") or []
    return HostReport(host, list(data.get("stopped", [])),  # type: ignore[call-overload]
                      list(data.get("leftovers", [])),  # type: ignore[call-overload]
                      "; ".join(errors) if errors else None)  # type: ignore[arg-type]


def sweep_hosts(
    local_hosts: Sequence[str],
    remote: dict[str, FdlConnection],
    args: Sequence[str],
) -> list[HostReport]:
    """Sweep every host at once; one report per host, in the given order."""
    reports: dict[str, HostReport] = {}
    threads = []
    for host in local_hosts:
        def run_local(h: str = host) -> None:
            try:
                reports[h] = _local(h, args)
            except Exception as exc:  # a report, not a crash: other hosts still count
                reports[h] = HostReport(h, error=str(exc))
        t = threading.Thread(target=run_local, name=f"fdl-sweep-{host}")
        t.start()
        threads.append(t)
    if remote:
        by_conn = {conn: host for host, conn in remote.items()}
        group = ThreadingGroup.from_connections(list(remote.values()))
        reports.update(_group_run(group, by_conn, args))
    for t in threads:
        t.join()
    order = [*local_hosts, *remote]
    return [reports[h] for h in order if h in reports]


def _group_run(group: ThreadingGroup, by_conn: dict[FdlConnection, str],
               args: Sequence[str]) -> dict[str, HostReport]:
    """Run the sweep on every connection at once; the host name comes from the mapping."""
    command = remote_command("", args)
    out: dict[str, HostReport] = {}
    try:
        results = group.run(command, hide=True, warn=True, pty=False, in_stream=False)
        items = list(results.items())
    except Exception as exc:  # GroupException carries per-host results
        items = list(getattr(exc, "result", {}).items())
        if not items:
            raise
    for conn, res in items:
        host = by_conn[conn]
        if isinstance(res, BaseException):
            out[host] = HostReport(host, error=f"{type(res).__name__}: {res}")
        else:
            rep = _from_output(host, res.stdout, res.stderr)
            out[host] = rep
    return out
