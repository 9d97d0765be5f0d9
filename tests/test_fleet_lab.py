"""The fleet pre-flight against real hosts: sshd hosts in network namespaces that reach
each other through the root namespace, with real nft rules and real interfaces.

Each test shows the row a user would read: the pair, the port and the cause, or the
interface a host lacks, or the one every peer reaches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fdl_fabric.clusterfile import load_cluster
from fdl_fabric.preflight import Check, Report, Status, run_checks
from fdl_fabric.testing.netns import NetnsLab
from labutil import run_launch

pytestmark = pytest.mark.lab

MASTER_PORT = 29533


def _rows(report: Report, *names: str) -> list[Check]:
    return [c for c in report.checks if c.name in names]


def _failed(report: Report, *names: str) -> list[Check]:
    return [c for c in _rows(report, *names) if c.status is Status.FAIL]


def _lab(netns_lab: Any, **kw: Any) -> NetnsLab:
    lab: NetnsLab = netns_lab(n_hosts=3, routed=True, **kw)
    return lab


def _cluster(lab: NetnsLab, **fields: Any) -> Path:
    # tunnel: the controller's coordinator is on our 127.0.0.1, the hosts are not
    return lab.write_cluster([lab.worker(h, nproc=1, tunnel=True, **fields) for h in lab.hosts],
                             master_port=MASTER_PORT)


def test_every_host_reaches_every_other_on_the_jobs_ports(netns_lab) -> None:
    lab = _lab(netns_lab)
    report = run_checks(load_cluster(_cluster(lab)), argv=["true"])
    assert not _failed(report, "reach", "nic"), report.to_json()
    ok = _rows(report, "reach")
    assert len(ok) == 1 and ok[0].status is Status.OK
    assert "between 3 hosts (every pair)" in ok[0].reason


def test_a_host_whose_traffic_to_rank_0_is_dropped_on_master_port_is_the_one_pair_named(
        netns_lab) -> None:
    lab = _lab(netns_lab)
    a, _, c = lab.hosts
    lab.drop(c, a, MASTER_PORT)
    report = run_checks(load_cluster(_cluster(lab)), argv=["true"])
    assert report.exit_code() == 1
    assert _failed(report, "reach", "nic") == [Check(
        c.name, "reach", Status.FAIL,
        f"{c.name} cannot reach {a.name}:{MASTER_PORT} at {a.addr} (MASTER_ADDR) "
        "(timed out after 2 s)")], report.to_json()


def test_an_interface_named_by_nccl_socket_ifname_that_one_host_lacks_is_named(
        netns_lab, tmp_path: Path) -> None:
    lab = _lab(netns_lab, host_ifnames={0: "eth9", 1: "eth9"})
    cluster = _cluster(lab, nccl_socket_ifname="eth9")
    report = run_checks(load_cluster(cluster), argv=["true"])
    third = lab.hosts[2]
    assert _failed(report, "nic") == [Check(
        third.name, "nic", Status.FAIL,
        f"nccl_socket_ifname eth9: no such interface on this host (it has "
        f"{lab.host_ifname(third)}): the ranks' collectives would fail or hang at init")]
    for h in lab.hosts[:2]:
        assert [r.status for r in report.checks if r.host == h.name and r.name == "nic"] == \
            [Status.OK], report.to_json()

    # A launch runs the same cheap check by default, and refuses before any rank starts.
    marker = tmp_path / "started"
    done = run_launch(cluster, "--cmd", f"touch {marker}", timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "eth9: no such interface on this host" in done.stdout + done.stderr
    assert not marker.exists()


def test_of_two_interfaces_the_one_every_peer_reaches_is_suggested(netns_lab) -> None:
    lab = _lab(netns_lab)
    b = lab.hosts[1]
    lab.add_interface(b, "side0", "10.99.7.1/24")
    report = run_checks(load_cluster(_cluster(lab)), argv=["true"])
    veth = lab.host_ifname(b)
    rows = [r for r in _rows(report, "nic") if r.host == b.name]
    assert len(rows) == 1 and rows[0].status is Status.WARN, report.to_json()
    assert rows[0].reason.startswith(f"{veth} reaches every peer, but side0 10.99.7.1 not from")
    assert rows[0].reason.endswith(f"set nccl_socket_ifname: {veth}")
    assert not _failed(report, "reach")


# -- inv launch --smoke: the same checks over the launch's own sessions ------------------


def test_launch_smoke_through_the_gateway_tree_checks_every_host_then_runs(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=4)
    cluster = lab.write_cluster([lab.worker(h, nproc=2) for h in lab.hosts], fanout=2,
                                kill_grace=1)
    done = run_launch(cluster, "--smoke", "--cmd", "python3 -c 'print(1)'", timeout=240)
    err = done.stderr
    assert done.returncode == 0, done.stdout + err
    assert "reach: " in err and "between 4 hosts (sampled beyond fanout), each reached" in err
    for h, ranks in zip(lab.hosts, ("0, 1", "2, 3", "4, 5", "6, 7")):
        assert f"smoke: {h.name}: ranks {ranks} all-reduced and passed the barrier" in err
    # before the first attempt: the smoke lines come before the run's own launch line
    assert err.index("smoke: ") < err.index("cluster launcher: run ")
    assert err.rstrip().splitlines()[-1] == \
        "cluster launcher: run completed — all 8 ranks exited 0"


def test_launch_smoke_names_the_blocked_pair_and_starts_nothing(
        netns_lab, tmp_path: Path) -> None:
    lab = _lab(netns_lab)
    a, _, c = lab.hosts
    lab.drop(c, a, MASTER_PORT)
    marker = tmp_path / "started"
    done = run_launch(_cluster(lab), "--smoke", "--cmd", f"touch {marker}", timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert f"{c.name} cannot reach {a.name}:{MASTER_PORT} at {a.addr} (MASTER_ADDR) " \
        "(timed out after 2 s)" in out
    assert "smoke: not run: hosts cannot reach each other" in out
    assert "nothing was started" in out.rstrip().splitlines()[-1]
    assert not marker.exists()
