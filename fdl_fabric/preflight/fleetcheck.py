"""The fleet pre-flight over the agents' sessions: host-to-host reachability and the
interfaces (`matrix`, `nic`), then the collective smoke test (`smoke`).

The same code path for prebuild-check and a launch: both hand over the sessions of the
agents they started (a launch's own, through the gateway tree beyond ``fanout``) and one
inbox; each step is a PROBE to every agent at once, answered by FACTS, collected under a
bound, judged by the pure functions. The listeners are closed, and their closing
confirmed, before the smoke test and before any rank starts, so the job finds its ports
free.
"""

from __future__ import annotations

import dataclasses
import queue
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import reports
from ..agent import fleet
from ..clusterfile import ClusterSpec
from ..errors import FdlError
from ..events import EventBus, Name
from ..planning.envelope import PrebuiltBinary
from ..planning.plan import LaunchPlan, build_plan
from ..transport.session import AgentSession
from . import matrix, nic
from .agents import CHECK_RUN, LiveAgent
from .answers import collect
from .probe import settings_of
from .report import CONTROLLER, Check, Status

#: Seconds every agent has to bind its ports and answer, and to release them.
LISTEN_TIMEOUT = 10.0
#: Beyond the dials' own bound, seconds the launcher waits for every host's results.
ANSWER_MARGIN = 5.0


def check_fleet(plan: LaunchPlan, sessions: Mapping[str, AgentSession],
                inbox: queue.SimpleQueue[reports.Report], events: EventBus) -> None:
    """``inv launch --smoke``, before the first attempt: the matrix, the interfaces and
    the smoke test over the launch's own sessions, each row said as the pre-flight's are;
    raise `FdlError` (exit 1, nothing started) on a FAIL, naming every failed row."""
    rows = with_smoke(plan, sessions, inbox, check_reach(plan, sessions, inbox))
    failures = []
    for row in rows:
        if row.status is Status.FAIL:
            events(Name.PREFLIGHT_FAILED_CHECK, host=row.host, check=row.name,
                   reason=row.reason)
            failures.append(row.reason)
        elif row.status is Status.WARN:
            events(Name.PREFLIGHT_WARNING, host=row.host, check=row.name, reason=row.reason)
        else:
            events(Name.FLEET_CHECK_PASSED, host=row.host, check=row.name, reason=row.reason)
    if failures:
        more = f"; and {len(failures) - 1} more above" if len(failures) > 1 else ""
        raise FdlError(f"cluster launcher: the smoke test failed ({failures[0]}{more}) — "
                       "nothing was started")


def with_smoke(plan: LaunchPlan, sessions: Mapping[str, AgentSession],
               inbox: queue.SimpleQueue[reports.Report], rows: list[Check]) -> list[Check]:
    """``rows`` and the smoke test's, unless a host cannot reach another: then every
    collective would only wait for its bound, and one row says why it did not run."""
    from .smoke import run_smoke

    if any(r.status is Status.FAIL and r.name in ("reach", "nic") for r in rows):
        return [*rows, Check(CONTROLLER, "smoke", Status.WARN, "not run: hosts cannot "
                             "reach each other on the job's ports (above), so no collective "
                             "can form")]
    return rows + run_smoke(plan, sessions, inbox)


def peers_of(cluster: ClusterSpec, hosts: Sequence[str]) -> list[matrix.Peer]:
    """The hosts of the check, in roster order, with their address and settings."""
    return [matrix.Peer(w.host, w.addr, settings_of(cluster, w))
            for w in cluster.workers if w.host in hosts]


def check_reach(plan: LaunchPlan, sessions: Mapping[str, AgentSession],
                inbox: queue.SimpleQueue[reports.Report]) -> list[Check]:
    """The matrix and the interface rows of the plan's hosts (two or more)."""
    hosts = [h for h in plan.hosts() if h in sessions]
    if len(hosts) < 2:
        return []
    started = time.monotonic()
    peers = peers_of(plan.cluster, hosts)
    master_host, port = plan.ranks[0].host, plan.cluster.master_port
    ask = _Ask(sessions, inbox, hosts)
    token = secrets.token_hex(16)
    try:
        answers = ask.each({p.host: matrix.listen_request(p, master_host, port, token)
                            for p in peers}, LISTEN_TIMEOUT)
        targets = matrix.dials(peers, answers, master_host, plan.master_addr, port,
                               plan.cluster.fanout, seed=plan.run_id)
        batches = -(-max(len(t) for t in targets.values()) // fleet.MAX_IN_FLIGHT) or 1
        dialed = ask.each({h: {"op": "dial", "timeout": matrix.DIAL_TIMEOUT,
                               "targets": [t.wire() for t in targets[h]]} for h in hosts},
                          matrix.DIAL_TIMEOUT * batches + ANSWER_MARGIN)
    finally:  # the ports are released, and that is confirmed, before anything else runs
        ask.each({h: {"op": "close"} for h in hosts}, LISTEN_TIMEOUT)
    results = {h: a.get("dialed") or {} for h, a in dialed.items()}
    rows = matrix.listen_rows(master_host, port, answers)
    rows += matrix.judge(targets, results, time.monotonic() - started,
                         sampled=len(hosts) > plan.cluster.fanout)
    by_host = matrix.iface_failures(targets, results)
    for p in peers:
        rows += nic.reach_rows(p.host, p.ifnames, by_host.get(p.host, {}))
    return rows


class _Ask:
    """One step of the fleet check: a request to every host's agent at once, and each
    one's answer under a bound."""

    def __init__(self, sessions: Mapping[str, AgentSession],
                 inbox: queue.SimpleQueue[reports.Report], hosts: Sequence[str]) -> None:
        self.sessions, self.inbox, self.hosts = sessions, inbox, hosts

    def each(self, requests: Mapping[str, dict[str, Any]], timeout: float
             ) -> dict[str, dict[str, Any]]:
        for host, request in requests.items():
            self.sessions[host].send_probe({"fleet": request})
        return _collect(self.hosts, self.inbox, timeout)


def _collect(hosts: Sequence[str], inbox: queue.SimpleQueue[reports.Report],
             timeout: float) -> dict[str, dict[str, Any]]:
    """Each host's next ``fleet`` answer; a host whose agent ended or did not answer in
    time gets ``{"error": why}``. Other reports are put back, in order."""
    return collect(hosts, inbox, timeout, lambda r: getattr(r, "fleet", None))


def prebuild_fleet(cluster: ClusterSpec, argv: Sequence[str],
                   prebuilt: Mapping[str, PrebuiltBinary], kept: Mapping[str, LiveAgent],
                   *, smoke: bool) -> list[Check]:
    """prebuild-check's fleet rows, over the agents it kept after their pre-flight: the
    plan a launch would make (its MASTER_ADDR, its ranks' environment), then the matrix
    and the interfaces, then (``smoke``) the smoke test."""
    inbox: queue.SimpleQueue[reports.Report] = queue.SimpleQueue()
    for live in kept.values():
        live.relay.inbox = inbox
    members = dataclasses.replace(cluster, workers=tuple(
        w for w in cluster.workers if w.host in kept))
    resolved = {h: _listed(live.values) for h, live in kept.items()}
    try:
        plan = build_plan(members, argv=tuple(argv) or ("true",), run_id=CHECK_RUN,
                          salt=secrets.token_bytes(16), resolved_devices=resolved,
                          prebuilt={h: b for h, b in prebuilt.items() if h in kept})
    except (ValueError, FdlError) as exc:
        return [Check(CONTROLLER, "reach", Status.FAIL, f"cannot plan the ranks: {exc}")]
    sessions = {h: live.session for h, live in kept.items()}
    rows = check_reach(plan, sessions, inbox)
    return with_smoke(plan, sessions, inbox, rows) if smoke else rows


def _listed(values: Mapping[str, str]) -> list[int]:
    """The GPU indices the agent listed (``local_devices: all``), else GPU 0."""
    found = [int(f.split(",")[0]) for f in values.get("gpus", "").split(";")
             if f.split(",")[0].strip().isdigit()]
    return found or [0]


def dismiss_all(kept: Iterable[LiveAgent]) -> None:
    """End every kept agent at once (each bounded by its own leash's timeout)."""
    agents = list(kept)
    with ThreadPoolExecutor(max_workers=max(1, min(32, len(agents)))) as pool:
        list(pool.map(lambda live: live.dismiss(), agents))
