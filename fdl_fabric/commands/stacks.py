"""Asking a cluster's hosts about a live run from another terminal: ``fdl-fabric stacks``.

Like a cleanup, it reaches every host of the cluster file itself (one agent each,
started exactly as a launch starts it), so it needs nothing from the running launcher.
Each agent lists the runs recorded on its host (`fdl_fabric.agent.procs.list_runs`);
the newest live run of the cluster is chosen unless ``--run-id`` names one; then each
host that holds a part of it reports where its ranks are (`fdl_fabric.agent.stacks`),
and the same grouped view a hung run prints is shown. The run is never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from .. import reports
from ..clusterfile import ClusterSpec
from ..errors import EXIT_FAILURE, EXIT_USAGE
from ..events import EventBus, Name
from ..planning.plan import cluster_key
from ..presentation.output import Console
from ..runs.reading import view
from ..transport.session import AgentSession
from .asking import ANSWER_TIMEOUT, asking_agents, cluster_to_ask, collect, newest_live_run
from .runref import ended, find_run


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
    if cluster.controller.join is not None:
        return _through_launcher(run_id, events)
    with asking_agents(cluster, settings) as (sessions, inbox, errors):
        return _show(cluster, sessions, inbox, errors, run_id, events, every_run)


def _through_launcher(run_id: Optional[str], events: EventBus) -> int:
    """A cluster whose workers dial in cannot be reached from here: its run's launcher,
    on this machine, is asked instead, as Ctrl-\\ asks it (SIGQUIT: every rank's stack,
    the run goes on), and the view it recorded is shown."""
    folder = find_run(run_id, "stacks", events)
    if folder is None:
        return EXIT_USAGE
    run = view(folder)
    if run.ended:
        return ended(run, events) or EXIT_FAILURE
    asked_at = time.time()
    os.kill(int(run.launcher["pid"]), signal.SIGQUIT)  # alive: `view` checked its start
    deadline = time.monotonic() + LAUNCHER_STACKS_S
    timeline = _Timeline(folder / "events.jsonl")
    while time.monotonic() < deadline:
        for record in timeline.new():
            if record.get("name") == Name.STACKS.value and record.get("time", 0) >= asked_at:
                # The launcher's own words for it (the record keeps each stack in a file
                # of its own, named in ``files``), shown as it printed them.
                data = dict(record.get("data") or {})
                print(f"run {run.run_id}, asked of its launcher (its hosts dial in):\n"
                      f"{record.get('message', '')}", flush=True)
                for name in data.get("files") or ():
                    print(f"  {folder / str(name)}", flush=True)
                return EXIT_FAILURE if data.get("problems") else 0
        time.sleep(0.2)
    events(Name.STACKS_PROBLEM, host=run.launcher.get("host", "?"),
           problem=f"its launcher did not record the stacks within {LAUNCHER_STACKS_S:g}s")
    return EXIT_FAILURE


#: How long ``stacks`` waits for a launcher to record the stacks it was asked for.
LAUNCHER_STACKS_S = 60.0


class _Timeline:
    """events.jsonl read as it grows: each call, the whole records written since the
    last (a line still being written waits for the next call)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def new(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        whole = data[:data.rfind(b"\n") + 1]
        self.offset += len(whole)
        found = []
        for line in whole.splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    found.append(record)
        return found


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
