"""SSH connections on Fabric and paramiko: host keys, connecting, sessions that stream bytes.

Settings come from `fdl_fabric.transport.sshconfig`. Fabric's default host-key policy,
``AutoAddPolicy``, accepts changed keys too and is replaced here with OpenSSH's
``accept-new`` (`hostkeys`): an unknown key is recorded, a changed key is refused. Sessions open
with a timeout, and a remote command killed by a signal is recorded as such.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Optional

import paramiko
from fabric import Config, Connection
from fabric.runners import Remote

from ..clusterfile import ClusterSpec, SshSpec, WorkerSpec
from ..events import EventBus
from ..shell import quote
from . import bundle, channels, connerrors, kinds
from .base import AgentProcess, ByteSink, ProbeResult, Transport, TransportError

# AcceptNewPolicy: named here too, where the host-key rules were before `hostkeys`.
from .hostkeys import AcceptNewPolicy as AcceptNewPolicy
from .hostkeys import apply_host_key_policy, known_hosts_of
from .probeout import ClockedOutput
from .runners import RUN_OPTIONS, InvokeAgentProcess
from .sshconfig import (
    SshOptionError,
    SshSettings,
    read_config,
    resolve_all_settings,
)
from .tunnel import forwarding

if TYPE_CHECKING:
    from .keepalive import KeepaliveMonitor

#: Seconds paramiko may spend opening one session channel.
SESSION_OPEN_TIMEOUT = 15.0
#: Seconds a connection fab built (``fab -H … cleanup``) may take to connect, to send its
#: banner and to log in, unless ``fab -t`` says otherwise: ssh_config's default here.
ADHOC_CONNECT_TIMEOUT = 10

# paramiko logs a failed handshake from its own thread with a traceback ("Exception
# (client): Error reading SSH protocol banner" and 25 lines); with no handler anywhere,
# Python's last-resort handler prints it on stderr, in the middle of a command's output.
# The failure itself reaches the user as one line (`connerrors`); a launch still gets
# the records as events (`commands.launch.third_party_logs`), and so does any handler an
# application adds.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


class SshConnectError(RuntimeError):
    """Connecting to a host failed; the message names the host and the cause."""

    def __init__(self, host: str, reason: str) -> None:
        super().__init__(f"host {host!r}: {reason}")
        self.host = host
        self.reason = reason


def _handle_request(chan: paramiko.Channel, m: paramiko.Message) -> None:
    """A channel request, with ``exit-signal`` taken as the end of the session.

    When a remote command dies from a signal, sshd sends ``exit-signal`` instead of
    ``exit-status``; paramiko ignores it, so the session would look alive for as long as
    anything still holds its output open (an orphaned rank, when its agent was killed).
    It is recorded as a shell would report the status (128 + the signal number), with
    the signal's name in ``channel.exit_signal``, so the launcher knows the session's
    own process died.
    """
    pos = m.packet.tell()
    key = m.get_text()
    name = ""
    if key == "exit-signal":
        m.get_boolean()  # want_reply
        name = m.get_text()
    m.packet.seek(pos)
    chan._handle_request(m)  # type: ignore[attr-defined]
    if key == "exit-signal" and not chan.status_event.is_set():
        number = getattr(signal.Signals, f"SIG{name}", None)
        chan.exit_signal = name  # type: ignore[attr-defined]
        chan.exit_status = 128 + int(number) if number is not None else -1
        chan.status_event.set()


#: Seconds a connected transport's thread waits in a read before it looks whether it
#: was closed (a close wakes it at once: `FdlTransport.stop_thread`).
CONNECTED_READ_TIMEOUT = 5.0


class FdlTransport(paramiko.Transport):
    """paramiko's Transport with our two settings, by subclassing (nothing is patched):

    * an ``exit-signal`` ends a session (`_handle_request`);
    * the transport thread looks for a close once a second instead of ten times while
      it connects, and every `CONNECTED_READ_TIMEOUT` seconds once it has (`settle`):
      each look is a wake-up, which costs this machine about 0.1 ms of CPU, and a
      launcher holds a connection per host (issue 35's idle). Closing stays immediate:
      `stop_thread` shuts the socket down, which wakes the thread's read at once;
      keepalives are our monitor's (`keepalive`).
    """

    _active_check_timeout = 1.0

    def stop_thread(self) -> None:
        sock = self.sock
        if isinstance(sock, socket.socket):
            self.active = False
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        super().stop_thread()
    _channel_handler_table = {
        **paramiko.Transport._channel_handler_table,  # type: ignore[attr-defined]
        paramiko.common.MSG_CHANNEL_REQUEST: _handle_request,
    }


def _transport_factory(sock: Any, **kwargs: Any) -> FdlTransport:
    """paramiko's hook for the Transport of a new client: ours, on a socket that sends
    small packets at once (TCP_NODELAY before the handshake: each auth step otherwise
    waits ~40 ms for a delayed ACK)."""
    if isinstance(sock, socket.socket):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return FdlTransport(sock, **kwargs)


class FdlConnection(Connection):  # type: ignore[misc]
    """A Fabric Connection whose sessions open with a timeout.

    paramiko waits up to an hour for a session channel when no timeout is
    given; a wedged server must not wedge the launcher.
    """

    def create_session(self) -> paramiko.Channel:
        """A session (agent forwarding asked on it when ``forward_agent``, as Fabric's own
        `create_session` does: a gateway's relay then hands the controller's ssh-agent to
        the ``ssh`` that starts its leaves)."""
        channel: paramiko.Channel = self.transport.open_session(timeout=SESSION_OPEN_TIMEOUT)
        if self.forward_agent:
            self._agent_handler = paramiko.agent.AgentRequestHandler(channel)
            self.agent_handlers.append(self._agent_handler)
        return channel

    @property
    def agent_handlers(self) -> list[Any]:
        """Every session's forwarding handler (Fabric keeps and closes only the last)."""
        handlers: list[Any] = self.__dict__.setdefault("_fdl_agent_handlers", [])
        return handlers

    def close(self) -> None:
        super().close()
        for handler in self.agent_handlers:
            with contextlib.suppress(Exception):
                handler.close()
        self.agent_handlers.clear()

def make_connection(
    settings: SshSettings, config: Optional[Config] = None, *, _hop: str = ""
) -> FdlConnection:
    """An unopened Connection with our host-key policy and timeouts."""
    conn = FdlConnection(**_connection_kwargs(settings, config,
                                              _jump_gateway(settings, config)))
    apply_host_key_policy(conn.client, settings.strict_host_key_checking,
                          settings.known_hosts_file)
    return conn


def _jump_gateway(settings: SshSettings, config: Optional[Config]) -> Any:
    """The chain of ProxyJump hops as nested gateway Connections (the last hop is the
    gateway of the target), or None without ProxyJump."""
    gateway: Any = None
    if not settings.proxy_jump:
        return gateway
    hops = [h.strip() for h in settings.proxy_jump.split(",") if h.strip()]
    for hop in hops:
        hop_conn = make_connection(_hop_settings(settings, hop), config)
        if gateway is not None:
            hop_conn.gateway = gateway
        gateway = hop_conn
    return gateway


def _hop_settings(settings: SshSettings, hop: str) -> SshSettings:
    """The settings of one ProxyJump hop (``user@host:port``): the target's keys, host-key
    checking and timeouts, no jump of its own."""
    hop_user, _, hop_host = hop.rpartition("@")
    hop_name, _, hop_port = hop_host.partition(":")
    return SshSettings(
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


def _connection_kwargs(settings: SshSettings, config: Optional[Config],
                       gateway: Any) -> dict[str, Any]:
    """The keyword arguments of the Connection: only what the settings set."""
    connect_kwargs: dict[str, Any] = {
        "banner_timeout": settings.handshake_timeout or settings.connect_timeout or None,
        "auth_timeout": settings.handshake_timeout or settings.connect_timeout or None,
        "transport_factory": _transport_factory,
    }
    if settings.identity_files:
        connect_kwargs["key_filename"] = list(settings.identity_files)
    kwargs: dict[str, Any] = {
        "host": settings.target,
        "connect_timeout": settings.connect_timeout or None,  # 0.5 s is no "none"
        "connect_kwargs": connect_kwargs,
        "inline_ssh_env": True,
    }
    if gateway is None and settings.proxy_command:  # Fabric starts it when connecting
        gateway = settings.proxy_command
    optional = {"user": settings.user or None, "port": settings.port or None,
                "forward_agent": settings.forward_agent, "gateway": gateway}
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    # Every Connection gets a Config of its own: Fabric writes connection attributes
    # (gateway, inline_ssh_env, ...) into its config, and a Config shared between the
    # threads that connect hosts in parallel made one connect in 26 fail with "No
    # attribute or config key found for 'gateway'" at 32 hosts.
    # Our own reading of the ssh_config (`sshconfig.read_config`: the ``-F`` file, else
    # ~/.ssh/config and /etc/ssh/ssh_config, as Fabric reads them): the Connection's
    # lookup then runs no ``Match exec`` inside a dry run (`configtrust.inert`).
    if config is not None:
        kwargs["config"] = config.clone()
        return kwargs
    try:
        ssh_config = read_config(settings.config_file, checked=settings.config_checked)
    except SshOptionError as exc:  # changed since it was checked: runs nothing, said so
        raise SshConnectError(settings.host, str(exc)) from None
    kwargs["config"] = Config(ssh_config=ssh_config)
    return kwargs


def describe_connect_error(exc: BaseException, settings: Optional[SshSettings] = None, *,
                           origin: Optional[connerrors.Origin] = None,
                           handshake: Optional[connerrors.Handshake] = None,
                           conn: Any = None) -> str:
    """A one-line, actionable reason for a failed connect (`connerrors.describe`): what
    failed, for which ``user@target:port`` as written (not the logical host name), with
    which key, and where the worker was named."""
    if settings is not None:
        dest = connerrors.from_settings(settings, origin)
    elif conn is not None:
        dest = connerrors.from_connection(conn, origin)
    else:
        dest = None
    return connerrors.describe(exc, dest, handshake)


def handshake_of(conn: Any) -> Optional[connerrors.Handshake]:
    """How far a failed connection's SSH handshake got (before it is closed): paramiko
    gives up on a silent server with "No existing session" when its connect timeout ends
    before its banner timeout does, so the exception alone cannot say."""
    transport = getattr(getattr(conn, "client", None), "_transport", None)
    if transport is None:
        return None
    return connerrors.Handshake(banner=bool(getattr(transport, "remote_version", "")),
                                kex=bool(getattr(transport, "initial_kex_done", False)))


def open_connection(settings: SshSettings, config: Optional[Config] = None, *,
                    origin: Optional[connerrors.Origin] = None) -> FdlConnection:
    """Connect now, or raise SshConnectError naming the host."""
    conn = make_connection(settings, config)
    try:
        conn.open()
    except Exception as exc:  # every transport failure becomes one clear error
        handshake = handshake_of(conn)
        conn.close()
        raise SshConnectError(settings.host, describe_connect_error(
            exc, settings, origin=origin, handshake=handshake)) from exc
    settle(conn)
    return conn


def settle(conn: FdlConnection) -> None:
    """A connected transport's thread reads with a longer timeout (`FdlTransport`)."""
    transport = getattr(getattr(conn, "client", None), "_transport", None)
    sock = getattr(transport, "sock", None)
    if isinstance(transport, FdlTransport) and isinstance(sock, socket.socket):
        with contextlib.suppress(OSError):
            sock.settimeout(CONNECTED_READ_TIMEOUT)


class RawRemote(Remote):  # type: ignore[misc]
    """An SSH session whose stdout and stderr go to `ByteSink`s (an agent's, a relay's),
    read by the launcher's one channel-reading thread (`channels.ChannelReader`) rather
    than by two invoke threads per session: invoke starts the session, we read it."""

    watch: Optional[channels.Watch] = None

    def create_io_threads(self) -> tuple[dict[Any, Any], list[str], list[str]]:
        host = getattr(self.context, "host", "")
        self.watch = channels.reader().watch(self.channel, self.streams["out"],
                                             self.streams["err"], name=str(host))
        return {}, [], []

    def kill(self) -> None:
        """Close the channel (paramiko closes its pipe too): the reader must look."""
        super().kill()
        if self.watch is not None:
            channels.reader().poke(self.watch)


class RemoteAgentProcess(InvokeAgentProcess):
    """An agent behind one SSH session: its exit status is the channel's."""

    lost_reason = "the SSH session or connection was lost"

    def reader_held_until(self) -> float:
        return channels.reader().held_until()

    def join(self, timeout: Optional[float] = None) -> None:
        watch = self.runner.watch
        if watch is not None:
            watch.wait(timeout)

    def exit_status(self, timeout: float) -> Optional[int]:
        with contextlib.suppress(Exception):
            channel = self.runner.channel
            if not channel.status_event.wait(timeout):
                return None
            status = int(channel.exit_status)
            if getattr(channel, "exit_signal", None) and status > 128:
                return 128 - status  # killed by signal N: -N, as subprocess says it
            return None if status == -1 else status
        return None


def known_host_state(settings: SshSettings, config: Any = None) -> tuple[str, str]:
    """(``known``/``unknown``/``unchecked``, key name) before connecting.

    Read from the known_hosts files the connection will use, under the name paramiko
    will look up (``[addr]:port`` unless the port is 22), after ~/.ssh/config aliases.
    """
    if settings.strict_host_key_checking == "no":
        return "unchecked", ""
    try:
        scratch = make_connection(settings, config)  # resolves aliases; opens no socket
    except SshConnectError:  # the connect that follows fails, saying why
        return "unknown", settings.target
    name = scratch.host if int(scratch.port) == 22 else f"[{scratch.host}]:{scratch.port}"
    for path in (settings.known_hosts_file, "/etc/ssh/ssh_known_hosts"):
        if not os.path.exists(path):
            continue
        try:
            if paramiko.HostKeys(path).lookup(name):
                return "known", name
        except (OSError, paramiko.SSHException):
            continue
    return "unknown", name


def _ms(start: float) -> float:
    return (time.monotonic() - start) * 1000.0


class SshTransport(Transport):
    """A host behind an SSH server: one Fabric Connection, one session per agent."""

    kind = kinds.SSH
    tree_member = True
    #: Where the host was named (a cluster file's line, ``--hosts``): said when a connect
    #: fails (`connerrors.mark`).
    origin: Optional[connerrors.Origin] = None

    def __init__(self, *args: Any, config: Optional[Config] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.config = config
        self.connection: Optional[FdlConnection] = None

    @classmethod
    def from_connection(cls, worker: WorkerSpec, conn: Any) -> SshTransport:
        """A transport over a Connection someone else built (``fab -H``'s): our host-key
        policy and our Transport class before it opens, like every connection we make."""
        transport = cls(worker)
        if not conn.is_connected:
            apply_host_key_policy(conn.client, known_hosts_file=known_hosts_of(conn))
            conn.connect_kwargs.setdefault("transport_factory", _transport_factory)
            # Every wait bounded, as for our own connections: fab's default is no connect
            # timeout (and paramiko's banner and login waits are 15 s and 30 s).
            timeout = conn.connect_kwargs.get("timeout") or conn.connect_timeout
            if not timeout:
                timeout = conn.connect_timeout = ADHOC_CONNECT_TIMEOUT
            for key in ("banner_timeout", "auth_timeout"):
                conn.connect_kwargs.setdefault(key, timeout)
        transport.connection = conn
        return transport

    def redial(self, timeout: float) -> Optional[SshTransport]:
        if self.settings is None:  # ``fab -H``'s connection: not ours to dial again
            return None
        settings = self._settings
        again = SshTransport(self.worker, dataclasses.replace(
            settings, connect_timeout=timeout,
            handshake_timeout=settings.handshake_timeout or settings.connect_timeout),
            config=self.config, purpose="cleanup")
        again.origin = self.origin
        return again

    @property
    def _settings(self) -> SshSettings:
        if self.settings is None:
            raise TransportError(self.host, "no SSH settings for this host")
        settings: SshSettings = self.settings
        return settings

    def connect(self) -> None:
        if self.connection is not None and self.connection.is_connected:
            return
        if self.connection is not None and self.settings is None:  # someone else's
            conn = self.connection
            try:
                conn.open()
            except Exception as exc:
                handshake = handshake_of(conn)
                with contextlib.suppress(Exception):
                    conn.close()
                raise TransportError(self.host, describe_connect_error(
                    exc, origin=self.origin, handshake=handshake, conn=conn)) from None
            settle(conn)
            return
        try:
            self.connection = open_connection(self._settings, self.config, origin=self.origin)
        except SshConnectError as exc:
            raise TransportError(self.host, exc.reason) from None

    @property
    def connected(self) -> bool:
        return self.connection is not None and bool(self.connection.is_connected)

    def shell(self) -> Optional[FdlConnection]:
        return self.connection

    @property
    def destination(self) -> Optional[str]:
        return None if self.settings is None else self._settings.target.rpartition("@")[2]

    @classmethod
    def resolve_settings(cls, cluster: ClusterSpec, workers: tuple[WorkerSpec, ...],
                         events: Optional[EventBus]) -> dict[str, Any]:
        """Through ~/.ssh/config (or the file's ``config_file``), as ssh would."""
        return resolve_all_settings(cluster, events)

    def close(self) -> None:
        conn, self.connection = self.connection, None
        if conn is not None:
            with contextlib.suppress(Exception):  # best effort: it may be long gone
                conn.close()

    def start_agent(self, stdout: ByteSink, stderr: ByteSink) -> AgentProcess:
        if self.connection is None:
            raise TransportError(self.host, "not connected")
        runner = RawRemote(context=self.connection, inline_env=True)
        promise = runner.run(bundle.remote_command(), out_stream=stdout, err_stream=stderr,
                             **RUN_OPTIONS)
        return RemoteAgentProcess(promise)

    @contextlib.contextmanager
    def tunnel(self, port: int, target: str, *,
               local_port: Optional[int] = None) -> Iterator[None]:
        """The remote forward, bounded (`transport.tunnel.Forward`); what it has to say
        goes to the log (`reporting_tunnel` says it as events)."""
        with self.reporting_tunnel(port, target, None, local_port=local_port):
            yield

    @contextlib.contextmanager
    def reporting_tunnel(self, port: int, target: str, events: Optional[EventBus], *,
                         local_port: Optional[int] = None) -> Iterator[None]:
        """``127.0.0.1:port`` on the host forwarded to ``target:port`` here (``target:
        local_port`` when given), within the bounds of `transport.tunnel`: connections
        turned away and a port exposed beyond loopback are reported as events on
        ``events``."""
        transport = self.connection.client.get_transport() if self.connection else None
        if transport is None or not transport.is_active():
            raise TransportError(self.host, "not connected")
        with forwarding(transport, self.worker, port, target, events, local_port=local_port):
            yield

    def watch(self, monitor: KeepaliveMonitor) -> None:
        transport = getattr(self.connection, "transport", None)
        if transport is not None and self.settings is not None:
            monitor.watch(self.host, transport, self.settings)

    def probe(self, script: str, *, timed: bool, tunnel: Optional[tuple[int, int]] = None,
              timeout: float = 60.0, clock_marker: str = "") -> ProbeResult:
        """Connect (timed, with the host key's state), time a ``true`` and a round trip,
        run the script once (with a remote forward for a tunneled worker's dial). The
        connection is kept as this transport's (`close` ends it), so prebuild-check's
        agent, asked next, needs no second one."""
        settings = self._settings
        state, key_name = known_host_state(settings, self.config)
        result = ProbeResult()
        start = time.monotonic()
        try:
            conn = open_connection(settings, self.config, origin=self.origin)
        except SshConnectError as exc:  # a changed key's words name known_hosts already
            result.reach, result.reach_status = exc.reason, "FAIL"
            return result
        connect_ms = _ms(start)
        kept = False
        try:
            self._probe_on(conn, script, timed, tunnel, timeout, clock_marker, result)
            if self.connection is None:  # the agent asked next rides on it: one a host
                self.connection, kept = conn, True
        finally:
            if not kept:
                with contextlib.suppress(Exception):
                    conn.close()
        if state == "known":
            key = "host key known"
        elif state == "unknown":
            key = "new host key recorded in known_hosts (accept-new)"
        else:
            key, result.reach_status = "host key NOT verified (StrictHostKeyChecking=no)", "warn"
        who = f"{settings.user + '@' if settings.user else ''}{key_name or settings.target}"
        result.reach = f"connected to {who} in {connect_ms:.0f} ms; {key}; checks took " \
            f"{result.probe_ms:.0f} ms"
        return result

    def _probe_on(self, conn: FdlConnection, script: str, timed: bool,
                  tunnel: Optional[tuple[int, int]], timeout: float, clock_marker: str,
                  result: ProbeResult) -> None:
        if timed:
            t = time.monotonic()
            conn.run("true", hide=True, warn=True, pty=False, in_stream=False,
                     timeout=timeout)
            result.shell_ms = _ms(t)
        with contextlib.ExitStack() as stack:
            if tunnel is not None:
                try:
                    stack.enter_context(conn.forward_remote(
                        tunnel[0], local_port=tunnel[1], local_host="127.0.0.1"))
                except Exception as exc:
                    result.tunnel_error = str(exc) or type(exc).__name__
            if timed:
                # A pure network round trip (no shell): bounds the clock estimate.
                t = time.monotonic()
                conn.transport.global_request("keepalive@openssh.com", wait=True)
                result.rtt = time.monotonic() - t
            out, err = ClockedOutput(clock_marker), ClockedOutput(clock_marker)
            t = time.monotonic()
            try:
                done = conn.run(f"exec sh -c {quote(script)}", hide=False, warn=True,
                                pty=False, in_stream=False, echo=False, out_stream=out,
                                err_stream=err, timeout=timeout)
                result.exit_status = done.exited
            except Exception as exc:  # CommandTimedOut, a dropped connection
                err.write(f"\n{type(exc).__name__}: {exc}")
            result.probe_ms = _ms(t)
        result.out, result.err, result.clock_at = out.text, err.text, out.clock_at

    def describe(self) -> str:
        """How the host is reached, resolved like the launch would (no socket opened)."""
        settings = self._settings
        conn = make_connection(settings)
        parts = [f"ssh {conn.user}@{conn.host} port {conn.port}"]
        if settings.identity_files:
            parts.append("identity " + ", ".join(settings.identity_files))
        else:
            parts.append("identity: ssh-agent and default keys")
        if settings.proxy_jump:
            parts.append(f"via {settings.proxy_jump}")
        elif settings.proxy_command:
            parts.append(f"via ProxyCommand {settings.proxy_command}")
        return ", ".join(parts) + "; one session runs the agent"

    def details(self) -> dict[str, Any]:
        return {"transport": self.kind, "ssh_target": self.worker.ssh_target}


def adhoc_worker(index: int, host: str) -> WorkerSpec:
    """A host named on the command line (``fab -H``), with no cluster file behind it."""
    return WorkerSpec(index=index, host=host, nproc=1, local_devices=None, path="~",
                      addr=host, nccl_socket_ifname=None, ssh=SshSpec(), tunnel=False,
                      env={}, data_path=None, is_local=False, line=0, transport=kinds.SSH)
