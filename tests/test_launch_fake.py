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
    # SIGKILLed: the agent's death is the cause, and none of its ranks is blamed for it.
    assert err[-1].startswith("cluster launcher: failed: the agent of fake2 was killed by "
                              "signal 9 (sender unknown): ranks 2, 3 were lost"), err[-3:]
    assert not any(line.startswith("root cause:") for line in err), err
    assert any("rank 2 of fake2 exited with no exit status (agent lost: the agent was killed "
               "by signal 9" in line for line in err), err


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


# -- a plug-in named in a cluster file --------------------------------------------------

def _cluster_file(tmp_path: Path, kind: str, hosts: int = 2, extra: str = "") -> Path:
    """A cluster file whose workers name their transport, as a user of a plug-in writes."""
    lines = [f"controller:\n  port: {_free_port()}", f"master_port: {_free_port()}",
             "kill_grace: 1", "workers:"]
    for i in range(hosts):
        lines += [f"  - host: {kind}{i + 1}", "    nproc: 1", f"    path: {tmp_path}",
                  "    addr: 127.0.0.1", f"    transport: {kind}" if not extra else
                  f"    transport:\n      kind: {kind}\n{extra}"]
    path = tmp_path / "cluster.yml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_a_plugin_transport_named_in_a_cluster_file_runs_launch_status_and_cleanup(
        fake: type[FakeTransport], tmp_path: Path) -> None:
    from fdl_fabric.commands.cleanup import run_cleanup
    from fdl_fabric.commands.status import run_status

    file = _cluster_file(tmp_path, "fake")
    out, err = io.StringIO(), io.StringIO()
    options = LaunchOptions(cluster_file=str(file),
                            argv=[sys.executable, "-c", "import time; time.sleep(60)"])
    ended: list[int] = []
    launcher = threading.Thread(
        target=lambda: ended.append(launch(options, console=Console(out, err, color=False))),
        daemon=True)
    launcher.start()
    deadline = time.monotonic() + 30
    seen = ""
    while time.monotonic() < deadline:
        status_out, status_err = io.StringIO(), io.StringIO()
        code = run_status(str(file), console=Console(status_out, status_err, color=False))
        seen = status_out.getvalue() + status_err.getvalue()
        if code == 0 and "fake1" in seen and "fake2" in seen and "rank" in seen:
            break
        time.sleep(0.3)
    assert "fake1" in seen and "fake2" in seen, seen
    assert sorted(fake.agents) == ["fake1", "fake2"]

    kept_out, kept_err = io.StringIO(), io.StringIO()
    assert run_cleanup(str(file), console=Console(kept_out, kept_err, color=False)) == 0
    assert launcher.is_alive(), "cleanup never touches a run whose launcher is alive"

    swept_out, swept_err = io.StringIO(), io.StringIO()
    code = run_cleanup(str(file), force=True,
                       console=Console(swept_out, swept_err, color=False))
    said = swept_out.getvalue() + swept_err.getvalue()
    assert code == 0, said
    launcher.join(30)
    assert not launcher.is_alive() and ended and ended[0] != 0, err.getvalue()
    verdict = err.getvalue().splitlines()[-1]
    assert verdict.startswith("cluster launcher: stopped by inv cleanup --force") and \
        verdict.endswith("every rank was stopped"), err.getvalue()


def test_a_transport_the_file_names_but_nobody_registered_is_refused_at_its_key(
        fake: type[FakeTransport], tmp_path: Path) -> None:
    file = _cluster_file(tmp_path, "fakr")
    out, err = io.StringIO(), io.StringIO()
    options = LaunchOptions(cluster_file=str(file), argv=[sys.executable, "-c", "pass"])
    status = launch(options, console=Console(out, err, color=False))
    assert status == 2
    text = err.getvalue()
    assert (f"{file}:10: workers[0].transport: unknown transport 'fakr' (did you mean "
            "'fake'?); known: local, ssh, slurm, join, fake") in text, text
    assert f"{file}:15: workers[1].transport:" in text, "every worker's problem, at once"
    assert fake.connects == [], "nothing was contacted"


def test_a_plugin_reads_its_own_settings_from_its_transport_block(
        fake: type[FakeTransport], tmp_path: Path) -> None:
    file = _cluster_file(tmp_path, "fake", hosts=1, extra="      zone: blue\n      slots: [1, 2]")
    spec = transport.resolve_cluster(str(file))
    made = transport.for_cluster(spec, transport.resolve_settings(spec))
    assert made["fake1"].settings == {"zone": "blue", "slots": [1, 2]}
    assert type(made["fake1"]) is FakeTransport


# -- a worker that dials in --------------------------------------------------------------

class Rendezvous:
    """One loopback port where agents dial in, each saying its host first (the fake's
    hello; `fdl-fabric join` will authenticate it)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.arrived: dict[str, socket.socket] = {}
        self.ready = threading.Condition()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            conn.settimeout(5)
            name = b""
            while not name.endswith(b"\n") and len(name) < 256:
                chunk = conn.recv(1)
                if not chunk:
                    break
                name += chunk
            conn.settimeout(None)
            with self.ready:
                self.arrived[name.decode().strip()] = conn
                self.ready.notify_all()

    def take(self, host: str, timeout: float) -> socket.socket:
        with self.ready:
            if not self.ready.wait_for(lambda: host in self.arrived, timeout):
                raise TransportError(host, f"its agent did not dial in within {timeout:.0f} s")
            return self.arrived.pop(host)

    def close(self) -> None:
        self.listener.close()


class DialInTransport(transport.Transport):
    """A kind whose agents dial in: the launcher starts nothing on the host; its agent,
    started there by whoever runs the host, connects and is handed to the launch."""

    kind = "dialin"
    dials_in = True
    sweep_after_loss = False
    rendezvous: Rendezvous

    def start_agent(self, stdout: ByteSink, stderr: ByteSink) -> AgentProcess:
        from fdl_fabric.transport.streams import SocketAgentProcess

        return SocketAgentProcess(self.rendezvous.take(self.host, 30), stdout, stderr)

    def probe(self, script: str, *, timed: bool, tunnel: Any = None, timeout: float = 60.0,
              clock_marker: str = "") -> Any:
        raise TransportError(self.host, "a worker that dials in has no shell to probe")

    def describe(self) -> str:
        return f"its agent dials in to 127.0.0.1:{self.rendezvous.port}"


def test_workers_that_dial_in_run_a_launch_to_its_verdict_and_are_leashed_by_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import subprocess

    import psutil

    monkeypatch.setattr(transport, "EXTRA_KINDS", dict(transport.EXTRA_KINDS))  # undone after
    transport.register(DialInTransport)  # the one registration a plug-in makes
    rendezvous = DialInTransport.rendezvous = Rendezvous()
    worker = Path(__file__).parent / "progs" / "dialin_worker.py"
    hosts = [subprocess.Popen([sys.executable, str(worker), str(rendezvous.port), name])
             for name in ("dialin1", "dialin2")]
    try:
        file = _cluster_file(tmp_path, "dialin")
        status, err, out = run_file(file, "import os; print('rank', os.environ['RANK'])")
        assert status == 0, err
        assert err[-1] == "cluster launcher: run completed — all 2 ranks exited 0"
        assert sorted(out.splitlines()) == ["[dialin1:cpu:r0] rank 0",
                                            "[dialin2:cpu:r1] rank 1"]
        for host in hosts:  # the stream's end is the agent's leash: the host's agent ends
            assert host.wait(30) == 0
            assert not psutil.pid_exists(host.pid) or \
                psutil.Process(host.pid).status() == psutil.STATUS_ZOMBIE
    finally:
        rendezvous.close()
        for host in hosts:
            if host.poll() is None:
                host.kill()
                host.wait(10)


def run_file(file: Path, code: str) -> tuple[int, list[str], str]:
    out, err = io.StringIO(), io.StringIO()
    options = LaunchOptions(cluster_file=str(file), argv=[sys.executable, "-c", code])
    status = launch(options, console=Console(out, err, color=False))
    return status, err.getvalue().splitlines(), out.getvalue()
