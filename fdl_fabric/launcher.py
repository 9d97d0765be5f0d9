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
agents' input, so whatever was started is stopped the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Optional, Union

from . import reports, shell
from .config import ClusterSpec, ConfigError, load_cluster, parse_max_failure
from .coordinator import Coordinator, CoordinatorError, CoordinatorSpec
from .dryrun import describe_dry_run, dry_run_devices, plan_as_json
from .envelope import (
    ENV_NET_TIMEOUT_SCALE,
    ENV_VERBOSITY,
    EnvelopeError,
    PrebuiltBinary,
    new_run_id,
    new_salt,
    prebuilt_from_environ,
)
from .errors import EXIT_FAILURE, EXIT_USAGE, LaunchError
from .events import EventBus, Kind
from .hosts import close_all, connect_all, start_agents
from .limits import RANKS_MAX, RANKS_PER_WORKER_MAX
from .output import Console, LiveConsole, RunLog, summary_table
from .plan import OMP_NOTICE, LaunchPlan, build_plan, coordinator_bind_host
from .preflight import Status, agent_checks, judge, launch_plan
from .sessions import AgentSession
from .sshopts import SshSettings, resolve_all_settings
from .supervisor import RunResult, Supervisor, Verdict, summary_rows

#: Seconds to wait for every agent's answer to a device probe.
PROBE_TIMEOUT = 60.0

MaxFailure = Union[int, float, None]


@dataclass
class LaunchOptions:
    cluster_file: Optional[str] = "cluster.yml"
    command: Optional[str] = None
    argv: Sequence[str] = ()
    kill_grace: Optional[float] = None
    verbosity: int = 1
    quiet: bool = False
    max_failure: Optional[str] = None
    log_dir: Optional[str] = None
    dry_run: bool = False
    env_overrides: dict[str, str] = field(default_factory=dict)
    preflight: bool = True
    max_restarts: Optional[int] = None
    #: A cluster built in code (``fdl-fabric run``) instead of ``cluster_file``.
    cluster: Optional[ClusterSpec] = None
    #: ``--slurm``: the workers are the nodes of the allocation this runs in. Without a
    #: ``cluster_file`` no file is read: the flags say everything.
    slurm: bool = False
    #: ``--nproc-per-node``: ranks on each Slurm node (wins over the file's).
    nproc_per_node: Optional[int] = None


def load_for(opts: LaunchOptions) -> ClusterSpec:
    """The cluster a launch runs: ``opts.cluster``, the cluster file, or (``--slurm``)
    the nodes of the allocation this runs in (`fdl_fabric.slurm`)."""
    if opts.slurm:
        from . import slurm

        return slurm.load(opts.cluster_file, nproc_per_node=opts.nproc_per_node)
    cluster = opts.cluster or load_cluster(opts.cluster_file or "cluster.yml")
    if cluster.slurm is not None:
        from . import slurm

        return slurm.resolve(cluster, flag=f"{cluster.file}: scheduler: slurm",
                             nproc_per_node=opts.nproc_per_node)
    if opts.nproc_per_node is not None:
        raise LaunchError("--nproc-per-node: only for a Slurm launch (--slurm, or "
                          "`scheduler: slurm` in the cluster file); SSH workers set nproc "
                          "in the cluster file", EXIT_USAGE)
    return cluster


def command_argv(opts: LaunchOptions, cluster: ClusterSpec) -> list[str]:
    """The rank program's argv (see `shell.command_words`); a missing one is exit 2."""
    try:
        return shell.command_words(opts.argv, opts.command, cluster.command)
    except ValueError as exc:
        raise LaunchError(f"{cluster.file}: {exc}" if "no command" in str(exc)
                          else f"{cluster.file}: command: {exc}", EXIT_USAGE) from None


def net_timeout_scale(environ: Mapping[str, str]) -> float:
    """FLODL_NET_TIMEOUT_SCALE: a finite float >= 0.1 multiplying every network deadline."""
    raw = environ.get(ENV_NET_TIMEOUT_SCALE, "").strip() or "1"
    try:
        scale = float(raw)
    except ValueError:
        scale = float("nan")
    if not math.isfinite(scale) or scale < 0.1:
        raise LaunchError(f"{ENV_NET_TIMEOUT_SCALE}={raw!r} must be a number >= 0.1",
                          EXIT_USAGE)
    return scale


def resolve_max_failure(opts: LaunchOptions, cluster: ClusterSpec) -> MaxFailure:
    if opts.max_failure is None:
        return cluster.elastic.max_failure
    try:
        return parse_max_failure(opts.max_failure)
    except ValueError as exc:
        raise LaunchError(f"--max-failure: {exc}", EXIT_USAGE) from None


def coordinator_spec(plan: LaunchPlan, max_failure: MaxFailure, scale: float) -> CoordinatorSpec:
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
        max_failure=max_failure,
        hello_timeout=10.0 * scale,
    )


class Attempts:
    """Where signals go while a launch runs one attempt after another.

    The handlers are installed once, for the whole launch; each attempt's supervisor
    registers here. An interrupt also ends the launch: it is never followed by a restart.
    """

    def __init__(self, kill_grace: float) -> None:
        self.kill_grace = kill_grace
        self.supervisor: Optional[Supervisor] = None
        self.interrupted = False

    def live(self) -> list[object]:
        return list(self.supervisor.live()) if self.supervisor is not None else []

    def request_interrupt(self, signum: int) -> None:
        self.interrupted = True
        if self.supervisor is not None:
            self.supervisor.request_interrupt(signum)

    def request_kill(self) -> None:
        if self.supervisor is not None:
            self.supervisor.request_kill()

    def request_signal(self, name: str) -> None:
        if self.supervisor is not None:
            self.supervisor.request_signal(name)


@contextlib.contextmanager
def signal_handlers(supervisor: Union[Supervisor, Attempts], console: Console) -> Iterator[None]:
    """Ctrl-C/TERM stop the run gracefully, a second Ctrl-C kills; USR1/2 are forwarded."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    seen: list[int] = []

    def on_stop(signum: int, frame: Optional[FrameType]) -> None:
        if seen and signum == signal.SIGINT:
            supervisor.request_kill()
            return
        if not seen:
            name = signal.Signals(signum).name
            live = len(supervisor.live())
            console.message(f"cluster launcher: {name} received — stopping {live} running "
                            f"rank(s) (TERM, KILL after {supervisor.kill_grace:g}s); "
                            "press Ctrl-C again to kill now")
        seen.append(signum)
        supervisor.request_interrupt(signum)

    def on_forward(signum: int, frame: Optional[FrameType]) -> None:
        supervisor.request_signal(signal.Signals(signum).name[3:])

    previous = {
        sig: signal.signal(sig, handler)
        for sig, handler in ((signal.SIGINT, on_stop), (signal.SIGTERM, on_stop),
                             (signal.SIGUSR1, on_forward), (signal.SIGUSR2, on_forward))
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def describe_plan(plan: LaunchPlan) -> str:
    per_host: dict[str, list[int]] = {}
    for r in plan.ranks:
        per_host.setdefault(r.host, []).append(r.rank)
    hosts = ", ".join(f"{h}: r{rs[0]}-r{rs[-1]}" if len(rs) > 1 else f"{h}: r{rs[0]}"
                      for h, rs in per_host.items())
    return (f"cluster launcher: run {plan.run_id}: {plan.world_size} rank(s) on "
            f"{len(per_host)} host(s) ({hosts})")


class Launch:
    """State of one launch, so every exit path can tear down what was opened."""

    def __init__(self, opts: LaunchOptions, console: Console, events: EventBus) -> None:
        self.opts = opts
        self.console = console
        self.events = events
        self.inbox: queue.SimpleQueue[reports.Report] = queue.SimpleQueue()
        self.sessions: dict[str, AgentSession] = {}
        self.connections: dict[str, object] = {}
        self.stack = contextlib.ExitStack()
        self.monitor: Optional[Any] = None
        self.log: Optional[RunLog] = None
        #: Seconds of silence from the launcher after which agents stop their ranks.
        self.lease: Optional[float] = None

    def run(self) -> int:
        try:
            return self._run()
        except ConfigError as exc:
            self.console.message(str(exc))
            return EXIT_USAGE
        except LaunchError as exc:
            self.console.message(str(exc))
            return exc.exit_code
        finally:
            self._teardown()

    def _teardown(self) -> None:
        for session in self.sessions.values():
            session.close_input()
        self.stack.close()
        if self.monitor is not None:
            self.monitor.close()
        close_all(self.connections.values())  # type: ignore[arg-type]

    def _run(self) -> int:
        opts = self.opts
        cluster = load_for(opts)
        if opts.kill_grace is not None:
            cluster = dataclasses.replace(cluster, kill_grace=opts.kill_grace)
        if opts.max_restarts is not None:
            cluster = dataclasses.replace(cluster, elastic=dataclasses.replace(
                cluster.elastic, max_restarts=opts.max_restarts))
        max_restarts = cluster.elastic.max_restarts
        max_failure = resolve_max_failure(opts, cluster)
        argv = command_argv(opts, cluster)
        settings = resolve_all_settings(cluster, self.console.message)
        try:
            prebuilt = prebuilt_from_environ()
        except EnvelopeError as exc:
            raise LaunchError(str(exc), EXIT_USAGE) from None
        launcher_env = dict(os.environ)
        launcher_env.update(opts.env_overrides)
        scale = net_timeout_scale(launcher_env)
        # The agents give the launcher what the coordinator gives a rank.
        self.lease = cluster.elastic.heartbeat_timeout * scale

        if opts.dry_run:
            plan = self._plan(cluster, argv, dry_run_devices(cluster), prebuilt, launcher_env)
            self.console.out.write(describe_dry_run(plan, settings))
            self.console.out.flush()
            return 0

        self.connections = dict(connect_all(settings, self._connected))
        self.sessions = start_agents(cluster.workers, self.connections,  # type: ignore[arg-type]
                                     self.inbox.put)
        resolved = self._resolve_devices(cluster)
        run_id = new_run_id()
        plan = self._plan(cluster, argv, resolved, prebuilt, launcher_env, run_id=run_id)
        if opts.log_dir:
            self.log = RunLog(opts.log_dir, plan.run_id)
            self.stack.callback(self.log.close)
            self.events.add(self.log)
            self.log.write_cluster(plan_as_json(plan))
        self.events(Kind.LAUNCH, describe_plan(plan), data={"run_id": plan.run_id,
                                                            "world_size": plan.world_size})
        for warning in plan_warnings(plan):
            self.events(Kind.WARNING, warning)
        if any(plan.defaults(h) for h in plan.hosts()):
            self.events(Kind.INFO, OMP_NOTICE)
        attempts = Attempts(plan.cluster.kill_grace)
        results: list[RunResult] = []
        joined_any = False
        with signal_handlers(attempts, self.console):
            for attempt in range(max_restarts + 1):
                if attempt:
                    plan = self._plan(cluster, argv, resolved, prebuilt, launcher_env,
                                      run_id=run_id, attempt=attempt)
                    self.sessions = start_agents(cluster.workers,
                                                 self.connections,  # type: ignore[arg-type]
                                                 self.inbox.put)
                if self.log is not None:
                    self.log.attempt = attempt
                coordinator = Coordinator(coordinator_spec(plan, max_failure, scale),
                                          self.events,
                                          on_join=lambda r: self.inbox.put(reports.Joined(r)))
                try:
                    coordinator.start()
                except CoordinatorError as exc:
                    raise LaunchError(f"{exc} — nothing was started") from None
                if attempt == 0:  # after the bind: a tunnel delivers to the coordinator
                    try:
                        self._open_tunnels(plan)
                    except LaunchError:
                        coordinator.stop()
                        raise
                    self._watch_connections(settings)
                try:
                    result = self._attempt(plan, coordinator, attempts, argv, prebuilt)
                finally:
                    coordinator.stop()
                joined_any = joined_any or bool(coordinator.joined)
                results.append(result)
                if attempts.interrupted or not result.restartable or attempt == max_restarts:
                    break
                self.events(Kind.RESTART, f"cluster launcher: attempt {attempt} failed "
                            f"({result.message.removeprefix('cluster launcher: ')}); "
                            f"restarting every rank (restart {attempt + 1} of {max_restarts})",
                            data={"attempt": attempt + 1, "cause": result.message})
        final = results[-1]
        if final.started_any and self.console.verbosity >= 0:
            self.console.message(summary_table(summary_rows(final.ranks)))
            if len(results) > 1:
                self.console.message(attempts_table(results))
        cause = root_cause_text(final)
        if cause and self.console.verbosity >= 0:
            self.console.message(cause)
        if max_failure is not None and not joined_any and final.started_any:
            self.events(Kind.WARNING, "cluster launcher: max_failure had no effect: no rank "
                        "joined the cohort, so every failure was fatal (ranks join with "
                        "fdl_fabric.rank.join())")
        self.events(Kind.VERDICT, final.message, data={"exit_code": final.exit_code,
                                                        "verdict": final.verdict.value,
                                                        "attempts": len(results)})
        return final.exit_code

    def _connected(self, host: str, settings: SshSettings) -> None:
        self.events(Kind.CONNECT, f"cluster launcher: connected to {host} ({settings.target})",
                    host=host)

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
                raise LaunchError(f"cluster launcher: no device list from {missing} within "
                                  f"{PROBE_TIMEOUT:g}s") from None
            if isinstance(report, reports.Facts):
                if not report.gpus:
                    raise LaunchError(
                        f"cluster launcher: host {report.host!r}: `local_devices: all` found no "
                        f"GPU (nvidia-smi: {report.error or 'listed none'}); give an explicit "
                        "list instead")
                if len(report.gpus) > RANKS_PER_WORKER_MAX:
                    raise LaunchError(
                        f"cluster launcher: host {report.host!r}: `local_devices: all` found "
                        f"{len(report.gpus)} GPUs; at most {RANKS_PER_WORKER_MAX} ranks a host",
                        EXIT_USAGE)
                resolved[report.host] = report.gpus
            elif isinstance(report, reports.AgentGone):
                raise LaunchError(f"cluster launcher: host {report.host!r}: {report.reason}")
            else:
                kept.append(report)
        for report in kept:
            self.inbox.put(report)
        total = sum(len(d) for d in resolved.values()) + sum(
            w.nproc or len(w.local_devices or ()) for w in cluster.workers
            if w.local_devices != "all")
        if total > RANKS_MAX:
            raise LaunchError(f"cluster launcher: {total} ranks in all once `local_devices: all` "
                              f"is resolved; at most {RANKS_MAX} are allowed", EXIT_USAGE)
        return resolved

    def _plan(self, cluster: ClusterSpec, argv: list[str], resolved: Mapping[str, list[int]],
              prebuilt: Mapping[str, PrebuiltBinary], launcher_env: Mapping[str, str], *,
              run_id: Optional[str] = None, attempt: int = 0) -> LaunchPlan:
        """The plan of one attempt: a fresh salt every time, so nothing of an earlier
        attempt can join this one's cohort; the run id stays (TORCHELASTIC_RUN_ID)."""
        try:
            return build_plan(cluster, argv=argv, run_id=run_id or new_run_id(),
                              salt=new_salt(), resolved_devices=resolved, prebuilt=prebuilt,
                              launcher_env=launcher_env, attempt=attempt)
        except ValueError as exc:
            raise LaunchError(f"{cluster.file}: {exc}", EXIT_USAGE) from None

    def _open_tunnels(self, plan: LaunchPlan) -> None:
        port = plan.cluster.controller.port
        # The forward delivers to wherever the coordinator listens.
        target = coordinator_bind_host(plan.cluster)
        for w in plan.cluster.workers:
            if not w.tunnel:
                continue
            conn = self.connections[w.host]
            try:
                self.stack.enter_context(
                    conn.forward_remote(port, local_port=port,  # type: ignore[attr-defined]
                                        local_host=target))
            except Exception as exc:
                raise LaunchError(f"cluster launcher: host {w.host!r}: tunnel could not bind "
                                  f"127.0.0.1:{port} on the remote side: {exc}") from None
            self.events(Kind.CONNECT, f"cluster launcher: tunnel {w.host}:127.0.0.1:{port} -> "
                        f"controller {target}:{port}", host=w.host)

    def _watch_connections(self, settings: Mapping[str, SshSettings]) -> None:
        if not self.connections:
            return
        from .keepalive import KeepaliveMonitor

        def dead(host: str, silent: float) -> None:
            self.events(Kind.WARNING, f"cluster launcher: host {host!r} stopped answering "
                        f"keepalives for {silent:.0f}s; treating its connection as lost",
                        host=host)

        self.monitor = KeepaliveMonitor(dead)
        for host, conn in self.connections.items():
            transport = getattr(conn, "transport", None)
            if transport is not None:
                self.monitor.watch(host, transport, settings[host])

    def _attempt(self, plan: LaunchPlan, coordinator: Coordinator, attempts: Attempts,
                 argv: list[str], prebuilt: Mapping[str, PrebuiltBinary]) -> RunResult:
        """One attempt: every agent gets its spec, the supervisor runs to a verdict."""
        checks = {w.host: launch_plan(plan.cluster, w, argv, prebuilt.get(w.host))
                  for w in plan.cluster.workers}

        def judge_host(host: str, values: Mapping[str, str]) -> tuple[list[str], list[str]]:
            rows = judge(checks[host], values)
            warn = [f"{c.name}: {c.reason}" for c in rows if c.status is Status.WARN]
            fail = [f"{c.name}: FAIL: {c.reason}" for c in rows if c.status is Status.FAIL]
            return warn, fail

        supervisor = Supervisor(plan.ranks, self.sessions, kill_grace=plan.cluster.kill_grace,
                                events=self.events, elastic=coordinator,
                                preflight=judge_host if self.opts.preflight else None,
                                inbox=self.inbox)
        attempts.supervisor = supervisor
        if attempts.interrupted:  # Ctrl-C between attempts
            supervisor.request_interrupt(signal.SIGINT)
        self.console.start_status(lambda: supervisor.ranks)
        try:
            for host in plan.hosts():
                spec = plan.agent_spec(
                    host, checks=agent_checks(checks[host]) if self.opts.preflight else None,
                    start_now=not self.opts.preflight, lease=self.lease)
                self.sessions[host].spec(spec)
            return supervisor.run()
        finally:
            self.console.stop_status()


def plan_warnings(plan: LaunchPlan) -> list[str]:
    """Addresses that cannot work: loopback where a remote worker must dial in."""
    remote = [w for w in plan.cluster.workers if not w.is_local and not w.tunnel
              and not is_loopback(w.addr)]
    if not remote:
        return []
    names = ", ".join(f"{w.host} ({w.addr})" for w in remote)
    warnings = []
    master = plan.ranks[0].env.get("MASTER_ADDR", "")
    if is_loopback(master):
        warnings.append(f"cluster launcher: MASTER_ADDR is {master}, a loopback address, but "
                        f"{names} dial it from another machine: give the first worker an "
                        "`addr:` the others reach")
    host = plan.cluster.controller.host
    if is_loopback(host):
        warnings.append(f"cluster launcher: controller.host is {host}, a loopback address, but "
                        f"{names} dial the coordinator from another machine: set "
                        "controller.host to an address they reach, or tunnel: true")
    return warnings


def is_loopback(address: str) -> bool:
    return address == "localhost" or address == "::1" or address.startswith("127.")


def attempts_table(results: Sequence[RunResult]) -> str:
    """One row per attempt: what ended it."""
    rows = [("attempt", "verdict", "cause")]
    rows += [(str(i), r.verdict.value, r.message.removeprefix("cluster launcher: "))
             for i, r in enumerate(results)]
    width = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"{a.ljust(width[0])}  {v.ljust(width[1])}  {c}".rstrip()
                     for a, v, c in rows)


def root_cause_text(result: RunResult) -> str:
    """The first failed rank, with what its error file says (as torchrun's summary)."""
    rank = result.root_cause
    if rank is None or result.verdict is Verdict.OK or rank.exit is None:
        return ""
    head = f"root cause: {rank.label} ({rank.plan.label}) exited with {rank.exit.describe()}"
    error = rank.exit.error
    if error is None:
        return head + " (no error file: decorate the entry point with torch's @record to " \
            "see the exception here)"
    lines = [f"{head}: {error.message}"]
    lines += ["  " + line for line in error.traceback_tail()]
    return "\n".join(lines)


def make_console(opts: LaunchOptions) -> Console:
    """A live status view on a terminal; plain event lines in CI and pipes."""
    if sys.stdout.isatty() and not opts.dry_run and os.environ.get("TERM") != "dumb":
        return LiveConsole(verbosity=opts.verbosity, show_rank_output=not opts.quiet)
    return Console(verbosity=opts.verbosity, show_rank_output=not opts.quiet)


def launch(opts: LaunchOptions, *, console: Optional[Console] = None) -> int:
    """Run one launch and return its exit code (0 ok, 1 failure, 2 config, 130/143)."""
    console = console or make_console(opts)
    if opts.verbosity >= 3:
        import logging

        # -vv: paramiko's own transport log (negotiation, auth, channels).
        logging.basicConfig(stream=sys.stderr, format="ssh: %(name)s: %(message)s")
        logging.getLogger("paramiko").setLevel(logging.INFO)
    events = EventBus(console)
    if opts.verbosity >= 2:
        opts.env_overrides.setdefault(ENV_VERBOSITY, str(opts.verbosity))
    return Launch(opts, console, events).run()


__all__ = ["EXIT_FAILURE", "LaunchError", "LaunchOptions", "launch"]
