"""The loopback warnings (`commands.planwarnings`): raised only for a host on another
machine, and worded in flags for a cluster given by ``--hosts`` or ``--hostfile``."""

from __future__ import annotations

import socket
import textwrap
import threading

import psutil
import pytest

from fdl_fabric.clusterfile import parse_cluster
from fdl_fabric.clusterfile.model import ClusterSpec
from fdl_fabric.commands import planwarnings
from fdl_fabric.commands.planwarnings import ThisMachine, is_loopback, plan_warnings
from fdl_fabric.events import event
from fdl_fabric.planning.plan import LaunchPlan, build_plan
from fdl_fabric.presentation.words import render


def plan_of(cluster: ClusterSpec) -> LaunchPlan:
    return build_plan(cluster, argv=["true"], run_id="r", salt=b"\0" * 16)


def hosts(*names: str, controller: str = "127.0.0.1") -> ClusterSpec:
    """What ``--hosts a,b`` stands for (`hosts.cluster_from_hosts` writes the same cluster
    and reads it with ``file="--hosts"``), with the coordinator at ``controller``."""
    workers = "".join(f"  - host: {n}\n    nproc: 1\n    path: /srv\n" for n in names)
    return parse_cluster(f"controller:\n  host: {controller}\nworkers:\n{workers}",
                         file="--hosts", folder="/srv", local_hostname="x")


def words(cluster: ClusterSpec, **kwargs: object) -> list[str]:
    return [render(event(name, **data))
            for name, data in plan_warnings(plan_of(cluster), **kwargs)]  # type: ignore[arg-type]


def nowhere(name: str) -> list[str]:
    return []


def own_address() -> str:
    """An address of one of this machine's interfaces that is not loopback."""
    found = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
             if a.family == socket.AF_INET and not is_loopback(a.address)]
    assert found, "this machine has an IPv4 address besides loopback"
    return found[0]


def test_hosts_that_are_this_machine_raise_no_loopback_warning() -> None:
    # Loopback addresses, this machine's own address, and aliases whose ssh HostName is
    # loopback (the names themselves resolve nowhere).
    assert words(hosts("127.4.0.21", "127.4.0.22"), lookup=nowhere) == []
    assert words(hosts(own_address(), "127.0.0.3"), lookup=nowhere) == []
    assert words(hosts("node0", "node1"), lookup=nowhere,
                 targets={"node0": "127.4.0.21", "node1": "127.4.0.22"}) == []
    # A name that resolves only to this machine's addresses is this machine.
    assert words(hosts("me.example.invalid", "node1"), targets={"node1": "127.0.0.9"},
                 lookup=lambda name: ["127.0.1.1", own_address()]) == []


def test_a_host_elsewhere_is_warned_about_once_for_the_master_and_never_for_the_coordinator(
        ) -> None:
    # The coordinator on 127.0.0.1 is fine: ranks reach it through their host's agent.
    (said,) = words(hosts("127.0.0.2", "gpu-b.example.invalid"), lookup=nowhere,
                    from_flags=True)
    assert said.startswith("cluster launcher: MASTER_ADDR is 127.0.0.2, a loopback address, "
                           "but gpu-b.example.invalid (gpu-b.example.invalid) dial it")
    assert "coordinator" not in said and "controller" not in said
    # A name resolving to this machine and to another is not only this machine.
    assert words(hosts("127.0.0.2", "mixed.example.invalid"), from_flags=True,
                 lookup=lambda name: ["127.0.0.1", "192.0.2.7"])


def test_a_thousand_names_are_looked_up_many_at_a_time() -> None:
    slow = threading.Event()
    at_once: list[int] = []
    running = [0]
    lock = threading.Lock()

    def lookup(name: str) -> list[str]:
        with lock:
            running[0] += 1
            at_once.append(running[0])
        slow.wait(0.01)
        with lock:
            running[0] -= 1
        return []

    names = [f"leaf{i:04d}.example.invalid" for i in range(1, 1025)]
    (said,) = words(hosts("127.0.0.2", *names), lookup=lookup)
    assert "and 1016 more hosts dial it" in said
    assert max(at_once) > 1, "lookups overlap"


def test_a_loopback_master_addr_of_a_file_less_run_names_the_flag() -> None:
    cluster = hosts("127.0.0.5", "192.0.2.10", controller="192.0.2.1")
    (said,) = words(cluster, lookup=nowhere, from_flags=True)
    assert said.startswith("cluster launcher: MASTER_ADDR is 127.0.0.5, a loopback address, "
                           "but 192.0.2.10 (192.0.2.10) dial it from another machine")
    assert said.endswith("pass --master-addr ADDR, an address of the first host that the "
                         "others reach")


def test_a_cluster_files_warning_keeps_the_files_words() -> None:
    cluster = parse_cluster(textwrap.dedent("""\
        workers:
          - host: localhost
            nproc: 1
            path: /srv
          - host: gpu-b.example.invalid
            addr: 192.0.2.10
            nproc: 1
            path: /srv
        """), local_hostname="x")
    (said,) = words(cluster, lookup=nowhere)
    assert "give the first worker an `addr:` the others reach" in said


def test_each_name_is_looked_up_once_and_only_when_a_warning_is_possible() -> None:
    asked: list[str] = []

    def lookup(name: str) -> list[str]:
        asked.append(name)
        return []

    here = ThisMachine(lookup)
    assert not here("a.example.invalid") and not here("a.example.invalid")
    assert here("127.0.0.1") and here("::1") and here("[::1]") and here("localhost")
    assert asked == ["a.example.invalid"]
    # Nothing on loopback: nothing to warn about, no name looked up.
    asked.clear()
    cluster = hosts("a.example.invalid", "b.example.invalid", controller="192.0.2.1")
    assert words(cluster, lookup=lookup) == [] and asked == []


def test_a_resolver_that_never_answers_holds_the_launch_no_longer_than_the_lookup_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    def lookup(name: str) -> list[str]:
        if name.startswith("stuck"):
            release.wait(60)  # a resolver dropping the query; never answered in the test
            return ["127.0.0.1"]
        return []

    monkeypatch.setattr(planwarnings, "LOOKUP_BUDGET", 0.3)
    try:
        (said,) = words(hosts("127.0.0.2", "stuck.example.invalid", "gone.example.invalid"),
                        lookup=lookup)
    finally:
        release.set()
    # Not resolved in time is taken as not resolving: warned about, as the other one.
    assert "stuck.example.invalid (stuck.example.invalid)" in said
    assert "gone.example.invalid (gone.example.invalid)" in said
