"""Asking a cluster's hosts about a live run from another terminal: ``fdl-fabric stacks``.

Like a cleanup, it reaches every host of the cluster file itself (one agent each,
started exactly as a launch starts it), so it needs nothing from the running launcher.
Each agent lists the runs recorded on its host (`fdl_fabric.agent.procs.list_runs`);
the newest live run of the cluster is chosen unless ``--run-id`` names one; then each
host that holds a part of it reports where its ranks are (`fdl_fabric.agent.stacks`),
and the same grouped view a hung run prints is shown. The run is never touched.
"""

from __future__ import annotations

import queue
from collections.abc import Mapping
from typing import Any, Optional

from .. import reports
from ..clusterfile import ClusterSpec
from ..errors import EXIT_FAILURE
from ..events import EventBus, Name
from ..planning.plan import cluster_key
from ..presentation.output import Console
from ..transport.session import AgentSession
from .asking import ANSWER_TIMEOUT, asking_agents, cluster_to_ask, collect, newest_live_run


def run_stacks(cluster_file: Optional[str], *, cluster: Optional[ClusterSpec] = None,
               run_id: Optional[str] = None, every_run: bool = False,
               console: Optional[Console] = None) -> int:
    """``fdl-fabric stacks``: 0 when stacks were shown, 1 when no live run was found or a
    host failed, 2 on a bad cluster file. ``cluster``: hosts named on the command line
    (``--hosts``; ``cluster_file`` None). ``every_run``: the newest live run on the hosts
    of any cluster, not only this one's (a ``--hosts`` run has a cluster of its own)."""
    console = console or Console()
    events = EventBus(console)
    asked = cluster_to_ask(cluster_file, cluster, events)
    if isinstance(asked, int):
        return asked
    cluster, settings = asked
    with asking_agents(cluster, settings) as (sessions, inbox, errors):
        return _show(cluster, sessions, inbox, errors, run_id, events, every_run)


def _show(cluster: ClusterSpec, sessions: Mapping[str, AgentSession],
          inbox: queue.SimpleQueue[reports.Report], errors: dict[str, str],
          run_id: Optional[str], events: EventBus, every_run: bool) -> int:
    """List the runs, pick one, ask its hosts for stacks, print the grouped view."""
    key = None if (run_id or every_run) else cluster_key(cluster)
    for session in sessions.values():
        session.list_runs(key)
    listed, problems = collect(inbox, set(sessions), reports.Runs, ANSWER_TIMEOUT)
    problems.update(errors)
    runs = [r for rep in listed.values() for r in rep.runs]
    chosen = run_id or newest_live_run(runs)
    if chosen is None:
        return _no_live_run(cluster, len(listed), problems, events)
    holders = _holders(listed, chosen)
    if not holders:
        events(Name.STACKS_RUN_UNKNOWN, run_id=chosen, file=cluster.file)
        return EXIT_FAILURE
    for host in holders:
        sessions[host].stacks(0, run=chosen, host=host)
    answers, late = collect(inbox, holders, reports.Stacks, ANSWER_TIMEOUT)
    problems.update(late)
    events(Name.STACKS_VIEW, **_view(chosen, answers, problems))
    return EXIT_FAILURE if problems else 0


def _holders(listed: Mapping[str, reports.Runs], chosen: str) -> set[str]:
    """The hosts that hold a part of run ``chosen``."""
    return {rep.host for rep in listed.values() if any(r.get("run") == chosen
                                                       for r in rep.runs)}


def _no_live_run(cluster: ClusterSpec, answered: int, problems: Mapping[str, str],
                 events: EventBus) -> int:
    """Each host's problem, then that no live run was found."""
    for host, why in sorted(problems.items()):
        events(Name.STACKS_PROBLEM, host=host, problem=why)
    # ``hosts``: those that answered (and have no live run), ``of``: all of them.
    events(Name.STACKS_NO_LIVE_RUN, file=cluster.file, hosts=answered,
           of=len(cluster.workers))
    return EXIT_FAILURE


def _view(chosen: str, answers: Mapping[str, reports.Stacks],
          problems: dict[str, str]) -> dict[str, Any]:
    """The grouped view's data from each host's answer (a host that sent only an error
    joins ``problems``)."""
    data: dict[str, Any] = {"reason": f"run {chosen}", "ranks": {}, "hosts": {},
                            "problems": problems, "py_spy": {}}
    for host, rep in answers.items():
        data["py_spy"][host] = rep.py_spy
        if rep.error and not rep.ranks:
            problems[host] = rep.error
        for rank, entry in rep.ranks.items():
            data["ranks"][str(rank)] = entry
            data["hosts"][str(rank)] = host
    return data
