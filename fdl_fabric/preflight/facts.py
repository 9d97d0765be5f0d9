"""What the verdicts judge: one host's measured values, and the controller's own facts
they are compared with (`verdicts`, `gpus`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class HostFacts:
    """What was measured on one host: the agent's values and the script's, plus the
    timings around them."""

    values: dict[str, str]
    exit_status: Optional[int] = 0
    stderr: str = ""
    probe_ms: float = 0.0
    shell_ms: Optional[float] = None
    #: Controller wall time matching the moment the host printed its clock, and its
    #: uncertainty (half the network round trip); None when not measured (local host).
    clock_ref: Optional[float] = None
    clock_error: float = 0.0
    tunnel_error: Optional[str] = None
    #: Why the host's agent gave no values (it did not start, ended, or did not answer).
    agent_error: Optional[str] = None


@dataclass(frozen=True)
class ControllerFacts:
    """What the verdicts compare hosts against."""

    arch: str = ""
    libc: str = ""
    #: Network namespace and boot id of the controller: equal on a host means the host's
    #: 127.0.0.1 is the controller's own (same machine, same namespace).
    identity: str = ""
    bind_host: str = "127.0.0.1"
    port: int = 1337
