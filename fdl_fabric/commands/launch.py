"""One launch, start to verdict: the sequence behind ``inv launch``.

1. Load and validate cluster.yml, the SSH options and every flag (a mistake exits 2
   before anything connects or any file is written): `launch_settings`.
2. Connect every remote host in parallel and start one agent per host (`launch_hosts`,
   over `transport`).
3. Resolve ``local_devices: all`` through the agents and build the plan (`planning`).
4. Bind the coordinator, open tunnels, send each agent its spec. Each agent runs the
   fast pre-flight and sweeps this cluster's leftovers; the supervisor starts the
   ranks once every host passed, then applies the failure policy to one verdict
   (`attempt`). Between attempts, the membership rule picks the next one's hosts and
   the tree is planned again around a lost gateway (`between`).
5. Print the summary and the verdict as the last line; exit with its code
   (`conclusion`).

Every failure after an agent started goes through the supervisor or closes the
agents' input, so whatever was started is stopped the same way. Whatever fails, and
at whatever stage (connecting, starting agents, a restart), the launch ends the same
way: the summary, the attempts, the root cause, and the verdict as the last line
(`conclusion.conclude`). Only bad input is refused earlier, with exit 2.

Signal handlers only record and post (`launch_signals.Signals`); the supervisor's loop
acts on them. Each restart starts from fresh connections to every host whose
connection is gone or that stopped answering, and new agents.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from .. import reports, shell
from ..clusterfile import ClusterSpec
from ..errors import EXIT_FAILURE, EXIT_USAGE, FdlError
from ..events import Event, EventBus, Name
from ..planning.envelope import ENV_VERBOSITY, new_run_id
from ..planning.joinwindow import WindowState
from ..planning.plan import LaunchPlan
from ..preflight import fleet, fleetcheck
from ..presentation.latest import RunFolder, point_latest
from ..presentation.output import Console, JsonConsole
from ..presentation.runlog import RunLog, cluster_json
from ..presentation.words import cause_data
from ..runs import place
from ..runs.reading import is_live, read_json
from ..runs.record import STOP_NOTE, RunRecord
from ..supervision.membership import Membership, Selection
from ..supervision.policy import Restarts
from ..supervision.rankoutput import RankOutput
from ..supervision.rootcause import root_error
from ..supervision.supervisor import RunResult
from ..supervision.timing import FORCE_MARGIN
from ..supervision.verdict import Verdict
from ..sync.step import CodeStep
from ..transport import check_open_files, for_cluster
from .attempt import Attempt
from .between import (
    LostGateways,
    degraded_if_fewer_hosts,
    host_fates,
    membership_data,
    membership_event,
    select_hosts,
    shortfall,
)
from .conclusion import conclude, failed, interrupted
from .dryrun import plan_as_json
from .healwatch import HealWatch
from .heap import LongLived, long_lived
from .joinwindow import Window
from .launch_hosts import Hosts
from .launch_settings import Resolved, attempt_cluster, dry_run, membership_for, plan_attempt
from .launch_settings import resolve as resolve_settings
from .launch_signals import LaunchInterrupted, Signals
from .launchoptions import LaunchOptions
from .planwarnings import plan_warnings


class Launch:
    """State of one launch, so every exit path can tear down what was opened and end
    with a verdict."""

    def __init__(self, opts: LaunchOptions, console: Console, events: EventBus) -> None:
        self.opts = opts
        self.console = console
        self.events = events
        self.inbox: queue.SimpleQueue[reports.Report] = queue.SimpleQueue()
        self.output = RankOutput(events)
        #: Every host's transport and agent, the tunnels and the keepalive watch.
        self.hosts = Hosts(events, self.output)
        self.log: Optional[RunLog] = None
        self.folder: Optional[RunFolder] = None
        self.signals = Signals()
        self.results: list[RunResult] = []
        self.run_id: Optional[str] = None
        self.joined_any = False
        #: Hosts that were lost or unresponsive in some attempt (their records are swept).
        self.faulted: dict[str, str] = {}
        self.launcher: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(),
                                         "started": time.time()}
        #: What the launch resolved before contacting any host.
        self.resolved: Optional[Resolved] = None
        #: Which hosts each attempt runs on (set once the cluster is read).
        self.membership = Membership(["-"])
        #: The hosts of each attempt, in step with ``results``.
        self.hosts_of: list[tuple[str, ...]] = []
        #: Gateways lost in some attempt: later attempts plan the tree without them.
        self.gateways = LostGateways(events)
        #: What refused the launch (bad input, exit 2), and the exit code once it ended.
        self.refused: Optional[FdlError] = None
        self.exit_code: Optional[int] = None
        #: The run's record on this controller (`runs.record`), once the run has an id.
        self.record: Optional[RunRecord] = None
        #: ``sync``: the code sent to every host (`fdl_fabric.sync`).
        self.code: Optional[CodeStep] = None
        #: The attempt now supervised (``--max-restarts``).
        self.attempt_now = 0
        #: Hosts lost in an attempt, dialled again until they answer (`healwatch`).
        self.healwatch: Optional[HealWatch] = None
        #: ``controller.join``: the window where workers that dial in are admitted.
        self.window: Optional[Window] = None
        #: The launch's long-lived objects, kept off the cycle collector (`heap`).
        self.heap = LongLived(False)

    def run(self) -> int:
        """The launch; its exit code. Bad input is refused (exit 2, nothing started);
        everything else ends with the summary and the verdict as the last line."""
        with self.signals.installed(), long_lived() as self.heap:
            self.events.add(self.heap)
            if self.signals.hangup_ignored and not self.opts.detached:
                self.events(Name.HANGUP_IGNORED)
            try:
                resolved = self._resolve()
                if resolved is None:
                    return 0
                self.heap.settle()
                self._launch(resolved)
            except FdlError as exc:  # a ConfigError too: it is one, with exit code 2
                if exc.exit_code == EXIT_USAGE and not self.run_id:
                    self.events(Name.REFUSED, error=str(exc))
                    self.refused = exc
                    return EXIT_USAGE
                self.results.append(failed(exc, self.events))
            except LaunchInterrupted as exc:
                self._interrupted(exc.signum)
            finally:
                self.signals.raising = False
                self.signals.supervisor = None
            try:
                if self.healwatch is not None:
                    self.healwatch.stop()
                self._sweep_faulted()
            finally:
                self._teardown()
            try:
                return conclude(self)
            finally:
                if self.log is not None:
                    self.log.close()
                if self.record is not None:
                    self.record.close()
                    # Its size kept now, after the verdict, so the next launch's prune
                    # does not walk its 24,000 files of 8,192 ranks (issue 35).
                    place.record_size(self.record.folder)

    def _teardown(self) -> None:
        self.hosts.teardown()
        if self.window is not None:
            self.window.close()

    def _sweep_faulted(self) -> None:
        """Hosts lost or unresponsive during the run: swept once it is over."""
        if self.resolved is not None and self.run_id is not None:
            self.hosts.sweep_faulted(self.run_id, self.faulted)

    def _interrupted(self, signum: int) -> None:
        self.results.append(interrupted(signum, between_attempts=bool(self.results)))

    # -- before any host is contacted ------------------------------------------------------
    def _resolve(self) -> Optional[Resolved]:
        """Every input checked (exit 2 on a mistake); None after a dry run."""
        resolved, self.code = resolve_settings(self.opts, self.events)
        self.resolved = resolved
        if resolved.cluster.workers:  # a discovery window's world comes when it forms
            self.membership = membership_for(resolved.cluster)
        if self.opts.dry_run:
            dry_run(resolved, self.membership, self.code, self.events)
            return None
        return resolved

    # -- the launch ------------------------------------------------------------------------
    def _launch(self, r: Resolved) -> None:
        """Connect, start the agents, plan, then one attempt after another, each on the
        hosts the membership rule gives it (`supervision.membership`)."""
        check_open_files(r.cluster, self.events)  # before anything is contacted: exit 2
        self._open_run(r)
        if r.cluster.controller.join is not None:
            joined = self._join_window(r)
            if joined is None:
                return
            r = self.resolved = joined
            self.membership = membership_for(r.cluster)
        self.hosts.transports = for_cluster(r.cluster, r.settings)
        assert self.run_id is not None
        self.healwatch = HealWatch(self.run_id, lambda: self.hosts.transports,
                                   lambda: self.attempt_now,
                                   r.lease + r.cluster.kill_grace + FORCE_MARGIN, self.events,
                                   ran=self.hosts.ran_an_agent)
        self.events.add(self.healwatch)
        selection = self._select(r, 0)
        if selection is None:
            return
        plan = self._prepare(r, selection, 0)
        self._announce(r, selection, plan)
        max_restarts = r.cluster.elastic.max_restarts
        restarts = Restarts(max_restarts)
        for attempt in range(max_restarts + 1):
            if attempt:
                following = self._restart(r, attempt)
                if following is None:
                    break
                selection, plan = following
            result = self._attempt(r, plan, attempt)
            self._after_attempt(r, result, selection, attempt)
            if not restarts.another(result.restartable, attempt,
                                    self.signals.received is not None):
                break
        if self.window is not None:  # no attempt left for a walk-in to join again for
            self.window.close()
        degraded = degraded_if_fewer_hosts(self.results, self.hosts_of, self.membership)
        if degraded is not None:
            self.results[-1] = degraded
        if self.signals.received is not None and \
                self.results[-1].verdict is not Verdict.INTERRUPTED:
            self._interrupted(self.signals.received)

    def _join_window(self, r: Resolved) -> Optional[Resolved]:
        """``controller.join``: the workers that dial in, admitted until the world forms
        (the launch goes on with them) or the window fails (its verdict; None)."""
        assert self.run_id is not None
        self.window = Window(r.cluster, self.run_id,
                             self.record.folder if self.record is not None else None,
                             self.events, r.scale)
        self.window.open()
        decision = self.window.wait()
        if decision.state is not WindowState.FORMED:
            self.results.append(self.window.failed(decision))
            return None
        cluster, settings = self.window.world()
        return dataclasses.replace(r, cluster=cluster, settings={**r.settings, **settings})

    def _open_run(self, r: Resolved) -> None:
        """The run's id, its record, its --log-dir folder; the code step said."""
        opts = self.opts
        self.run_id = opts.run_id or new_run_id()
        self._open_record(r)
        if opts.log_dir:
            self.log = RunLog(opts.log_dir, self.run_id, on_error=self._log_failed,
                              deferred=True)
            self.events.add(self.log)
            self.folder = point_latest(opts.log_dir, self.run_id)
            self.events(Name.LOG_FOLDER, **self.folder.data())
        if self.code is not None:
            self.code.announce()

    def _select(self, r: Resolved, attempt: int) -> Optional[Selection]:
        """The hosts of ``attempt``, connected; None when there are not enough (the launch
        then ends with that verdict)."""
        selection = select_hosts(self.membership, self.hosts, r.cluster, attempt,
                                 self.faulted)
        short = shortfall(self.membership, selection)
        if short is not None:
            self.results.append(short)
            return None
        return selection

    def _prepare(self, r: Resolved, selection: Selection, attempt: int) -> LaunchPlan:
        """The agents of an attempt's hosts started, the code in place, the devices and
        versions asked of them: the attempt's plan."""
        members = attempt_cluster(r.cluster, selection.hosts)
        self.hosts.start_agents(self.membership.current, self.inbox)
        if self.code is not None:  # ``sync``: the tree in place, the ranks' folder in it
            members = self.code.apply(members, self.hosts.sessions, self.inbox)
        devices = self.hosts.resolve_devices(members, self.inbox)
        self._check_versions(r, members)
        plan = self._plan(r, members, devices, run_id=self.run_id, attempt=attempt)
        if self.opts.preflight and self.opts.smoke and attempt == 0:
            # --smoke: every host reaches every other, and a collective works (bounded)
            fleetcheck.check_fleet(plan, self.hosts.sessions, self.inbox, self.events)
        return plan

    def _plan(self, r: Resolved, cluster: ClusterSpec, resolved: Mapping[str, list[int]], *,
              run_id: Optional[str] = None, attempt: int = 0) -> LaunchPlan:
        return plan_attempt(r, cluster, resolved, run_id=run_id, attempt=attempt)

    def _check_versions(self, r: Resolved, members: ClusterSpec) -> None:
        """The same Python, libraries and NCCL on every host (`preflight.fleet`)."""
        if self.opts.preflight and fleet.wanted(members, r.argv):
            fleet.check_versions(members, r.argv, self.hosts.sessions, self.inbox,
                                 self.events)

    def _announce(self, r: Resolved, selection: Selection, plan: LaunchPlan) -> None:
        """The first attempt's hosts, the plan kept with the logs, the launch line and
        what the plan warns of."""
        membership_event(self.events, selection, plan)
        logs = [log for log in (self.log, self.record) if log is not None]
        if logs:
            text = cluster_json(plan_as_json(plan, self.hosts.transports))  # masked once
            for log in logs:
                log.write_cluster(text)
        self.events(Name.LAUNCH, run_id=plan.run_id, world_size=plan.world_size,
                    ranks={h: [r.rank for r in plan.host_ranks(h)] for h in plan.hosts()})
        for name, data in plan_warnings(
                plan, targets={h: t.destination for h, t in self.hosts.transports.items()
                               if t.destination},
                from_flags=r.cluster.named_by is not None):
            self.events(name, **data)
        if any(plan.defaults(h) for h in plan.hosts()):
            self.events(Name.OMP_DEFAULTED)

    def _restart(self, r: Resolved, attempt: int) -> Optional[tuple[Selection, LaunchPlan]]:
        """The next attempt's hosts and plan, on fresh agents; None when there are not
        enough hosts for it."""
        failed_before = self.results[-1]
        self.gateways.replan_around_lost_gateways(self.hosts, r, attempt)
        selection = self._select(r, attempt)
        if selection is None:
            return None
        self.inbox = queue.SimpleQueue()
        plan = self._prepare(r, selection, attempt)
        self.events(Name.RESTARTING, attempt=attempt, max_restarts=r.cluster.elastic.max_restarts,
                    cause=cause_data(failed_before.cause, error=root_error(failed_before)),
                    error=root_error(failed_before), **membership_data(selection, plan))
        membership_event(self.events, selection, plan)
        return selection, plan

    def _attempt(self, r: Resolved, plan: LaunchPlan, attempt: int) -> RunResult:
        """One attempt (`attempt.Attempt`), its rank output and logs numbered with it."""
        self.output.attempt(plan)
        self.heap.settle()  # the plan, the sessions, the agents: there for the attempt
        self.attempt_now = attempt
        if self.log is not None:
            self.log.attempt = attempt
        if self.record is not None:
            self.record.log.attempt = attempt
        one = Attempt(r, plan, self.inbox, self.hosts, self.events, self.console,
                      self.signals, preflight=self.opts.preflight, launcher=self.launcher,
                      stop_note=self._stop_note)
        result = one.run()
        self.joined_any = self.joined_any or one.joined
        return result

    def _after_attempt(self, r: Resolved, result: RunResult, selection: Selection,
                       attempt: int) -> None:
        """The attempt kept, and how each host came out of it told to the membership
        rule."""
        self.hosts.note_greeted()
        self.results.append(result)
        self.hosts_of.append(selection.hosts)
        self.faulted.update(result.faults)
        self.hosts.stale.update(result.faults)
        self.membership.after(attempt, {**host_fates(result),
                                        **self.gateways.cut_off(r.cluster, result)})

    # -- the run's record on this controller ---------------------------------------------------
    def _open_record(self, r: Resolved) -> None:
        """The record ``attach``, ``logs``, ``stop``, ``wait`` and ``status`` read
        (`runs.record`); old ones are pruned first. A record that cannot be written is
        said, and the run goes on without one."""
        assert self.run_id is not None
        folder = str(place.runs_path() / self.run_id)
        try:
            root = place.runs_root()
            folder = str(root / self.run_id)
            pruned = place.prune(is_live, root=root, spare=[self.run_id], background=True)
            self.record = RunRecord(
                root / self.run_id, self.run_id, detached=self.opts.detached,
                verbosity=self.opts.verbosity,
                about={"command": " ".join(shell.quote(w) for w in r.argv),
                       "cluster": r.cluster.file, "kill_grace": r.cluster.kill_grace},
                on_error=self._record_failed)
        except OSError as exc:
            self.events(Name.RECORD_FAILED, error=exc.strerror or str(exc), folder=folder)
            return
        self.events.add(self.record, first=True)
        if pruned:
            self.events(Name.RECORDS_PRUNED, runs=pruned)

    def _record_failed(self, error: str, folder: str) -> None:
        self.events(Name.RECORD_FAILED, error=error, folder=folder)

    def _log_failed(self, error: str, folder: str) -> None:
        self.events(Name.LOG_FAILED, error=error, folder=folder)

    def _stop_note(self) -> Optional[Mapping[str, object]]:
        """Who sent the TERM, when ``fdl-fabric stop`` left its note addressed to this
        launcher (`commands.stopping`); None for any other TERM."""
        if self.record is None:
            return None
        note = read_json(self.record.folder / STOP_NOTE)
        if note is None or note.get("to_pid") != os.getpid():
            return None
        return note


def make_console(opts: LaunchOptions) -> Console:
    """A live status view on a terminal; plain event lines in CI and pipes. Either way
    one writer thread owns the terminal (`screen`): supervision never waits on it."""
    hint = "--log-dir keeps them" if opts.log_dir else "use --log-dir to keep every line"
    if opts.json:
        return JsonConsole(verbosity=opts.verbosity, threaded=not opts.dry_run,
                           dropped_hint=hint)
    live = sys.stdout.isatty() and not opts.dry_run and os.environ.get("TERM") != "dumb"
    return Console(verbosity=opts.verbosity, show_rank_output=not opts.quiet,
                   threaded=not opts.dry_run, live=live, dropped_hint=hint)


class _LogToEvents(logging.Handler):
    """paramiko's and invoke's log records as DEBUG events: shown with -v, kept in
    events.jsonl, never a third-party traceback on the console."""

    def __init__(self, events: EventBus, level: int) -> None:
        super().__init__(level)
        self.events = events

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.events(Name.LIBRARY_LOG, logger=record.name, text=record.getMessage())


@contextlib.contextmanager
def third_party_logs(events: EventBus, verbosity: int) -> Iterator[None]:
    """For the launch: library logs become events, and an exception that escapes a
    library's thread (paramiko's, invoke's) is one warning line, its traceback a DEBUG
    event."""
    handler = _LogToEvents(events, logging.INFO if verbosity >= 3 else logging.WARNING)
    loggers = [logging.getLogger(name) for name in ("paramiko", "invoke", "fabric")]
    saved = [(lg, lg.propagate, lg.level) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False
        lg.setLevel(handler.level)
    previous_hook = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        name = args.thread.name if args.thread is not None else "?"
        events(Name.THREAD_CRASHED, thread=name, error_type=args.exc_type.__name__,
               error=str(args.exc_value))
        events(Name.TRACEBACK, traceback="".join(traceback.format_exception(
            args.exc_type, args.exc_value, args.exc_traceback)).rstrip())

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous_hook
        for lg, propagate, level in saved:
            lg.removeHandler(handler)
            lg.propagate = propagate
            lg.setLevel(level)


def launch(opts: LaunchOptions, *, console: Optional[Console] = None,
           binary: str = "fdl-fabric") -> int:
    """Run one launch and return its exit code (0 ok, 1 failure, 2 config, 130/143);
    with ``--detach``, until every rank runs under its detached supervisor (exit 0)."""
    if opts.detach:
        from .detach import launch_detached

        return launch_detached(opts, binary)
    code = execute(opts, console=console).exit_code
    return EXIT_FAILURE if code is None else code


def execute(opts: LaunchOptions, *, console: Optional[Console] = None) -> Launch:
    """Run one launch; the `Launch` holds its exit code, its attempts' results, and
    what refused it (bad input) if anything did (the Python API reads them)."""
    console = console or make_console(opts)
    events = EventBus(console)
    if opts.on_event is not None:
        events.add(_Callback(opts.on_event))
    if opts.verbosity >= 2:
        opts.env_overrides.setdefault(ENV_VERBOSITY, str(opts.verbosity))
    try:
        with third_party_logs(events, opts.verbosity):
            run = Launch(opts, console, events)
            run.exit_code = run.run()
            return run
    finally:
        console.close()


@dataclass
class _Callback:
    """A plain callable as an event sink."""

    call: Callable[[Event], None]

    def emit(self, event: Event) -> None:
        self.call(event)


__all__ = ["EXIT_FAILURE", "FdlError", "Launch", "LaunchOptions", "execute", "launch"]
