"""SSH connections on Fabric and paramiko: host keys, connecting, sessions that stream bytes.

Settings come from `fdl_fabric.transport.sshconfig`. Fabric's default host-key policy,
``AutoAddPolicy``, accepts changed keys too and is replaced here with OpenSSH's
``accept-new``: an unknown key is recorded, a changed key is refused. Sessions open
with a timeout, and a remote command killed by a signal is recorded as such.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from typing import Any, Optional

import paramiko
from fabric import Config, Connection
from fabric.runners import Remote

from .runners import RawOutput
from .sshconfig import DEFAULT_KNOWN_HOSTS, SshSettings

#: Seconds paramiko may spend opening one session channel.
SESSION_OPEN_TIMEOUT = 15.0
#: Seconds between the wake-ups of each connection's transport thread when idle.
TRANSPORT_POLL = 1.0


class SshConnectError(RuntimeError):
    """Connecting to a host failed; the message names the host and the cause."""

    def __init__(self, host: str, reason: str) -> None:
        super().__init__(f"host {host!r}: {reason}")
        self.host = host
        self.reason = reason


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
    # paramiko's transport thread wakes every 0.1 s to look for a close; once a second
    # is enough (closing stays immediate: close() marks the packetizer closed), and it
    # cuts the launcher's idle CPU per host tenfold. Keepalives are our monitor's.
    with contextlib.suppress(OSError, AttributeError):
        conn.transport.sock.settimeout(TRANSPORT_POLL)
    return conn


class RawRemote(RawOutput, Remote):  # type: ignore[misc]
    """An SSH session whose stdout and stderr go to `runners.ByteSink`s (an agent's)."""
