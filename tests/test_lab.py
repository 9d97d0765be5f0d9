"""Tests for the sshd lab (fdl_fabric.testing) against real OpenSSH servers.

These run real ``sshd`` processes on 127.x.y.z addresses; they fail (not skip) where
openssh-server is missing, because the rest of the suite's fault tests depend on the lab.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

import fabric
import paramiko
import psutil
import pytest
import yaml

from fdl_fabric import testing
from fdl_fabric.testing import LabError, LabHost, SshdLab, fixtures

# conftest.py loads the labs plugin (fdl_fabric.testing.fixtures) as users' conftests do;
# pytester lets one test check how the fixture behaves on a machine without sshd.
pytest_plugins = ["pytester"]

pytestmark = pytest.mark.lab

LabFactory = Callable[..., SshdLab]


def _gone(pid: int) -> bool:
    """Dead, or a zombie nobody reaped yet (container inits may never reap orphans)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _run(lab: SshdLab, host: LabHost, command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        lab.ssh_argv(host, command), capture_output=True, text=True, timeout=30, check=False
    )


@pytest.fixture
def held_sessions() -> Iterator[list[subprocess.Popen[str]]]:
    """ssh clients a test keeps open; killed at teardown whatever happened."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def _hold(
    lab: SshdLab, host: LabHost, command: str, procs: list[subprocess.Popen[str]]
) -> tuple[subprocess.Popen[str], str]:
    """Start ``command`` over ssh, keep the connection open, return its first stdout line."""
    proc = subprocess.Popen(
        lab.ssh_argv(host, command),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    procs.append(proc)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line, f"no output from {command!r}: {proc.stderr.read() if proc.stderr else ''}"
    return proc, line


def test_each_lab_host_accepts_key_auth_from_openssh(sshd_lab: LabFactory) -> None:
    lab = sshd_lab(n_hosts=2)
    assert len({h.addr for h in lab.hosts}) == 2, "each host needs its own address"
    assert Path(lab.known_hosts).read_text() == "", "known_hosts must start empty (accept-new)"

    for host in lab.hosts:
        result = _run(lab, host, "echo ok; echo $SSH_CONNECTION")
        assert result.returncode == 0, result.stderr + host.log_text()
        lines = result.stdout.splitlines()
        assert lines[0] == "ok"
        # The server end of SSH_CONNECTION proves we reached this host's sshd.
        assert lines[1].split()[2:] == [host.addr, str(host.port)]
        assert f"Accepted publickey for {lab.user}" in host.log_text()

    recorded = Path(lab.known_hosts).read_text().splitlines()
    assert sorted(recorded) == sorted(h.known_hosts_line() for h in lab.hosts)


def test_each_lab_host_accepts_paramiko_via_fabric(sshd_lab: LabFactory) -> None:
    lab = sshd_lab(n_hosts=2)
    for host in lab.hosts:
        with fabric.Connection(
            host=host.addr,
            port=host.port,
            user=lab.user,
            connect_kwargs={
                "key_filename": lab.identity_file,
                "look_for_keys": False,
                "allow_agent": False,
            },
            # An empty SSHConfig keeps ~/.ssh/config out of the test.
            config=fabric.Config(ssh_config=paramiko.SSHConfig()),
        ) as conn:
            # in_stream=False: Invoke would otherwise read stdin, which pytest forbids.
            result = conn.run(f"echo hi; echo ${testing.MARKER_ENV}", hide=True, in_stream=False)
        assert result.stdout.splitlines() == ["hi", host.marker]


def test_stop_leaves_no_lab_process_behind(
    sshd_lab: LabFactory, held_sessions: list[subprocess.Popen[str]]
) -> None:
    lab = sshd_lab(n_hosts=2)
    first, second = lab.hosts

    # A session in progress: its shell execs into sleep, so the printed pid is the sleep.
    holder, line = _hold(lab, first, "echo $$; exec sleep 300", held_sessions)
    in_session = int(line)
    serving = first.session_pids()
    assert serving

    # Daemonised leftovers: re-parented to init, so no longer sshd descendants.  The
    # second one also scrubs the lab marker and is found through SSH_CONNECTION.
    out = _run(
        lab,
        second,
        "setsid sleep 300 </dev/null >/dev/null 2>&1 & echo $!; "
        f"env -u {testing.MARKER_ENV} setsid sleep 301 </dev/null >/dev/null 2>&1 & echo $!",
    )
    escaped = [int(pid) for pid in out.stdout.split()]
    assert len(escaped) == 2, out.stderr
    tree = {p.pid for p in psutil.Process(second.sshd.pid).children(recursive=True)}
    deadline = time.monotonic() + 5
    while any(pid in tree for pid in escaped) and time.monotonic() < deadline:
        time.sleep(0.05)
        tree = {p.pid for p in psutil.Process(second.sshd.pid).children(recursive=True)}
    assert not tree & set(escaped), "the escapees should have left the sshd tree"

    # A bystander that merely looks like an ssh session elsewhere must survive.
    bystander = subprocess.Popen(
        ["sleep", "300"],
        env={**os.environ, "SSH_CONNECTION": "127.0.0.1 50000 127.0.0.1 22"},
    )
    try:
        listeners = [h.sshd.pid for h in lab.hosts]
        started = time.monotonic()
        lab.stop()
        elapsed = time.monotonic() - started

        for pid in [in_session, *escaped, *serving, *listeners]:
            assert _gone(pid), f"pid {pid} survived lab.stop()"
        assert all(h.sshd.returncode is not None for h in lab.hosts)
        assert elapsed < 3, f"stop() took {elapsed:.1f} s for processes that obey SIGTERM"
        assert bystander.poll() is None, "stop() killed a process the lab did not start"
        assert _lab_session_processes(lab) == []
        assert holder.wait(timeout=10) != 0, "the ssh client should see the connection drop"
    finally:
        bystander.kill()
        bystander.wait()


def _lab_session_processes(lab: SshdLab) -> list[int]:
    """Live processes that carry one of the lab's session markers."""
    markers = {h.marker for h in lab.hosts}
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(testing.MARKER_ENV) in markers and not _gone(proc.pid):
                found.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return found


def test_stop_kills_what_ignores_sigterm(
    sshd_lab: LabFactory, held_sessions: list[subprocess.Popen[str]]
) -> None:
    lab = sshd_lab(n_hosts=1, kill_grace=0.5)
    (host,) = lab.hosts
    # The ignored TERM is inherited by every short-lived child the loop keeps starting,
    # so stop() has to KILL the shell and then catch its last orphaned child.
    _, line = _hold(lab, host, "trap '' TERM; echo $$; while :; do sleep 0.05; done", held_sessions)
    stubborn = int(line)
    assert _lab_session_processes(lab)

    started = time.monotonic()
    lab.stop()
    elapsed = time.monotonic() - started

    assert _gone(stubborn)
    assert _lab_session_processes(lab) == []
    assert 0.5 <= elapsed < 4, f"expected TERM, {lab.kill_grace} s grace, KILL; took {elapsed}"


def test_session_pids_names_the_serving_sshd(
    sshd_lab: LabFactory, held_sessions: list[subprocess.Popen[str]]
) -> None:
    lab = sshd_lab(n_hosts=2)
    host, other = lab.hosts
    assert host.session_pids() == [], "readiness probes must not look like sessions"

    holder, line = _hold(lab, host, "echo $PPID; exec sleep 300", held_sessions)
    shell_parent = int(line)
    pids = host.session_pids()
    assert len(pids) == 1
    assert other.session_pids() == []
    # The listed pid is a child of the listener and an ancestor of the session's command
    # (the parent itself for root; the privsep monitor above it for other users).
    assert psutil.Process(pids[0]).ppid() == host.sshd.pid
    lineage = {shell_parent} | {p.pid for p in psutil.Process(shell_parent).parents()}
    assert pids[0] in lineage

    # The fault the API exists for: kill the serving sshd, the client loses the connection
    # and the host keeps accepting new ones.
    os.kill(pids[0], signal.SIGKILL)
    assert holder.wait(timeout=10) == 255
    deadline = time.monotonic() + 5
    while host.session_pids() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert host.session_pids() == []
    assert _run(lab, host, "echo again").stdout == "again\n"


def _served_key(host: LabHost) -> str:
    """The base64 host key the server presents, read with paramiko (no ssh-keyscan)."""
    sock = socket.create_connection((host.addr, host.port), timeout=10)
    transport = paramiko.Transport(sock)
    try:
        transport.start_client(timeout=10)
        return transport.get_remote_server_key().get_base64()
    finally:
        transport.close()


def test_regenerated_host_key_is_served(
    sshd_lab: LabFactory, held_sessions: list[subprocess.Popen[str]]
) -> None:
    lab = sshd_lab(n_hosts=1)
    (host,) = lab.hosts
    assert _run(lab, host, "true").returncode == 0  # records the key (accept-new)
    old_key, port, pid = host.host_key_pub, host.port, host.sshd.pid
    assert _served_key(host) == old_key.split()[1]

    # A session open across the restart, waiting for a line on stdin.
    holder, line = _hold(lab, host, "echo ready; read x; echo survived $x", held_sessions)
    assert line == "ready"

    host.regenerate_host_key()

    assert host.host_key_pub != old_key
    assert (host.port, host.sshd.pid) == (port, pid), "same listener, same addr/port"
    assert _served_key(host) == host.host_key_pub.split()[1]
    refused = _run(lab, host, "echo should-not-run")
    assert refused.returncode == 255
    assert "Host key verification failed" in refused.stderr
    assert "should-not-run" not in refused.stdout

    # Like a production sshd restart (SIGHUP), established sessions keep working.
    out, _ = holder.communicate("yes\n", timeout=10)
    assert out.strip() == "survived yes"


def test_write_cluster_produces_loadable_yaml(sshd_lab: LabFactory) -> None:
    lab = sshd_lab(n_hosts=2)
    first, second = lab.hosts
    path = lab.write_cluster(
        [lab.worker(first), lab.worker(second, local_devices=[0, 1], ssh={"port": 2222})],
        run_name="smoke",
    )
    assert path == lab.root / "cluster.yml"
    doc = yaml.safe_load(path.read_text())

    assert list(doc) == ["controller", "master_port", "kill_grace", "run_name", "workers"]
    assert doc["controller"]["host"] == "127.0.0.1"
    assert 0 < doc["controller"]["port"] < 65536
    assert doc["kill_grace"] == 2
    w1, w2 = doc["workers"]
    assert w1 == {
        "host": first.name,
        "path": first.path,
        "nproc": 2,
        "ssh": {
            "target": first.addr,
            "port": first.port,
            "user": lab.user,
            "identity_file": lab.identity_file,
            "options": lab.ssh_options(),
        },
    }
    assert "nproc" not in w2 and w2["local_devices"] == [0, 1]
    assert w2["ssh"]["port"] == 2222 and w2["ssh"]["target"] == second.addr
    assert os.path.isdir(first.path)


def test_login_shell_rc_runs_before_commands(sshd_lab: LabFactory, tmp_path: Path) -> None:
    tally = tmp_path / "rc_runs"
    lab = sshd_lab(
        n_hosts=1, login_shell_rc=f"export LAB_RC_RAN=yes; echo x >> {tally}", max_sessions=3
    )
    (host,) = lab.hosts
    assert "MaxSessions 3" in Path(host.config_path).read_text()
    # The rc ran, HOME is the real one again, and a nested bash does not rerun the rc.
    result = _run(lab, host, 'echo "$LAB_RC_RAN $HOME"; bash -c true')
    assert result.stdout == f"yes {os.path.expanduser('~')}\n", result.stderr
    assert tally.read_text() == "x\n"


def test_failed_start_reports_the_sshd_log_and_cleans_up(tmp_path: Path) -> None:
    lab = SshdLab(tmp_path, n_hosts=2, extra_sshd_config=["NoSuchLabOption yes"])
    with pytest.raises(LabError, match="NoSuchLabOption"):
        lab.start()
    assert all(h.sshd.poll() is not None for h in lab.hosts)


@pytest.mark.parametrize("plugin", ["fdl_fabric.testing.fixtures", "fdl_fabric.testing"])
def test_fixture_fails_loudly_without_sshd(
    plugin: str, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fixtures, "sshd_available", lambda: False)
    pytester.makeconftest(f'pytest_plugins = ["{plugin}"]')
    pytester.makepyfile("def test_uses_lab(sshd_lab):\n    sshd_lab()\n")
    result = pytester.runpytest_inprocess()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*install openssh-server*"])
