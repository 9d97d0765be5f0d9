"""A worker whose agent dials in (``transport: join``, or a walk-in of a discovery
window): the launcher starts nothing there. Its joiner (`fdl-fabric join`) was
admitted by the join window (`joinport`), and its settings are that admission
(`joinport.Joined`); starting its agent is telling the joiner to start the agent of the
fdl-fabric installed there, whose frames then travel on the same connection. The leash
is that connection: when it ends, the joiner closes its agent's input, and the agent
stops its ranks as it does when an SSH session ends.
"""

from __future__ import annotations

from typing import Any, Optional

from ..clusterfile import JOIN_KIND
from .base import AgentProcess, ByteSink, ProbeResult, Transport, TransportError
from .joinport import HANDSHAKE_S, Joined, JoinedAgentProcess


class JoinTransport(Transport):
    """A joined worker: its agent is started by a message on its connection.

    Its settings are its first admission (`joinport.Joined`); the joiner it starts an
    agent through is always its host's latest (`JoinPort.current`): each attempt needs a
    fresh one, since a joiner's agent runs once, and `fdl-fabric join --persist` dials
    again after each run. Connecting is waiting for that joiner, bounded by the window's
    length (`rejoin_wait`): a walk-in that never comes back is a host that cannot be
    reached, which the membership rule (``min_hosts``) leaves out or which ends the
    launch, as any unreachable host does."""

    kind = JOIN_KIND
    dials_in = True
    #: Its connection is gone with its agent: nothing reaches the host after a loss.
    sweep_after_loss = False

    @property
    def first(self) -> Joined:
        if not isinstance(self.settings, Joined):
            raise TransportError(self.host, "it has not joined the window (fdl-fabric join)")
        return self.settings

    def _current(self) -> Optional[Joined]:
        first = self.first
        return first.port.current(self.host) or first

    @property
    def this_machine(self) -> bool:
        return False

    @property
    def tunnels(self) -> bool:
        return False

    @property
    def destination(self) -> Optional[str]:
        return self.first.peer if isinstance(self.settings, Joined) else None

    @property
    def connected(self) -> bool:
        """A joiner of this host is there, its agent not yet started."""
        current = self._current()
        return current is not None and current.ready

    def connect(self) -> None:
        """Wait, bounded, for a joiner of this host ready to start an agent."""
        port = self.first.port
        if port.wait_ready(self.host, port.rejoin_wait) is None:
            raise TransportError(self.host, f"it did not join again within "
                                 f"{port.rejoin_wait:g}s (fdl-fabric join --persist dials "
                                 "again after each run)")

    def start_agent(self, stdout: ByteSink, stderr: ByteSink) -> AgentProcess:
        """One agent per joiner, started by telling it to start its own install's."""
        port = self.first.port
        joined = port.wait_ready(self.host, HANDSHAKE_S)
        if joined is None:
            raise TransportError(self.host, "no joiner of it is ready: its agent has run "
                                 "and it did not join again (fdl-fabric join --persist)")
        joined.attach(stdout, stderr)
        joined.send({"start": True})
        return JoinedAgentProcess(joined)

    def probe(self, script: str, *, timed: bool, tunnel: Optional[tuple[int, int]] = None,
              timeout: float = 60.0, clock_marker: str = "") -> ProbeResult:
        raise TransportError(self.host, "a worker that dials in has no shell to probe; its "
                             "agent answers the launch's pre-flight")

    def describe(self) -> str:
        if isinstance(self.settings, Joined):
            return f"its agent dialled in from {self.settings.peer} (fdl-fabric join)"
        return "its agent dials in to the join window (fdl-fabric join)"

    def details(self) -> dict[str, Any]:
        return {"transport": self.kind,
                "peer": self.settings.peer if isinstance(self.settings, Joined) else None}
