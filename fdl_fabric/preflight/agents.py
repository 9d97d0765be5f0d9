"""prebuild-check asks each host's agent for its facts, as a launch's pre-flight does.

One agent per host, started as a launch starts it (`Transport.start_agent`, an
`AgentSession`) and given a spec with no rank whose ``checks`` are the pre-flight's
(`probe.agent_checks`): it answers PREFLIGHT with raw values, exactly as before a launch
(`fdl_fabric.agent.checks.gather`), and ends on the leash, having started nothing. So a
host fact is gathered by one gatherer whichever command asks.

The controller's end of the port check is here too: a listener that answers an agent's
keyed ``probe`` frame as the coordinator does, with this check's salt, so the agent's
``ok`` proves it reached *this* controller. A tunneled worker dials it through the
transport's remote forward, held open while its agent gathers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import queue
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Optional

from .. import rank, reports
from ..agent import wire
from ..transport import Transport, TransportError
from ..transport.fanout import describe_start_error
from ..transport.session import AgentSession
from .probe import HostPlan, agent_checks

#: The run id of a prebuild-check's agents: it keys the dial with the check's salt.
CHECK_RUN = "prebuild-check"
#: Seconds an agent has to report (nvidia-smi gets 10 s per query, a dial 3 s).
ANSWER_TIMEOUT = 60.0
#: Seconds an agent has to end once told to (it started nothing).
GONE_TIMEOUT = 5.0
#: Seconds a connection to the listener has to send its probe frame.
PROBE_READ_TIMEOUT = 2.0


class Relay:
    """Where a kept agent's reports go: its own queue while it answers its pre-flight,
    then the fleet check's shared inbox (`LiveAgent`)."""

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue[reports.Report] = queue.SimpleQueue()

    def put(self, report: reports.Report) -> None:
        self.inbox.put(report)


@dataclass
class LiveAgent:
    """An agent kept after its pre-flight answer, for the fleet check across hosts;
    `dismiss` ends it (the leash) and closes its tunnel."""

    session: AgentSession
    relay: Relay
    stack: contextlib.ExitStack
    values: dict[str, str]

    def dismiss(self) -> None:
        try:
            _dismiss(self.session, self.relay.inbox)
        finally:
            self.stack.close()


@dataclass
class AgentAnswer:
    """What one host's agent said: its values, or why there are none; and why the
    tunnel for its dial could not be opened, if it could not."""

    values: dict[str, str]
    error: Optional[str] = None
    tunnel_error: Optional[str] = None


def check_spec(plan: HostPlan, salt: bytes) -> dict[str, object]:
    """A spec with no rank and no cluster (nothing to sweep): the agent gathers what
    ``checks`` asks, reports it, and waits for the leash. The salt reaches the agent in
    the envelope, as a launch's does, on its stdin."""
    envelope = json.dumps({"salt": salt.hex()}).encode("utf-8").hex()
    return {"version": wire.VERSION, "mode": "check", "run_id": CHECK_RUN, "cluster": "",
            "host": plan.host, "kill_grace": 0, "cwd": plan.worker.path, "argv": [],
            "env": {}, "ranks": [], "envelope": envelope, "checks": agent_checks(plan),
            "start_now": False}


def ask_agent(plan: HostPlan, transport: Transport, salt: bytes,
              keep: Optional[dict[str, LiveAgent]] = None) -> AgentAnswer:
    """Connect, hold the worker's tunnel open (if it has one), start its agent, ask, and
    tell it to end, or, with ``keep``, keep it there (alive, for the fleet check) instead.
    Never raises for the host's sake: a failure is the answer's error."""
    try:
        transport.connect()
    except TransportError as exc:
        return AgentAnswer({}, error=exc.reason)
    with contextlib.ExitStack() as stack:
        tunnel_error = _open_tunnel(stack, plan, transport)
        if plan.dial is not None and tunnel_error is not None:
            # Nothing to dial; the host still says which loopback it has.
            plan = dataclasses.replace(plan, dial=dataclasses.replace(plan.dial, host=""))
        relay = Relay()
        session = AgentSession(transport, relay.put)
        try:
            session.start()
        except Exception as exc:
            return AgentAnswer({}, f"cannot start its agent: {describe_start_error(exc)}",
                               tunnel_error)
        kept = False
        try:
            session.spec(check_spec(plan, salt))
            values, error = _answer(relay.inbox, ANSWER_TIMEOUT)
            if keep is not None and error is None:
                keep[plan.host] = LiveAgent(session, relay, stack.pop_all(), values)
                kept = True
        finally:
            if not kept:
                _dismiss(session, relay.inbox)
        return AgentAnswer(values, error, tunnel_error)


def _open_tunnel(stack: contextlib.ExitStack, plan: HostPlan,
                 transport: Transport) -> Optional[str]:
    """A tunneled worker's remote forward to the listener, entered on ``stack``; why it
    could not be opened, else None."""
    dial = plan.dial
    if dial is None or not dial.tunnel or not dial.host:
        return None
    try:  # the host's configured port, delivered to our listener (a stand-in when busy)
        stack.enter_context(transport.tunnel(dial.configured_port, "127.0.0.1",
                                             local_port=dial.listen_port))
    except Exception as exc:  # what sshd said (a paramiko error), or TransportError
        return getattr(exc, "reason", None) or str(exc) or type(exc).__name__
    return None


def _answer(inbox: queue.SimpleQueue[reports.Report], timeout: float
            ) -> tuple[dict[str, str], Optional[str]]:
    """The agent's PREFLIGHT values, or why none came within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            report = inbox.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return {}, f"no answer within {timeout:g} s"
        if isinstance(report, reports.Preflight):
            return report.values, None
        if isinstance(report, reports.AgentGone):
            return {}, report.reason or "its agent ended without reporting"


def _dismiss(session: AgentSession, inbox: queue.SimpleQueue[reports.Report]) -> None:
    """The leash (the agent started nothing, so it ends at once); cut after
    `GONE_TIMEOUT` if it has not."""
    session.close_input()
    deadline = time.monotonic() + GONE_TIMEOUT
    while True:
        try:
            report = inbox.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            session.abandon()
            break
        if isinstance(report, reports.AgentGone):
            break
    session.join(GONE_TIMEOUT)


class ProbeListener:
    """The controller end of the port check: answer every keyed ``probe`` frame with
    ``probe_ok``, as the coordinator answers a launch's agents. Each connection is read
    on a thread of its own, bounded by `PROBE_READ_TIMEOUT`, so a silent one holds up
    no other."""

    def __init__(self, sock: socket.socket, salt: bytes) -> None:
        self.sock = sock
        self.salt = salt
        self.port = int(sock.getsockname()[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fdl-preflight-port",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.sock], [], [], 0.1)
            if not ready:
                continue
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._answer, args=(conn,), name="fdl-preflight-probe",
                             daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError, rank.FrameError), conn:
            conn.settimeout(PROBE_READ_TIMEOUT)
            message = rank.receive(conn, bytearray(), self.salt, CHECK_RUN, 0)
            if message is not None and message.get("type") == "probe":
                conn.sendall(rank.encode_frame(self.salt, CHECK_RUN, 0, {"type": "probe_ok"}))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self.sock.close()
