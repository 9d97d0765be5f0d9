"""SSH policy on Fabric and paramiko: options, host keys, connecting, liveness.

Users describe SSH the way they know it, as OpenSSH ``Key=Value`` options;
this module maps the options we support onto Fabric and paramiko and refuses
the rest (silently ignoring an option the user relies on is worse than an
error). Defaults follow the flodl launcher: no prompts, keepalive 10 s x 3,
connect timeout 10 s, and host keys with ``accept-new`` semantics: an unknown
key is recorded, a changed key is refused. Fabric's own default,
``AutoAddPolicy``, accepts changed keys too and is replaced here.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import paramiko
from fabric import Config, Connection

from .config import (
    ClusterSpec,
    ConfigError,
    Problem,
    WorkerSpec,
    host_name_problem,
    single_line_problem,
    ssh_option_value_problem,
    ssh_target_problem,
    user_name_problem,
)
from .limits import PORT_MAX

#: OpenSSH options we understand, by lowercase name.
SUPPORTED_OPTIONS = {
    "stricthostkeychecking": "StrictHostKeyChecking",
    "userknownhostsfile": "UserKnownHostsFile",
    "connecttimeout": "ConnectTimeout",
    "serveraliveinterval": "ServerAliveInterval",
    "serveralivecountmax": "ServerAliveCountMax",
    "proxyjump": "ProxyJump",
    "identityfile": "IdentityFile",
    "user": "User",
    "port": "Port",
    "batchmode": "BatchMode",
    "hostname": "HostName",
}

#: Our defaults; user options override them.
DEFAULT_OPTIONS = {
    "stricthostkeychecking": "accept-new",
    "connecttimeout": "10",
    "serveraliveinterval": "10",
    "serveralivecountmax": "3",
    "batchmode": "yes",
}

#: known_hosts when nothing else is configured, as for OpenSSH.
DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"

#: Seconds paramiko may spend opening one session channel.
SESSION_OPEN_TIMEOUT = 15.0


class SshOptionError(ValueError):
    """An ``ssh.options`` entry we cannot honour; the message names it."""


class SshConnectError(RuntimeError):
    """Connecting to a host failed; the message names the host and the cause."""

    def __init__(self, host: str, reason: str) -> None:
        super().__init__(f"host {host!r}: {reason}")
        self.host = host
        self.reason = reason


@dataclass(frozen=True)
class SshSettings:
    """Everything needed to open one host's Connection, resolved."""

    host: str
    target: str
    user: Optional[str]
    port: Optional[int]
    identity_files: tuple[str, ...]
    strict_host_key_checking: str
    known_hosts_file: str
    connect_timeout: float
    alive_interval: float
    alive_count_max: int
    proxy_jump: Optional[str]
    batch_mode: bool

    @property
    def alive_timeout(self) -> float:
        """How long a silent connection is trusted before it is declared dead."""
        return self.alive_interval * max(1, self.alive_count_max)


def parse_options(options: Sequence[str]) -> dict[str, str]:
    """Lowercase option name to value; the first occurrence wins, as in OpenSSH.

    Values follow config's grammar (one line, a port in 1-65535, a host name for HostName,
    ...), the same one a cluster file is checked against, so options given in code cannot
    carry a second line ("...\\nProxyCommand ...") or a port 0 that paramiko reads as 22.
    """
    parsed: dict[str, str] = {}
    for raw in options:
        problem = single_line_problem(raw)
        if problem:
            raise SshOptionError(f"ssh option {_shown(raw)} {problem}")
        key, sep, value = raw.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise SshOptionError(f"{_shown(raw)} is not of the form Key=Value")
        name = key.lower()
        if name not in SUPPORTED_OPTIONS:
            known = ", ".join(sorted(SUPPORTED_OPTIONS.values()))
            raise SshOptionError(
                f"ssh option {_shown(key)} is not supported (supported: {known})"
            )
        problem = ssh_option_value_problem(key, value)
        if problem:
            raise SshOptionError(problem)
        parsed.setdefault(name, value)
    return parsed


def _shown(text: str) -> str:
    """repr() of a user's text, shortened so an error stays one readable line."""
    return repr(text) if len(text) <= 60 else f"{text[:60]!r}... ({len(text)} characters)"


def batchmode_warning(options: Sequence[str], host: str) -> Optional[str]:
    """The seed's warning when a user turns BatchMode off; the option is still honoured."""
    for opt in options:
        key, sep, value = opt.partition("=")
        if sep and key.strip().lower() == "batchmode" and value.strip().lower() != "yes":
            return (
                f"fdl-fabric: host {host!r} ssh.options set `{opt.strip()}` — the ssh dispatch "
                "is non-interactive and will hang on any prompt (passphrase, host-key). "
                "Proceeding as requested."
            )
    return None


def _number(name: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise SshOptionError(f"{SUPPORTED_OPTIONS[name]}={value!r} must be a number") from None
    if not math.isfinite(number):  # float() takes "nan" and "inf"; no timeout can be either
        raise SshOptionError(f"{SUPPORTED_OPTIONS[name]}={value!r} must be a finite number")
    if number < 0:
        raise SshOptionError(f"{SUPPORTED_OPTIONS[name]}={value!r} must not be negative")
    return number


def _check_spec_names(worker: WorkerSpec) -> None:
    """The names ``resolve_settings`` hands to paramiko, held to config's grammar again: a
    WorkerSpec can be built in code, without the cluster file's checks."""
    spec = worker.ssh
    problems = [
        ("host", host_name_problem(worker.host)),
        ("ssh.target", spec.target and ssh_target_problem(spec.target)),
        ("ssh.user", spec.user and user_name_problem(spec.user)),
    ]
    for key, problem in problems:
        if problem:
            raise SshOptionError(f"{key}: {problem}")
    if spec.port is not None and not 1 <= spec.port <= PORT_MAX:
        raise SshOptionError(f"ssh.port: must be between 1 and {PORT_MAX}, got {spec.port}")


def resolve_settings(worker: WorkerSpec) -> SshSettings:
    """Merge a worker's ``ssh`` block, its options and our defaults.

    Precedence: the explicit ``ssh.target/user/port/identity_file`` fields,
    then user options, then our defaults; whatever is still unset comes from
    ``~/.ssh/config`` through Fabric (HostName, User, Port, IdentityFile,
    ProxyJump for Host aliases).
    """
    spec = worker.ssh
    _check_spec_names(worker)
    opts = {**DEFAULT_OPTIONS, **parse_options(spec.options)}
    strict = opts["stricthostkeychecking"].lower()
    if strict == "off":
        strict = "no"
    if strict == "ask":
        strict = "yes"  # we never prompt; 'ask' without a prompt is 'yes'
    if strict not in ("yes", "no", "accept-new"):
        raise SshOptionError(
            f"StrictHostKeyChecking={opts['stricthostkeychecking']!r} must be one of "
            "yes, no, accept-new"
        )
    port: Optional[int] = spec.port
    if port is None and "port" in opts:
        port = int(opts["port"])  # parse_options made sure it is 1..65535
    identities = [spec.identity_file] if spec.identity_file else []
    if "identityfile" in opts:
        identities.append(os.path.expanduser(opts["identityfile"]))
    count_max = _number("serveralivecountmax", opts["serveralivecountmax"])
    return SshSettings(
        host=worker.host,
        target=spec.target or opts.get("hostname") or worker.host,
        user=spec.user or opts.get("user"),
        port=port,
        identity_files=tuple(identities),
        strict_host_key_checking=strict,
        known_hosts_file=os.path.expanduser(
            opts.get("userknownhostsfile", DEFAULT_KNOWN_HOSTS).split()[0]
        ),
        connect_timeout=_number("connecttimeout", opts["connecttimeout"]),
        alive_interval=_number("serveraliveinterval", opts["serveraliveinterval"]),
        alive_count_max=int(count_max),
        proxy_jump=opts.get("proxyjump") if opts.get("proxyjump", "none") != "none" else None,
        batch_mode=opts["batchmode"].lower() == "yes",
    )


def resolve_all_settings(
    cluster: ClusterSpec, warn: Optional[Callable[[str], None]] = None
) -> dict[str, SshSettings]:
    """Every remote worker's SSH settings; a bad option is a ConfigError (exit 2)."""
    settings: dict[str, SshSettings] = {}
    problems: list[Problem] = []
    for w in cluster.workers:
        if w.is_local:
            continue
        warning = batchmode_warning(w.ssh.options, w.host)
        if warning and warn is not None:
            warn(warning)
        try:
            settings[w.host] = resolve_settings(w)
        except SshOptionError as exc:
            problems.append(Problem(cluster.file, f"workers[{w.index}].ssh.options", w.line,
                                    str(exc)))
    if problems:
        raise ConfigError(problems)
    return settings


_known_hosts_lock = threading.Lock()


class AcceptNewPolicy(paramiko.MissingHostKeyPolicy):
    """OpenSSH's ``accept-new``: record an unknown key, never a changed one.

    A changed key never reaches this policy: paramiko raises
    BadHostKeyException itself when a loaded key differs. We append one line
    instead of rewriting the file, so concurrent connections cannot clobber
    each other's entries.
    """

    def __init__(self, known_hosts_file: str) -> None:
        self.known_hosts_file = known_hosts_file

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: Any) -> None:
        entry = paramiko.hostkeys.HostKeyEntry([hostname], key)
        with _known_hosts_lock:
            folder = os.path.dirname(self.known_hosts_file)
            if folder:
                os.makedirs(folder, mode=0o700, exist_ok=True)
            with open(self.known_hosts_file, "a", encoding="utf-8") as fh:
                fh.write(entry.to_line() or "")
        client.get_host_keys().add(hostname, key.get_name(), key)


class _RecordOnlyPolicy(paramiko.MissingHostKeyPolicy):
    """``StrictHostKeyChecking=no``: accept anything, record nothing."""

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: Any) -> None:
        client.get_host_keys().add(hostname, key.get_name(), key)


def _record_exit_signal() -> None:
    """Make paramiko treat an ``exit-signal`` request as the end of the session.

    When a remote command dies from a signal, sshd sends ``exit-signal``
    instead of ``exit-status``; paramiko ignores it, so the session would look
    alive for as long as anything still holds its output open (an orphaned
    rank, when its wrapper was killed). We record it as a shell would report
    the status (128 + the signal number) and keep the signal name in
    ``channel.exit_signal``, so the launcher knows the session's own process
    died and that its rank may be orphaned.
    """
    original = paramiko.Channel._handle_request  # type: ignore[attr-defined]
    if getattr(original, "_fdl_patched", False):
        return

    def handle(self: paramiko.Channel, m: paramiko.Message) -> None:
        pos = m.packet.tell()
        key = m.get_text()
        name = ""
        if key == "exit-signal":
            m.get_boolean()  # want_reply
            name = m.get_text()
        m.packet.seek(pos)
        original(self, m)
        if key == "exit-signal" and not self.status_event.is_set():
            number = getattr(signal.Signals, f"SIG{name}", None)
            self.exit_signal = name  # type: ignore[attr-defined]
            self.exit_status = 128 + int(number) if number is not None else -1
            self.status_event.set()

    handle._fdl_patched = True  # type: ignore[attr-defined]
    paramiko.Channel._handle_request = handle  # type: ignore[method-assign,attr-defined]
    # The transport dispatches through a table of the functions themselves.
    table = paramiko.Transport._channel_handler_table  # type: ignore[attr-defined]
    table[paramiko.common.MSG_CHANNEL_REQUEST] = handle


_record_exit_signal()


class FdlConnection(Connection):  # type: ignore[misc]
    """A Fabric Connection whose sessions open with a timeout.

    paramiko waits up to an hour for a session channel when no timeout is
    given; a wedged server must not wedge the launcher.
    """

    def create_session(self) -> paramiko.Channel:
        channel: paramiko.Channel = self.transport.open_session(timeout=SESSION_OPEN_TIMEOUT)
        return channel


def apply_host_key_policy(client: paramiko.SSHClient, strict: str = "accept-new",
                          known_hosts_file: str = DEFAULT_KNOWN_HOSTS) -> None:
    """Our host-key rules on a client that has not connected yet (Fabric's default
    AutoAddPolicy would accept a changed key): ``accept-new``, ``yes`` or ``no``."""
    known_hosts_file = os.path.expanduser(known_hosts_file)
    if strict == "no":
        client.set_missing_host_key_policy(_RecordOnlyPolicy())
        return
    if os.path.exists("/etc/ssh/ssh_known_hosts"):
        client.load_system_host_keys("/etc/ssh/ssh_known_hosts")
    if os.path.exists(known_hosts_file):
        client.load_host_keys(known_hosts_file)
    if strict == "accept-new":
        client.set_missing_host_key_policy(AcceptNewPolicy(known_hosts_file))
    else:
        client.set_missing_host_key_policy(paramiko.RejectPolicy())


def make_connection(
    settings: SshSettings, config: Optional[Config] = None, *, _hop: str = ""
) -> FdlConnection:
    """An unopened Connection with our host-key policy and timeouts."""
    gateway: Any = None
    if settings.proxy_jump:
        hops = [h.strip() for h in settings.proxy_jump.split(",") if h.strip()]
        for hop in hops:
            hop_user, _, hop_host = hop.rpartition("@")
            hop_name, _, hop_port = hop_host.partition(":")
            hop_settings = SshSettings(
                host=f"{settings.host} (jump {hop})",
                target=hop_name,
                user=hop_user or None,
                port=int(hop_port) if hop_port else None,
                identity_files=settings.identity_files,
                strict_host_key_checking=settings.strict_host_key_checking,
                known_hosts_file=settings.known_hosts_file,
                connect_timeout=settings.connect_timeout,
                alive_interval=settings.alive_interval,
                alive_count_max=settings.alive_count_max,
                proxy_jump=None,
                batch_mode=settings.batch_mode,
            )
            hop_conn = make_connection(hop_settings, config)
            if gateway is not None:
                hop_conn.gateway = gateway
            gateway = hop_conn
    connect_kwargs: dict[str, Any] = {
        "banner_timeout": settings.connect_timeout or None,
        "auth_timeout": settings.connect_timeout or None,
    }
    if settings.identity_files:
        connect_kwargs["key_filename"] = list(settings.identity_files)
    kwargs: dict[str, Any] = {
        "host": settings.target,
        "connect_timeout": int(settings.connect_timeout) or None,
        "connect_kwargs": connect_kwargs,
        "inline_ssh_env": True,
    }
    if settings.user:
        kwargs["user"] = settings.user
    if settings.port:
        kwargs["port"] = settings.port
    # Every Connection gets a Config of its own: Fabric writes connection attributes
    # (gateway, inline_ssh_env, ...) into its config, and a Config shared between the
    # threads that connect hosts in parallel made one connect in 26 fail with "No
    # attribute or config key found for 'gateway'" at 32 hosts.
    kwargs["config"] = config.clone() if config is not None else Config()
    if gateway is not None:
        kwargs["gateway"] = gateway
    conn = FdlConnection(**kwargs)
    apply_host_key_policy(conn.client, settings.strict_host_key_checking,
                          settings.known_hosts_file)
    return conn


def describe_connect_error(exc: BaseException) -> str:
    """A one-line, actionable reason for a failed connect."""
    if isinstance(exc, paramiko.BadHostKeyException):
        return (
            f"host key has CHANGED (got {exc.key.get_name()} {exc.key.get_fingerprint().hex()}, "
            f"expected {exc.expected_key.get_fingerprint().hex()}); refusing to connect. "
            "If the host was reinstalled, remove its old line from "
            "known_hosts."
        )
    if isinstance(exc, paramiko.SSHException) and "not found in known_hosts" in str(exc):
        return f"host key is unknown and StrictHostKeyChecking=yes: {exc}"
    if isinstance(exc, paramiko.AuthenticationException):
        return f"authentication refused: {exc}"
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        return f"unreachable: {exc}"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "connect timed out"
    if isinstance(exc, OSError):
        return f"unreachable: {exc.strerror or exc}"
    return f"{type(exc).__name__}: {exc}"


def open_connection(settings: SshSettings, config: Optional[Config] = None) -> FdlConnection:
    """Connect now, or raise SshConnectError naming the host."""
    conn = make_connection(settings, config)
    try:
        conn.open()
    except Exception as exc:  # every transport failure becomes one clear error
        conn.close()
        raise SshConnectError(settings.host, describe_connect_error(exc)) from exc
    # Control lines to several ranks of one host go out back to back; without
    # TCP_NODELAY the second waits for the first one's delayed ACK (~40 ms).
    with contextlib.suppress(OSError, AttributeError):
        conn.transport.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


class KeepaliveMonitor:
    """Declare a connection dead when it stops answering keepalives.

    paramiko's own keepalive only sends packets and never notices a silent
    peer (a partitioned network keeps TCP retransmitting for many minutes).
    This monitor asks the server for a reply every ``interval`` seconds, as
    OpenSSH's ServerAliveInterval does, and closes the transport after
    ``interval x count_max`` seconds without one; every session on it then
    ends, which the supervisor sees as lost ranks.
    """

    def __init__(self, on_dead: Callable[[str, float], None]) -> None:
        self._on_dead = on_dead
        self._entries: list[_Watched] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fdl-keepalive", daemon=True)

    def watch(self, host: str, transport: paramiko.Transport, settings: SshSettings) -> None:
        if settings.alive_interval <= 0:
            return
        with self._lock:
            self._entries.append(_Watched(host, transport, settings.alive_interval,
                                          settings.alive_timeout))
        if not self._thread.is_alive():
            self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            now = time.monotonic()
            with self._lock:
                entries = list(self._entries)
            for entry in entries:
                if entry.dead or not entry.transport.is_active():
                    continue
                silent = now - entry.last_reply
                if silent > entry.timeout:
                    entry.dead = True
                    entry.transport.close()
                    self._on_dead(entry.host, silent)
                elif not entry.pinging and now - entry.last_ping >= entry.interval:
                    entry.ping()


class _Watched:
    def __init__(self, host: str, transport: paramiko.Transport, interval: float,
                 timeout: float) -> None:
        self.host = host
        self.transport = transport
        self.interval = interval
        self.timeout = timeout
        self.last_reply = time.monotonic()
        self.last_ping = 0.0
        self.pinging = False
        self.dead = False

    def ping(self) -> None:
        self.pinging = True
        self.last_ping = time.monotonic()
        threading.Thread(target=self._ping, name=f"fdl-ping-{self.host}", daemon=True).start()

    def _ping(self) -> None:
        try:
            # OpenSSH answers an unknown global request with a failure reply;
            # any reply proves the peer is alive.
            self.transport.global_request("keepalive@openssh.com", wait=True)
            if self.transport.is_active():
                self.last_reply = time.monotonic()
        except Exception:
            pass
        finally:
            self.pinging = False
