"""Cohort formation and elastic membership, end to end through the sshd lab.

The ranks run the bundled examples (the stdlib toy trainer with the rank
client, and real PyTorch DDP on gloo); deaths are real SIGKILLs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest

from fdl_fabric.testing import SshdLab
from labutil import ROOT, LiveLaunch, run_launch

pytestmark = pytest.mark.lab

TOY = str(ROOT / "examples" / "toy_train.py")
DDP = str(ROOT / "examples" / "ddp_torch.py")


def _two_by_two(lab: SshdLab, **top: object) -> Path:
    """One local worker and one lab host, two CPU ranks each."""
    local = {"host": "localhost", "nproc": 2, "path": str(ROOT)}
    return lab.write_cluster([local, lab.worker(lab.hosts[0], nproc=2)], **top)


def _pid_of(run: LiveLaunch, rank: int) -> int:
    m = run.wait_line(rf":r{rank}\] rank {rank}/\d+ joined on .* \(pid (\d+)\)")
    return int(m.group(1))


def test_ddp_on_two_lab_hosts_trains_and_parameters_agree(sshd_lab, tmp_path: Path) -> None:
    import torch  # noqa: F401  - installed by `make test` (requirements-torch.txt); never skipped
    lab = sshd_lab(n_hosts=2)
    workers = [lab.worker(h, nproc=2, nccl_socket_ifname="lo") for h in lab.hosts]
    cluster = lab.write_cluster(workers)
    out = run_launch(cluster, "--cmd", f"python3 {DDP} --steps 20 --out {tmp_path}/p",
                     timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    prints = {json.loads((tmp_path / "p" / f"params-r{r}.json").read_text())["fingerprint"]
              for r in range(4)}
    assert len(prints) == 1
    assert out.stdout.count("ranks agree: True") == 4
    assert "cohort formed — 4 ranks" in out.stderr


def test_a_rank_sigkilled_after_formation_is_tolerated_and_the_run_completes_degraded(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = _two_by_two(lab)
    run = LiveLaunch(cluster, "--cmd", f"python3 {TOY} --steps 25 --step-time 0.1 "
                     f"--checkpoint-dir {tmp_path}/ck")
    try:
        run.wait_line("cohort formed — 4 ranks", stderr=True)
        victim = _pid_of(run, 3)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        code = run.finish(60)
    finally:
        run.kill()
    assert code == 0, "\n".join(run.stderr_lines)
    err = run.stderr_lines
    assert any("rank 3 of lab1 exited with signal 9 — tolerating (elastic membership): "
               "reporting rank(s) [3] dead" in line for line in err)
    assert err[-1].startswith("cluster launcher: run completed DEGRADED — 1 of 4 ranks lost")
    later_steps = [line for t, stream, line in run.lines
                   if stream == "out" and t > killed_at + 0.3 and "step " in line]
    assert any(line.startswith("[localhost:cpu:r0] step") for line in later_steps)
    assert any(line.startswith("[lab1:cpu:r2] step") for line in later_steps)
    assert "peer failure" not in "\n".join(err)


def test_max_failure_breach_makes_survivors_save_and_the_launch_fail(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = _two_by_two(lab, elastic={"max_failure": 1})
    ck = tmp_path / "ck"
    run = LiveLaunch(cluster, "--cmd", f"python3 {TOY} --steps 200 --step-time 0.1 "
                     f"--checkpoint-dir {ck}")
    try:
        run.wait_line("cohort formed — 4 ranks", stderr=True)
        os.kill(_pid_of(run, 1), signal.SIGKILL)
        code = run.finish(60)
    finally:
        run.kill()
    assert code == 1
    assert run.stderr_lines[-1].startswith(
        "cluster launcher: failed: max_failure exceeded (1/4 ranks dead, threshold 1)")
    for r in (0, 2, 3):
        saved = json.loads((ck / f"checkpoint-r{r}.json").read_text())
        assert saved["reason"] == "shutdown" and saved["step"] < 200
    assert not (ck / "checkpoint-r1.json").exists()
    survivors = [line for line in run.stderr_lines if re.search(r"rank [023] of .* exited", line)]
    assert not any("signal" in line for line in survivors)  # they exited 0 on their own


def test_max_failure_from_the_command_line_overrides_the_file(sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = _two_by_two(lab, elastic={"max_failure": 3})
    run = LiveLaunch(cluster, "--max-failure", "25%", "--cmd",
                     f"python3 {TOY} --steps 200 --step-time 0.1 --checkpoint-dir {tmp_path}")
    try:
        run.wait_line("cohort formed — 4 ranks", stderr=True)
        os.kill(_pid_of(run, 2), signal.SIGKILL)
        code = run.finish(60)
    finally:
        run.kill()
    assert code == 1
    assert "(1/4 ranks dead, threshold 1)" in run.stderr_lines[-1]


def test_a_rank_killed_before_formation_still_kills_all(sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = _two_by_two(lab)
    run = LiveLaunch(cluster, "--cmd", f"python3 {TOY} --steps 200 --step-time 0.1 "
                     f"--join-delay-rank 3 --join-delay 60 --checkpoint-dir {tmp_path}")
    try:
        victim = _pid_of(run, 0)
        os.kill(victim, signal.SIGKILL)
        code = run.finish(30)
    finally:
        run.kill()
    assert code == 1
    err = run.stderr_lines
    assert "cluster launcher: peer failure — terminating all still-running ranks" in err
    assert err[-1] == "cluster launcher: failed: rank 0 of localhost exited with signal 9"


def test_a_cohort_that_does_not_form_in_time_aborts_naming_the_missing_ranks(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = _two_by_two(lab, elastic={"formation_timeout": 2})
    out = run_launch(cluster, "--cmd", f"python3 {TOY} --steps 200 --step-time 0.1 "
                     f"--join-delay-rank 2 --join-delay 60 --checkpoint-dir {tmp_path}",
                     timeout=60)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert "did not form within 2s" in last and "[2]" in last


def test_a_coordinator_that_cannot_bind_fails_the_launch_before_any_rank(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = _two_by_two(lab)
    port = int(re.search(r"port: (\d+)", cluster.read_text()).group(1))  # type: ignore[union-attr]
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", port))
        blocker.listen()
        out = run_launch(cluster, "--no-preflight", "--cmd",
                         f"python3 {TOY} --checkpoint-dir {tmp_path}")
    assert out.returncode == 1
    assert "coordinator could not bind" in out.stderr and str(port) in out.stderr
    assert "joined" not in out.stdout
