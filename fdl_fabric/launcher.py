"""One launch, start to verdict: the sequence behind ``inv launch``.

1. Load and validate cluster.yml and the SSH options (a config error exits 2
   before anything connects).
2. Connect every remote host in parallel, with our host-key policy.
3. Resolve ``local_devices: all`` and build the plan (ranks in roster order).
4. Open tunnels, start every rank (local through invoke, remote through one
   Fabric session each), and hand them to the supervisor.
5. Print the verdict as the last line and exit with its code.

Any failure after the first rank started goes through the supervisor, so
every started rank is stopped the same way, whatever went wrong.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Optional

from . import commands
from .cleanup import sweep_args, sweep_hosts
from .config import (
    ClusterSpec,
    ConfigError,
    load_cluster,
    parse_max_failure,
    this_host_name,
)
from .coordinator import Coordinator, CoordinatorError, CoordinatorSpec
from .dryrun import describe_dry_run, dry_run_devices, plan_as_json
from .envelope import (
    ENV_NET_TIMEOUT_SCALE,
    ENV_VERBOSITY,
    EnvelopeError,
    new_run_id,
    new_salt,
    prebuild_from_environ,
)
from .events import Event, EventBus, Kind
from .output import Console, LiveConsole, RankRow, RunLog, summary_table
from .plan import LaunchPlan, build_plan, cluster_key
from .spawn import (
    HostSessions,
    RankProcess,
    fabric_config,
    local_context,
    start_local,
    start_remote,
)
from .ssh import (
    KeepaliveMonitor,
    SshConnectError,
    SshSettings,
    open_connection,
    resolve_all_settings,
)
from .supervisor import (
    RankState,
    RunResult,
    SupervisedRank,
    Supervisor,
    Verdict,
    summary_rows,
)

EXIT_CONFIG = 2
EXIT_FAILURE = 1


@dataclass
class LaunchOptions:
    cluster_file: str = "cluster.yml"
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


class LaunchError(Exception):
    """A failure that ends the launch with a message and an exit code."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def command_argv(opts: LaunchOptions, cluster: ClusterSpec) -> list[str]:
    """The rank program's argv: ``--`` words, else ``--cmd``, else cluster.yml."""
    if opts.argv:
        return list(opts.argv)
    text = opts.command if opts.command is not None else cluster.command
    if not text:
        raise LaunchError(
            f"{cluster.file}: no command to run: set `command:` in the file, or pass "
            "--cmd \"...\" or `-- prog args`", EXIT_CONFIG)
    try:
        return commands.split_command(text)
    except ValueError as exc:
        raise LaunchError(f"{cluster.file}: command: {exc}", EXIT_CONFIG) from None


def net_timeout_scale(environ: Mapping[str, str]) -> float:
    """FLODL_NET_TIMEOUT_SCALE: a finite float >= 0.1 multiplying every network deadline."""
    raw = environ.get(ENV_NET_TIMEOUT_SCALE, "").strip() or "1"
    try:
        scale = float(raw)
    except ValueError:
        scale = float("nan")
    if not math.isfinite(scale) or scale < 0.1:
        raise LaunchError(f"{ENV_NET_TIMEOUT_SCALE}={raw!r} must be a number >= 0.1",
                          EXIT_CONFIG)
    return scale


def coordinator_spec(plan: LaunchPlan, opts: LaunchOptions, scale: float) -> CoordinatorSpec:
    """The coordinator for this plan: loopback when no worker dials it over the network."""
    cluster = plan.cluster
    max_failure = cluster.elastic.max_failure
    if opts.max_failure is not None:
        try:
            max_failure = parse_max_failure(opts.max_failure)
        except ValueError as exc:
            raise LaunchError(f"--max-failure: {exc}", EXIT_CONFIG) from None
    return CoordinatorSpec(
        run_id=plan.run_id,
        salt=plan.salt,
        world_size=plan.world_size,
        bind_host="127.0.0.1" if plan.bind_loopback else cluster.controller.host,
        port=cluster.controller.port,
        formation_timeout=cluster.elastic.formation_timeout * scale,
        heartbeat_timeout=cluster.elastic.heartbeat_timeout * scale,
        max_failure=max_failure,
        hello_timeout=10.0 * scale,
    )


def ssh_settings(cluster: ClusterSpec, console: Console) -> dict[str, SshSettings]:
    """Resolve every remote worker's SSH settings; a bad option is a config error."""
    return resolve_all_settings(cluster, console.message)


def connect_all(
    settings: dict[str, SshSettings], config: Any, events: EventBus
) -> dict[str, HostSessions]:
    """Connect to every remote host at once; fail naming each host that failed."""
    if not settings:
        return {}
    opened: dict[str, HostSessions] = {}
    errors: list[str] = []
    with ThreadPoolExecutor(max_workers=min(32, len(settings))) as pool:
        futures = {host: pool.submit(open_connection, s, config) for host, s in settings.items()}
        for host, fut in futures.items():
            try:
                conn = fut.result()
            except SshConnectError as exc:
                errors.append(f"cluster launcher: cannot connect to {exc}")
                continue
            opened[host] = HostSessions(settings[host], config, conn)
            events(Kind.CONNECT, f"cluster launcher: connected to {host} "
                   f"({settings[host].target})", host=host)
    if errors:
        for sessions in opened.values():
            sessions.close()
        raise LaunchError("\n".join(errors))
    return opened


def resolve_all_devices(
    cluster: ClusterSpec, sessions: dict[str, HostSessions]
) -> dict[str, list[int]]:
    """GPU indices of every ``local_devices: all`` worker, via nvidia-smi."""
    query = "nvidia-smi --query-gpu=index --format=csv,noheader"
    resolved: dict[str, list[int]] = {}
    for w in cluster.workers:
        if w.local_devices != "all":
            continue
        if w.is_local:
            proc = subprocess.run(query.split(), capture_output=True, text=True, check=False)
            out, ok = proc.stdout, proc.returncode == 0
        else:
            res = sessions[w.host].connections[0].run(query, hide=True, warn=True, pty=False)
            out, ok = res.stdout, res.ok
        indices = [int(x) for x in out.split() if x.strip().isdigit()]
        if not ok or not indices:
            raise LaunchError(
                f"cluster launcher: host {w.host!r}: `local_devices: all` found no GPU "
                "(nvidia-smi failed or listed none); give an explicit list instead")
        resolved[w.host] = indices
    return resolved


@contextlib.contextmanager
def signal_handlers(supervisor: Supervisor, console: Console) -> Iterator[None]:
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
        self.sessions: dict[str, HostSessions] = {}
        self.stack = contextlib.ExitStack()
        self.monitor: Optional[KeepaliveMonitor] = None
        self.log: Optional[RunLog] = None

    def run(self) -> int:
        try:
            return self._run()
        except ConfigError as exc:
            self.console.message(str(exc))
            return EXIT_CONFIG
        except LaunchError as exc:
            self.console.message(str(exc))
            return exc.exit_code
        finally:
            self.stack.close()
            if self.monitor is not None:
                self.monitor.close()
            for s in self.sessions.values():
                s.close()

    def _run(self) -> int:
        opts = self.opts
        cluster = load_cluster(opts.cluster_file)
        if opts.kill_grace is not None:
            cluster = _with_kill_grace(cluster, opts.kill_grace)
        argv = command_argv(opts, cluster)
        settings = ssh_settings(cluster, self.console)
        try:
            prebuild = prebuild_from_environ()
        except EnvelopeError as exc:
            raise LaunchError(str(exc), EXIT_CONFIG) from None
        launcher_env = dict(os.environ)
        launcher_env.update(opts.env_overrides)
        scale = net_timeout_scale(launcher_env)

        if opts.dry_run:
            plan = self._plan(cluster, argv, dry_run_devices(cluster), prebuild, launcher_env)
            self.console.out.write(describe_dry_run(plan))
            self.console.out.flush()
            return 0

        config = fabric_config()
        if opts.preflight:
            self._preflight(cluster, argv, settings, config)
        self.sessions = connect_all(settings, config, self.events)
        resolved = resolve_all_devices(cluster, self.sessions)
        plan = self._plan(cluster, argv, resolved, prebuild, launcher_env)
        if opts.log_dir:
            self.log = RunLog(opts.log_dir, plan.run_id)
            self.stack.callback(self.log.close)
            self.events.add(self.log)
            self.log.write_cluster(plan_as_json(plan))
        self.events(Kind.LAUNCH, describe_plan(plan), data={"run_id": plan.run_id,
                                                            "world_size": plan.world_size})
        coordinator = Coordinator(coordinator_spec(plan, opts, scale), self.events)
        self._sweep(plan, before=True)
        try:
            coordinator.start()
        except CoordinatorError as exc:
            raise LaunchError(f"{exc} — nothing was started") from None
        self.stack.callback(coordinator.stop)
        self._open_tunnels(plan)
        self._watch_connections(settings)
        try:
            return self._spawn_and_supervise(plan, coordinator).exit_code
        finally:
            self._sweep(plan, before=False)

    def _preflight(self, cluster: ClusterSpec, argv: list[str],
                   settings: dict[str, SshSettings], config: Any) -> None:
        """The fast pre-flight (ssh, paths, program, port) on every host, in parallel.

        Each of these would otherwise fail the launch after some ranks started, with
        the cause buried in rank output; here nothing has started yet.
        """
        from .preflight import Status, run_checks

        report = run_checks(cluster, argv=argv, fast=True, settings=settings, config=config)
        for check in report.checks:
            if check.status is Status.WARN:
                self.events(Kind.WARNING, f"cluster launcher: pre-flight: {check.host}: "
                            f"{check.name}: {check.reason}", host=check.host)
        failed = report.failed()
        if failed:
            lines = [f"cluster launcher: pre-flight: {c.host}: {c.name}: FAIL: {c.reason}"
                     for c in failed]
            lines.append("cluster launcher: pre-flight failed, nothing was started "
                         "(`inv prebuild-check` checks more; --no-preflight skips this)")
            raise LaunchError("\n".join(lines))
        self.events(Kind.DEBUG, f"cluster launcher: pre-flight passed "
                    f"({len(report.checks)} checks in {report.elapsed:.2f} s)")

    def _plan(self, cluster: ClusterSpec, argv: list[str], resolved: dict[str, list[int]],
              prebuild: Any, launcher_env: dict[str, str]) -> LaunchPlan:
        try:
            return build_plan(cluster, argv=argv, run_id=new_run_id(), salt=new_salt(),
                              resolved_devices=resolved, prebuild=prebuild,
                              launcher_env=launcher_env)
        except ValueError as exc:
            raise LaunchError(f"{cluster.file}: {exc}", EXIT_CONFIG) from None

    def _sweep(self, plan: LaunchPlan, *, before: bool) -> None:
        """Stop leftovers: of earlier runs of this cluster before, of this run after."""
        local = [this_host_name()] if any(w.is_local for w in plan.cluster.workers) else []
        remote = {h: s.connections[0] for h, s in self.sessions.items()
                  if s.connections[0].is_connected}
        args = (sweep_args(cluster=cluster_key(plan.cluster)) if before
                else sweep_args(runs=[plan.run_id]))
        for report in sweep_hosts(local, remote, args):
            if report.error:
                self.events(Kind.WARNING, f"cluster launcher: cleanup on {report.host} failed: "
                            f"{report.error}", host=report.host)
            elif report.stopped:
                what = "leftovers of earlier runs of this cluster" if before else \
                    "leftovers of this run"
                self.events(Kind.WARNING, f"cluster launcher: stopped {what} on "
                            f"{report.summary()}", host=report.host)
            if report.leftovers:
                self.events(Kind.WARNING, f"cluster launcher: could not stop on {report.host}: "
                            f"{report.leftovers}", host=report.host)

    def _open_tunnels(self, plan: LaunchPlan) -> None:
        port = plan.cluster.controller.port
        # The forward delivers to wherever the coordinator listens.
        target = "127.0.0.1" if plan.bind_loopback else plan.cluster.controller.host
        for w in plan.cluster.workers:
            if not w.tunnel:
                continue
            conn = self.sessions[w.host].connections[0]
            try:
                self.stack.enter_context(
                    conn.forward_remote(port, local_port=port, local_host=target))
            except Exception as exc:
                raise LaunchError(f"cluster launcher: host {w.host!r}: tunnel could not bind "
                                  f"127.0.0.1:{port} on the remote side: {exc}") from None
            self.events(Kind.CONNECT, f"cluster launcher: tunnel {w.host}:127.0.0.1:{port} -> "
                        f"controller {target}:{port}", host=w.host)

    def _watch_connections(self, settings: dict[str, SshSettings]) -> None:
        def dead(host: str, silent: float) -> None:
            self.events(Kind.WARNING, f"cluster launcher: host {host!r} stopped answering "
                        f"keepalives for {silent:.0f}s; treating its connection as lost",
                        host=host)

        self.monitor = KeepaliveMonitor(dead)
        for host, sessions in self.sessions.items():
            transport = sessions.connections[0].transport
            if transport is not None:
                self.monitor.watch(host, transport, settings[host])

    def _spawn_and_supervise(self, plan: LaunchPlan, coordinator: Coordinator) -> RunResult:
        ctx = local_context()
        procs = [RankProcess(r, plan.run_id, plan.cluster.kill_grace) for r in plan.ranks]
        supervised = [SupervisedRank(p.plan.rank, p.plan.host, p, state=RankState.STARTING)
                      for p in procs]
        for p, s in zip(procs, supervised):
            p.on_pid(functools.partial(_mark_running, s))
        by_rank = {s.rank: s for s in supervised}
        self.events.add(_JoinTracker(by_rank))
        supervisor = Supervisor([], kill_grace=plan.cluster.kill_grace, events=self.events,
                                elastic=coordinator)

        def rows() -> list[RankRow]:
            return [RankRow(p.plan.host, p.plan.rank,
                            "cpu" if p.plan.device is None else str(p.plan.device), p.pid,
                            s.state.value, s.started, s.ended, p.last_line)
                    for p, s in zip(procs, supervised)]

        self.console.start_status(rows)
        try:
            # Handlers first: a Ctrl-C while ranks are still starting must stop
            # the ones already started, like any other stop.
            with signal_handlers(supervisor, self.console):
                spawn_error = self._spawn(plan, procs, ctx)
                supervisor.ranks = [s for p, s in zip(procs, supervised)
                                    if p.promise is not None]
                if spawn_error:
                    supervisor.request_abort(spawn_error)
                result = supervisor.run()
        finally:
            self.console.stop_status()
        if spawn_error and result.verdict is Verdict.FAILED:
            result = RunResult(result.verdict, result.exit_code, spawn_error, result.ranks)
        if result.ranks and self.console.verbosity >= 0:
            self.console.message(summary_table(summary_rows(result.ranks)))
        self.events(Kind.VERDICT, result.message, data={"exit_code": result.exit_code,
                                                         "verdict": result.verdict.value})
        return result

    def _spawn(self, plan: LaunchPlan, procs: list[RankProcess], ctx: Any) -> Optional[str]:
        """Start every rank; on the first failure, stop starting and report it."""
        failure: list[str] = []
        lock = threading.Lock()

        def start_host(host: str, ranks: list[RankProcess]) -> None:
            for p in ranks:
                with lock:
                    if failure:
                        return
                try:
                    if p.plan.worker.is_local:
                        start_local(p, plan, self.console, ctx, self.log)
                    else:
                        start_remote(p, plan, self.console, self.sessions[host], self.log)
                    self.events(Kind.SPAWN, f"cluster launcher: started {p.plan.label}",
                                host=host, rank=p.plan.rank)
                except Exception as exc:
                    with lock:
                        failure.append(f"cluster launcher: host {host!r}: could not start rank "
                                       f"{p.plan.rank}: {type(exc).__name__}: {exc}")
                    return

        by_host: dict[str, list[RankProcess]] = {}
        for p in procs:
            by_host.setdefault(p.plan.host, []).append(p)
        with ThreadPoolExecutor(max_workers=min(32, len(by_host))) as pool:
            for fut in [pool.submit(start_host, h, rs) for h, rs in by_host.items()]:
                fut.result()
        return failure[0] if failure else None


def _mark_running(s: SupervisedRank, pid: int) -> None:
    if s.state is RankState.STARTING:
        s.state = RankState.RUNNING


class _JoinTracker:
    """Moves a rank to JOINED when the coordinator reports its hello."""

    def __init__(self, ranks: dict[int, SupervisedRank]) -> None:
        self.ranks = ranks

    def emit(self, event: Event) -> None:
        if event.kind is Kind.JOIN and event.rank in self.ranks:
            s = self.ranks[event.rank]
            if s.state in (RankState.STARTING, RankState.RUNNING):
                s.state = RankState.JOINED


def _with_kill_grace(cluster: ClusterSpec, grace: float) -> ClusterSpec:
    import dataclasses

    return dataclasses.replace(cluster, kill_grace=grace)


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


__all__ = ["LaunchOptions", "launch"]
