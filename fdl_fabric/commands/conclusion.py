"""The conclusion: whatever failed and wherever, a launch ends the same way.

The summary of the ranks, the attempts, the root cause, the ``--on-exit`` hook, and the
verdict as the last line (`conclude`). A failure outside the ranks (connecting,
starting agents, a restart's set-up) and a stop signal with no supervisor running
become an attempt's result like any other (`failed`, `interrupted`), so they end the
same way too.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from typing import Optional, Protocol

from ..errors import EXIT_FAILURE, FdlError
from ..events import EventBus, Name, event
from ..presentation.latest import RunFolder
from ..presentation.output import Console
from ..presentation.runlog import RunLog
from ..presentation.words import cause_data
from ..runs.hook import bound as hook_bound
from ..runs.hook import hook_env, run_hook
from ..runs.record import ON_EXIT_LOG, RunRecord
from ..supervision.rankoutput import RankOutput
from ..supervision.rootcause import root_cause, root_error
from ..supervision.supervisor import RunResult
from ..supervision.verdict import Verdict
from .launch_settings import Resolved
from .launchoptions import LaunchOptions


class Concluded(Protocol):
    """What the conclusion reads of a launch (`launch.Launch`)."""

    opts: LaunchOptions
    console: Console
    events: EventBus
    output: RankOutput
    results: list[RunResult]
    hosts_of: list[tuple[str, ...]]
    run_id: Optional[str]
    faulted: dict[str, str]
    joined_any: bool
    resolved: Optional[Resolved]
    log: Optional[RunLog]
    record: Optional[RunRecord]
    folder: Optional[RunFolder]


def failed(exc: FdlError, events: EventBus) -> RunResult:
    """A failure outside the ranks (connecting, starting agents, a restart's set-up)."""
    for line in exc.details:
        events(Name.FAILURE_DETAIL, text=line)
    return RunResult(Verdict.FAILED, exc.exit_code or 1,
                     event(Name.LAUNCH_FAILED, error=str(exc)), ())


def interrupted(signum: int, *, between_attempts: bool) -> RunResult:
    """A stop signal that arrived while no supervisor ran."""
    return RunResult(Verdict.INTERRUPTED, 128 + signum, event(
        Name.INTERRUPTED_OUTSIDE_RUN, signal=signal.Signals(signum).name,
        between_attempts=between_attempts), ())


def stderr_log(run: Concluded, rank: int) -> Optional[str]:
    """Where a rank's whole stderr is kept: --log-dir's copy, else the run's record."""
    log = run.log if run.log is not None else (
        run.record.log if run.record is not None else None)
    return str(log.rank_folder(rank) / "stderr.log") if log is not None else None


def on_exit(run: Concluded, final: RunResult) -> None:
    """``--on-exit``: once, before the verdict line (which stays the last line); its
    failure is said, and changes nothing of the verdict."""
    command = run.opts.on_exit or (run.resolved.cluster.on_exit
                                   if run.resolved is not None else None)
    if not command or run.run_id is None:
        return
    folder = run.record.folder if run.record is not None else None
    log = folder / ON_EXIT_LOG if folder is not None else None
    for written in (run.record.log if run.record is not None else None, run.log):
        if written is not None:
            written.flush()  # the hook reads the record (console.log) as of now
    outcome = run_hook(command, hook_env(run.run_id, final.verdict.value,
                                         final.exit_code, folder), log)
    if outcome.ok:
        run.events(Name.ON_EXIT_RAN, seconds=round(outcome.seconds, 3))
    else:
        run.events(Name.ON_EXIT_FAILED, exit_code=outcome.exit_code,
                   timed_out=outcome.timed_out, error=outcome.error,
                   timeout=hook_bound(), log=str(log) if log else "not kept")


def attempts_data(results: Sequence[RunResult], hosts_of: Sequence[tuple[str, ...]]
                  ) -> list[Mapping[str, object]]:
    """Each attempt's verdict, cause and hosts (an attempt that failed before its hosts
    were chosen has none)."""
    hosts = [*hosts_of, *[()] * (len(results) - len(hosts_of))]
    return [{"verdict": r.verdict.value, "cause": cause_data(r.cause, error=root_error(r)),
             "hosts": list(h)} for r, h in zip(results, hosts)]


def _said_before_the_verdict(run: Concluded, final: RunResult) -> None:
    """What the operator may want to know before the verdict: lines dropped, a
    ``max_failure`` no rank could use, where the logs are."""
    events = run.events
    if run.log is not None:
        run.log.flush()  # what it has to say of a failed write, said now
    dropped = run.console.dropped
    if dropped:
        events(Name.OUTPUT_DROPPED, dropped=dropped,
               log_kept=run.log is not None and run.log.failed is None)
    if run.resolved is not None and run.resolved.max_failure is not None \
            and not run.joined_any and final.started_any:
        events(Name.MAX_FAILURE_UNUSED)
    if run.folder is not None and run.log is not None:
        events(Name.LOGS_KEPT, **run.folder.data(), failed=run.log.failed)


def conclude(run: Concluded) -> int:
    """The summary, the attempts, the root cause, and the verdict as the last line; the
    launch's exit code."""
    if not run.results:
        return EXIT_FAILURE
    events = run.events
    final = run.results[-1]
    shown = next((r for r in reversed(run.results) if r.started_any), None)
    if shown is not None:
        events(Name.SUMMARY, ranks=[r.summary() for r in shown.ranks])
    if len(run.results) > 1:
        events(Name.ATTEMPTS, attempts=attempts_data(run.results, run.hosts_of))
    cause = root_cause(final, stderr_tail=run.output.tail,
                       log_of=lambda rank: stderr_log(run, rank))
    if cause is not None:
        events.emit(cause)
    _said_before_the_verdict(run, final)
    on_exit(run, final)
    events(Name.VERDICT, cause=cause_data(final.cause), exit_code=final.exit_code,
           verdict=final.verdict.value, attempts=len(run.results), run_id=run.run_id,
           faults=dict(run.faulted))
    return final.exit_code
