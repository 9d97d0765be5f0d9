"""``fdl-fabric status`` / ``inv status``: the live runs on a cluster's hosts.

Read from the records the agents keep on each host (`fdl_fabric.agent.procs`), through
one agent per host (`asking`), so it works from any terminal while the launcher runs,
and after the launcher died too: a run whose launcher is gone but whose ranks are still
up shows as such. Like ``squeue`` for a Slurm user: what runs, where, since when.
What the hosts say is shown as `masking` lets it be, as the controller's rows are.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from .. import reports
from ..clusterfile import ClusterSpec
from ..errors import EXIT_FAILURE
from ..events import EventBus, Name
from ..masking import mask_data
from ..planning.plan import cluster_key
from ..presentation.output import Console
from .asking import ANSWER_TIMEOUT, asking_agents, cluster_to_ask, collect
from .joincli import local_windows
from .runsview import controller_runs


def run_status(cluster_file: Optional[str], *, cluster: Optional[ClusterSpec] = None,
               every_run: bool = False, as_json: bool = False,
               console: Optional[Console] = None, ended_too: bool = False,
               hosts: bool = True) -> int:
    """This controller's runs (`runsview`; ended ones with ``ended_too``), then, with
    ``hosts``, the live runs of the cluster (or, with ``every_run``, of any cluster) on
    its hosts: 0 when every host answered, 1 when one could not, 2 on bad input.
    ``cluster``: hosts named on the command line (``--hosts``; ``cluster_file`` None)."""
    console = console or Console()
    events = EventBus(console)
    mine = controller_runs(every_run=ended_too)
    if not hosts:
        if as_json:
            console.json({"controller": mine})
        else:
            events(Name.RUNS_VIEW, **mine)
            local_windows(as_json=False)
        return 0
    asked = cluster_to_ask(cluster_file, cluster, events)
    if isinstance(asked, int):
        return asked
    cluster, settings = asked
    key = None if every_run else cluster_key(cluster)
    with asking_agents(cluster, settings) as (sessions, inbox, errors):
        for session in sessions.values():
            session.list_runs(key)
        listed, problems = collect(inbox, set(sessions), reports.Runs, ANSWER_TIMEOUT)
    problems.update(errors)
    runs = live_runs([r for rep in listed.values() for r in rep.runs], now=time.time())
    # ``hosts``: the hosts that answered (the runs listed are theirs), ``of``: all of them.
    data: dict[str, Any] = mask_data({"file": cluster.file, "hosts": len(listed),
                                      "of": len(cluster.workers), "runs": runs,
                                      "problems": dict(sorted(problems.items()))})
    if as_json:
        console.json({**data, "controller": mine})
    else:
        events(Name.RUNS_VIEW, **mine)
        local_windows(as_json=False)
        events(Name.STATUS_VIEW, **data)
    return EXIT_FAILURE if problems else 0


def live_runs(records: Sequence[Mapping[str, Any]], *, now: float) -> list[dict[str, Any]]:
    """Each host's record of a run, merged into one entry per live run, newest first:
    its launcher, its hosts with their ranks and whether each is up, its uptime."""
    merged: dict[str, dict[str, Any]] = {}
    for rec in records:
        if not rec.get("live"):
            continue
        run = merged.setdefault(str(rec["run"]), {
            "run": rec["run"], "launcher": rec.get("launcher") or {}, "hosts": {},
            "started": None})
        started = _started(rec)
        if started is not None and (run["started"] is None or started < run["started"]):
            run["started"] = started
        run["hosts"][rec["host"]] = sorted(
            ({"rank": r["rank"], "pid": r["pid"], "state": "running" if r["alive"] else "ended"}
             for r in rec.get("ranks", ())), key=lambda r: r["rank"])
    out = []
    for run in merged.values():
        run["uptime"] = None if run["started"] is None else round(max(0.0, now - run["started"]), 1)
        out.append(run)
    out.sort(key=lambda r: -(r["started"] or 0))
    return out


def _started(record: Mapping[str, Any]) -> Optional[float]:
    launcher = record.get("launcher")
    value = launcher.get("started") if isinstance(launcher, dict) else None
    value = value or record.get("started")
    return float(value) if isinstance(value, (int, float)) else None
