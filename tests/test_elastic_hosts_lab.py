"""Issue 20: lost hosts don't end the job. The next attempt carries on with the hosts that
answer, spares take a lost host's place, a host that answers again is re-admitted, and
too few hosts end the launch with the reason. Real sshd hosts (the lab), real gloo DDP
(`examples/elastic_ddp.py`, a checkpoint every step), a host killed with its sshd and
every session it served.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
from test_liveness_lab import launches  # noqa: F401  (the fixture)
from test_reliability import private_lab

from fdl_fabric.testing import SshdLab
from labutil import ROOT, LiveLaunch, gloo_run_completed, processes_of_run, wait_for

pytestmark = [pytest.mark.lab, pytest.mark.timeout(180)]

ELASTIC = str(ROOT / "examples" / "elastic_ddp.py")
STEPS = 24


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cluster(lab: SshdLab, tmp_path: Path, *, spares: int = 0, **elastic: Any) -> Path:
    hosts = lab.hosts
    workers = [lab.worker(h, nproc=2, nccl_socket_ifname="lo") for h in hosts]
    for w in workers[len(hosts) - spares:]:
        w["spare"] = True
    return lab.write_cluster(workers, master_port=_port(), kill_grace=1,
                             elastic={"heartbeat_timeout": 10, **elastic})


def _train(tmp_path: Path) -> list[str]:
    return ["--", "python3", ELASTIC, "--steps", str(STEPS), "--sleep", "0.25",
            "--ckpt", str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "out")]


def _results(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((tmp_path / "out").glob("result-r*.json"))]


def _restart_line(run: LiveLaunch) -> str:
    (line,) = [x for x in run.err_lines() if "restarting every rank" in x]
    return line


def test_a_lost_host_is_left_out_and_the_next_attempt_resumes_on_the_other_two(
        sshd_lab, launches, tmp_path: Path) -> None:  # noqa: F811
    lab = private_lab(sshd_lab, 3)
    cluster = _cluster(lab, tmp_path, min_hosts=2)
    logs = tmp_path / "logs"
    run: LiveLaunch = launches(cluster, "--max-restarts", "1", "--log-dir", str(logs),
                               *_train(tmp_path))
    run.wait_line(r"lab3:cpu:r5\] step 3/", stderr=False)
    lab.hosts[2].lose()
    assert run.finish(150) == 0, run.err
    (run_dir,) = [p for p in logs.iterdir() if not p.is_symlink()]
    records = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    membership = [(r["attempt"], r["data"]["hosts"], r["data"]["world_size"],
                   r["data"]["left_out"]) for r in records if r["name"] == "attempt_hosts"]
    assert membership == [(0, ["lab1", "lab2", "lab3"], 6, {}),
                          (1, ["lab1", "lab2"], 4, {"lab3": "lost in attempt 0"})]
    (verdict,) = [r["data"] for r in records if r["kind"] == "verdict"]
    assert verdict["verdict"] == "degraded" and verdict["exit_code"] == 0
    assert "on 2 of 3 hosts (lab1, lab2), world size 4; left out: lab3 lost in attempt 0" \
        in _restart_line(run)
    out = "\n".join(run.stdout_lines)
    resumed = [int(x.rsplit(" ", 1)[1]) for x in out.splitlines()
               if "attempt 1 rank" in x and "/4 resumes at step" in x]
    assert len(resumed) == 4 and min(resumed) >= 3, out[-3000:]
    assert run.err_lines()[-1] == ("cluster launcher: run completed on 2 of 3 hosts (lab3 lost "
                                   "in attempt 0) — DEGRADED: 4 ranks in the last attempt")
    results = _results(tmp_path)
    assert {(r["world_size"], r["restart_count"], r["step"]) for r in results} == {
        (4, 1, STEPS)}
    assert len({r["fingerprint"] for r in results}) == 1
    wait_for(lambda: not processes_of_run(run.run_id), 20, "nothing of the run left")


def test_a_spare_takes_the_lost_hosts_place_and_the_world_is_whole_again(
        sshd_lab, launches, tmp_path: Path) -> None:  # noqa: F811
    lab = private_lab(sshd_lab, 4)
    cluster = _cluster(lab, tmp_path, spares=1, min_hosts=3)
    run: LiveLaunch = launches(cluster, "--max-restarts", "1", *_train(tmp_path))
    run.wait_line(r"lab3:cpu:r5\] step 3/", stderr=False)
    assert not [line for line in run.stdout_lines if line.startswith("[lab4")], \
        "a spare is not started unless needed"
    lab.hosts[2].lose()
    assert run.finish(150) == 0, run.err
    assert "on 3 of 3 hosts (lab1, lab2, lab4), world size 6; spares in: lab4; left out: " \
        "lab3 lost in attempt 0" in _restart_line(run)
    assert gloo_run_completed(run.err_lines()[-1], 6), run.err
    assert {(r["world_size"], r["restart_count"]) for r in _results(tmp_path)} == {(6, 1)}


def test_a_lost_host_that_answers_again_is_readmitted_before_the_attempt_after(
        sshd_lab, launches, tmp_path: Path) -> None:  # noqa: F811
    lab = private_lab(sshd_lab, 3)
    cluster = _cluster(lab, tmp_path, min_hosts=2)
    run: LiveLaunch = launches(cluster, "--max-restarts", "2", *_train(tmp_path))
    run.wait_line(r"lab3:cpu:r5\] step 3/", stderr=False)
    lab.hosts[2].lose()
    run.wait_line(r"lab2:cpu:r3\] attempt 1 rank 3/4", stderr=False)
    lab.hosts[2].restart()  # the host is back before attempt 2 ...
    run.wait_line(r"lab2:cpu:r3\] step \d+/\d+ world 4", stderr=False)
    lab.hosts[1].lose()  # ... which a second loss brings about
    lab.hosts[1].restart()
    assert run.finish(150) == 0, run.err
    restarts = [x for x in run.err_lines() if "restarting every rank" in x]
    assert len(restarts) == 2, run.err
    assert "on 2 of 3 hosts (lab1, lab3), world size 4; re-admitted: lab3; left out: lab2 " \
        "lost in attempt 1" in restarts[1]
    assert {r["world_size"] for r in _results(tmp_path)} == {4}


def test_too_few_hosts_end_the_launch_naming_each_host_left_out(
        sshd_lab, launches, tmp_path: Path) -> None:  # noqa: F811
    lab = private_lab(sshd_lab, 3)
    cluster = _cluster(lab, tmp_path, min_hosts=3)
    run: LiveLaunch = launches(cluster, "--max-restarts", "1", *_train(tmp_path))
    run.wait_line(r"lab3:cpu:r5\] step 3/", stderr=False)
    lab.hosts[2].lose()
    assert run.finish(120) == 1, run.err
    assert run.err_lines()[-1] == ("cluster launcher: failed: not enough hosts: 2 of min 3 (lab3 "
                                   "lost in attempt 0)")
    assert not [x for x in run.err_lines() if "restarting every rank" in x]
    wait_for(lambda: not processes_of_run(run.run_id), 20, "nothing of the run left")
