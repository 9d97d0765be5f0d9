"""Issue 35, the coordinator's side: ranks that speak through their host's agent.

The agent's session hands the coordinator ``cohort`` and ``beats`` reports (a fake
session here, which keeps what goes down); every rule of the cohort applies to them as to
a socket's frames: formation, the welcome, membership, the heartbeat timeout from each
rank's own last frame, clean exits, save-and-shutdown. A host speaks for its own ranks
only. The real agent's side, over its Unix socket: tests/test_cohortrelay.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from fdl_fabric import reports
from fdl_fabric.agent import wire
from fdl_fabric.events import EventBus, EventLog, Name, event
from fdl_fabric.supervision.coordinator import Coordinator, CoordinatorSpec
from fdl_fabric.testing.launches import wait_for as waiting
from fdl_fabric.transport.session import BEATS_FRESH, AgentSession

SALT = bytes(range(16))
RUN = "20261205-100000-abcd1234"
#: Ranks 0 and 1 on node0, 2 and 3 on node1.
HOSTS = {0: "node0", 1: "node0", 2: "node1", 3: "node1"}


class Downlinks:
    """What the coordinator sent down to each host's agent."""

    def __init__(self) -> None:
        self.sent: dict[str, list[dict[str, Any]]] = {"node0": [], "node1": []}
        self.lock = threading.Lock()

    def of(self, host: str) -> Callable[[dict[str, Any]], None]:
        def send(body: dict[str, Any]) -> None:
            with self.lock:
                self.sent[host].append(body)
        return send

    def messages(self, host: str, rank: Any = ...) -> list[dict[str, Any]]:
        with self.lock:
            return [b["msg"] for b in self.sent[host]
                    if "msg" in b and (rank is ... or b["rank"] in (rank, None))]

    def broadcasts(self, host: str) -> list[dict[str, Any]]:
        with self.lock:
            return [b["msg"] for b in self.sent[host] if "msg" in b and b["rank"] is None]

    def closes(self, host: str) -> list[int]:
        with self.lock:
            return [b["rank"] for b in self.sent[host] if b.get("close")]


def until(predicate: Callable[[], Any]) -> Any:
    """What the coordinator's I/O thread does at its next turn, waited for (bounded)."""
    return waiting(predicate, 5.0, "the coordinator's I/O thread to act")


@pytest.fixture
def cohort() -> Iterator[tuple[Coordinator, Downlinks, EventLog]]:
    log = EventLog()
    spec = CoordinatorSpec(run_id=RUN, salt=SALT, world_size=4, bind_host="127.0.0.1",
                           port=0, heartbeat_timeout=1.0)
    coord = Coordinator(spec, EventBus(log), rank_hosts=HOSTS)
    down = Downlinks()
    for host in ("node0", "node1"):
        coord.link(host, down.of(host))
    coord.start()
    yield coord, down, log
    coord.stop()


def hello(host: str, rank: int) -> reports.CohortUp:
    return reports.CohortUp(host, rank, {"type": "hello", "rank": rank, "host": host,
                                         "pid": 1000 + rank, "lib": 1})


def join_all(coord: Coordinator) -> None:
    for rank, host in HOSTS.items():
        coord.relayed(hello(host, rank))
    until(lambda: coord.cohort_formed)


def test_ranks_that_speak_through_their_agents_form_the_cohort_and_are_welcomed(
        cohort: tuple[Coordinator, Downlinks, EventLog]) -> None:
    coord, down, log = cohort
    join_all(coord)
    assert coord.joined == {0, 1, 2, 3}
    welcome = down.messages("node1", 2)[0]
    assert welcome["type"] == "welcome" and welcome["rank"] == 2 and welcome["world_size"] == 4
    until(lambda: any(m["type"] == "formed" for m in down.messages("node0", 0)))
    assert [e.data["peer"] for e in log.named(Name.RANK_JOINED) if e.rank == 0] == \
        ["node0 (through its agent)"]


def test_a_host_speaking_for_a_rank_it_does_not_run_changes_nothing(
        cohort: tuple[Coordinator, Downlinks, EventLog]) -> None:
    coord, down, log = cohort
    coord.relayed(hello("node1", 0))  # rank 0 is node0's
    coord.relayed(reports.CohortUp("node1", 1, {"type": "exiting"}))
    coord.relayed(reports.Beats("node1", {0: (0.0, 5)}))
    time.sleep(0.3)
    assert coord.joined == set() and coord.exited == set()
    assert down.sent["node1"] == [] and down.sent["node0"] == []
    assert until(lambda: log.named(Name.PEER_DROPPED) or log.named(Name.PEERS_REFUSED))


def test_a_hello_for_another_rank_than_its_agent_bound_is_refused(
        cohort: tuple[Coordinator, Downlinks, EventLog]) -> None:
    coord, down, log = cohort
    coord.relayed(reports.CohortUp("node0", 1, {"type": "hello", "rank": 0, "host": "node0",
                                                "pid": 1, "lib": 1}))
    time.sleep(0.3)
    assert coord.joined == set() and down.messages("node0") == []
    dropped = until(lambda: log.named(Name.PEER_DROPPED))
    assert "a hello naming rank 0 relayed as rank 1" in str(dropped[0].data), dropped


def test_folded_beats_keep_ranks_alive_and_a_silent_rank_is_declared_dead_from_its_own_age(
        cohort: tuple[Coordinator, Downlinks, EventLog]) -> None:
    coord, down, log = cohort
    dead: list[int] = []
    coord.on_dead = lambda rank, why: dead.append(rank)
    join_all(coord)
    started = time.monotonic()
    while time.monotonic() - started < 2.5:  # 2.5 heartbeat timeouts
        silent = time.monotonic() - started
        coord.relayed(reports.Beats("node0", {0: (0.0, 1), 1: (silent, 0)}))
        coord.relayed(reports.Beats("node1", {2: (0.0, 1), 3: (0.0, 1)}))
        time.sleep(0.1)
    assert dead == [1], "rank 1's agent reported it silent since the start; the rest spoke"
    (declared,) = log.named(Name.RANK_DECLARED_DEAD)
    assert declared.rank == 1 and declared.host == "node0"
    assert 1 in down.closes("node0"), "its agent is told to close it"
    assert any(m["type"] == "membership" and m["dead"] == [1]
               for m in down.messages("node1", 2))


def test_progress_in_folded_beats_is_the_runs_progress(
        cohort: tuple[Coordinator, Downlinks, EventLog]) -> None:
    coord, down, log = cohort
    join_all(coord)
    assert coord.last_progress == 0.0
    coord.relayed(reports.Beats("node1", {3: (0.0, 7)}))
    until(lambda: coord.last_progress > 0.0)


def test_a_clean_exit_said_through_the_agent_is_never_a_death(
        cohort: tuple[Coordinator, Downlinks, EventLog]) -> None:
    coord, down, log = cohort
    join_all(coord)
    coord.relayed(reports.CohortUp("node1", 3, {"type": "exiting"}))
    coord.relayed(reports.CohortUp("node1", 3, closed="connection closed"))
    until(lambda: 3 in coord.exited)
    until(lambda: log.named(Name.RANK_DISCONNECTED))
    assert not log.named(Name.RANK_CONNECTION_LOST)


def test_a_rank_whose_connection_to_its_agent_closes_is_reported_lost(
        cohort: tuple[Coordinator, Downlinks, EventLog]) -> None:
    coord, down, log = cohort
    join_all(coord)
    coord.relayed(reports.CohortUp("node0", 1, closed="connection reset"))
    lost = until(lambda: log.named(Name.RANK_CONNECTION_LOST))
    assert lost[0].rank == 1 and lost[0].data["detail"] == "connection reset"
    assert 1 not in down.closes("node0"), "closed from below: nothing to tell its agent"


def test_save_and_shutdown_reaches_every_relayed_rank(
        cohort: tuple[Coordinator, Downlinks, EventLog]) -> None:
    coord, down, log = cohort
    join_all(coord)
    coord.broadcast_shutdown(event(Name.MAX_FAILURE_REACHED, dead=1, world_size=4, limit=1))
    for host in ("node0", "node1"):
        until(lambda h=host: [m["type"] for m in down.broadcasts(h)].count("shutdown") == 1)
    assert [m["type"] for m in down.broadcasts("node0")] == ["formed", "shutdown"], \
        "one frame per host for all its ranks, not one per rank"


def test_a_hosts_beats_mark_them_flowing_for_the_supervisors_pings() -> None:
    session = AgentSession(SimpleNamespace(host="h1"), lambda report: None)  # type: ignore[arg-type]
    got: list[reports.Report] = []
    session.cohort = got.append
    assert not session.beats_flowing
    session.handle(wire.BEATS, {"ranks": {"3": [0.5, 7]}})
    assert session.beats_flowing and isinstance(got[-1], reports.Beats)
    session._beats_at -= BEATS_FRESH + 0.1  # as if the last came that long ago
    assert not session.beats_flowing
