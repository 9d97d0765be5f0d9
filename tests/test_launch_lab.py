"""`inv launch` through real OpenSSH sshd hosts (the sshd lab).

One local worker plus lab hosts that are reached over SSH, with real
processes and real signals: the behaviour users rely on, end to end.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import yaml

from fdl_fabric.planning.envelope import SlimEnvelope
from fdl_fabric.testing import SshdLab
from labutil import PROBE, ROOT, LiveLaunch, alive, dumps, run_launch, wait_for

pytestmark = pytest.mark.lab


def _cluster(lab: SshdLab, tmp: Path, *, local: bool = True, nproc: int = 2,
             **top: object) -> Path:
    workers = []
    if local:
        workers.append({"host": "localhost", "nproc": nproc, "path": str(ROOT),
                        "env": {"WHERE": "local"}})
    for h in lab.hosts:
        workers.append(lab.worker(h, nproc=nproc, env={"WHERE": h.name}))
    top.setdefault("env", {"SHARED": "yes", "SECRET_TOKEN": "s3cr3t-value"})
    return lab.write_cluster(workers, **top)


def test_every_rank_gets_its_environment_and_prefixed_output(sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=2)
    cluster = _cluster(lab, tmp_path)
    out = run_launch(cluster, "--cmd", f"python3 {PROBE} --dump {tmp_path}/d")
    assert out.returncode == 0, out.stderr
    master_port = str(yaml.safe_load(cluster.read_text())["master_port"])
    d = dumps(tmp_path / "d", 6)
    hosts = ["localhost", "localhost", "lab1", "lab1", "lab2", "lab2"]
    for rank, dump in d.items():
        env = dump["env"]
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "6"
        assert env["LOCAL_RANK"] == str(rank % 2) and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == str(rank // 2) and env["MASTER_PORT"] == master_port
        assert env["FLODL_HOST_NAME"] == hosts[rank]
        assert env["FLODL_INTERNAL_LOCAL_RANK"] == str(rank % 2)
        assert env["WHERE"] == ("local" if rank < 2 else hosts[rank])
        assert env["SHARED"] == "yes" and env["SECRET_TOKEN"] == "s3cr3t-value"
        envelope = SlimEnvelope.from_hex(env["FLODL_INTERNAL_CLUSTER_JSON"])
        assert envelope.host == hosts[rank] and rank in envelope.ranks
        assert dump["pgid"] == dump["pid"] == dump["sid"]
        want_cwd = ROOT if rank < 2 else Path(lab.hosts[rank // 2 - 1].path)
        assert Path(dump["cwd"]).resolve() == want_cwd.resolve()
    for rank, host in enumerate(hosts):
        assert f"[{host}:cpu:r{rank}] hello from rank {rank}\n" in out.stdout
        assert f"[{host}:cpu:r{rank}] stderr of rank {rank}\n" in out.stderr
    assert out.stderr.strip().splitlines()[-1] == \
        "cluster launcher: run completed — all 6 ranks exited 0"


def test_a_failing_rank_stops_every_peer_on_every_host_within_the_grace(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=2)
    cluster = _cluster(lab, tmp_path, kill_grace=2)
    proc = LiveLaunch(cluster, "--cmd",
                      f"python3 {PROBE} --dump {tmp_path}/d --sleep 300 --ignore-term "
                      "--exit-rank 3 --exit-code 3 --exit-after 2")
    d = dumps(tmp_path / "d", 6)
    peers = {r: v["pid"] for r, v in d.items() if r != 3}
    wait_for(lambda: not alive(d[3]["pid"]), 20, "rank 3 to exit")
    failed_at = time.monotonic()
    wait_for(lambda: not any(alive(p) for p in peers.values()), 2 + 1.0,
             "every peer to be gone within kill_grace + 1 s")
    gone_after = time.monotonic() - failed_at
    assert proc.finish(timeout=30) == 1, proc.err
    err = proc.err
    assert err.strip().splitlines()[-1] == ("cluster launcher: failed: rank 3 of lab1 exited with "
                                             "status 3")
    assert "peer failure — terminating all still-running ranks" in err
    assert gone_after <= 3.0


def test_a_remote_rank_killed_by_sigkill_is_reported_as_signal_9(sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = _cluster(lab, tmp_path, local=False, nproc=2)
    proc = LiveLaunch(cluster, "--cmd", f"python3 {PROBE} --dump {tmp_path}/d --sleep 300")
    d = dumps(tmp_path / "d", 2)
    os.kill(d[1]["pid"], signal.SIGKILL)
    assert proc.finish(timeout=30) == 1, proc.err
    err = proc.err
    assert err.strip().splitlines()[-1] == ("cluster launcher: failed: rank 1 of lab1 exited with "
                                             "signal 9")


def test_no_process_on_any_host_has_the_salt_or_a_secret_in_its_command_line(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=2)
    cluster = _cluster(lab, tmp_path)
    proc = LiveLaunch(cluster, "--cmd", f"python3 {PROBE} --dump {tmp_path}/d --sleep 300")
    try:
        d = dumps(tmp_path / "d", 6)
        envelope_hex = d[0]["env"]["FLODL_INTERNAL_CLUSTER_JSON"]
        salt = SlimEnvelope.from_hex(envelope_hex).salt.hex()
        remote_envelope = d[2]["env"]["FLODL_INTERNAL_CLUSTER_JSON"]
        needles = [salt, envelope_hex, remote_envelope, "s3cr3t-value"]
        offenders = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().decode("utf-8", "replace")
            except OSError:
                continue
            offenders += [(entry.name, n[:12]) for n in needles if n in cmdline]
        assert offenders == []
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.finish(timeout=30)
    assert code == 143, proc.err


def test_a_config_error_exits_2_and_starts_nothing(sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = _cluster(lab, tmp_path, env={"CUDA_VISIBLE_DEVICES": "0"})
    out = run_launch(cluster, "--cmd", f"python3 {PROBE} --dump {tmp_path}/d")
    assert out.returncode == 2
    assert re.search(r"cluster\.yml:\d+: env\[\"CUDA_VISIBLE_DEVICES\"\]", out.stderr)
    assert lab.hosts[0].session_pids() == []
    assert not (tmp_path / "d").exists()


def test_an_unsupported_ssh_option_is_a_config_error_naming_it(sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    w = lab.worker(lab.hosts[0])
    w["ssh"]["options"] = [*w["ssh"]["options"], "ForwardX11=yes"]
    cluster = lab.write_cluster([w])
    out = run_launch(cluster, "--cmd", "true")
    assert out.returncode == 2
    assert "workers[0].ssh.options" in out.stderr and "ForwardX11" in out.stderr


def test_unknown_host_key_is_recorded_and_a_changed_one_is_refused(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = _cluster(lab, tmp_path, local=True, nproc=1)
    assert Path(lab.known_hosts).read_text() == ""
    assert run_launch(cluster, "--cmd", "true").returncode == 0
    recorded = Path(lab.known_hosts).read_text()
    assert lab.hosts[0].host_key_pub.split()[1] in recorded
    lab.hosts[0].regenerate_host_key()
    out = run_launch(cluster, "--cmd", f"python3 {PROBE} --dump {tmp_path}/d")
    assert out.returncode == 1
    assert "lab1" in out.stderr and "CHANGED" in out.stderr
    assert not (tmp_path / "d").exists()  # the local rank never started either


def test_an_unreachable_host_fails_naming_it_before_any_rank_starts(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=2)
    cluster = _cluster(lab, tmp_path)
    lab.hosts[1].stop()
    out = run_launch(cluster, "--no-preflight", "--cmd", f"python3 {PROBE} --dump {tmp_path}/d")
    assert out.returncode == 1
    assert "cannot connect to host 'lab2'" in out.stderr and "unreachable" in out.stderr
    assert not (tmp_path / "d").exists()


def test_refused_authentication_fails_naming_the_host(sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    other_key = tmp_path / "other_key"
    os.system(f"ssh-keygen -q -t ed25519 -N '' -f {other_key}")
    w = lab.worker(lab.hosts[0])
    w["ssh"]["identity_file"] = str(other_key)
    cluster = lab.write_cluster([w])
    out = run_launch(cluster, "--cmd", "true", env={"SSH_AUTH_SOCK": ""})
    assert out.returncode == 1
    assert "lab1" in out.stderr and "authentication refused" in out.stderr
    host = lab.hosts[0]
    # What to fix is named: the destination as written and the key that was offered.
    assert (f"authentication refused for {lab.user}@{host.addr}:{host.port} with key "
            f"{other_key}") in out.stderr


def test_a_missing_identity_file_is_named_with_the_destination(sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    w = lab.worker(lab.hosts[0])
    w["ssh"]["identity_file"] = str(tmp_path / "no_such_key")
    cluster = lab.write_cluster([w])
    out = run_launch(cluster, "--cmd", "true", env={"SSH_AUTH_SOCK": ""})
    assert out.returncode == 1
    host = lab.hosts[0]
    assert (f"identity file {tmp_path / 'no_such_key'} does not exist ({lab.user}@{host.addr}:"
            f"{host.port} with key {tmp_path / 'no_such_key'})") in out.stderr, out.stderr


def test_a_missing_remote_path_stops_the_ranks_already_started(sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    w = lab.worker(lab.hosts[0], path=str(tmp_path / "does-not-exist"))
    local = {"host": "localhost", "nproc": 2, "path": str(ROOT)}
    cluster = lab.write_cluster([local, w])
    out = run_launch(cluster, "--no-preflight", "--cmd",
                     f"python3 {PROBE} --dump {tmp_path}/d --sleep 300")
    assert out.returncode == 1
    assert "does-not-exist" in out.stderr
    assert "could not start rank 2: cannot enter the working directory" in out.stderr
    d = json.loads((tmp_path / "d" / "env-r0.json").read_text()) \
        if (tmp_path / "d" / "env-r0.json").exists() else None
    if d is not None:
        assert not alive(d["pid"])


def test_one_launch_of_12_ranks_opens_one_connection_and_one_session_on_the_host(
        sshd_lab, tmp_path: Path) -> None:
    """One agent per host: 12 ranks, more than OpenSSH's default MaxSessions (10), ride
    one SSH session; the sshd's own log (LogLevel VERBOSE) counts them."""
    lab = sshd_lab(n_hosts=1)
    (h,) = lab.hosts
    cluster = _cluster(lab, tmp_path, local=False, nproc=12)
    before = len(h.log_text())
    out = run_launch(cluster, "--cmd", f"python3 {PROBE}")
    assert out.returncode == 0, out.stderr
    for rank in range(12):
        assert f"[lab1:cpu:r{rank}] hello from rank {rank}" in out.stdout
    log = h.log_text()[before:]
    assert log.count("Accepted publickey for") == 1, log
    assert log.count("Starting session:") == 1, log


def test_a_tunnel_that_cannot_bind_fails_loudly(sshd_lab, tmp_path: Path) -> None:
    # Every lab host shares this machine's loopback, where the coordinator
    # already listens on 127.0.0.1:<controller.port>: the remote forward of
    # that port cannot bind, which is exactly the failure under test.
    lab = sshd_lab(n_hosts=1)
    w = lab.worker(lab.hosts[0], tunnel=True)
    cluster = lab.write_cluster([w])
    out = run_launch(cluster, "--no-preflight", "--cmd", f"python3 {PROBE} --dump {tmp_path}/d")
    assert out.returncode == 1
    assert "tunnel could not bind" in out.stderr and "lab1" in out.stderr
    assert not (tmp_path / "d").exists()


def test_ssh_config_host_alias_is_honoured(sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    h = lab.hosts[0]
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(
        f"Host trainbox\n  HostName {h.addr}\n  Port {h.port}\n  User {lab.user}\n"
        f"  IdentityFile {lab.identity_file}\n")
    w = {"host": "lab1", "path": h.path, "nproc": 1,
         "ssh": {"target": "trainbox", "options": lab.ssh_options()}}
    cluster = lab.write_cluster([w])
    out = run_launch(cluster, "--cmd", f"python3 {PROBE}", env={"HOME": str(home)})
    assert out.returncode == 0, out.stderr
    assert "[lab1:cpu:r0] hello from rank 0" in out.stdout


def test_the_launch_preflight_refuses_a_missing_path_naming_host_and_check(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=2)
    local = {"host": "localhost", "nproc": 1, "path": str(ROOT)}
    bad = lab.worker(lab.hosts[1], path=str(tmp_path / "missing"))
    cluster = lab.write_cluster([local, lab.worker(lab.hosts[0]), bad])
    out = run_launch(cluster, "--cmd", f"python3 {PROBE} --dump {tmp_path}/d --sleep 30")
    assert out.returncode == 1
    assert "pre-flight: lab2: paths: FAIL" in out.stderr and "missing" in out.stderr
    assert "nothing was started" in out.stderr
    assert not (tmp_path / "d").exists()
    # The agents exit on their own once the launcher is gone; sshd follows them.
    wait_for(lambda: all(h.session_pids() == [] for h in lab.hosts), 5, "sessions to end")


def test_the_launch_preflight_refuses_a_program_missing_on_a_host(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = lab.write_cluster([lab.worker(lab.hosts[0])])
    out = run_launch(cluster, "--cmd", "nosuchprog-xyz --flag")
    assert out.returncode == 1
    assert "pre-flight: lab1: program: FAIL" in out.stderr and "nosuchprog-xyz" in out.stderr
