"""prebuild-check against real OpenSSH sshd hosts (the sshd lab), one injected fault each.

Every test shows the row a user would read and the exit code a script would see.
Lab hosts all live on this machine, so "reaching the controller" is trivially true for
them; the tunnel test moves one sshd into its own network namespace, where 127.0.0.1
is not ours, to exercise the real remote-forward path.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fdl_fabric.clusterfile import load_cluster
from fdl_fabric.preflight import CONTROLLER, Check, Report, Status, run_checks
from fdl_fabric.testing import SshdLab
from fdl_fabric.testing.sshd import _find_sshd, _read_banner
from labutil import PROBE, ROOT

pytestmark = pytest.mark.lab

ARGV = ["python3", PROBE]


def _check(report: Report, host: str, name: str) -> Check:
    rows = [c for c in report.checks if c.host == host and c.name == name]
    assert len(rows) == 1, report.to_json()
    return rows[0]


def _run(cluster: Path, argv: list[str] = ARGV, **kw: Any) -> Report:
    return run_checks(load_cluster(cluster), argv=argv, **kw)


# --------------------------------------------------------------------------------------------
# Healthy
# --------------------------------------------------------------------------------------------


def test_a_healthy_cluster_passes_with_every_check_on_every_host(sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=2)
    local = {"host": "localhost", "nproc": 1, "path": str(ROOT), "data_path": str(tmp_path)}
    workers = [local] + [lab.worker(h, data_path=str(tmp_path)) for h in lab.hosts]
    cluster = lab.write_cluster(workers)
    report = _run(cluster)
    table = report.to_json()
    assert report.exit_code() == 0, table
    # The shell row may warn: this machine's own ~/.bashrc (pyenv init) is close to 200 ms.
    assert all(c.status is Status.OK for c in report.checks if c.name != "shell"), table
    for h in lab.hosts:
        names = [c.name for c in report.checks if c.host == h.name]
        assert names == ["ssh", "shell", "paths", "program", "platform", "stacks", "data_path",
                         "clock", "port"]
        assert "new host key recorded" in _check(report, h.name, "ssh").reason
        assert "reached the controller" in _check(report, h.name, "port").reason
    assert _check(report, CONTROLLER, "port").status is Status.OK

    fast = _run(cluster, fast=True)
    assert fast.exit_code() == 0
    assert {c.name for c in fast.checks} == {"ssh", "paths", "program", "port"}
    assert "host key known" in _check(fast, "lab1", "ssh").reason


# --------------------------------------------------------------------------------------------
# One fault each
# --------------------------------------------------------------------------------------------


def test_a_missing_path_fails_that_hosts_paths_row(sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=2)
    missing = str(tmp_path / "does-not-exist")
    cluster = lab.write_cluster([lab.worker(lab.hosts[0], path=missing),
                                 lab.worker(lab.hosts[1])])
    report = _run(cluster, fast=True)
    assert report.exit_code() == 1
    assert _check(report, "lab1", "paths") == Check("lab1", "paths", Status.FAIL,
                                                   f"path {missing} does not exist")
    assert _check(report, "lab2", "paths").status is Status.OK
    assert [c.host for c in report.failed()] == ["lab1"]


def test_a_spare_is_checked_like_every_other_host(sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=2)
    missing = str(tmp_path / "not-on-the-spare")
    cluster = lab.write_cluster([lab.worker(lab.hosts[0]),
                                 lab.worker(lab.hosts[1], path=missing, spare=True)])
    report = _run(cluster, fast=True)
    assert _check(report, "lab1", "paths").status is Status.OK
    assert _check(report, "lab2", "paths").status is Status.FAIL
    assert [c.host for c in report.failed()] == ["lab2"]


def test_a_wrong_key_fails_the_ssh_row_and_other_hosts_are_still_checked(
        sshd_lab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)  # no agent key may log us in
    lab = sshd_lab(n_hosts=2)
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    cluster = lab.write_cluster([lab.worker(lab.hosts[0], ssh={"identity_file": str(other)}),
                                 lab.worker(lab.hosts[1])])
    report = _run(cluster, fast=True)
    assert report.exit_code() == 1
    row = _check(report, "lab1", "ssh")
    assert row.status is Status.FAIL and row.reason.startswith("authentication refused")
    assert str(other) in row.reason
    assert [c.name for c in report.checks if c.host == "lab1"] == ["ssh"]
    assert _check(report, "lab2", "port").status is Status.OK


def test_a_changed_host_key_fails_with_changed(sshd_lab) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = lab.write_cluster([lab.worker(lab.hosts[0])])
    first = _run(cluster, fast=True)
    assert first.exit_code() == 0
    assert "new host key recorded in known_hosts (accept-new)" in \
        _check(first, "lab1", "ssh").reason
    lab.hosts[0].regenerate_host_key()
    report = _run(cluster, fast=True)
    assert report.exit_code() == 1
    row = _check(report, "lab1", "ssh")
    assert row.status is Status.FAIL and "host key has CHANGED" in row.reason
    assert lab.known_hosts in row.reason


def test_a_missing_binary_fails_the_program_row(sshd_lab) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = lab.write_cluster([lab.worker(lab.hosts[0])])
    report = _run(cluster, argv=["nosuchprog-xyz", "--epochs", "3"], fast=True)
    assert report.exit_code() == 1
    assert _check(report, "lab1", "program") == Check(
        "lab1", "program", Status.FAIL, "`nosuchprog-xyz` not found on this host's PATH")


def test_an_occupied_controller_port_fails_naming_its_owner(sshd_lab) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = lab.write_cluster([lab.worker(lab.hosts[0])])
    port = load_cluster(cluster).controller.port
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", port))
    blocker.listen()
    try:
        report = _run(cluster, fast=True)
    finally:
        blocker.close()
    assert report.exit_code() == 1
    row = _check(report, CONTROLLER, "port")
    assert row.status is Status.FAIL
    assert f"127.0.0.1:{port} is in use by pid {os.getpid()}" in row.reason
    worker = _check(report, "lab1", "port")  # routes are still tested, on a stand-in port
    assert worker.status is Status.OK and "stand-in port" in worker.reason


FAKE_NVIDIA_SMI = """\
#!/bin/sh
# Two GPUs; GPU 1 runs a compute process.
case "$*" in
  *--query-gpu=*) printf '0, GPU-aaaa-0000\\n1, GPU-bbbb-1111\\n' ;;
  *--query-compute-apps=*) printf 'GPU-bbbb-1111, 4242\\n' ;;
  *) echo "fake nvidia-smi" ;;
esac
"""


def test_gpus_fewer_than_listed_fail_busy_ones_warn_and_no_nvidia_smi_fails(
        sshd_lab, tmp_path: Path) -> None:
    fakebin = tmp_path / "fakebin"
    fakebin.mkdir()
    (fakebin / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (fakebin / "nvidia-smi").chmod(0o755)
    assert shutil.which("nvidia-smi") is None  # the controller (local worker) has none
    lab = sshd_lab(n_hosts=2, login_shell_rc=f"export PATH={fakebin}:$PATH")
    local = {"host": "localhost", "local_devices": [0], "path": str(tmp_path)}
    cluster = lab.write_cluster([
        local,
        lab.worker(lab.hosts[0], local_devices=[0, 1, 2]),
        lab.worker(lab.hosts[1], local_devices=[1]),
    ])
    report = _run(cluster, argv=["true"])
    assert report.exit_code() == 1
    assert _check(report, "lab1", "gpus") == Check(
        "lab1", "gpus", Status.FAIL, "GPU 2 not found (nvidia-smi lists 0, 1)")
    busy = _check(report, "lab2", "gpus")
    assert busy.status is Status.WARN and "GPU 1: pid 4242" in busy.reason
    none = _check(report, "localhost", "gpus")
    assert none.status is Status.FAIL and "nvidia-smi is not on this host's PATH" in none.reason


def test_a_slow_rc_file_warns_on_the_shell_row(sshd_lab) -> None:
    lab = sshd_lab(n_hosts=1, login_shell_rc="sleep 0.3")
    cluster = lab.write_cluster([lab.worker(lab.hosts[0])])
    report = _run(cluster)
    row = _check(report, "lab1", "shell")
    assert row.status is Status.WARN and "slow rc file?" in row.reason
    ms = int(re.search(r"shell start-up (\d+) ms", row.reason).group(1))  # type: ignore[union-attr]
    assert ms >= 300
    assert report.exit_code() == 0, report.to_json()  # a warning does not block


def test_an_unreachable_host_fails_only_its_own_row(sshd_lab) -> None:
    lab = sshd_lab(n_hosts=2)
    cluster = lab.write_cluster([lab.worker(h) for h in lab.hosts])
    lab.hosts[1].stop()
    report = _run(cluster, fast=True)
    assert report.exit_code() == 1
    row = _check(report, "lab2", "ssh")
    assert row.status is Status.FAIL and "unreachable" in row.reason
    assert _check(report, "lab1", "program").status is Status.OK


# --------------------------------------------------------------------------------------------
# Tunnels: a host with its own loopback
# --------------------------------------------------------------------------------------------


def _can_netns() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None


@contextlib.contextmanager
def netns_host(lab: SshdLab, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """An sshd of ``lab`` (same keys and session marker) in its own network namespace.

    Yields (controller address on the veth, host address). Its 127.0.0.1 is not the
    controller's, as on a real remote machine, so remote forwards and loopback dials
    mean what they mean in production.
    """
    tag = secrets.token_hex(3)
    ns, outer, inner = f"fdlpf{tag}", f"fdlpf{tag}a", f"fdlpf{tag}b"
    net = random.randint(1, 250)
    ctl_ip, host_ip = f"10.199.{net}.1", f"10.199.{net}.2"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    ip("netns", "add", ns)
    proc = None
    try:
        ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        ip("link", "set", inner, "netns", ns)
        ip("addr", "add", f"{ctl_ip}/30", "dev", outer)
        ip("link", "set", outer, "up")
        for args in (("addr", "add", f"{host_ip}/30", "dev", inner), ("link", "set", inner, "up"),
                     ("link", "set", "lo", "up")):
            ip("netns", "exec", ns, "ip", *args)
        h = lab.hosts[0]
        config = Path(h.config_path).read_text()
        config = re.sub(r"(?m)^ListenAddress .*$", f"ListenAddress {host_ip}:22", config)
        config = re.sub(r"(?m)^Port .*$", "Port 22", config)
        config = re.sub(r"(?m)^PidFile .*$", f"PidFile {tmp_path / 'ns-sshd.pid'}", config)
        (tmp_path / "ns-sshd_config").write_text(config)
        sshd = _find_sshd()
        assert sshd is not None
        with open(tmp_path / "ns-sshd.log", "ab") as log:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, sshd, "-D", "-e", "-f",
                 str(tmp_path / "ns-sshd_config")],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 10
        while not _read_banner(host_ip, 22):
            assert proc.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "ns-sshd.log").read_text()
            time.sleep(0.02)
        yield ctl_ip, host_ip
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", outer], check=False, capture_output=True)


@pytest.mark.skipif(not _can_netns(), reason="needs root and iproute2 for a network namespace")
def test_tunnels_reach_the_controller_and_loopback_dials_do_not(sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    with netns_host(lab, tmp_path) as (ctl_ip, host_ip):
        def worker(name: str, **fields: Any) -> dict[str, Any]:
            w = lab.worker(lab.hosts[0], ssh={"target": host_ip, "port": 22}, **fields)
            w["host"] = name
            return w

        # 1. A tunneled worker dials 127.0.0.1:<port> on its side and reaches us.
        report = _run(lab.write_cluster([worker("far", tunnel=True)]), argv=["true"], fast=True)
        row = _check(report, "far", "port")
        assert row.status is Status.OK and "through the SSH tunnel" in row.reason, \
            report.to_json()
        # 2. Without a tunnel, controller.host 127.0.0.1 is the worker's own loopback: a
        # warning, in prebuild-check too (only a rank run by hand dials the port).
        cluster = lab.write_cluster([worker("far")])
        report = _run(cluster, argv=["true"])
        row = _check(report, "far", "port")
        assert row.status is Status.WARN and "Connection refused" in row.reason
        assert "controller.host is a loopback address" in row.reason
        assert "only a rank run by hand" in row.reason
        row = _check(_run(cluster, argv=["true"], fast=True), "far", "port")
        assert row.status is Status.WARN and "only a rank run by hand" in row.reason
        # 3. With the controller's real address, the direct dial works.
        cluster = lab.write_cluster([worker("far")])
        cluster.write_text(cluster.read_text().replace("host: 127.0.0.1", f"host: {ctl_ip}"))
        report = _run(cluster, argv=["true"], fast=True)
        assert _check(report, "far", "port").reason.startswith(
            f"reached the controller at {ctl_ip}:")
        # 4. Mixed tunneled and direct workers: the launcher's tunnel cannot deliver.
        cluster = lab.write_cluster([worker("far"), worker("tun", tunnel=True)])
        cluster.write_text(cluster.read_text().replace("host: 127.0.0.1", f"host: {ctl_ip}"))
        report = _run(cluster, argv=["true"])
        row = _check(report, "tun", "port")
        assert row.status is Status.WARN and "tunnel every remote worker, or none" in row.reason
        # 5. The controller's port busy here: the tunnel still listens on the configured
        # port on its side and delivers to the stand-in, so the route is still tested.
        cluster = lab.write_cluster([worker("far", tunnel=True)])
        port = load_cluster(cluster).controller.port
        with socket.socket() as blocker:
            blocker.bind(("127.0.0.1", port))
            blocker.listen()
            report = _run(cluster, argv=["true"], fast=True)
        assert _check(report, CONTROLLER, "port").status is Status.FAIL
        row = _check(report, "far", "port")
        assert row.status is Status.OK, report.to_json()
        assert "through the SSH tunnel" in row.reason and "stand-in port" in row.reason


def test_a_tunnel_to_a_host_sharing_our_loopback_is_explained(sshd_lab) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = lab.write_cluster([lab.worker(lab.hosts[0], tunnel=True)])
    report = _run(cluster, argv=["true"], fast=True)
    row = _check(report, "lab1", "port")
    assert row.status is Status.FAIL
    assert "shares the controller's machine and network namespace" in row.reason


# --------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------


def _invoke_wired() -> bool:
    from fdl_fabric.tasks import ns

    return "prebuild-check" in ns.task_names


CLIS = [
    pytest.param([sys.executable, "-m", "fdl_fabric.preflight"], id="module"),
    pytest.param([sys.executable, "-m", "invoke", "--search-root", str(ROOT), "prebuild-check"],
                 id="invoke", marks=pytest.mark.skipif(
                     not _invoke_wired(), reason="prebuild-check is not wired into tasks.py yet")),
]


def _cli(cli: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_COLOR": "1"}
    env.pop("FLODL_INTERNAL_PREBUILD_PER_HOST", None)
    return subprocess.run([*cli, *args], capture_output=True, text=True, timeout=60,
                          cwd=str(ROOT), env=env)


@pytest.mark.parametrize("cli", CLIS)
def test_cli_json_for_a_healthy_cluster(sshd_lab, cli: list[str]) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = lab.write_cluster([lab.worker(lab.hosts[0])], command=f"python3 {PROBE}")
    out = _cli(cli, "--cluster", str(cluster), "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads(out.stdout)
    assert data["ok"] is True
    assert {(c["host"], c["check"]) for c in data["checks"]} >= {
        ("lab1", "ssh"), ("lab1", "paths"), ("lab1", "program"), ("lab1", "port"),
        (CONTROLLER, "port")}


@pytest.mark.parametrize("cli", CLIS)
def test_cli_table_for_a_missing_binary_and_a_config_error(sshd_lab, cli: list[str],
                                                           tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = lab.write_cluster([lab.worker(lab.hosts[0])])
    out = _cli(cli, "--cluster", str(cluster), "--cmd", "nosuchprog-xyz")
    assert out.returncode == 1, out.stdout + out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("lab1") and " program " in x)
    assert re.search(r"lab1\s+program\s+FAIL\s+`nosuchprog-xyz` not found", line)
    assert "\x1b[" not in out.stdout  # NO_COLOR and not a terminal
    bad = tmp_path / "bad.yml"
    bad.write_text("workers: [{host: x, nprocs: 1}]\n")
    out = _cli(cli, "--cluster", str(bad))
    assert out.returncode == 2 and "did you mean 'nproc'" in out.stderr
