"""The one seam between the launcher and a kind of host: `Transport`.

A host is reached one way: this machine (`local`), an SSH server (`ssh`), a node of a
Slurm allocation (`slurm`). Everything above this package (the launch, cleanup,
``stacks``, the pre-flight, the dry run) talks to a host only through its `Transport`,
picked by one lookup (`fdl_fabric.transport.for_worker`), and never asks which kind it
is. A new kind (``kubectl exec -i``, a gateway agent) is one module with one subclass,
plus its line in `fdl_fabric.transport.KINDS`.

What a transport does: open and close whatever the host needs (an SSH connection;
nothing for the others), start the host's agent with its stdin and stdout as a byte
stream (`AgentProcess`), and a few host-level services: a tunnel to the controller,
keepalives, one pre-flight script run (`ProbeResult`), a line for the dry run.
Invoke's and paramiko's private API is used only inside the implementations.
"""

from __future__ import annotations

import abc
import contextlib
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Protocol

from ..clusterfile import ClusterSpec, WorkerSpec
from ..events import EventBus

if TYPE_CHECKING:
    from .keepalive import KeepaliveMonitor


class TransportError(Exception):
    """A host cannot be reached or used; ``reason`` says why in the user's terms."""

    def __init__(self, host: str, reason: str) -> None:
        super().__init__(f"host {host!r}: {reason}")
        self.host = host
        self.reason = reason


class ByteSink(Protocol):
    """Where an agent's output goes: every chunk, then one close at end of stream."""

    def feed(self, data: bytes) -> None: ...

    def close(self) -> None: ...


class AgentProcess(abc.ABC):
    """One running agent: its stdin to write frames to, its end to learn about."""

    #: Why the agent is gone when no exit status came (the session, the process, the step).
    lost_reason: ClassVar[str] = "the agent's stream was lost"
    #: The gateway whose relay carries this agent (a leaf of the tree); None: the launcher
    #: reaches it itself.
    served_by: Optional[str] = None

    def serve(self, root: str, need: list[int]) -> None:
        """A sync's objects for this agent (the manifest's entries ``need``), read on its
        gateway from the gateway's store at ``root``: only a leaf's agent is served so."""
        raise NotImplementedError("only an agent behind a gateway is served by it")

    def send_shared(self, frame: bytes) -> None:
        """A frame many agents get the same; through a gateway, kept there once."""
        self.write(frame)

    @abc.abstractmethod
    def write(self, data: bytes) -> None:
        """Write to the agent's stdin (raises when it is gone)."""

    def write_lazy(self, data: bytes) -> None:
        """A write that may wait a few milliseconds to travel with others (a lease
        renewal, sent to every agent at once): as `write` where nothing is gained."""
        self.write(data)

    def reader_held_until(self) -> float:
        """The last moment the thread that reads this agent was held by another stream's
        sink (a slow console): its silence until then is the launcher's, not the agent's.
        0.0 where each agent has a reader of its own."""
        return 0.0

    @abc.abstractmethod
    def close_input(self) -> None:
        """EOF on the agent's stdin: the leash."""

    @abc.abstractmethod
    def kill(self) -> None:
        """Last resort: end the process or cut the session (its agent sees EOF)."""

    @abc.abstractmethod
    def exit_status(self, timeout: float) -> Optional[int]:
        """Once its streams ended: the status, -N for a signal, None when none came."""

    @abc.abstractmethod
    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the reading threads (after the agent is gone)."""


@dataclass
class ProbeResult:
    """One run of the pre-flight script on a host, as `fdl_fabric.preflight` reads it."""

    out: str = ""
    err: str = ""
    exit_status: Optional[int] = None
    #: When (time.time) the clock sentinel line arrived, and the round trip it rode on.
    clock_at: Optional[float] = None
    rtt: float = 0.0
    shell_ms: Optional[float] = None
    probe_ms: float = 0.0
    #: How the host was reached, for the ``ssh`` row (None: nothing to report).
    reach: Optional[str] = None
    #: The reach row's status: "ok", "warn" (e.g. an unchecked host key) or "FAIL".
    reach_status: str = "ok"
    tunnel_error: Optional[str] = None


class Transport(abc.ABC):
    """How the launcher reaches one host; see the module docstring.

    What the layers above need to know of a host is asked here, as a capability, never
    by its kind: whether it is this machine (`this_machine`), whether its ranks dial
    the controller through a tunnel (`tunnels`), whether it may be a gateway or a leaf
    of the tree (`tree_member`), whether its agent dials in rather than being started
    (`dials_in`), how a dry run says it is reached (`describe`, `details`), and whether
    it gives a shell for ``--on`` (`shell`).
    """

    #: The kind's name, as a cluster file's ``transport:`` names it.
    kind: ClassVar[str] = ""
    #: Can a launch reach this host again after losing it, to clear what is left there?
    #: (Not a Slurm node whose slurmd died: srun would wait for it.)
    sweep_after_loss: ClassVar[bool] = True
    #: May the host be a gateway of the tree, or a leaf started through one (beyond
    #: ``fanout``)? Only hosts a gateway's relay can itself reach (an SSH server).
    tree_member: ClassVar[bool] = False
    #: Does the host's agent connect to the launcher, rather than the launcher starting
    #: it? Then `start_agent` waits, bounded, for that agent and returns its stream; the
    #: kill-all and the leash are the same, because they travel on that stream.
    dials_in: ClassVar[bool] = False

    def __init__(self, worker: WorkerSpec, settings: object = None, *,
                 purpose: str = "agent") -> None:
        self.worker = worker
        self.host = worker.host
        #: The kind's own settings, as its kind reads them (an SSH host's ``SshSettings``
        #: through ~/.ssh/config; a plug-in's ``transport:`` block): only the kind reads it.
        self.settings: Any = settings
        #: What the agent is for: ``agent`` (a run) or ``cleanup``; a Slurm step's name.
        self.purpose = purpose

    @classmethod
    def check_worker(cls, worker: WorkerSpec) -> Optional[str]:
        """Why this kind cannot reach ``worker`` as the cluster file describes it (said at
        its ``transport`` key, exit 2, before anything starts), or None."""
        return None

    @classmethod
    def resolve_settings(cls, cluster: ClusterSpec, workers: tuple[WorkerSpec, ...],
                         events: Optional[EventBus]) -> dict[str, Any]:
        """These workers' settings, by host, resolved before anything is contacted (a
        problem is a `ConfigError`). By default a worker's ``transport:`` block as the
        file gives it (`WorkerSpec.transport_settings`)."""
        return {w.host: dict(w.transport_settings) for w in workers if w.transport_settings}

    @property
    def this_machine(self) -> bool:
        """The host is the launcher's own machine (its name says so): loopback reaches it,
        and its devices can be listed without an agent."""
        return self.worker.is_local

    @property
    def destination(self) -> Optional[str]:
        """The address the host is really dialled at, as its kind resolved it (an SSH
        host's ssh_config ``HostName``), or None: what tells whether a host named by an
        alias is this machine after all (`commands.planwarnings`)."""
        return None

    @property
    def tunnels(self) -> bool:
        """The host's ranks reach the coordinator through a tunnel this transport holds."""
        return self.worker.tunnel

    # -- the connection -----------------------------------------------------------------
    def connect(self) -> None:
        """Open what the host needs before agents start; `TransportError` if it cannot."""
        return None

    @property
    def connected(self) -> bool:
        """True while what `connect` opened is usable (always, for a host with nothing)."""
        return True

    def redial(self, timeout: float) -> Optional[Transport]:
        """A new transport to this host whose connect waits at most ``timeout`` seconds,
        or None where that means nothing (this machine, a Slurm node, a leaf reached
        through a gateway): how the launcher reaches a host cut off by a partition again
        the moment the link is back (`commands.healwatch`)."""
        return None

    def reconnect(self) -> None:
        """A fresh connection: the old one is gone or cannot be trusted."""
        self.close()
        self.connect()

    def close(self) -> None:
        """Release the connection (idempotent)."""
        return None

    # -- the agent ----------------------------------------------------------------------
    @abc.abstractmethod
    def start_agent(self, stdout: ByteSink, stderr: ByteSink) -> AgentProcess:
        """Start this host's agent; its stdout and stderr bytes go to the sinks."""

    # -- host services ------------------------------------------------------------------
    @contextlib.contextmanager
    def tunnel(self, port: int, target: str, *,
               local_port: Optional[int] = None) -> Iterator[None]:
        """A remote forward of ``port`` on the host to ``target:port`` here (to
        ``target:local_port`` when given: a pre-flight's stand-in for a busy port)."""
        raise TransportError(self.host, f"a {self.kind} host has no tunnel")
        yield  # pragma: no cover

    def watch(self, monitor: KeepaliveMonitor) -> None:
        """Have ``monitor`` check this host's connection (SSH keepalives)."""
        return None

    def answers(self) -> Optional[str]:
        """After `connect`: None when the host itself answers, else why not. Connecting
        reaches the host for most kinds; a kind whose connect does not (a gateway's leaf:
        it only makes sure the relay runs) checks here, so an elastic launch leaves a dead
        host out rather than failing when its agent will not start."""
        return None

    @abc.abstractmethod
    def probe(self, script: str, *, timed: bool, tunnel: Optional[tuple[int, int]] = None,
              timeout: float = 60.0, clock_marker: str = "") -> ProbeResult:
        """Run the pre-flight script once (``timed``: also time the shell and the round
        trip, and note when the line starting ``clock_marker`` arrived); ``tunnel`` =
        (remote port, local port) to forward meanwhile."""

    @abc.abstractmethod
    def describe(self) -> str:
        """How the agent is reached, for the dry run (opens nothing)."""

    @classmethod
    def after_sweep(cls, workers: tuple[WorkerSpec, ...], events: EventBus) -> None:
        """After a cleanup swept these workers: anything the kind itself must tidy (a
        Slurm job's leftover agent steps), said as events. Most kinds have nothing."""
        return None

    def details(self) -> dict[str, Any]:
        """What the dry run's JSON says of how the host is reached."""
        return {"transport": self.kind}

    def shell(self) -> Any:
        """A Fabric Connection that runs commands on the host (``--on HOST``), for kinds
        that have one; None for the others."""
        return None


def launcher_address(toward: str) -> str:
    """The address of this machine that ``toward`` would see: what ranks dial to reach the
    coordinator. A connected UDP socket sends nothing; the kernel only picks the route."""
    try:
        infos = socket.getaddrinfo(toward, None, type=socket.SOCK_DGRAM)
    except OSError:
        return socket.gethostname()
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect((sockaddr[0], 9))
                return str(s.getsockname()[0])
            except OSError:
                continue
    return socket.gethostname()
