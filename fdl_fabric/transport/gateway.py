"""The gateway tree, launcher side: leaves reached through a relay on their gateway.

Beyond ``fanout`` SSH hosts (`fdl_fabric.planning.tree`) the launcher connects to a few
gateways only. A gateway is an SSH host like any other (`GatewayHost`, an `SshTransport`:
its own agent, its own ranks, keepalives), whose connection also carries a second
session: the `Relay`, which runs the bundle in relay mode (`fdl_fabric.agent.relay`) and
starts each leaf's agent with the gateway's OpenSSH client. A leaf is a
`GatewayTransport`: its agent is a `RelayedAgent`, a byte stream multiplexed over its
gateway's relay session, so everything above the transport (sessions, the supervisor,
cleanup, ``status``) is unchanged.

Launcher side of one relay: one session, one reading thread that demultiplexes the
relay's batches into each leaf's sinks (the same `session.AgentSession` sinks a flat
host's agent feeds), and one lock-protected writer. When the relay's session ends (the
relay killed, the gateway's connection lost) every leaf agent of it is lost, with a
reason naming the gateway; the leaf agents themselves stop their ranks when their ssh
goes (the leash, one level down).

Trust: a gateway needs SSH access to its leaves (keys on the gateway), and it sees the
run's envelope on the streams it carries, as any host of the run does (docs/design.md).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Optional

from ..agent import mux
from ..clusterfile import ClusterSpec, WorkerSpec
from ..planning.tree import Tree
from ..shell import quote
from . import bundle, channels
from .base import AgentProcess, ByteSink, ProbeResult, Transport, TransportError
from .leafssh import leaf_ssh_argv
from .probeout import ClockedOutput
from .runners import RUN_OPTIONS
from .ssh import RawRemote, RemoteAgentProcess, SshTransport
from .sshconfig import SshSettings

#: Seconds the lazy-write thread waits for bytes before it looks whether its relay ended.
LAZY_IDLE_CHECK = 5.0

#: Seconds a lease renewal to a leaf may wait for the others' (`Relay.send_lazy`).
LAZY_WRITE_DELAY = 0.02
#: Seconds a relay may take to start (its session, python3, the bundle) and say hello.
RELAY_START_TIMEOUT = 30.0
#: Bytes of the relay's stderr kept to explain how it ended.
STDERR_TAIL = 4096
# -- one relay, launcher side ------------------------------------------------------------------
class _RelayStdout:
    def __init__(self, relay: Relay) -> None:
        self.relay = relay

    def feed(self, data: bytes) -> None:
        self.relay._feed(data)

    def close(self) -> None:
        self.relay._stream_closed()


class _RelayStderr:
    def __init__(self, relay: Relay) -> None:
        self.relay = relay

    def feed(self, data: bytes) -> None:
        self.relay._stderr = (self.relay._stderr + data)[-STDERR_TAIL:]

    def close(self) -> None:
        self.relay._stream_closed()


class Relay:
    """The relay on one gateway, seen from the launcher: a second session on the
    gateway's connection, its leaves by id, one reader (the session's stdout thread), one
    writer lock."""

    def __init__(self, gateway: str, connection: Any) -> None:
        self.gateway = gateway
        self.connection = connection
        self.pid: Optional[int] = None
        self._reader = mux.Reader(mux.UP_TYPES, handshake=True)
        self._write_lock = threading.Lock()
        self._lazy = bytearray()
        #: Set while `_lazy` holds bytes; one thread flushes them (a Timer a burst was a
        #: thread started every 20 ms per relay while 8,192 ranks joined).
        self._lazy_wanted = threading.Event()
        self._flusher: Optional[threading.Thread] = None
        self._leaves_lock = threading.Lock()
        self._leaves: dict[int, RelayedAgent] = {}
        self._next_id = 1
        self._blob_sent = False
        #: The agent frame the relay keeps for REPLAY (the sync's manifest), if any.
        self._kept: Optional[bytes] = None
        self._hello = threading.Event()
        self._settled = threading.Event()
        self._ended = threading.Event()
        self._closed_streams = 0
        self._stderr = b""
        self._problem = ""
        self._said = ""
        self._broken = False
        self.reason = ""
        self.runner: Any = None
        self.promise: Any = None

    # -- life --------------------------------------------------------------------------------
    def start(self, timeout: float = RELAY_START_TIMEOUT) -> None:
        """Start the relay and wait for its hello; `TransportError` naming the gateway."""
        runner = RawRemote(context=self.connection, inline_env=True)
        try:
            self.promise = runner.run(bundle.remote_command("relay"),
                                      out_stream=_RelayStdout(self),
                                      err_stream=_RelayStderr(self), **RUN_OPTIONS)
        except Exception as exc:
            raise TransportError(self.gateway, f"cannot start the relay: "
                                 f"{type(exc).__name__}: {exc}") from None
        self.runner = runner
        with contextlib.suppress(Exception):  # if it fails, the relay's end says why
            self._write(bundle.payload())
        if not self._settled.wait(timeout):
            self.abandon()
            raise TransportError(self.gateway, f"the relay did not start within {timeout:g}s")
        if not self._hello.is_set():
            self._ended.wait(5.0)
            raise TransportError(self.gateway, f"the relay did not start: {self.reason}")

    @property
    def running(self) -> bool:
        return self._hello.is_set() and not self._ended.is_set()

    def close(self) -> None:
        """EOF on the relay's stdin: it closes every leaf's stdin and exits once they end."""
        if self.runner is None:
            return
        with self._write_lock, contextlib.suppress(Exception):
            self.runner.close_proc_stdin()

    def abandon(self) -> None:
        """Cut the relay's session (its leaves then see EOF, as on a lost connection)."""
        self.close()
        if self.runner is not None:
            with contextlib.suppress(Exception):
                self.runner.kill()

    def wait_ended(self, timeout: Optional[float] = None) -> bool:
        return self._ended.wait(timeout)

    # -- leaves ------------------------------------------------------------------------------
    def open(self, host: str, argv: list[str], stdout: ByteSink, stderr: ByteSink
             ) -> RelayedAgent:
        """Start ``argv`` (a leaf's ssh) on the gateway; its bytes go to the sinks."""
        with self._leaves_lock:
            if self._ended.is_set() or not self._hello.is_set():
                raise TransportError(host, f"its gateway {self.gateway!r} has no relay "
                                     f"running{': ' + self.reason if self.reason else ''}")
            lid = self._next_id
            self._next_id += 1
            agent = RelayedAgent(self, lid, host, stdout, stderr)
            self._leaves[lid] = agent
        try:
            self._write(mux.open_frame(lid, argv))
        except Exception as exc:
            with self._leaves_lock:
                self._leaves.pop(lid, None)
            raise TransportError(host, f"its gateway {self.gateway!r}: cannot reach the "
                                 f"relay: {type(exc).__name__}: {exc}") from None
        return agent

    def _write(self, data: bytes) -> None:
        with self._write_lock:
            self._flush_lazy()
            self.runner._write_proc_stdin(data)

    def send_data(self, lid: int, data: bytes) -> None:
        with self._write_lock:
            self._flush_lazy()
            for piece in mux.data_frames(lid, data):
                self.runner._write_proc_stdin(piece)

    def send_lazy(self, lid: int, data: bytes) -> None:
        """``data`` for a leaf that may wait `LAZY_WRITE_DELAY` to travel with others: the
        supervisor renews every agent's lease at once, and 31 leaves' pings in one write
        are one SSH packet instead of 31. Anything else written first takes them along,
        so a leaf's bytes keep their order."""
        with self._write_lock:
            self._lazy += b"".join(mux.data_frames(lid, data))
            self._lazy_wanted.set()
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_loop, daemon=True,
                                                 name=f"fdl-relay-{self.gateway}")
                self._flusher.start()

    def _flush_loop(self) -> None:
        """`LAZY_WRITE_DELAY` after lazy bytes came, write them; until the relay ends."""
        while not self._ended.is_set():
            if not self._lazy_wanted.wait(LAZY_IDLE_CHECK):
                continue
            time.sleep(LAZY_WRITE_DELAY)
            with self._write_lock, contextlib.suppress(Exception):
                self._flush_lazy()

    def _flush_lazy(self) -> None:
        """Under the write lock: what `send_lazy` holds, now."""
        self._lazy_wanted.clear()
        if self._lazy:
            data, self._lazy = bytes(self._lazy), bytearray()
            self.runner._write_proc_stdin(data)

    def send_payload(self, lid: int) -> None:
        """The agent payload to a leaf: sent to the relay once, then named per leaf."""
        with self._write_lock:
            self._flush_lazy()
            if not self._blob_sent:
                self.runner._write_proc_stdin(mux.frame(mux.BLOB, bundle.payload()))
                self._blob_sent = True
            self.runner._write_proc_stdin(mux.leaf_frame(mux.PAYLOAD, lid))

    def serve(self, lid: int, root: str, need: list[int]) -> None:
        """A sync's objects for leaf ``lid`` (entries of the kept manifest), read by the
        relay from the gateway's store at ``root`` (`fdl_fabric.agent.feeder`): the
        launcher sends them to the gateway only once."""
        body = mux.json_body({"root": root, "need": need})
        with self._write_lock:
            self._flush_lazy()
            self.runner._write_proc_stdin(mux.leaf_frame(mux.SERVE, lid, body))

    def send_kept(self, lid: int, frame: bytes) -> None:
        """An agent frame many leaves get the same (a sync's manifest): sent to the relay
        once (``KEEP``), then named per leaf (``REPLAY``), as the payload is."""
        with self._write_lock:
            self._flush_lazy()
            if self._kept is not frame:
                self.runner._write_proc_stdin(mux.frame(mux.KEEP, frame))
                self._kept = frame
            self.runner._write_proc_stdin(mux.leaf_frame(mux.REPLAY, lid))

    def send(self, kind: int, lid: int) -> None:
        with self._write_lock, contextlib.suppress(Exception):
            self._flush_lazy()
            self.runner._write_proc_stdin(mux.leaf_frame(kind, lid))

    # -- reading (the session's stdout thread) -------------------------------------------------
    def _feed(self, data: bytes) -> None:
        if self._broken:
            return
        try:
            frames = self._reader.feed(data)
            for kind, body in frames:
                self._frame(kind, body)
        except (mux.MuxError, KeyError, TypeError, ValueError) as exc:
            self._broken = True
            self._problem = f"protocol error from the relay: {exc}"
            self.abandon()

    def _frame(self, kind: int, body: bytes) -> None:
        if kind == mux.BATCH:
            leaves = self._leaves
            for lid, stream, chunk in mux.parse_batch(body):
                agent = leaves.get(lid)
                if agent is not None:
                    agent.deliver(stream, chunk)
        elif kind == mux.CLOSED:
            lid, rest = mux.parse_leaf(body)
            obj = mux.parse_json(rest)
            with self._leaves_lock:
                agent = self._leaves.pop(lid, None)
            if agent is not None:
                code, sig = obj.get("code"), obj.get("signal")
                status = -int(sig) if sig is not None else (
                    None if code is None else int(code))
                agent.finish(status, str(obj.get("error") or ""))
        elif kind == mux.HELLO:
            pid = mux.parse_json(body).get("pid")
            self.pid = int(pid) if isinstance(pid, int) else None
            self._hello.set()
            self._settled.set()
        elif kind == mux.ERROR:
            self._said = str(mux.parse_json(body).get("message", ""))

    def _stream_closed(self) -> None:
        with self._leaves_lock:
            self._closed_streams += 1
            if self._closed_streams < 2:
                return
        status = None
        if self.promise is not None:
            status = RemoteAgentProcess(self.promise).exit_status(2.0)
        self.reason = self._why(status)
        with self._leaves_lock:
            self._ended.set()
            leaves, self._leaves = list(self._leaves.values()), {}
        self._settled.set()
        for agent in leaves:
            agent.lost(f"lost with its gateway {self.gateway!r}: {self.reason}")

    def _why(self, status: Optional[int]) -> str:
        parts = [p for p in (self._problem, self._said) if p]
        if not self._hello.is_set() and self._reader.noise:
            parts.append(f"the login shell printed {self._reader.noise[-200:]!r}")
        if status is None:
            parts.append("the gateway's connection or the relay's session was lost")
        elif status < 0:
            parts.append(f"the relay was killed by signal {-status}")
        elif status:
            parts.append(f"the relay exited with status {status}")
        else:
            parts.append("the relay ended")
        tail = self._stderr.decode("utf-8", "replace").strip()
        if tail:
            parts.append("its last words: " + tail.splitlines()[-1][:300])
        return "; ".join(parts)


class RelayedAgent(AgentProcess):
    """A leaf's agent, through its gateway's relay: writes become DATA frames, EOF and
    kill are frames too, and its exit status is the leaf ssh's (CLOSED)."""

    lost_reason = "the session through its gateway was lost"

    def __init__(self, relay: Relay, lid: int, host: str, stdout: ByteSink,
                 stderr: ByteSink) -> None:
        self.relay = relay
        self.id = lid
        self.host = host
        self.served_by = relay.gateway
        self.stdout = stdout
        self.stderr = stderr
        self._wrote = False
        self._status: Optional[int] = None
        self._ended = threading.Event()

    def write(self, data: bytes) -> None:
        if self._ended.is_set():
            raise TransportError(self.host, "its agent is gone")
        first, self._wrote = not self._wrote, True
        payload = bundle.payload()
        if first and (data is payload or data == payload):
            self.relay.send_payload(self.id)
        else:
            self.relay.send_data(self.id, data)

    def serve(self, root: str, need: list[int]) -> None:
        self.relay.serve(self.id, root, need)

    def send_shared(self, frame: bytes) -> None:
        self.relay.send_kept(self.id, frame)

    def write_lazy(self, data: bytes) -> None:
        if self._ended.is_set():
            raise TransportError(self.host, "its agent is gone")
        if not self._wrote:  # the payload goes first, by `write`
            self.write(data)
            return
        self.relay.send_lazy(self.id, data)

    def close_input(self) -> None:
        if not self._ended.is_set():
            self.relay.send(mux.EOF, self.id)

    def kill(self) -> None:
        if not self._ended.is_set():
            self.relay.send(mux.KILL, self.id)

    def exit_status(self, timeout: float) -> Optional[int]:
        if not self._ended.wait(timeout):
            return None
        return self._status

    def join(self, timeout: Optional[float] = None) -> None:
        self._ended.wait(timeout)

    def reader_held_until(self) -> float:
        return channels.reader().held_until()  # the relay's session is read there

    # -- from the relay's reading thread ----------------------------------------------------------
    def deliver(self, stream: int, data: bytes) -> None:
        (self.stdout if stream == mux.STDOUT else self.stderr).feed(data)

    def finish(self, status: Optional[int], note: str = "") -> None:
        """Its ssh ended (or its relay did): the status first, then the sinks' close."""
        if self._ended.is_set():
            return
        self._status = status
        self._ended.set()
        if note:
            with contextlib.suppress(Exception):
                self.stderr.feed(f"fdl-fabric relay on {self.relay.gateway}: {note}\n".encode())
        for sink in (self.stdout, self.stderr):
            with contextlib.suppress(Exception):
                sink.close()

    def lost(self, reason: str) -> None:
        # The reason is this agent's own (it names the gateway): an instance attribute
        # over the class's default, which `AgentSession` reads.
        setattr(self, "lost_reason", reason)  # noqa: B010
        self.finish(None)


# -- transports --------------------------------------------------------------------------------
class GatewayHost(SshTransport):
    """A gateway: an SSH host like any other (its own agent and ranks), whose connection
    also carries the relay of its leaves, started by the first leaf that connects."""

    def __init__(self, *args: Any, leaves: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.leaves = leaves
        self._gate = threading.RLock()
        self.relay: Optional[Relay] = None

    def connect(self) -> None:
        """Connect, and start the relay at once: the leaves' connects (which wait for it)
        then find it running, rather than filling the connect pool one gateway at a
        time while each relay starts (issue 23's model: 4.8 s -> 2.3 s to all running at
        1,024 hosts). A relay that cannot start is tried again by its leaves, which say
        why; the gateway itself is still a worker."""
        with self._gate:
            super().connect()
            if self.leaves:
                with contextlib.suppress(TransportError):
                    self.ensure_relay()

    def close(self) -> None:
        with self._gate:
            relay, self.relay = self.relay, None
            if relay is not None:
                relay.close()
            super().close()

    def ensure_relay(self, timeout: float = RELAY_START_TIMEOUT) -> Relay:
        """The relay, running: connects the gateway and starts it when needed."""
        with self._gate:
            relay = self.relay
            if relay is not None and relay.running and self.connected:
                return relay
            if relay is not None:
                relay.abandon()
                self.relay = None
            if not self.connected:
                super().connect()
            relay = Relay(self.host, self.connection)
            relay.start(timeout)
            self.relay = relay
            return relay

    def describe(self) -> str:
        leaves = self.leaves
        span = f"{leaves[0]} .. {leaves[-1]}" if len(leaves) > 1 else ", ".join(leaves)
        return (f"{super().describe()}; gateway: a second session runs the relay that "
                f"starts {len(leaves)} leaves ({span})")

    def details(self) -> dict[str, Any]:
        return {**super().details(), "gateway_of": list(self.leaves)}


class GatewayTransport(Transport):
    """A leaf: its agent starts on its gateway's relay, with the gateway's ssh."""

    kind = "gateway"

    def __init__(self, worker: WorkerSpec, settings: Optional[SshSettings] = None, *,
                 purpose: str = "agent", gateway: GatewayHost) -> None:
        super().__init__(worker, settings, purpose=purpose)
        self.gateway = gateway

    @property
    def destination(self) -> Optional[str]:
        return None if self.settings is None else str(self.settings.target).rpartition("@")[2]

    def _refuse_tunnel(self) -> None:
        if self.worker.tunnel:
            raise TransportError(self.host, (
                f"tunnel: true is not supported through a gateway (this host is reached "
                f"through {self.gateway.host!r}, since the cluster has more SSH hosts than "
                f"its fanout): raise `fanout:` to the number of SSH hosts, or let this "
                f"host dial the controller directly"))

    def connect(self) -> None:
        """Make sure the gateway's relay runs (the leaf itself is reached when its agent
        starts: a leaf that cannot be reached fails then, naming its ssh's error)."""
        self._refuse_tunnel()
        try:
            self.gateway.ensure_relay()
        except TransportError as exc:
            raise TransportError(self.host, f"its gateway {self.gateway.host!r}: "
                                 f"{exc.reason}") from None

    @property
    def connected(self) -> bool:
        relay = self.gateway.relay
        return relay is not None and relay.running

    def start_agent(self, stdout: ByteSink, stderr: ByteSink) -> AgentProcess:
        self._refuse_tunnel()
        relay = self.gateway.relay
        if relay is None or not relay.running:
            raise TransportError(self.host, f"its gateway {self.gateway.host!r} has no relay "
                                 "running")
        argv = [*leaf_ssh_argv(self.worker, self.settings), bundle.remote_command()]
        return relay.open(self.host, argv, stdout, stderr)

    def answers(self) -> Optional[str]:
        """One ``ssh <leaf> exit 0`` through the relay, bounded by the connect timeout
        (doubled: the leaf's ssh has its own); its error when the leaf did not answer."""
        timeout = 2 * (self.settings.connect_timeout if self.settings else 10.0)
        result = self.probe("exit 0", timed=False, timeout=timeout)
        if result.reach_status == "FAIL":
            return result.reach
        if result.exit_status != 0:
            said = result.err.strip().splitlines()
            return (f"through gateway {self.gateway.host!r}: "
                    f"{said[-1] if said else f'exit status {result.exit_status}'}")
        return None

    def probe(self, script: str, *, timed: bool, tunnel: Optional[tuple[int, int]] = None,
              timeout: float = 60.0, clock_marker: str = "") -> ProbeResult:
        """The script run once through the gateway (its ssh to this host). Not measured
        through a gateway: the shell's start and the round trip (``timed``)."""
        result = ProbeResult()
        try:
            self._refuse_tunnel()
            relay = self.gateway.ensure_relay()
        except TransportError as exc:
            result.reach, result.reach_status = exc.reason, "FAIL"
            return result
        if tunnel is not None:
            result.tunnel_error = "no tunnel through a gateway"
        out, err = ClockedOutput(clock_marker), ClockedOutput()
        argv = [*leaf_ssh_argv(self.worker, self.settings), f"exec sh -c {quote(script)}"]
        start = time.monotonic()
        try:
            agent = relay.open(self.host, argv, out, err)
        except TransportError as exc:
            result.reach, result.reach_status = exc.reason, "FAIL"
            return result
        agent.close_input()
        status = agent.exit_status(timeout)
        if status is None and not agent._ended.is_set():
            agent.kill()
            err.feed(f"\ntimed out after {timeout:g}s".encode())
        result.probe_ms = (time.monotonic() - start) * 1000.0
        result.out, result.err = out.text, err.text
        result.exit_status, result.clock_at = status, out.clock_at
        # The clock line waited up to one batch interval in the relay: the estimate's
        # bound (half of this either way), not a measured round trip.
        result.rtt = mux.BATCH_INTERVAL
        if status == 255:
            result.reach, result.reach_status = (
                f"through gateway {self.gateway.host!r}: ssh failed: "
                f"{err.text.strip().splitlines()[-1] if err.text.strip() else 'status 255'}",
                "FAIL")
        else:
            result.reach = (f"through gateway {self.gateway.host!r} (its ssh); checks took "
                            f"{result.probe_ms:.0f} ms")
        return result

    def describe(self) -> str:
        who = ""
        if self.settings is not None:
            user = f"{self.settings.user}@" if self.settings.user else ""
            port = f" port {self.settings.port}" if self.settings.port else ""
            who = f": ssh {user}{self.settings.target}{port} from there"
        return f"host {self.host} via gateway {self.gateway.host}{who}; one relayed session " \
            "runs the agent"

    def details(self) -> dict[str, Any]:
        return {"transport": self.kind, "gateway": self.gateway.host,
                "ssh_target": self.worker.ssh_target}


def tree_transports(cluster: ClusterSpec, tree: Tree, settings: Mapping[str, SshSettings],
                    *, purpose: str = "agent",
                    direct: Callable[..., Transport]) -> dict[str, Transport]:
    """Every worker's transport in roster order, for a cluster with a gateway tree:
    `GatewayHost` for each gateway, `GatewayTransport` for each leaf, the kind's own
    transport for every other worker (local, Slurm, a flat SSH host), made by ``direct``
    (`transport.for_worker`, handed in: this module is below the kinds' registry)."""

    by_host = {w.host: w for w in cluster.workers}
    gateways: dict[str, GatewayHost] = {}
    for g in tree.gateways:
        gateways[g.host] = GatewayHost(by_host[g.host], settings.get(g.host), purpose=purpose,
                                       leaves=g.leaves)
    out: dict[str, Transport] = {}
    for w in cluster.workers:
        if w.host in gateways:
            out[w.host] = gateways[w.host]
            continue
        via = tree.gateway_of(w.host)
        if via is None:
            out[w.host] = direct(w, settings, purpose=purpose)
        else:
            out[w.host] = GatewayTransport(w, settings.get(w.host), purpose=purpose,
                                           gateway=gateways[via])
    return out
