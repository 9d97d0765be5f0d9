"""Running the full pre-flight (``inv prebuild-check``): every host in parallel, one report.

Each host is asked twice through its transport (`fdl_fabric.transport`), each thing once:
the transport's probe measures what only it can (how the host was reached, the shell's
start-up, the clock's line against a round trip, the Python an agent would start under:
`probe.probe_script`), then the host's agent gathers every fact of the host, as before a
launch (`agents.ask_agent`). The controller answers the port check itself, on the
coordinator's port (`agents.ProbeListener`).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from ..agent import checks, procs
from ..clusterfile import ClusterSpec, WorkerSpec
from ..planning.envelope import ENV_PREBUILD, EnvelopeError, PrebuiltBinary, parse_prebuilt
from ..planning.plan import controller_dial_host, coordinator_bind_host, interpreted_argv
from ..supervision.coordinator import bind_listener
from ..transport import HostSettings, Transport, for_cluster, resolve_settings
from ..transport.fanout import close_all
from .agents import LiveAgent, ProbeListener, ask_agent
from .facts import ControllerFacts, HostFacts
from .fleetcheck import dismiss_all, prebuild_fleet
from .probe import (
    BIND_ALL,
    SENTINEL,
    Dial,
    HostPlan,
    parse_sentinels,
    probe_script,
    settings_of,
)
from .report import CONTROLLER, Check, Report, Status
from .verdicts import ONLY_BY_HAND, evaluate

#: Seconds the whole host script may take (nvidia-smi can hang on a broken driver).
PROBE_TIMEOUT = 60.0

_ROW_ORDER = ("command", "prebuild", "ssh", "slurm", "probe", "shell", "paths", "program",
              "platform", "stacks", "gpus", "gpu_health", "data_path", "clock", "port",
              "master", "nic", "reach", "smoke")




def port_owner(port: int) -> str:
    """Who listens on ``port`` here, for the refusal: one of this user's own live runs
    (its run id, from the registry), another process of this user (pid and name), or
    another user's process (whose pid a non-root user cannot see). Best effort."""
    try:
        import psutil

        for conn in psutil.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                return _listener(conn.pid)
    except Exception:
        pass
    return "another process"


def _listener(pid: Optional[int]) -> str:
    import psutil

    if pid is None:
        return "a process of another user"
    try:
        proc = psutil.Process(pid)
        name, uid, argv = proc.name(), proc.uids().real, " ".join(proc.cmdline())
        since = time.strftime("%H:%M:%S", time.localtime(proc.create_time()))
    except psutil.Error:
        return f"pid {pid}"
    if uid != os.getuid():
        return f"pid {pid} ({name}) of another user"
    runs = _own_runs_of(pid)
    if runs:
        return f"your own live run {', '.join(runs)} (launcher pid {pid}, since {since})"
    if "fdl-fabric" in argv or "fdl_fabric" in argv or " launch" in argv:
        return f"pid {pid} ({name}), one of your own fdl-fabric launches (since {since})"
    return f"pid {pid} ({name}), one of your own processes, not an fdl-fabric launch"


def _own_runs_of(pid: int) -> list[str]:
    """The run ids of this user's recorded live runs whose launcher is ``pid`` here."""
    try:
        records, _ = procs.read_records()
    except OSError:
        return []
    return sorted({str(r["run"]) for r in records if procs.record_live(r)
                   and isinstance(r.get("launcher"), dict) and r["launcher"].get("pid") == pid})


def _open_listener(cluster: ClusterSpec, salt: bytes) -> tuple[Check, Optional[ProbeListener]]:
    """Check that the coordinator port is free and keep it open for the workers to dial."""
    host = coordinator_bind_host(cluster)
    port = cluster.controller.port
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        return (Check(CONTROLLER, "port", Status.OK, f"{address} is free (the coordinator "
                      "binds it)"), ProbeListener(bind_listener(host, port), salt))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            row = Check(CONTROLLER, "port", Status.FAIL,
                        f"{address} is in use by {port_owner(port)}: the coordinator cannot "
                        "bind it (pick another controller.port, or stop that process)")
        elif exc.errno == errno.EADDRNOTAVAIL:
            return (Check(CONTROLLER, "port", Status.FAIL,
                          f"controller.host {host} is not an address of this machine, so the "
                          "coordinator cannot listen on it"), None)
        else:
            row = Check(CONTROLLER, "port", Status.FAIL, f"cannot bind {address}: {exc}")
    try:  # a stand-in port still tests routes and firewalls from every worker
        return row, ProbeListener(bind_listener(host, 0), salt)
    except OSError:
        return row, None


def _check_host(plan: HostPlan, transport: Transport, ctl: ControllerFacts,
                salt: bytes, keep: Optional[dict[str, LiveAgent]] = None) -> list[Check]:
    """One host's checks: the probe, then the host's agent, then the verdicts. How the
    host was reached (an SSH connection, an srun step) is a row of its own, named after
    the transport; nothing more is checked where that failed, and the agent is not asked
    where the probe's script did not finish (that is the host's one row)."""
    result = transport.probe(probe_script(plan), timed=not plan.fast,
                             timeout=PROBE_TIMEOUT, clock_marker=f"{SENTINEL} clock=")
    reach = []
    if result.reach is not None:
        status = {"ok": Status.OK, "warn": Status.WARN}.get(result.reach_status, Status.FAIL)
        reach = [Check(plan.host, transport.kind, status, result.reach)]
        if status is Status.FAIL:
            return reach
    measured = parse_sentinels(result.out)
    facts = HostFacts(values=measured, shell_ms=result.shell_ms,
                      exit_status=result.exit_status, stderr=result.err,
                      probe_ms=result.probe_ms)
    if measured.get("end") == "1":
        answer = ask_agent(plan, transport, salt, keep)
        facts.values = {**answer.values, **measured}
        facts.agent_error, facts.tunnel_error = answer.error, answer.tunnel_error
    if result.clock_at is not None:
        facts.clock_ref = result.clock_at - result.rtt / 2
        facts.clock_error = result.rtt / 2
    return [*reach, *evaluate(plan, facts, ctl)]


def _guarded(host: str, fn: Callable[..., list[Check]], *args: Any) -> list[Check]:
    """Run one host's checks; a crash becomes that host's FAIL row, never the whole report's."""
    try:
        return fn(*args)
    except Exception as exc:
        return [Check(host, "probe", Status.FAIL, f"check crashed: {type(exc).__name__}: {exc}")]


def _controller_facts(cluster: ClusterSpec, fast: bool) -> ControllerFacts:
    """The controller's own platform and loopback identity (what hosts are compared with),
    gathered by the agents' own functions, so both sides are measured alike."""
    platform = checks.platform_facts() if not fast else {}
    return ControllerFacts(arch=platform.get("arch", ""), libc=platform.get("libc", ""),
                           identity=checks.loopback_identity(),
                           bind_host=coordinator_bind_host(cluster),
                           port=cluster.controller.port)


def _prebuilt_rows(cluster: ClusterSpec,
                   environ: Mapping[str, str]) -> tuple[list[Check], dict[str, PrebuiltBinary]]:
    raw = environ.get(ENV_PREBUILD)
    if raw is None or not raw.strip():
        return [], {}
    try:
        entries = parse_prebuilt(raw)
    except EnvelopeError as exc:
        return [Check(CONTROLLER, "prebuild", Status.FAIL, str(exc))], {}
    hosts = {w.host for w in cluster.workers}
    unknown = sorted(set(entries) - hosts)
    if unknown:
        row = Check(CONTROLLER, "prebuild", Status.FAIL,
                    f"{ENV_PREBUILD} names host(s) not in {cluster.file}: {', '.join(unknown)}")
    else:
        row = Check(CONTROLLER, "prebuild", Status.OK,
                    f"{ENV_PREBUILD}: {len(entries)} prebuilt binary(ies) for "
                    f"{', '.join(sorted(entries)) or 'no host'}")
    return [row], {h: e for h, e in entries.items() if h in hosts}


def run_checks(
    cluster: ClusterSpec,
    *,
    argv: Sequence[str],
    fast: bool = False,
    smoke: bool = False,
    settings: Optional[HostSettings] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> Report:
    """Check every host of ``cluster`` in parallel and return the report.

    ``argv`` is the rank command (its first word is resolved on every host);
    ``fast`` keeps only what ``inv launch`` checks before spawning (ssh, paths,
    program, port); ``settings`` defaults to what a launch would use; ``environ``
    (default os.environ) supplies FLODL_INTERNAL_PREBUILD_PER_HOST; ``smoke`` adds the
    collective smoke test to the fleet check (`fleetcheck`: host-to-host reachability
    and the interfaces, run unless ``fast``). Every host is
    reached through its transport (an SSH connection, an srun step, this machine); an
    unreachable host FAILs its own row, every other host is still checked.
    """
    started = time.monotonic()
    env = os.environ if environ is None else environ
    if settings is None:
        settings = resolve_settings(cluster)
    rows: list[Check] = []
    if not argv:
        rows.append(Check(CONTROLLER, "command", Status.FAIL,
                          "no command to check: set `command:` in the cluster file or pass --cmd"))
    prebuild_rows, prebuilt = _prebuilt_rows(cluster, env)
    rows += prebuild_rows
    salt = secrets.token_bytes(16)
    port_row, listener = _open_listener(cluster, salt)
    rows.append(port_row)
    transports = for_cluster(cluster, settings, purpose="cleanup")
    kept: Optional[dict[str, LiveAgent]] = None if fast else {}
    try:
        ctl = _controller_facts(cluster, fast)
        plans = [_host_plan(cluster, w, argv, fast, prebuilt, ctl, listener, salt, smoke)
                 for w in cluster.workers]
        with ThreadPoolExecutor(max_workers=max(1, min(32, len(plans)))) as pool:
            futures = [pool.submit(_guarded, p.host, _host_job(p, ctl), p,
                                   transports[p.host], ctl, salt, kept) for p in plans]
            for fut in futures:
                rows += fut.result()
            if kept:
                rows += prebuild_fleet(cluster, argv, prebuilt, kept, smoke=smoke)
    finally:
        if kept:
            dismiss_all(kept.values())
        close_all(transports.values())
        if listener is not None:
            listener.close()
    return Report(_ordered(rows), elapsed=time.monotonic() - started)


def _host_plan(cluster: ClusterSpec, w: WorkerSpec, argv: Sequence[str], fast: bool,
               prebuilt: Mapping[str, PrebuiltBinary], ctl: ControllerFacts,
               listener: Optional[ProbeListener], salt: bytes, smoke: bool = False) -> HostPlan:
    """What to check on one worker; its dial only where a listener answers."""
    dial = None
    if listener is not None:
        dial = Dial(host="127.0.0.1" if w.tunnel else controller_dial_host(cluster, w),
                    port=cluster.controller.port if w.tunnel else listener.port,
                    token=salt.hex(), tunnel=w.tunnel, listen_host=ctl.bind_host,
                    listen_port=listener.port, configured_port=cluster.controller.port)
    return HostPlan(worker=w, fast=fast, argv=interpreted_argv(cluster, w, argv),
                    prebuilt=prebuilt.get(w.host), dial=dial, smoke=smoke,
                    path_env=w.env.get("PATH", cluster.env.get("PATH")),
                    python_path=w.env.get("PYTHONPATH", cluster.env.get("PYTHONPATH")),
                    ifnames=settings_of(cluster, w))


def _host_job(plan: HostPlan, ctl: ControllerFacts) -> Callable[..., list[Check]]:
    """A tunneled worker whose coordinator binds a non-loopback address cannot work: it
    is checked without its dial (`_tunnel_mismatch`); every other host as it is."""
    if plan.dial is not None and plan.dial.tunnel \
            and ctl.bind_host not in ("127.0.0.1", *BIND_ALL):
        return _tunnel_mismatch
    return _check_host


def _tunnel_mismatch(plan: HostPlan, transport: Transport, ctl: ControllerFacts,
                     salt: bytes, keep: Optional[dict[str, LiveAgent]] = None) -> list[Check]:
    """A tunneled worker in a cluster whose coordinator binds a non-loopback address.

    The launcher's remote forward delivers to 127.0.0.1:<port> on the controller, where
    nothing listens when the coordinator binds ``controller.host`` (some workers dial it
    directly). Reported without opening the forward.
    """
    assert plan.dial is not None
    rows = _check_host(dataclasses.replace(plan, dial=None), transport, ctl, salt, keep)
    if any(r.name == transport.kind and r.status is Status.FAIL for r in rows):
        return rows
    rows.append(Check(plan.host, "port", Status.WARN,
                      f"tunnel: true, but the coordinator binds {ctl.bind_host}:{ctl.port} "
                      "(other workers dial it directly) while the tunnel delivers to "
                      f"127.0.0.1:{ctl.port} there: tunnel every remote worker, or "
                      f"none{ONLY_BY_HAND}"))
    return rows


def _ordered(rows: list[Check]) -> list[Check]:
    """Controller rows first, then hosts in roster order, checks in a fixed order."""
    hosts: list[str] = [CONTROLLER]
    for r in rows:
        if r.host not in hosts:
            hosts.append(r.host)
    rank = {name: i for i, name in enumerate(_ROW_ORDER)}
    return sorted(rows, key=lambda r: (hosts.index(r.host), rank.get(r.name, len(rank))))
