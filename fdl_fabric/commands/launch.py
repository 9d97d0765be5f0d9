"""One launch, start to verdict: the sequence behind ``inv launch``.

1. Load and validate cluster.yml, the SSH options and every flag (a mistake exits 2
   before anything connects or any file is written).
2. Connect every remote host in parallel and start one agent per host (`hosts`):
   through Fabric for remote hosts, through invoke for local ones.
3. Resolve ``local_devices: all`` through the agents and build the plan (`plan`).
4. Bind the coordinator, open tunnels, send each agent its spec. Each agent runs the
   fast pre-flight and sweeps this cluster's leftovers; the supervisor starts the
   ranks once every host passed, then applies the failure policy to one verdict.
5. Print the summary and the verdict as the last line; exit with its code.

Every failure after an agent started goes through the supervisor or closes the
agents' input, so whatever was started is stopped the same way. Whatever fails, and
at whatever stage (connecting, starting agents, a restart), the launch ends the same
way: the summary, the attempts, the root cause, and the verdict as the last line
(`Launch._conclude`). Only bad input is refused earlier, with exit 2.

Signal handlers only record and post (`Signals`); the supervisor's loop acts on them.
Each restart starts from fresh connections to every host whose connection is gone or
that stopped answering, and new agents.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, Optional

from .. import shell
from ..clusterfile import ClusterSpec
from ..errors import EXIT_FAILURE, EXIT_USAGE, FdlError
from ..events import Event, EventBus, Name, event
from ..limits import RANKS_MAX, RANKS_PER_WORKER_MAX
from ..planning.envelope import (
    ENV_NET_TIMEOUT_SCALE,
    ENV_VERBOSITY,
    EnvelopeError,
    PrebuiltBinary,
    new_run_id,
    new_salt,
    prebuilt_from_environ,
)
from ..planning.plan import LaunchPlan, build_plan, coordinator_bind_host, interpreted_argv
from ..planning.tree import cluster_tree, tree_hosts
from ..preflight import Status, agent_checks, fleet, judge, launch_plan
from ..preflight.run import port_owner
from ..presentation.dryrun import dry_run_data, dry_run_devices, plan_as_json
from ..presentation.latest import RunFolder, point_latest
from ..presentation.output import Console, JsonConsole, RunLog
from ..presentation.rankoutput import RankOutput
from ..presentation.words import cause_data, unreachable
from ..runs import place
from ..runs.hook import bound as hook_bound
from ..runs.hook import hook_env, run_hook
from ..runs.reading import is_live, read_json
from ..runs.record import ON_EXIT_LOG, STOP_NOTE, RunRecord
from ..supervision import reports
from ..supervision.coordinator import Coordinator, CoordinatorError, CoordinatorSpec
from ..supervision.membership import HostFate, Membership, Selection
from ..supervision.policy import Elastic, Restarts
from ..supervision.rootcause import root_cause, root_error
from ..supervision.supervisor import RankState, RunResult, Supervisor
from ..supervision.verdict import Verdict
from ..sync.step import CodeStep, never_sent, sync_spec
from ..transport import Transport, for_cluster, resolve_cluster
from ..transport.fanout import close_all, connect_all, connect_each, start_agents
from ..transport.session import AgentSession
from ..transport.sshconfig import SshSettings, resolve_all_settings, with_dialable_addrs
from ..transport.tunnel import check_open_files, open_tunnel
from .cleanup import sweep_request, sweep_with_agents
from .launchoptions import LaunchOptions, MaxFailure
from .planwarnings import plan_warnings

#: Seconds to wait for every agent's answer to a device probe.
PROBE_TIMEOUT = 60.0
#: Seconds the final sweep of lost hosts may take (it runs only after a fault).
SWEEP_TIMEOUT = 30.0



def load_for(opts: LaunchOptions) -> ClusterSpec:
    """The cluster a launch runs: ``opts.cluster``, the cluster file, or (``--slurm``)
    the nodes of the allocation this runs in (`fdl_fabric.transport.resolve_cluster`)."""
    return resolve_cluster(opts.cluster_file, opts.cluster, slurm=opts.slurm,
                           nproc_per_node=opts.nproc_per_node)


def command_argv(opts: LaunchOptions, cluster: ClusterSpec) -> list[str]:
    """The rank program's argv (see `shell.command_words`); a missing one is exit 2."""
    try:
        return shell.command_words(opts.argv, opts.command, cluster.command)
    except ValueError as exc:
        raise FdlError(f"{cluster.file}: {exc}" if "no command" in str(exc)
                          else f"{cluster.file}: command: {exc}", EXIT_USAGE) from None


def net_timeout_scale(environ: Mapping[str, str]) -> float:
    """FLODL_NET_TIMEOUT_SCALE: a finite float >= 0.1 multiplying every network deadline."""
    raw = environ.get(ENV_NET_TIMEOUT_SCALE, "").strip() or "1"
    try:
        scale = float(raw)
    except ValueError:
        scale = float("nan")
    if not math.isfinite(scale) or scale < 0.1:
        raise FdlError(f"{ENV_NET_TIMEOUT_SCALE}={raw!r} must be a number >= 0.1",
                          EXIT_USAGE)
    return scale


def resolve_max_failure(opts: LaunchOptions, cluster: ClusterSpec) -> MaxFailure:
    """The flag wins over the file; both were parsed when they were read."""
    return cluster.elastic.max_failure if opts.max_failure is None else opts.max_failure


def coordinator_spec(plan: LaunchPlan, scale: float) -> CoordinatorSpec:
    """The coordinator for this plan: loopback when no worker dials it over the network."""
    cluster = plan.cluster
    return CoordinatorSpec(
        run_id=plan.run_id,
        salt=plan.salt,
        world_size=plan.world_size,
        bind_host=coordinator_bind_host(cluster),
        port=cluster.controller.port,
        formation_timeout=cluster.elastic.formation_timeout * scale,
        heartbeat_timeout=cluster.elastic.heartbeat_timeout * scale,
        hello_timeout=10.0 * scale,
    )


class LaunchInterrupted(Exception):
    """A stop signal arrived while no supervisor was running (connecting, between
    attempts): the launch ends where it stands, with a verdict."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


#: Signals that stop a run: Ctrl-C, ``kill``, the terminal closing.
_STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Every signal a launch handles.
_HANDLED = (*_STOPS, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGTSTP,
            signal.SIGCONT)


class Signals:
    """The launch's signal handlers. They only record what arrived and post it to the
    running supervisor's inbox (`queue.SimpleQueue.put` is safe there): the supervisor's
    loop prints and acts. A handler never takes a lock, so it can never wait on the
    thread it interrupted.

    With no supervisor running (connecting, starting agents, between attempts), a stop
    signal raises `LaunchInterrupted` in the main thread, while ``raising``.

    INT (Ctrl-C), TERM and HUP (the terminal closed) stop the run gracefully, a second
    INT kills; QUIT (Ctrl-\\) shows every rank's stack and the run goes on; USR1 and
    USR2 are forwarded; TSTP (Ctrl-Z) suspends supervision and CONT resumes it.
    """

    def __init__(self) -> None:
        self.supervisor: Optional[Supervisor] = None
        #: The first stop signal of the launch.
        self.received: Optional[int] = None
        self.raising = True
        #: SIGHUP was ignored when the launch started (``nohup``, a detached supervisor):
        #: it stays ignored, as well-behaved programs do.
        self.hangup_ignored = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self.hangup_ignored = signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        handled = [s for s in _HANDLED if not (s is signal.SIGHUP and self.hangup_ignored)]
        previous = {sig: signal.signal(sig, self._handle) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        sup = self.supervisor
        if signum in _STOPS:
            first = self.received is None
            if first:
                self.received = signum
            if sup is None:
                if self.raising:
                    raise LaunchInterrupted(signum)
                return
            if first or signum != signal.SIGINT:
                sup.request_interrupt(signum)
            else:
                sup.request_kill()
        elif sup is None:
            if signum == signal.SIGTSTP:  # nothing runs that must know: just stop
                os.kill(os.getpid(), signal.SIGSTOP)
        elif signum == signal.SIGQUIT:
            sup.request_stacks()
        elif signum in (signal.SIGUSR1, signal.SIGUSR2):
            sup.request_signal(signal.Signals(signum).name[3:])
        elif signum == signal.SIGTSTP:
            sup.request_suspend()
        elif signum == signal.SIGCONT:
            sup.request_resume()


@dataclass
class _Settings:
    """What one launch resolved before contacting any host."""

    cluster: ClusterSpec
    argv: list[str]
    settings: dict[str, SshSettings]
    prebuilt: Mapping[str, PrebuiltBinary]
    launcher_env: dict[str, str]
    scale: float
    max_failure: MaxFailure


class Launch:
    """State of one launch, so every exit path can tear down what was opened and end
    with a verdict."""

    def __init__(self, opts: LaunchOptions, console: Console, events: EventBus) -> None:
        self.opts = opts
        self.console = console
        self.events = events
        self.inbox: queue.SimpleQueue[reports.Report] = queue.SimpleQueue()
        self.sessions: dict[str, AgentSession] = {}
        #: Every host's transport (its connection, for an SSH host), by host.
        self.transports: dict[str, Transport] = {}
        self.stack = contextlib.ExitStack()
        self.monitor: Optional[Any] = None
        self.log: Optional[RunLog] = None
        self.folder: Optional[RunFolder] = None
        #: Seconds of silence from the launcher after which agents stop their ranks.
        self.lease: Optional[float] = None
        self.signals = Signals()
        self.output = RankOutput(events)
        self.results: list[RunResult] = []
        self.run_id: Optional[str] = None
        self.joined_any = False
        #: Hosts that were lost or unresponsive in some attempt (their records are swept).
        self.faulted: dict[str, str] = {}
        #: Hosts whose agent started in some attempt (only they can hold what to sweep).
        self.greeted: set[str] = set()
        self.launcher = {"host": socket.gethostname(), "pid": os.getpid(),
                         "started": time.time()}
        #: What the launch resolved before contacting any host.
        self.resolved: Optional[_Settings] = None
        #: Which hosts each attempt runs on (set once the cluster is read).
        self.membership = Membership(["-"])
        #: The hosts of each attempt, in step with ``results``.
        self.hosts_of: list[tuple[str, ...]] = []
        #: Hosts whose connection is not to be trusted until it is made afresh.
        self.stale: set[str] = set()
        #: Gateways lost in some attempt: later attempts plan the tree without them.
        self.lost_gateways: set[str] = set()
        #: Gateways lost in the last attempt, until the next one's tree is planned.
        self.replan: list[str] = []
        #: What refused the launch (bad input, exit 2), and the exit code once it ended.
        self.refused: Optional[FdlError] = None
        self.exit_code: Optional[int] = None
        #: The run's record on this controller (`runs.record`), once the run has an id.
        self.record: Optional[RunRecord] = None
        #: ``sync``: the code sent to every host (`fdl_fabric.sync`).
        self.code: Optional[CodeStep] = None

    def run(self) -> int:
        """The launch; its exit code. Bad input is refused (exit 2, nothing started);
        everything else ends with the summary and the verdict as the last line."""
        with self.signals.installed():
            if self.signals.hangup_ignored and not self.opts.detached:
                self.events(Name.HANGUP_IGNORED)
            try:
                resolved = self._resolve()
                if resolved is None:
                    return 0
                self._launch(resolved)
            except FdlError as exc:  # a ConfigError too: it is one, with exit code 2
                if exc.exit_code == EXIT_USAGE and not self.run_id:
                    self.events(Name.REFUSED, error=str(exc))
                    self.refused = exc
                    return EXIT_USAGE
                self._failed(exc)
            except LaunchInterrupted as exc:
                self._interrupted(exc.signum)
            finally:
                self.signals.raising = False
                self.signals.supervisor = None
            try:
                self._sweep_faulted()
            finally:
                self._teardown()
            try:
                return self._conclude()
            finally:
                if self.log is not None:
                    self.log.close()
                if self.record is not None:
                    self.record.close()

    def _teardown(self) -> None:
        for session in self.sessions.values():
            session.close_input()
        with contextlib.suppress(Exception):
            self.stack.close()
        if self.monitor is not None:
            self.monitor.close()
        close_all(self.transports.values())

    # -- before any host is contacted ------------------------------------------------------
    def _resolve(self) -> Optional[_Settings]:
        """Every input checked (exit 2 on a mistake); None after a dry run."""
        opts = self.opts
        cluster = with_dialable_addrs(load_for(opts))
        changes: dict[str, Any] = {}
        if opts.kill_grace is not None:
            changes["kill_grace"] = opts.kill_grace
        if opts.agent_timeout is not None:
            changes["agent_timeout"] = opts.agent_timeout
        if opts.hang_timeout is not None:
            changes["hang_timeout"] = opts.hang_timeout or None
        if opts.fanout is not None:
            changes["fanout"] = opts.fanout
        if opts.max_restarts is not None:
            changes["elastic"] = dataclasses.replace(cluster.elastic,
                                                     max_restarts=opts.max_restarts)
        if opts.python is not None:
            changes["python"] = opts.python
            changes["workers"] = tuple(dataclasses.replace(w, python=None)
                                       for w in cluster.workers)
        sync = sync_spec(cluster, opts.sync)
        if sync != cluster.sync:
            changes["sync"] = sync
        cluster = dataclasses.replace(cluster, **changes) if changes else cluster
        if cluster.setup is not None and sync is None:
            self.events(Name.SETUP_NOT_RUN)
        if sync is not None:  # a refusal here (no src, a link out of it) starts nothing
            self.code = CodeStep(sync, self.events, setup=cluster.setup,
                                 never=never_sent(str(place.runs_path()), opts.log_dir))
            self.code.build()
        max_failure = resolve_max_failure(opts, cluster)
        argv = command_argv(opts, cluster)
        settings = resolve_all_settings(cluster, self.events)
        try:
            prebuilt = prebuilt_from_environ()
        except EnvelopeError as exc:
            raise FdlError(str(exc), EXIT_USAGE) from None
        launcher_env = dict(os.environ)
        launcher_env.update(opts.env_overrides)
        scale = net_timeout_scale(launcher_env)
        # The agents give the launcher what the coordinator gives a rank.
        self.lease = cluster.elastic.heartbeat_timeout * scale
        resolved = self.resolved = _Settings(cluster, argv, settings, prebuilt, launcher_env,
                                             scale, max_failure)
        self.membership = membership_for(cluster)
        if opts.dry_run:
            roster = attempt_cluster(cluster, self.membership.roster)
            if self.code is not None:
                roster = self.code.planned(roster)
            plan = self._plan(resolved, roster, dry_run_devices(roster))
            self.events(Name.DRY_RUN, **dry_run_data(plan, settings),
                        spares=list(self.membership.spares),
                        min_hosts=cluster.elastic.min_hosts,
                        code=self.code.dry_run() if self.code else None)
            return None
        return resolved

    # -- the launch ------------------------------------------------------------------------
    def _launch(self, r: _Settings) -> None:
        """Connect, start the agents, plan, then one attempt after another, each on the
        hosts the membership rule gives it (`supervision.membership`)."""
        opts, cluster = self.opts, r.cluster
        check_open_files(cluster, self.events)  # before anything is contacted: exit 2
        self.run_id = opts.run_id or new_run_id()
        self._open_record(r)
        if opts.log_dir:
            self.log = RunLog(opts.log_dir, self.run_id, on_error=self._log_failed)
            self.events.add(self.log)
            self.folder = point_latest(opts.log_dir, self.run_id)
            self.events(Name.LOG_FOLDER, **self.folder.data())
        if self.code is not None:
            self.code.announce()
        self.transports = for_cluster(cluster, r.settings)
        selection = self._select(r, 0)
        if selection is None:
            return
        members = attempt_cluster(cluster, selection.hosts)
        self.sessions = self._start_agents(self.inbox)
        members = self._put_code(members)
        devices = self._resolve_devices(members)
        self._check_versions(r, members)
        plan = self._plan(r, members, devices, run_id=self.run_id)
        self._membership_event(selection, plan)
        for log in (self.log, self.record):
            if log is not None:
                log.write_cluster(plan_as_json(plan))
        self.events(Name.LAUNCH, run_id=plan.run_id, world_size=plan.world_size,
                    ranks={h: [r.rank for r in plan.host_ranks(h)] for h in plan.hosts()})
        for name, data in plan_warnings(
                plan, targets={h: s.target.rpartition("@")[2] for h, s in r.settings.items()},
                from_flags=cluster.named_by is not None):
            self.events(name, **data)
        if any(plan.defaults(h) for h in plan.hosts()):
            self.events(Name.OMP_DEFAULTED)
        max_restarts = cluster.elastic.max_restarts
        restarts = Restarts(max_restarts)
        for attempt in range(max_restarts + 1):
            if attempt:
                failed = self.results[-1]
                self._replan_tree(r, attempt)
                selection = self._select(r, attempt)
                if selection is None:
                    break
                inbox: queue.SimpleQueue[reports.Report] = queue.SimpleQueue()
                self.inbox = inbox
                members = attempt_cluster(cluster, selection.hosts)
                self.sessions = self._start_agents(inbox)
                members = self._put_code(members)
                devices = self._resolve_devices(members)
                self._check_versions(r, members)
                plan = self._plan(r, members, devices, run_id=self.run_id, attempt=attempt)
                self.events(Name.RESTARTING, attempt=attempt, max_restarts=max_restarts,
                            cause=cause_data(failed.cause, error=root_error(failed)),
                            error=root_error(failed), **membership_data(selection, plan))
                self._membership_event(selection, plan)
            result = self._attempt(r, plan, attempt)
            self.greeted.update(h for h, s in self.sessions.items() if s.greeted)
            self.results.append(result)
            self.hosts_of.append(selection.hosts)
            self.faulted.update(result.faults)
            self.stale.update(result.faults)
            self.membership.after(attempt, {**host_fates(result), **self._cut_off(cluster, result)})
            if not restarts.another(result.restartable, attempt,
                                    self.signals.received is not None):
                break
        self._degraded_if_fewer_hosts()
        if self.signals.received is not None and \
                self.results[-1].verdict is not Verdict.INTERRUPTED:
            self._interrupted(self.signals.received)

    def _start_agents(self, inbox: queue.SimpleQueue[reports.Report]
                      ) -> dict[str, AgentSession]:
        """One agent on each host of this attempt."""
        hosts = {h: self.transports[h] for h in self.membership.current}
        return start_agents(hosts, inbox.put, on_output=self.output)

    def _put_code(self, members: ClusterSpec) -> ClusterSpec:
        """With ``sync``: the tree in place on each host, the ranks' folder moved into it."""
        if self.code is None:
            return members
        return self.code.apply(members, self.sessions, self.inbox)

    def _check_versions(self, r: _Settings, members: ClusterSpec) -> None:
        """The same Python, libraries and NCCL on every host (`preflight.fleet`)."""
        if self.opts.preflight and fleet.wanted(members, r.argv):
            fleet.check_versions(members, r.argv, self.sessions, self.inbox, self.events)

    def _cut_off(self, cluster: ClusterSpec, result: RunResult) -> dict[str, HostFate]:
        """Gateways lost in this attempt: noted, so the next attempt's tree is planned
        without them (`_replan_tree`); their leaves' losses are theirs, not the leaves',
        so each leaf is probed again through the gateways left (`HostFate.CUT_OFF`)."""
        tree = cluster_tree(cluster, avoid=self.lost_gateways)
        lost = {g.host for g in tree.gateways} & set(result.faults)
        if not lost:
            return {}
        self.lost_gateways |= lost
        self.replan = sorted(lost)
        return {leaf: HostFate.CUT_OFF for g in tree.gateways if g.host in lost
                for leaf in g.leaves if leaf in result.faults}

    def _replan_tree(self, r: _Settings, attempt: int) -> None:
        """The tree planned again without the gateways lost so far, with fresh transports
        for every host of the tree: the lost gateways' leaves start through the gateways
        that are left, and a lost gateway itself is connected directly (the membership
        rule keeps it or leaves it out by whether it answers, like any host)."""
        if not self.replan:
            return
        cluster = r.cluster
        hosts = tree_hosts(cluster)
        close_all([self.transports[h] for h in hosts])
        fresh = for_cluster(cluster, r.settings, avoid=self.lost_gateways)
        self.transports.update({h: fresh[h] for h in hosts})
        self.events(Name.TREE_REPLANNED, attempt=attempt, lost=self.replan,
                    tree=cluster_tree(cluster, avoid=self.lost_gateways).as_data())
        self.replan = []

    # -- membership ----------------------------------------------------------------------------
    def _select(self, r: _Settings, attempt: int) -> Optional[Selection]:
        """The hosts of ``attempt``, connected; None when there are not enough (the launch
        then ends with that verdict). Without ``min_hosts`` or spares, every attempt is the
        whole roster and a host that cannot be reached ends the launch, as it always did."""
        membership = self.membership
        if not membership.elastic:
            selection = membership.select(attempt, lambda hosts: {})
            if attempt == 0:
                connect_all({h: self.transports[h] for h in selection.hosts}, self._connected)
            else:
                self._reconnect(r)
            return selection
        selection = membership.select(attempt, lambda hosts: self._probe(r, attempt, hosts))
        if not selection.enough:
            self.results.append(RunResult(Verdict.FAILED, EXIT_FAILURE, event(
                Name.NOT_ENOUGH_HOSTS, hosts=list(selection.hosts),
                min_hosts=selection.min_hosts, left_out=dict(selection.left_out),
                attempt=attempt), ()))
            return None
        return selection

    def _probe(self, r: _Settings, attempt: int, hosts: Sequence[str]) -> dict[str, str]:
        """Connect the hosts that are not connected, or whose connection is not to be
        trusted (lost or unresponsive in an attempt); each bounded by its connect timeout.
        Why each one that failed failed."""
        todo = [self.transports[h] for h in hosts
                if h in self.stale or not self.transports[h].connected]
        if not todo:
            return {}
        close_all(todo)
        errors = connect_each(todo, self._connected, check=True)
        for transport in todo:
            if transport.host in errors:
                continue
            self.stale.discard(transport.host)
            if self.monitor is not None:
                transport.watch(self.monitor)
            if attempt and any(w.host == transport.host and w.tunnel
                               for w in r.cluster.workers):
                self._open_tunnel(r.cluster, transport.host)
        return errors

    def _membership_event(self, selection: Selection, plan: LaunchPlan) -> None:
        self.events(Name.ATTEMPT_HOSTS, attempt=selection.attempt,
                    **membership_data(selection, plan))
        if selection.attempt == 0 and selection.left_out:
            self.events(Name.HOSTS_LEFT_OUT, left_out=dict(selection.left_out),
                        spares=list(selection.spares))

    def _degraded_if_fewer_hosts(self) -> None:
        """A run that completed on fewer hosts than the roster: exit 0, but said, as a
        run that lost ranks under max_failure is."""
        if not self.results or not self.hosts_of:
            return
        final = self.results[-1]
        hosts = self.hosts_of[-1]
        roster = self.membership.target
        if final.verdict is not Verdict.OK or len(hosts) >= roster \
                or len(self.hosts_of) != len(self.results):
            return
        last = self.membership.last
        left_out = {h: why for h, why in (last.left_out if last else {}).items()
                    if h in self.membership.roster}
        self.results[-1] = dataclasses.replace(final, verdict=Verdict.DEGRADED, cause=event(
            Name.COMPLETED_ON_FEWER_HOSTS, hosts=len(hosts), roster=roster,
            left_out=left_out, world_size=len(final.ranks)))

    def _attempt(self, r: _Settings, plan: LaunchPlan, attempt: int) -> RunResult:
        """One attempt: the coordinator, every agent's spec, the supervisor to a verdict."""
        inbox = self.inbox
        self.output.attempt(plan)
        if self.log is not None:
            self.log.attempt = attempt
        if self.record is not None:
            self.record.log.attempt = attempt
        coordinator = Coordinator(
            coordinator_spec(plan, r.scale), self.events,
            on_join=lambda rank: inbox.put(reports.Joined(rank)),
            on_dead=lambda rank, why: inbox.put(reports.DeclaredDead(rank, why)),
            on_abort=lambda why: inbox.put(reports.Request("abort", cause=why)))
        try:
            coordinator.start()
        except CoordinatorError as exc:
            held = (f" (held by {port_owner(plan.cluster.controller.port)})"
                    if "in use" in str(exc) else "")
            raise FdlError(f"{exc}{held} — nothing was started") from None
        try:
            if attempt == 0:  # after the bind: a tunnel delivers to the coordinator
                for w in plan.cluster.workers:
                    if w.tunnel:
                        self._open_tunnel(plan.cluster, w.host)
                self._watch_connections()
            result = self._supervise(r, plan, coordinator, inbox)
        finally:
            coordinator.stop()
        self.joined_any = self.joined_any or bool(coordinator.joined)
        return result

    def _supervise(self, r: _Settings, plan: LaunchPlan, coordinator: Coordinator,
                   inbox: queue.SimpleQueue[reports.Report]) -> RunResult:
        cluster = plan.cluster
        checks = {w.host: launch_plan(cluster, w, interpreted_argv(cluster, w, r.argv),
                                      r.prebuilt.get(w.host),
                                      master=(plan.master_addr, cluster.master_port))
                  for w in cluster.workers}

        def judge_host(host: str, values: Mapping[str, str]
                       ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
            rows = judge(checks[host], values)
            warn = [(c.name, c.reason) for c in rows if c.status is Status.WARN]
            fail = [(c.name, c.reason) for c in rows if c.status is Status.FAIL]
            return warn, fail

        supervisor = Supervisor(
            plan.ranks, self.sessions, kill_grace=cluster.kill_grace, events=self.events,
            cohort=coordinator, policy=Elastic(plan.world_size, r.max_failure),
            preflight=judge_host if self.opts.preflight else None,
            inbox=inbox, agent_timeout=cluster.agent_timeout * r.scale,
            hang_timeout=cluster.hang_timeout, on_resume=self._resumed, lease=self.lease,
            attempt=plan.attempt, stop_note=self._stop_note)
        self.signals.supervisor = supervisor
        if self.signals.received is not None:  # arrived while this attempt was set up
            supervisor.request_interrupt(self.signals.received)
        self.console.start_status(lambda: supervisor.ranks)
        try:
            for host in plan.hosts():
                spec = plan.agent_spec(
                    host, checks=agent_checks(checks[host]) if self.opts.preflight else None,
                    start_now=not self.opts.preflight, lease=self.lease,
                    launcher=self.launcher)
                self.sessions[host].spec(spec)
            return supervisor.run()
        finally:
            self.signals.supervisor = None
            self.console.stop_status()

    # -- connections -------------------------------------------------------------------------
    def _connected(self, transport: Transport) -> None:
        self.events(Name.CONNECTED, host=transport.host)

    def _reconnect(self, r: _Settings) -> None:  # the roster's path (no min_hosts, no spares)
        """Before a restart: a fresh connection to every host whose connection is gone or
        whose agent stopped answering (its link may be dead while paramiko thinks not)."""
        stale = [t for h, t in self.transports.items() if h in self.faulted or not t.connected]
        if not stale:
            return
        close_all(stale)
        errors = connect_each(stale, self._connected)
        if errors:
            lines = tuple(f"cluster launcher: host {h!r} {unreachable(why)}"
                          for h, why in errors.items())
            if len(lines) == 1:
                raise FdlError(lines[0])
            raise FdlError(f"cluster launcher: {len(lines)} hosts unreachable "
                           f"({', '.join(errors)})", details=lines)
        for transport in stale:
            if self.monitor is not None:
                transport.watch(self.monitor)
            if any(w.host == transport.host and w.tunnel for w in r.cluster.workers):
                self._open_tunnel(r.cluster, transport.host)

    def _open_tunnel(self, cluster: ClusterSpec, host: str) -> None:
        port = cluster.controller.port
        # The forward delivers to wherever the coordinator listens.
        target = coordinator_bind_host(cluster)
        try:
            self.stack.enter_context(open_tunnel(self.transports[host], port, target,
                                                 self.events))
        except Exception as exc:
            raise FdlError(f"cluster launcher: host {host!r}: tunnel could not bind "
                           f"127.0.0.1:{port} on the remote side: {exc}") from None
        self.events(Name.TUNNEL_OPENED, host=host, port=port, target=target)

    def _watch_connections(self) -> None:
        from ..transport.keepalive import KeepaliveMonitor

        def dead(host: str, silent: float) -> None:
            self.events(Name.KEEPALIVE_LOST, host=host, silent=round(silent, 3))

        self.monitor = KeepaliveMonitor(dead)
        for transport in self.transports.values():
            transport.watch(self.monitor)

    def _resumed(self) -> None:
        if self.monitor is not None:
            self.monitor.resumed()

    def _resolve_devices(self, cluster: ClusterSpec) -> dict[str, list[int]]:
        """GPU indices of every ``local_devices: all`` worker, asked of its agent."""
        wanted = {w.host for w in cluster.workers if w.local_devices == "all"}
        for host in wanted:
            self.sessions[host].probe(gpus=True)
        resolved: dict[str, list[int]] = {}
        kept: list[reports.Report] = []
        deadline = time.monotonic() + PROBE_TIMEOUT
        while wanted - set(resolved):
            try:
                report = self.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                missing = ", ".join(sorted(wanted - set(resolved)))
                raise FdlError(f"cluster launcher: no device list from {missing} within "
                                  f"{PROBE_TIMEOUT:g}s") from None
            if isinstance(report, reports.Facts):
                if not report.gpus:
                    raise FdlError(
                        f"cluster launcher: host {report.host!r}: `local_devices: all` found no "
                        f"GPU (nvidia-smi: {report.error or 'listed none'}); give an explicit "
                        "list instead")
                if len(report.gpus) > RANKS_PER_WORKER_MAX:
                    raise FdlError(
                        f"cluster launcher: host {report.host!r}: `local_devices: all` found "
                        f"{len(report.gpus)} GPUs; at most {RANKS_PER_WORKER_MAX} ranks a host",
                        EXIT_USAGE)
                resolved[report.host] = report.gpus
            elif isinstance(report, reports.AgentGone):
                raise FdlError(f"cluster launcher: host {report.host!r}: {report.reason}")
            else:
                kept.append(report)
        for report in kept:
            self.inbox.put(report)
        total = sum(len(d) for d in resolved.values()) + sum(
            w.nproc or len(w.local_devices or ()) for w in cluster.workers
            if w.local_devices != "all")
        if total > RANKS_MAX:
            raise FdlError(f"cluster launcher: {total} ranks in all once `local_devices: all` "
                              f"is resolved; at most {RANKS_MAX} are allowed", EXIT_USAGE)
        return resolved

    def _plan(self, r: _Settings, cluster: ClusterSpec, resolved: Mapping[str, list[int]], *,
              run_id: Optional[str] = None, attempt: int = 0) -> LaunchPlan:
        """The plan of one attempt, from its hosts: ranks numbered afresh, a fresh salt
        every time, so nothing of an earlier attempt can join this one's cohort; the run
        id stays (TORCHELASTIC_RUN_ID)."""
        try:
            return build_plan(cluster, argv=r.argv, run_id=run_id or new_run_id(),
                              salt=new_salt(), resolved_devices=resolved, prebuilt=r.prebuilt,
                              launcher_env=r.launcher_env, attempt=attempt)
        except ValueError as exc:
            raise FdlError(f"{r.cluster.file}: {exc}", EXIT_USAGE) from None

    # -- the run's record on this controller ---------------------------------------------------
    def _open_record(self, r: _Settings) -> None:
        """The record ``attach``, ``logs``, ``stop``, ``wait`` and ``status`` read
        (`runs.record`); old ones are pruned first. A record that cannot be written is
        said, and the run goes on without one."""
        assert self.run_id is not None
        folder = str(place.runs_path() / self.run_id)
        try:
            root = place.runs_root()
            folder = str(root / self.run_id)
            pruned = place.prune(is_live, root=root, spare=[self.run_id])
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

    def _stop_note(self) -> Optional[Mapping[str, object]]:
        """Who sent the TERM, when ``fdl-fabric stop`` left its note addressed to this
        launcher (`commands.stopping`); None for any other TERM."""
        if self.record is None:
            return None
        note = read_json(self.record.folder / STOP_NOTE)
        if note is None or note.get("to_pid") != os.getpid():
            return None
        return note

    def _on_exit(self, final: RunResult) -> None:
        """``--on-exit``: once, before the verdict line (which stays the last line); its
        failure is said, and changes nothing of the verdict."""
        command = self.opts.on_exit or (self.resolved.cluster.on_exit
                                        if self.resolved is not None else None)
        if not command or self.run_id is None:
            return
        folder = self.record.folder if self.record is not None else None
        log = folder / ON_EXIT_LOG if folder is not None else None
        outcome = run_hook(command, hook_env(self.run_id, final.verdict.value,
                                             final.exit_code, folder), log)
        if outcome.ok:
            self.events(Name.ON_EXIT_RAN, seconds=round(outcome.seconds, 3))
        else:
            self.events(Name.ON_EXIT_FAILED, exit_code=outcome.exit_code,
                        timed_out=outcome.timed_out, error=outcome.error,
                        timeout=hook_bound(), log=str(log) if log else "not kept")

    # -- the end -------------------------------------------------------------------------------
    def _log_failed(self, error: str, folder: str) -> None:
        self.events(Name.LOG_FAILED, error=error, folder=folder)

    def _failed(self, exc: FdlError) -> None:
        """A failure outside the ranks (connecting, starting agents, a restart's set-up)."""
        for line in exc.details:
            self.events(Name.FAILURE_DETAIL, text=line)
        self.results.append(RunResult(Verdict.FAILED, exc.exit_code or 1,
                                      event(Name.LAUNCH_FAILED, error=str(exc)), ()))

    def _interrupted(self, signum: int) -> None:
        self.results.append(RunResult(
            Verdict.INTERRUPTED, 128 + signum,
            event(Name.INTERRUPTED_OUTSIDE_RUN, signal=signal.Signals(signum).name,
                  between_attempts=bool(self.results)), ()))

    def _sweep_faulted(self) -> None:
        """Hosts lost or unresponsive during the run: once the run is over, stop whatever
        of it is still there and remove its registry records, or say they were left."""
        r = self.resolved
        if r is None or self.run_id is None:
            return
        hosts = [t for h, t in self.transports.items()
                 if h in self.faulted and t.sweep_after_loss and h in self.greeted]
        if not hosts:
            return
        # A connection to a host that stopped answering is not to be trusted, whatever
        # paramiko thinks of it: every faulted host gets a fresh one.
        close_all(hosts)
        errors = connect_each(hosts)
        found = {rep.host: rep for rep in sweep_with_agents(
            [t for t in hosts if t.host not in errors],
            sweep_request(runs=[self.run_id], by={"command": "the launcher's final sweep"}),
            timeout=SWEEP_TIMEOUT)}
        for host, why in errors.items():
            self.events(Name.SWEEP_UNREACHABLE, host=host, reason=why, run_id=self.run_id)
        for host, rep in found.items():
            if rep.error or rep.leftovers:
                self.events(Name.SWEEP_INCOMPLETE, host=host, run_id=self.run_id,
                            problem=rep.error or rep.leftovers)
            elif rep.stopped:
                pids = sorted({p for s in rep.stopped for p in s.get("pids", [])})
                self.events(Name.SWEEP_STOPPED, host=host, run_id=self.run_id, pids=pids)

    def _stderr_log(self, rank: int) -> Optional[str]:
        """Where a rank's whole stderr is kept: --log-dir's copy, else the run's record."""
        log = self.log if self.log is not None else (
            self.record.log if self.record is not None else None)
        return str(log.rank_folder(rank) / "stderr.log") if log is not None else None

    def _conclude(self) -> int:
        """The summary, the attempts, the root cause, and the verdict as the last line."""
        if not self.results:
            return EXIT_FAILURE
        final = self.results[-1]
        shown = next((r for r in reversed(self.results) if r.started_any), None)
        if shown is not None:
            self.events(Name.SUMMARY, ranks=[r.summary() for r in shown.ranks])
        if len(self.results) > 1:
            hosts = [*self.hosts_of, *[()] * (len(self.results) - len(self.hosts_of))]
            self.events(Name.ATTEMPTS, attempts=[
                {"verdict": r.verdict.value, "cause": cause_data(r.cause, error=root_error(r)),
                 "hosts": list(h)} for r, h in zip(self.results, hosts)])
        cause = root_cause(final, stderr_tail=self.output.tail, log_of=self._stderr_log)
        if cause is not None:
            self.events.emit(cause)
        dropped = self.console.dropped
        if dropped:
            self.events(Name.OUTPUT_DROPPED, dropped=dropped,
                        log_kept=self.log is not None and self.log.failed is None)
        if self.resolved is not None and self.resolved.max_failure is not None \
                and not self.joined_any and final.started_any:
            self.events(Name.MAX_FAILURE_UNUSED)
        if self.folder is not None and self.log is not None:
            self.events(Name.LOGS_KEPT, **self.folder.data(), failed=self.log.failed)
        self._on_exit(final)
        self.events(Name.VERDICT, cause=cause_data(final.cause), exit_code=final.exit_code,
                    verdict=final.verdict.value, attempts=len(self.results),
                    run_id=self.run_id, faults=dict(self.faulted))
        return final.exit_code


def membership_for(cluster: ClusterSpec) -> Membership:
    """The membership rule of a cluster: its roster, its spares, its min_hosts."""
    return Membership(roster=[w.host for w in cluster.workers if not w.spare],
                      spares=[w.host for w in cluster.workers if w.spare],
                      min_hosts=cluster.elastic.min_hosts,
                      host_failures=cluster.elastic.host_failures)


def attempt_cluster(cluster: ClusterSpec, hosts: Sequence[str]) -> ClusterSpec:
    """The cluster of one attempt: its hosts in roster order, numbered afresh (each
    worker's index is its GROUP_RANK)."""
    by_host = {w.host: w for w in cluster.workers}
    return dataclasses.replace(cluster, workers=tuple(
        dataclasses.replace(by_host[h], index=i) for i, h in enumerate(hosts)))


def host_fates(result: RunResult) -> dict[str, HostFate]:
    """How each host came out of an attempt: lost (its agent or link), failed (one of its
    ranks failed), or fine (its ranks ended well or were stopped for another's sake)."""
    fates: dict[str, HostFate] = {}
    for rank in result.ranks:
        if rank.state is RankState.FAILED:
            fates[rank.host] = HostFate.FAILED
    for host in result.faults:
        fates[host] = HostFate.LOST
    return fates


def membership_data(selection: Selection, plan: LaunchPlan) -> dict[str, Any]:
    return {"hosts": list(selection.hosts), "world_size": plan.world_size,
            "roster": selection.target, "left_out": dict(selection.left_out),
            "readmitted": list(selection.readmitted), "spares": list(selection.spares)}


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
