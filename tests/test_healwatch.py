"""Issue 34, item 6, as logic: a host lost in an attempt is dialled again until it answers
(each dial bounded), and then its lost attempt is swept there at once; never past the
bound, never after the verdict. Fake transports here; the real partition and heal, in
network namespaces: tests/test_heal_lab.py.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import pytest

from fdl_fabric.clusterfile import parse_cluster
from fdl_fabric.commands import healwatch
from fdl_fabric.commands.cleanup import HostReport
from fdl_fabric.events import EventBus, EventLog, Name, event
from fdl_fabric.presentation.words import render
from fdl_fabric.transport import Transport, TransportError


class Host(Transport):
    """A host this module never starts an agent on (the sweep is faked)."""

    def start_agent(self, stdout: Any, stderr: Any) -> Any:
        raise NotImplementedError

    def probe(self, script: str, **_: Any) -> Any:
        raise NotImplementedError

    def describe(self) -> str:
        return "fake"


class Dialled(Host):
    """A host that refuses ``refusals`` dials, then answers."""

    refusals = 0
    dials = 0

    def connect(self) -> None:
        type(self).dials += 1
        if type(self).dials <= type(self).refusals:
            raise TransportError(self.host, "Network is unreachable")
        self.open = True

    @property
    def connected(self) -> bool:
        return getattr(self, "open", False)

    def close(self) -> None:
        self.open = False


class Lost(Host):
    """The launcher's transport to a host it lost: it can be dialled again."""

    def redial(self, timeout: float) -> Optional[Transport]:
        return Dialled(self.worker, purpose="cleanup")


class ThisMachine(Host):
    """A host with nothing to dial (the default)."""


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    Dialled.refusals, Dialled.dials = 0, 0
    monkeypatch.setattr(healwatch, "RETRY", 0.01)
    asked: list[dict[str, Any]] = []

    def sweep(transports: list[Transport], request: dict[str, Any], **_: Any) -> list[HostReport]:
        asked.append(dict(request, hosts=[t.host for t in transports]))
        return [HostReport(transports[0].host, stopped=[{"run": "r1", "pids": [4321]}])]
    monkeypatch.setattr(healwatch, "sweep_with_agents", sweep)
    return asked


def watch(bound: float = 5.0, attempt: int = 0, kind: type[Transport] = Lost
          ) -> tuple[healwatch.HealWatch, EventLog]:
    log = EventLog()
    (worker,) = parse_cluster("workers:\n  - host: node2\n    path: /srv\n    nproc: 1\n",
                              local_hostname="controller").workers
    transports = {"node2": kind(worker)}
    w = healwatch.HealWatch("r1", lambda: transports, lambda: attempt, bound, EventBus(log))
    return w, log


def wait_until(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_lost_host_is_dialled_until_it_answers_then_its_lost_attempt_is_stopped_there(
        fresh: list[dict[str, Any]]) -> None:
    Dialled.refusals = 3
    w, log = watch(attempt=2)
    w.emit(event(Name.HOST_LOST, host="node2", reason="the SSH session or connection was lost"))
    wait_until(lambda: log.named(Name.HOST_ANSWERED_AGAIN))
    w.stop()
    assert Dialled.dials == 4, "three refused, the fourth answered"
    (asked,) = fresh
    assert (asked["keep"], asked["keep_attempt"], asked["hosts"]) == ("r1", 3, ["node2"]), \
        "attempt 2 and earlier are stopped there; a later attempt there is never touched"
    (said,) = log.named(Name.HOST_ANSWERED_AGAIN)
    assert said.host == "node2" and said.data["pids"] == [4321] and said.data["attempt"] == 2


def test_an_unresponsive_host_is_watched_as_a_lost_one(fresh: list[dict[str, Any]]) -> None:
    w, log = watch()
    w.emit(event(Name.HOST_UNRESPONSIVE, host="node2", host_fault="unresponsive"))
    wait_until(lambda: fresh)
    w.stop()


def test_a_host_that_never_answers_is_given_up_once_its_lease_has_ended_it(
        fresh: list[dict[str, Any]]) -> None:
    Dialled.refusals = 10**6
    w, log = watch(bound=0.3)
    w.emit(event(Name.HOST_LOST, host="node2", reason="lost"))
    time.sleep(0.6)
    dials = Dialled.dials
    time.sleep(0.2)
    assert Dialled.dials == dials, "no dial past the bound"
    assert fresh == [] and not log.named(Name.HOST_ANSWERED_AGAIN)
    w.stop()


def test_a_host_with_nothing_to_dial_is_not_watched(fresh: list[dict[str, Any]]) -> None:
    w, log = watch(kind=ThisMachine)
    w.emit(event(Name.HOST_LOST, host="node2", reason="lost"))
    w.stop()
    assert fresh == [] and Dialled.dials == 0


def test_nothing_is_dialled_or_said_once_the_launch_has_stopped_watching(
        fresh: list[dict[str, Any]]) -> None:
    w, log = watch()
    w.stop()
    w.emit(event(Name.HOST_LOST, host="node2", reason="lost"))
    time.sleep(0.1)
    assert Dialled.dials == 0 and not log.named(Name.HOST_ANSWERED_AGAIN)


def test_a_host_that_answers_with_nothing_left_is_not_mentioned(
        fresh: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(healwatch, "sweep_with_agents",
                        lambda transports, request, **_: [HostReport("node2")])
    w, log = watch()
    w.emit(event(Name.HOST_LOST, host="node2", reason="lost"))
    wait_until(lambda: Dialled.dials >= 1)
    w.stop()
    assert not log.named(Name.HOST_ANSWERED_AGAIN)


def test_what_the_watch_says_is_one_line_naming_the_host_and_the_attempt() -> None:
    said = render(event(Name.HOST_ANSWERED_AGAIN, host="node2", after=12.5, attempt=0,
                        pids=[4321], problem=None))
    assert said == ("cluster launcher: host 'node2' reached again 12.5s after it was lost: "
                    "stopped what attempt 0 still ran there (pids [4321])")
    failed = render(event(Name.HOST_ANSWERED_AGAIN, host="node2", after=1, attempt=0, pids=[],
                          problem="disk\x1b[2Kfull\nfake"))
    assert "\n" not in failed and "\x1b" not in failed


def test_a_host_whose_agent_never_started_is_not_dialled_again(
        fresh: list[dict[str, Any]]) -> None:
    """Its login shell stood in the way, say: nothing of the run can be there."""
    log = EventLog()
    (worker,) = parse_cluster("workers:\n  - host: node2\n    path: /srv\n    nproc: 1\n",
                              local_hostname="controller").workers
    transports = {"node2": Lost(worker)}
    w = healwatch.HealWatch("r1", lambda: transports, lambda: 0, 5.0, EventBus(log),
                            ran=lambda host: False)
    w.emit(event(Name.HOST_LOST, host="node2", reason="the login shell consumed stdin"))
    w.stop()
    assert Dialled.dials == 0 and fresh == []
