"""What hosts report to the supervisor: one small immutable record per kind of report.

Agent sessions (`fdl_fabric.transport.session`) turn protocol frames into these; the supervisor
consumes them from its inbox, on its own thread, and is the only one that changes rank
state. Requests from signal handlers and the coordinator travel the same way, so the
supervisor sees everything in one order.

Vocabulary (it imports only `events`): transport makes these records and supervision
consumes them, so they live below both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from .events import Event


@dataclass(frozen=True)
class AgentReady:
    """The agent answered with its handshake."""

    host: str
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Facts:
    """Answers to a probe (GPU indices), needed before the plan exists."""

    host: str
    gpus: Optional[list[int]]
    error: str = ""
    #: What the ranks' interpreter reports (`agent.versions.gather`), when asked.
    versions: Optional[dict[str, Any]] = None
    #: The fleet pre-flight's answers (`agent.fleet`): the ports a host listens on and
    #: its interfaces, or what its dials found.
    fleet: Optional[dict[str, Any]] = None
    #: The collective smoke test's answer (`agent.smokerun`): one entry per rank slot.
    smoke: Optional[dict[str, Any]] = None


@dataclass(frozen=True)
class SyncAnswer:
    """A host's answer during a sync (`fdl_fabric.sync`): SYNC_NEED (which objects it
    lacks) or SYNCED (its tree is in place); ``info`` holds ``error`` when it could not."""

    host: str
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SetupOutput:
    """Bytes a host's ``setup:`` wrote (`fdl_fabric.sync.setup` cuts them into lines)."""

    host: str
    stderr: bool
    data: bytes


@dataclass(frozen=True)
class SetupDone:
    """A host's ``setup:`` ended, or was skipped (``info``: the agent's SETUP_DONE)."""

    host: str
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Preflight:
    """The host's fast pre-flight facts (raw values; `preflight` judges them)."""

    host: str
    values: dict[str, str]


@dataclass(frozen=True)
class Swept:
    """What a sweep stopped on the host (leftovers of this cluster, or a cleanup)."""

    host: str
    report: dict[str, Any]


@dataclass(frozen=True)
class Spawned:
    host: str
    rank: int
    pid: int


@dataclass(frozen=True)
class SpawnFailed:
    host: str
    rank: int
    reason: str


@dataclass(frozen=True)
class Output:
    """A chunk of one rank's output: whole lines, or a piece of a long or last line."""

    host: str
    rank: int
    stderr: bool
    data: bytes
    partial: bool


@dataclass(frozen=True)
class Exited:
    host: str
    rank: int
    code: Optional[int]
    signal: Optional[int]
    #: The rank's error file (TORCHELASTIC_ERROR_FILE), when it failed and wrote one.
    error: str = ""


@dataclass(frozen=True)
class Verified:
    """After its last rank: what the agent had to stop, and anything it could not."""

    host: str
    stopped: list[dict[str, Any]]
    remaining: list[dict[str, Any]]


@dataclass(frozen=True)
class AgentError:
    host: str
    message: str
    rank: Optional[int] = None
    #: The agent heard nothing from the launcher for its lease and is stopping its ranks.
    lease_ran_out: bool = False


@dataclass(frozen=True)
class AgentDone:
    """The agent said it is about to exit normally."""

    host: str


@dataclass(frozen=True)
class AgentGone:
    """The agent's session ended. ``clean``: after DONE and with status 0."""

    host: str
    clean: bool
    reason: str
    #: The signal that killed the agent, when its end says so (sshd's ``exit-signal``, a
    #: local agent's status): its host's fault, and no rank's.
    killed_by: Optional[int] = None


@dataclass(frozen=True)
class Signaled:
    """A signal from outside reached the host's agent. ``stopping``: a TERM, INT or HUP
    (scancel, a time limit, an operator) on which it stops its ranks; else a USR1/USR2,
    ``forwarded`` to the ranks by the agent, or delivered to them by Slurm itself."""

    host: str
    signal: str
    stopping: bool
    forwarded: bool = False
    #: Who sent it, when a cleanup stopped this live run (its note: command, pid, host).
    by: Optional[dict[str, Any]] = None


@dataclass(frozen=True)
class Stacks:
    """Where each of the host's ranks is (`fdl_fabric.agent.stacks`)."""

    host: str
    request_id: int
    run: Optional[str]
    ranks: dict[int, dict[str, Any]]
    py_spy: bool = False
    error: str = ""


@dataclass(frozen=True)
class Runs:
    """The runs recorded on a host (``status``, ``stacks``)."""

    host: str
    runs: list[dict[str, Any]]
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class DeclaredDead:
    """The coordinator heard nothing from a joined rank for its heartbeat timeout."""

    rank: int
    #: ``{"silent": s, "heartbeat_timeout": t}`` (`coordinator.Reason`).
    reason: Mapping[str, Any]


@dataclass(frozen=True)
class Joined:
    """The coordinator accepted this rank's hello."""

    rank: int


@dataclass(frozen=True)
class Request:
    """From a signal handler or the launcher: interrupt, kill, forward a signal, abort,
    suspend, resume, stacks."""

    kind: str
    arg: Optional[str] = None
    #: An abort's cause (the cohort did not form, the coordinator failed).
    cause: Optional[Event] = None


@dataclass(frozen=True)
class CohortUp:
    """One of the host's ranks, through its agent (docs/protocol.md): a message the agent
    verified (``msg``: a hello, exiting or ack_shutdown), or its closed connection
    (``closed``, why). For the coordinator, not the supervisor."""

    host: str
    rank: int
    msg: Optional[dict[str, Any]] = None
    closed: Optional[str] = None


@dataclass(frozen=True)
class Beats:
    """Every joined rank of the host: seconds since its last frame, and its progress."""

    host: str
    ranks: dict[int, tuple[float, int]]


Report = Union[AgentReady, Facts, Preflight, Swept, Spawned, SpawnFailed, Output, Exited,
               Verified, AgentError, AgentDone, AgentGone, Signaled, Joined, Request, Stacks,
               Runs, DeclaredDead, SyncAnswer, SetupOutput, SetupDone, CohortUp, Beats]
