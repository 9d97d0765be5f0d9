"""A launch end to end over a fake transport: no sshd, the real agents and supervisor.

`FakeTransport` is a kind of host the launcher has never heard of, registered the way a
plug-in would be (`fdl_fabric.transport.EXTRA_KINDS`): its agents run on this machine,
but it is no "local" host, and the test decides when it cannot be reached or loses its
agent. The launch itself runs in this process, so the seam is all that is faked.
"""

from __future__ import annotations

import io
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fdl_fabric import transport
from fdl_fabric.clusterfile import ClusterSpec, ControllerSpec, ElasticSpec, SshSpec, WorkerSpec
from fdl_fabric.commands.launch import LaunchOptions, launch
from fdl_fabric.presentation.output import Console
from fdl_fabric.transport.base import AgentProcess, ByteSink, TransportError
from fdl_fabric.transport.local import LocalTransport


class FakeTransport(LocalTransport):
    """Agents on this machine, under any host name; failures on demand."""

    kind = "fake"
    #: Hosts that cannot be reached, and why.
    unreachable: dict[str, str] = {}
    #: Every agent started, by host.
    agents: dict[str, AgentProcess] = {}
    transports: dict[str, FakeTransport] = {}
    connects: list[str] = []

    def connect(self) -> None:
        FakeTransport.connects.append(self.host)
        if self.host in FakeTransport.unreachable:
            raise TransportError(self.host, FakeTransport.unreachable[self.host])
        self.open = True

    @property
    def connected(self) -> bool:
        return getattr(self, "open", False)

    def close(self) -> None:
        self.open = False

    def start_agent(self, stdout: ByteSink, stderr: ByteSink) -> AgentProcess:
        process = super().start_agent(stdout, stderr)
        FakeTransport.agents[self.host] = process
        FakeTransport.transports[self.host] = self
        return process

    def describe(self) -> str:
        return "a fake host (its agent runs here)"


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeTransport]]:
    monkeypatch.setitem(transport.EXTRA_KINDS, "fake", FakeTransport)
    FakeTransport.unreachable = {}
    FakeTransport.agents = {}
    FakeTransport.transports = {}
    FakeTransport.connects = []
    yield FakeTransport


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cluster(tmp_path: Path, hosts: int = 2, nproc: int = 2, **top: Any) -> ClusterSpec:
    workers = tuple(
        WorkerSpec(index=i, host=f"fake{i + 1}", nproc=nproc, local_devices=None,
                   path=str(tmp_path), addr="127.0.0.1", nccl_socket_ifname=None,
                   ssh=SshSpec(), tunnel=False, env={}, data_path=None, is_local=False,
                   line=0, transport="fake")
        for i in range(hosts))
    return ClusterSpec(file="fake.yml", folder=str(tmp_path),
                       controller=ControllerSpec(port=_free_port()), command=None, env={},
                       kill_grace=top.pop("kill_grace", 1.0), master_port=_free_port(),
                       elastic=ElasticSpec(**top.pop("elastic", {})), workers=workers,
                       key=f"fake-{tmp_path.name}", **top)


def run(spec: ClusterSpec, code: str, **opts: Any) -> tuple[int, list[str], str]:
    out, err = io.StringIO(), io.StringIO()
    options = LaunchOptions(cluster=spec, argv=[sys.executable, "-c", code], **opts)
    status = launch(options, console=Console(out, err, color=False))
    return status, err.getvalue().splitlines(), out.getvalue()


def test_a_launch_over_a_transport_the_launcher_never_heard_of_runs_to_its_verdict(
        fake: type[FakeTransport], tmp_path: Path) -> None:
    status, err, out = run(cluster(tmp_path), "import os; print('rank', os.environ['RANK'])")
    assert status == 0, err
    assert err[-1] == "cluster launcher: run completed — all 4 ranks exited 0"
    assert sorted(line for line in out.splitlines()) == [
        "[fake1:cpu:r0] rank 0", "[fake1:cpu:r1] rank 1",
        "[fake2:cpu:r2] rank 2", "[fake2:cpu:r3] rank 3"]
    assert sorted(fake.connects) == ["fake1", "fake2"]


def test_a_host_its_transport_cannot_reach_ends_the_launch_naming_it(
        fake: type[FakeTransport], tmp_path: Path) -> None:
    fake.unreachable = {"fake2": "unreachable: no route to host"}
    status, err, _ = run(cluster(tmp_path), "print('never')")
    assert status == 1
    assert err[-1] == ("cluster launcher: failed: cannot connect to host 'fake2': "
                       "unreachable: no route to host — nothing was started")
    assert fake.agents == {}


def test_a_host_whose_agent_goes_away_is_lost_and_every_other_rank_is_stopped(
        fake: type[FakeTransport], tmp_path: Path) -> None:
    def cut_when_running() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "fake2" not in fake.agents:
            time.sleep(0.02)
        time.sleep(1.0)  # the ranks have started
        fake.agents["fake2"].kill()

    threading.Thread(target=cut_when_running, daemon=True).start()
    status, err, _ = run(cluster(tmp_path), "import time; time.sleep(30)")
    assert status == 1, err
    assert err[-1].startswith("cluster launcher: failed: rank 2 of fake2 exited with no exit "
                              "status (agent lost: "), err[-3:]
    assert any("the agent was killed by signal 9" in line for line in err), err


def test_a_restart_reconnects_a_host_whose_connection_is_gone(
        fake: type[FakeTransport], tmp_path: Path) -> None:
    def drop_when_running() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "fake2" not in fake.transports:
            time.sleep(0.02)
        fake.transports["fake2"].open = False  # its connection is gone after attempt 0

    threading.Thread(target=drop_when_running, daemon=True).start()
    code = ("import os, sys, time\n"
            "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
            "    time.sleep(0.5)\n"
            "    sys.exit(3 if os.environ['RANK'] == '2' else 0)\n")
    status, err, _ = run(cluster(tmp_path, elastic={"max_restarts": 1}), code)
    assert status == 0, err
    assert any("restarting every rank (restart 1 of 1)" in line for line in err)
    assert sorted(fake.connects) == ["fake1", "fake2", "fake2"], fake.connects
