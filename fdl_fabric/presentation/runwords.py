"""The words of runs that outlive the terminal: ``--detach``, ``attach``, ``logs``, ``stop``,
``wait``, the controller's view in ``status`` and the ``--on-exit`` hook (merged into
`words`' one table; kept apart so each wording module stays one concern)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Callable

from ..events import Event, Name
from .speakers import L

Words = Callable[[Event, Mapping[str, Any]], str]


def _detached(e: Event, d: Mapping[str, Any]) -> str:
    run, binary = d["run_id"], d.get("binary") or "fdl-fabric"
    # said on the host that stays up, read on the laptop: the commands name that host
    it = f"{run} --on {d['on']}" if d.get("on") else run
    return "\n".join([
        f"{L}run {run} goes on detached: its supervisor is pid {d['pid']} on {e.host}, "
        "with no terminal; closing this one changes nothing",
        f"  {binary} attach {it}     follow it live (Ctrl-C leaves it running)",
        f"  {binary} logs {it} -f    its output (--rank N, --tail N)",
        f"  {binary} stop {it}       stop it (TERM, then KILL after the kill grace)",
        f"  {binary} wait {it}       wait for it and exit with its exit code",
        f"  its record: {d['folder']}"])


def _on_exit_failed(e: Event, d: Mapping[str, Any]) -> str:
    how = (f"was stopped after {d['timeout']:g}s" if d.get("timed_out")
           else f"exited with {d.get('exit_code')}" if d.get("exit_code") is not None
           else f"could not start: {d.get('error')}")
    return (f"{L}the --on-exit hook {how} (its output: {d['log']}); the run's verdict and "
            "exit code are unchanged")


def _lost(e: Event, d: Mapping[str, Any]) -> str:
    return (f"{L}failed: run {d['run_id']}: its launcher (pid {d.get('pid')} on "
            f"{d.get('on')}) is gone without a verdict ({d.get('state')} when last "
            "recorded); its agents stop every rank once its connection closes, or its lease "
            "runs out (`fdl-fabric cleanup --run-id` verifies the hosts)")


def _stop_sent(e: Event, d: Mapping[str, Any]) -> str:
    how = ("KILL now (--kill)" if d.get("kill")
           else f"TERM, then KILL after the kill grace ({d.get('kill_grace', '?')}s)")
    return (f"stop: run {d['run_id']}: asked its launcher (pid {d['pid']}) to stop every "
            f"rank: {how}")


def _ago(seconds: float) -> str:
    minutes, secs = divmod(int(max(0.0, seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d{hours:02d}h"
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def run_row(run: Mapping[str, Any], now: float) -> str:
    """One run of this controller: id, state (with its attempt or verdict), since when."""
    state = run["state"]
    if state == "running":
        state = f"running (attempt {run.get('attempt', 0)})"
    elif state == "ended":
        state = f"ended: {run.get('verdict')}, exit {run.get('exit_code')}"
    elif state == "lost":
        state = "lost: its launcher is gone without a verdict"
    started = run.get("started") or now
    if run.get("ended"):
        when = f"ended {_ago(now - run['ended'])} ago"
    elif run["state"] == "lost":
        when = f"last recorded {_ago(now - (run.get('updated') or started))} ago"
    else:
        when = f"up {_ago(now - started)}"
    mode = "detached" if run.get("detached") else "foreground"
    hosts = run.get("hosts") or []
    where = f"{run.get('world_size', '?')} rank(s) on {len(hosts)} host(s)" if hosts else ""
    code = f"  code {run['code_id']}" if run.get("code_id") else ""
    return f"  {run['run_id']}  {state}  {when}  {mode}  {where}{code}".rstrip()


def runs_text(d: Mapping[str, Any]) -> str:
    """``status``: this controller's runs, newest last (ended ones with ``--all``)."""
    runs: Sequence[Mapping[str, Any]] = d["runs"]
    now = d.get("now") or time.time()
    shown = "run(s) recorded" if d.get("all") else "live run(s)"
    head = f"{len(runs)} {shown} on this controller ({d['folder']})"
    hidden = d.get("ended_hidden") or 0
    tail = [f"  ({hidden} ended run(s) not shown: --all)"] if hidden else []
    return "\n".join([head, *(run_row(r, now) for r in runs), *tail])


RUN_WORDS: dict[Name, Words] = {
    Name.ALL_RANKS_RUNNING: lambda e, d: (f"{L}every rank is running ({d['world_size']} on "
                                          f"{d['hosts']} host(s), attempt {d['attempt']})"),
    Name.DETACHED: _detached,
    Name.HANGUP_IGNORED: lambda e, d: (f"{L}SIGHUP is ignored (started under nohup or "
                                       "alike): closing the terminal will not stop this run"),
    Name.RECORD_FAILED: lambda e, d: (f"{L}the run's record in {d['folder']} could not be "
                                      f"written ({d['error']}): what follows is missing from "
                                      "it (attach, logs, wait read it); the run goes on"),
    Name.RECORDS_PRUNED: lambda e, d: (f"{L}pruned {len(d['runs'])} old run record(s): "
                                       f"{', '.join(d['runs'])}"),
    Name.SUPERVISOR_LOST: _lost,
    Name.ATTACHED: lambda e, d: (f"attached to run {d['run_id']} ({d['state']}): "
                                 + ("Ctrl-C stops it" if d.get("stop")
                                    else "Ctrl-C leaves it running")),
    Name.ATTACH_LEFT: lambda e, d: (f"detached from run {d['run_id']}: it goes on "
                                    f"(fdl-fabric attach {d['run_id']} to come back, "
                                    f"fdl-fabric stop {d['run_id']} to stop it)"),
    Name.RUN_ENDED: lambda e, d: str(d["message"]),
    Name.RUN_NOT_FOUND: lambda e, d: f"{d['command']}: {d['error']}",
    Name.STOP_SENT: _stop_sent,
    Name.WAIT_TIMED_OUT: lambda e, d: (f"wait: run {d['run_id']} is still {d['state']} "
                                       f"after {d['timeout']:g}s (exit 124)"),
    Name.RUNS_VIEW: lambda e, d: runs_text(d),
    Name.ON_EXIT_RAN: lambda e, d: (f"{L}the --on-exit hook ran (exit 0, "
                                    f"{d['seconds']:.1f}s)"),
    Name.ON_EXIT_FAILED: _on_exit_failed,
}

__all__ = ["RUN_WORDS", "run_row", "runs_text"]
