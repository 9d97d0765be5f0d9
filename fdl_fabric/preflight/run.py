"""Running the full pre-flight (``inv prebuild-check``): every host in parallel, one report.

Each host runs one script through its transport (`fdl_fabric.transport`): an SSH host
gets one connection and one script run, plus a ``true`` and a keepalive round trip that
time the shell and the clock; this machine runs it with bash; a Slurm node in an srun
step. The controller answers the port check itself, on the coordinator's port.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import secrets
import select
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from ..agent import procs
from ..clusterfile import ClusterSpec
from ..planning.envelope import ENV_PREBUILD, EnvelopeError, PrebuiltBinary, parse_prebuilt
from ..planning.plan import controller_dial_host, coordinator_bind_host, interpreted_argv
from ..supervision.coordinator import bind_listener
from ..transport import Transport, for_cluster
from ..transport.sshconfig import SshSettings, resolve_all_settings
from .probe import SENTINEL, Dial, HostPlan, parse_sentinels, probe_script
from .report import CONTROLLER, Check, Report, Status
from .verdicts import BIND_ALL, ControllerFacts, HostFacts, evaluate

#: Seconds the whole host script may take (nvidia-smi can hang on a broken driver).
PROBE_TIMEOUT = 60.0

_ROW_ORDER = ("command", "prebuild", "ssh", "slurm", "probe", "shell", "paths", "program",
              "platform", "stacks", "gpus", "data_path", "clock", "port")




class _TokenListener:
    """The controller end of the port check: answer every connection with the token."""

    def __init__(self, sock: socket.socket, token: str) -> None:
        self.sock = sock
        self.token = token
        self.port = int(sock.getsockname()[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fdl-preflight-port",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        line = f"fdl-preflight {self.token}\n".encode()
        while not self._stop.is_set():
            ready, _, _ = select.select([self.sock], [], [], 0.1)
            if not ready:
                continue
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with contextlib.suppress(OSError), conn:
                conn.settimeout(1.0)
                conn.sendall(line)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self.sock.close()


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


def _open_listener(cluster: ClusterSpec, token: str) -> tuple[Check, Optional[_TokenListener]]:
    """Check that the coordinator port is free and keep it open for the workers to dial."""
    host = coordinator_bind_host(cluster)
    port = cluster.controller.port
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        return (Check(CONTROLLER, "port", Status.OK, f"{address} is free (the coordinator "
                      "binds it)"), _TokenListener(bind_listener(host, port), token))
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
        return row, _TokenListener(bind_listener(host, 0), token)
    except OSError:
        return row, None


def _check_host(plan: HostPlan, transport: Transport, ctl: ControllerFacts) -> list[Check]:
    """One host's checks: the script run through its transport, then the verdicts. How
    the host was reached (an SSH connection, an srun step) is a row of its own, named
    after the transport; nothing more is checked where that failed."""
    dial = plan.dial
    tunnel = (dial.configured_port, dial.listen_port) if dial is not None and dial.tunnel \
        else None
    result = transport.probe(probe_script(plan), timed=not plan.fast, tunnel=tunnel,
                             timeout=PROBE_TIMEOUT, clock_marker=f"{SENTINEL} clock=")
    reach = []
    if result.reach is not None:
        status = {"ok": Status.OK, "warn": Status.WARN}.get(result.reach_status, Status.FAIL)
        reach = [Check(plan.host, transport.kind, status, result.reach)]
        if status is Status.FAIL:
            return reach
    if result.tunnel_error is not None:
        plan = _without_dial_run(plan)
    facts = HostFacts(values=parse_sentinels(result.out), shell_ms=result.shell_ms,
                      exit_status=result.exit_status, stderr=result.err,
                      probe_ms=result.probe_ms, tunnel_error=result.tunnel_error)
    if result.clock_at is not None:
        facts.clock_ref = result.clock_at - result.rtt / 2
        facts.clock_error = result.rtt / 2
    return [*reach, *evaluate(plan, facts, ctl)]


def _without_dial_run(plan: HostPlan) -> HostPlan:
    """After a failed tunnel there is nothing to dial; keep asking for the netns identity."""
    assert plan.dial is not None
    return dataclasses.replace(plan, dial=dataclasses.replace(plan.dial, host="", port=0))


def _guarded(host: str, fn: Callable[..., list[Check]], *args: Any) -> list[Check]:
    """Run one host's checks; a crash becomes that host's FAIL row, never the whole report's."""
    try:
        return fn(*args)
    except Exception as exc:
        return [Check(host, "probe", Status.FAIL, f"check crashed: {type(exc).__name__}: {exc}")]


def _controller_facts(cluster: ClusterSpec, fast: bool) -> ControllerFacts:
    """The controller's own platform and loopback identity (what hosts are compared with)."""
    arch = libc = ""
    if not fast:
        out = subprocess.run(
            ["sh", "-c", "uname -m; ldd --version 2>&1 | head -n 1"], capture_output=True,
            text=True, errors="replace", stdin=subprocess.DEVNULL, check=False).stdout
        lines = out.splitlines() + ["", ""]
        arch, libc = lines[0].strip(), lines[1].strip()
    identity = ""
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            boot = fh.read().strip()
        identity = f"{os.readlink('/proc/self/ns/net')} {boot}"
    host = coordinator_bind_host(cluster)
    return ControllerFacts(arch=arch, libc=libc, identity=identity, bind_host=host,
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
    settings: Optional[dict[str, SshSettings]] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> Report:
    """Check every host of ``cluster`` in parallel and return the report.

    ``argv`` is the rank command (its first word is resolved on every host);
    ``fast`` keeps only what ``inv launch`` checks before spawning (ssh, paths,
    program, port); ``settings`` defaults to what a launch would use; ``environ``
    (default os.environ) supplies FLODL_INTERNAL_PREBUILD_PER_HOST. Every host is
    reached through its transport (an SSH connection, an srun step, this machine); an
    unreachable host FAILs its own row, every other host is still checked.
    """
    started = time.monotonic()
    env = os.environ if environ is None else environ
    if settings is None:
        settings = resolve_all_settings(cluster)
    rows: list[Check] = []
    if not argv:
        rows.append(Check(CONTROLLER, "command", Status.FAIL,
                          "no command to check: set `command:` in the cluster file or pass --cmd"))
    prebuild_rows, prebuilt = _prebuilt_rows(cluster, env)
    rows += prebuild_rows
    token = secrets.token_hex(8)
    port_row, listener = _open_listener(cluster, token)
    rows.append(port_row)
    transports = for_cluster(cluster, settings, purpose="cleanup")
    try:
        ctl = _controller_facts(cluster, fast)
        jobs: list[tuple[str, Callable[..., list[Check]], tuple[Any, ...]]] = []
        for w in cluster.workers:
            dial = None
            if listener is not None:
                dial = Dial(
                    host="127.0.0.1" if w.tunnel else controller_dial_host(cluster, w),
                    port=cluster.controller.port if w.tunnel else listener.port,
                    token=token, tunnel=w.tunnel, listen_host=ctl.bind_host,
                    listen_port=listener.port, configured_port=cluster.controller.port)
            path_env = w.env.get("PATH", cluster.env.get("PATH"))
            plan = HostPlan(worker=w, fast=fast, argv=interpreted_argv(cluster, w, argv),
                            prebuilt=prebuilt.get(w.host),
                            dial=dial, path_env=path_env)
            if w.tunnel and dial is not None and ctl.bind_host not in ("127.0.0.1", *BIND_ALL):
                jobs.append((w.host, _tunnel_mismatch, (plan, transports[w.host], ctl)))
            else:
                jobs.append((w.host, _check_host, (plan, transports[w.host], ctl)))
        with ThreadPoolExecutor(max_workers=max(1, min(32, len(jobs)))) as pool:
            futures = [pool.submit(_guarded, h, fn, *args) for h, fn, args in jobs]
            for fut in futures:
                rows += fut.result()
    finally:
        if listener is not None:
            listener.close()
    return Report(_ordered(rows), elapsed=time.monotonic() - started)


def _tunnel_mismatch(plan: HostPlan, transport: Transport,
                     ctl: ControllerFacts) -> list[Check]:
    """A tunneled worker in a cluster whose coordinator binds a non-loopback address.

    The launcher's remote forward delivers to 127.0.0.1:<port> on the controller, where
    nothing listens when the coordinator binds ``controller.host`` (some workers dial it
    directly). Reported without opening the forward: Fabric's forward handler raises in
    paramiko's transport thread when the local connect is refused.
    """
    assert plan.dial is not None
    rows = _check_host(dataclasses.replace(plan, dial=None), transport, ctl)
    if any(r.name == transport.kind and r.status is Status.FAIL for r in rows):
        return rows
    status, only_join = (Status.WARN, " (only ranks that join the cohort dial it)") \
        if plan.fast else (Status.FAIL, "")
    rows.append(Check(plan.host, "port", status,
                      f"tunnel: true, but the coordinator binds {ctl.bind_host}:{ctl.port} "
                      "(other workers dial it directly) while the tunnel delivers to "
                      f"127.0.0.1:{ctl.port} there: tunnel every remote worker, or "
                      f"none{only_join}"))
    return rows


def _ordered(rows: list[Check]) -> list[Check]:
    """Controller rows first, then hosts in roster order, checks in a fixed order."""
    hosts: list[str] = [CONTROLLER]
    for r in rows:
        if r.host not in hosts:
            hosts.append(r.host)
    rank = {name: i for i, name in enumerate(_ROW_ORDER)}
    return sorted(rows, key=lambda r: (hosts.index(r.host), rank.get(r.name, len(rank))))
