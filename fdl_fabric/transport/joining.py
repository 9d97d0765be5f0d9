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
    """A joined worker: its agent is started by a message on its connection."""

    kind = JOIN_KIND
    dials_in = True
    #: Its connection is gone with its agent: nothing reaches the host after a loss.
    sweep_after_loss = False

    @property
    def joined(self) -> Joined:
        if not isinstance(self.settings, Joined):
            raise TransportError(self.host, "it has not joined the window (fdl-fabric join)")
        return self.settings

    @property
    def this_machine(self) -> bool:
        return False

    @property
    def tunnels(self) -> bool:
        return False

    @property
    def destination(self) -> Optional[str]:
        return self.joined.peer if isinstance(self.settings, Joined) else None

    def start_agent(self, stdout: ByteSink, stderr: ByteSink) -> AgentProcess:
        """One agent per joiner: a second attempt's agent needs the joiner to dial a
        later window (`fdl-fabric join --persist`)."""
        joined = self.joined
        if joined.started:
            raise TransportError(self.host, "its joiner's agent has already run; it joins "
                                 "again at the next window (fdl-fabric join --persist)")
        if not joined.accepted.wait(HANDSHAKE_S) or joined.stream.closed:
            raise TransportError(self.host, "its joiner's connection was closed")
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
