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
from typing import Any, Optional, TextIO

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
    """``python3 -c <sweep source> --host H ...``: no file needs to exist remotely.

    The sweep is standard library only, so the system interpreter is preferred
    over whatever ``python3`` the login PATH finds first (a pyenv or conda
    shim costs 100 ms or more per start).
    """
    words = ["-I", "-c", sweep.module_source(), "--host", host, *args]
    return ('p=/usr/bin/python3; [ -x "$p" ] || p=python3; exec "$p" '
            + " ".join(shlex.quote(w) for w in words))


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
        from fabric import ThreadingGroup

        by_conn = {conn: host for host, conn in remote.items()}
        group = ThreadingGroup.from_connections(list(remote.values()))
        reports.update(_group_run(group, by_conn, args))
    for t in threads:
        t.join()
    order = [*local_hosts, *remote]
    return [reports[h] for h in order if h in reports]


def _group_run(group: Any, by_conn: dict[FdlConnection, str],
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


def run_cleanup(cluster_file: str, *, run_id: Optional[str] = None, all_runs: bool = False,
                pattern: Optional[str] = None, out: Optional[TextIO] = None) -> int:
    """``inv cleanup``: sweep every host of a cluster; 0 clean, 1 leftovers, 2 config."""
    from .config import ConfigError, load_cluster, this_host_name
    from .events import EventBus
    from .launcher import LaunchError, connect_all, ssh_settings
    from .output import Console
    from .plan import cluster_key
    from .spawn import fabric_config

    console = Console(err=out) if out is not None else Console()
    try:
        cluster = load_cluster(cluster_file)
        settings = ssh_settings(cluster, console)
        sessions = connect_all(settings, fabric_config(), EventBus())
    except ConfigError as exc:
        console.message(str(exc))
        return 2
    except LaunchError as exc:
        console.message(str(exc))
        return exc.exit_code
    try:
        local = [this_host_name()] if any(w.is_local for w in cluster.workers) else []
        remote = {h: s.connections[0] for h, s in sessions.items()}
        args = sweep_args(runs=[run_id] if run_id else [],
                          cluster=None if (run_id or all_runs) else cluster_key(cluster),
                          all_runs=all_runs, pattern=pattern)
        reports = sweep_hosts(local, remote, args)
    finally:
        for s in sessions.values():
            s.close()
    return report_and_verdict(reports, console)


def report_and_verdict(reports: Sequence[HostReport], console: Any) -> int:
    """Print one line per host and a verdict; non-zero when anything survived."""
    for rep in reports:
        console.message(f"cleanup: {rep.summary()}")
    bad = [r.host for r in reports if not r.clean]
    if bad:
        console.message(f"cleanup: FAILED — leftovers or errors on {', '.join(bad)}")
        return 1
    stopped = sum(len(r.stopped) for r in reports)
    console.message(f"cleanup: verified — nothing of the selected runs remains on "
                    f"{len(reports)} host(s) ({stopped} group(s) stopped)")
    return 0


def adhoc_cleanup(conn: Any, *, run_id: Optional[str] = None,
                  pattern: Optional[str] = None) -> HostReport:
    """``fab -H host cleanup``: sweep one host through the Connection fab made.

    fab builds its Connection with Fabric's AutoAddPolicy; it gets our
    accept-new policy before it opens, like every other connection we make.
    """
    from .ssh import AcceptNewPolicy

    if not conn.is_connected:
        import os

        known = os.path.expanduser("~/.ssh/known_hosts")
        if os.path.exists(known):
            conn.client.load_host_keys(known)
        conn.client.set_missing_host_key_policy(AcceptNewPolicy(known))
    args = sweep_args(runs=[run_id] if run_id else [], all_runs=not run_id, pattern=pattern)
    res = conn.run(remote_command(conn.host, args), hide=True, warn=True, pty=False,
                   in_stream=False)
    return _from_output(conn.host, res.stdout, res.stderr)


def adhoc_cleanup_hosts(conns: Sequence[Any], *, run_id: Optional[str] = None,
                        pattern: Optional[str] = None) -> int:
    """``fab -H a,b cleanup``: every host in parallel; a failing host never stops the others."""
    reports: list[HostReport] = []
    lock = threading.Lock()

    def one(conn: Any) -> None:
        try:
            rep = adhoc_cleanup(conn, run_id=run_id, pattern=pattern)
        except Exception as exc:  # unreachable, refused, ...: a row, not an abort
            from .ssh import describe_connect_error

            rep = HostReport(conn.host, error=describe_connect_error(exc))
        with lock:
            reports.append(rep)

    threads = [threading.Thread(target=one, args=(c,)) for c in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    order = {c.host: i for i, c in enumerate(conns)}
    reports.sort(key=lambda r: order.get(r.host, 0))

    class _Print:
        @staticmethod
        def message(text: str) -> None:
            print(text, flush=True)

    return report_and_verdict(reports, _Print())
