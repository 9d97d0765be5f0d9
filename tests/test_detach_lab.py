"""Runs outlive the terminal (issue 30): ``--detach``, ``attach``, ``logs``, ``stop``,
``wait`` and ``status``, against real sshd lab hosts, real ranks (torch gloo DDP where
the run's length allows), real signals and a real terminal (tmux).

Every test keeps its run records in a folder of its own (``FDL_FABRIC_RUNS_DIR``), and
"nothing left" is checked the way the reliability labs do: no process on this machine
(every lab host is this machine) carries the run's id.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from fdl_fabric.testing.launches import processes_of_run, wait_for
from fdl_fabric.testing.panes import Pane
from labutil import ROOT

pytestmark = [pytest.mark.lab, pytest.mark.timeout(180)]

FDL = (sys.executable, "-m", "fdl_fabric")
DDP = str(ROOT / "examples" / "ddp_torch.py")



@pytest.fixture
def pane(tmp_path: Path, runs: Path) -> Iterator[Pane]:
    p = Pane(tmp_path, env={"FDL_FABRIC_RUNS_DIR": str(runs), "HOME": os.environ["HOME"],
                            "PYTHONPATH": str(ROOT)})
    try:
        yield p
    finally:
        p.close()


def fdl(*args: str, timeout: float = 120, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FDL, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=str(cwd), stdin=subprocess.DEVNULL)


def only_run(runs: Path) -> str:
    (run_id,) = [p.name for p in runs.iterdir()]
    return run_id


def state(runs: Path, run_id: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((runs / run_id / "state.json").read_text())
    return data


def supervisors(runs: Path) -> list[psutil.Process]:
    """Detached supervisors of this test (their environment names its records folder)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if "fdl_fabric.commands.supervise" in " ".join(proc.info["cmdline"] or ()) \
                    and proc.environ().get("FDL_FABRIC_RUNS_DIR") == str(runs):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def detached(lab: Any, runs: Path, rank: str, *, nproc: int, **top: Any) -> str:
    """``launch --detach`` of ``python -u RANK`` on every lab host; the run's id."""
    cluster = lab.write_cluster([lab.worker(h, nproc=nproc) for h in lab.hosts],
                                command=f"{sys.executable} -u {rank}", **top)
    out = fdl("launch", "--detach", "-c", str(cluster))
    assert out.returncode == 0, out.stderr
    return only_run(runs)


def ssh_home(lab: Any, tmp_path: Path) -> Path:
    """A HOME whose ~/.ssh/config names the lab's hosts node1, node2...: how a user
    reaches the host that stays up (``--on node1``)."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    lab.write_ssh_config(home / ".ssh" / "config")
    return home


def nothing_left(run_id: str, timeout: float = 30) -> None:
    wait_for(lambda: not processes_of_run(run_id), timeout,
             f"every process of run {run_id} to end")


def test_a_detached_ddp_run_survives_its_terminal_closing_and_completes(
        sshd_lab, pane: Pane, runs: Path) -> None:
    lab = sshd_lab(n_hosts=3)
    cluster = lab.write_cluster([lab.worker(h, nproc=2) for h in lab.hosts],
                                command=f"{sys.executable} -u {DDP} --steps 60")
    assert pane.run([*FDL, "launch", "--detach", "-c", str(cluster)], timeout=120) == 0
    run_id = only_run(runs)
    text = pane.text()
    assert f"run {run_id} goes on detached" in text, text
    assert f"fdl-fabric attach {run_id}" in text and f"fdl-fabric wait {run_id}" in text
    pane.close()  # SIGHUP to everything in the terminal, as a closed window
    done = fdl("wait", run_id, timeout=150)
    assert done.returncode == 0, done.stderr
    # under load a rank may end in the teardown window: still completed, said so
    assert done.stderr.splitlines()[-1].startswith("cluster launcher: run completed"), \
        done.stderr
    logs = fdl("logs", run_id, "--rank", "5")
    assert logs.returncode == 0
    last = logs.stdout.splitlines()[-1]
    assert last.startswith("[") and ":r5] params fingerprint " in last, logs.stdout
    assert "ranks agree: True" in last
    status = fdl("status", "--all")
    row = [line for line in status.stdout.splitlines() if run_id in line]
    assert row and "ended: ok, exit 0" in row[0] and "detached" in row[0], status.stdout
    nothing_left(run_id)
    assert not supervisors(runs)


def test_attach_follows_live_and_ctrl_c_leaves_the_run_running(
        sshd_lab, pane: Pane, runs: Path, steady: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = lab.write_cluster([lab.worker(lab.hosts[0], nproc=2)],
                                command=f"{sys.executable} -u {steady} 400 0.05")
    assert fdl("launch", "--detach", "-c", str(cluster)).returncode == 0
    run_id = only_run(runs)
    pane.type([*FDL, "attach", run_id])
    wait_for(lambda: f"attached to run {run_id} (running, attempt 0)" in pane.text(), 20,
             "attach to say it is attached")
    seen = max(int(line.rsplit(" ", 1)[1]) for line in pane.lines() if ":r0] r0 line " in line)
    wait_for(lambda: any(line.endswith(f"r0 line {seen + 5}") for line in pane.lines()), 10,
             "lines printed after attach to show live")
    table = re.compile(r"host +rank +device +pid +state +uptime +last output")
    wait_for(lambda: any(table.search(line) for line in pane.lines()), 10,
             "the live table below the output, as on the launching terminal")
    rows = [line for line in pane.lines() if re.match(r"lab1 +[01] +cpu +\d+ +running ", line)]
    assert len(rows) == 2 and all(" r" in row and " line " in row for row in rows), rows
    pane.key("C-c")
    wait_for(lambda: f"detached from run {run_id}: it goes on" in pane.text(), 10,
             "Ctrl-C to leave the run running")
    assert state(runs, run_id)["state"] == "running"
    assert processes_of_run(run_id), "the ranks still run"
    assert pane.run([*FDL, "attach", run_id, "--tail", "3"], timeout=60) == 0, pane.text()
    assert pane.lines()[-2] == "cluster launcher: run completed — all 2 ranks exited 0"
    nothing_left(run_id)


def test_stop_ends_a_detached_run_with_143_naming_who_stopped_it(
        sshd_lab, runs: Path, steady: Path) -> None:
    lab = sshd_lab(n_hosts=2)
    run_id = detached(lab, runs, f"{steady} 2000 0.05", nproc=2)
    stop = fdl("stop", run_id[:17])  # the id's unique start is enough
    assert stop.returncode == 0, stop.stderr
    said = stop.stderr.splitlines()
    assert said[0].startswith(f"stop: run {run_id}: asked its launcher (pid ")
    assert said[-1].startswith("cluster launcher: stopped by fdl-fabric stop (")
    assert f", pid {os.getpid()})" not in said[-1] and "@" in said[-1]
    waited = fdl("wait", run_id)
    assert waited.returncode == 143, waited.stderr
    assert waited.stderr.splitlines()[-1] == said[-1]
    nothing_left(run_id)
    assert not supervisors(runs)
    result = json.loads((runs / run_id / "result.json").read_text())
    assert (result["verdict"], result["exit_code"]) == ("interrupted", 143)


def test_a_killed_supervisor_leaves_nothing_and_status_says_its_launcher_was_lost(
        sshd_lab, runs: Path, steady: Path) -> None:
    lab = sshd_lab(n_hosts=2)
    run_id = detached(lab, runs, f"{steady} 2000 0.05", nproc=1, elastic={"heartbeat_timeout": 6})
    assert processes_of_run(run_id)
    os.kill(state(runs, run_id)["launcher"]["pid"], signal.SIGKILL)
    nothing_left(run_id, timeout=60)  # the agents' lease runs out: they stop every rank
    status = fdl("status", "--all")
    row = [line for line in status.stdout.splitlines() if run_id in line]
    assert row and "lost: its launcher is gone without a verdict" in row[0], status.stdout
    waited = fdl("wait", run_id)
    assert waited.returncode == 1
    assert waited.stderr.splitlines()[-1].startswith(
        f"cluster launcher: failed: run {run_id}: its launcher (pid ")


def test_detach_refuses_in_the_foreground_and_leaves_no_supervisor(
        sshd_lab, runs: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text("workers:\n  - host: localhost\n    nproc: many\n")
    out = fdl("launch", "--detach", "-c", str(bad))
    assert out.returncode == 2, out.stderr
    assert f"{bad}:" in out.stderr and "nproc" in out.stderr
    assert not supervisors(runs)
    assert not runs.exists() or not list(runs.iterdir()), "a refused launch keeps no record"
    unreachable = fdl("launch", "--detach", "--hosts", "127.0.0.1:1", "--cmd", "true",
                      cwd=tmp_path)
    assert unreachable.returncode == 1, unreachable.stderr
    assert unreachable.stderr.splitlines()[-1].startswith("cluster launcher: failed: ")
    assert "127.0.0.1" in unreachable.stderr.splitlines()[-1]
    assert unreachable.stdout == ""
    wait_for(lambda: not supervisors(runs), 10, "the supervisor to be gone")


def test_two_detached_runs_from_one_folder_are_addressed_one_at_a_time(
        sshd_lab, runs: Path, steady: Path, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=2)
    hosts = ",".join(f"{lab.user}@{h.addr}:{h.port}" for h in lab.hosts)
    common = ["run", "--detach", "--hosts", hosts, "-i", lab.identity_file]
    env_home = {"cwd": tmp_path}
    first = fdl(*common, str(steady), "2000", "0.05", **env_home)  # type: ignore[arg-type]
    assert first.returncode == 0, first.stderr
    (a,) = [p.name for p in runs.iterdir()]
    second = fdl(*common, str(steady), "30", "0.1", **env_home)  # type: ignore[arg-type]
    assert second.returncode == 0, second.stderr
    (b,) = [p.name for p in runs.iterdir() if p.name != a]
    stopped = fdl("stop", a)
    assert stopped.returncode == 0 and "stopped by fdl-fabric stop" in stopped.stderr
    assert state(runs, b)["state"] == "running", "stopping one run leaves the other"
    assert fdl("wait", b).returncode == 0
    assert fdl("wait", a).returncode == 143
    logs_a, logs_b = fdl("logs", a).stdout, fdl("logs", b).stdout
    assert f"run {a}:" in logs_a and f"run {b}" not in logs_a
    assert f"run {b}:" in logs_b and f"run {a}:" not in logs_b
    assert f"run {a} of this cluster is live" in logs_b, "b left a's ranks alone"
    assert "done r0" in logs_b and "done r0" not in logs_a
    assert "stopped by fdl-fabric stop" in logs_a and "stopped by" not in logs_b
    nothing_left(a)
    nothing_left(b)


def test_logs_follow_shows_both_attempts_of_a_restart_and_ends_with_the_verdict(
        sshd_lab, runs: Path, steady: Path) -> None:
    lab = sshd_lab(n_hosts=2)
    run_id = detached(lab, runs, f"{steady} 20 0.1 fail-first", nproc=1,
                      elastic={"max_restarts": 1})
    out = fdl("logs", run_id, "-f")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    # the first rank to fail ends attempt 0 (the other may be stopped before it prints)
    failed = [i for i, line in enumerate(lines) if line.endswith("fails on attempt 0")]
    restart = [i for i, line in enumerate(lines) if "restarting every rank (restart 1 of 1)"
               in line]
    assert failed and restart and failed[0] < restart[0], lines
    after = lines[restart[0]:]
    assert "[lab1:cpu:r0] done r0" in after and "[lab2:cpu:r1] done r1" in after, after
    assert lines[-1] == "cluster launcher: run completed — all 2 ranks exited 0"
    one = fdl("logs", run_id, "--rank", "1").stdout.splitlines()  # the attempts are named
    assert any("restarting every rank" in line for line in one)
    assert one[-1] == "[lab2:cpu:r1] done r1"
    nothing_left(run_id)


def test_detach_on_a_host_that_stays_up_runs_there_and_is_followed_from_here(
        sshd_lab, runs: Path, steady: Path, tmp_path: Path) -> None:
    there = tmp_path / "runs-on-node1"  # the head's records, as its sessions see them
    lab = sshd_lab(n_hosts=3, session_env={"FDL_FABRIC_RUNS_DIR": str(there),
                                           "PATH": os.environ["PATH"]})
    home = ssh_home(lab, tmp_path)  # node1, node2, node3
    cluster = lab.write_cluster([lab.worker(h, nproc=1) for h in lab.hosts[1:]],
                                command=f"{sys.executable} -u {steady} 30 0.1")
    env = {**os.environ, "HOME": str(home)}
    out = subprocess.run([*FDL, "launch", "--detach", "--on", "node1", "-c", str(cluster)],
                         capture_output=True, text=True, timeout=120, env=env,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout + out.stderr
    (run_id,) = [p.name for p in there.iterdir()]
    assert f"fdl-fabric wait {run_id} --on node1" in out.stdout
    assert not runs.exists() or not list(runs.iterdir()), "nothing of it runs here"
    waited = subprocess.run([*FDL, "wait", run_id, "--on", "node1"], capture_output=True,
                            text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    assert "cluster launcher: run completed — all 2 ranks exited 0" in waited.stderr
    logs = subprocess.run([*FDL, "logs", run_id, "--on", "node1", "--rank", "1"],
                          capture_output=True, text=True, timeout=60, env=env,
                          stdin=subprocess.DEVNULL)
    assert logs.returncode == 0
    assert logs.stdout.splitlines()[-1].endswith(":r1] done r1"), logs.stdout
    nothing_left(run_id)


def test_on_a_host_with_another_version_is_refused_with_how_to_install(
        sshd_lab, tmp_path: Path) -> None:
    fake = tmp_path / "fake"
    (fake / "fdl_fabric").mkdir(parents=True)
    (fake / "fdl_fabric" / "__init__.py").write_text("")
    (fake / "fdl_fabric" / "__main__.py").write_text("print('fdl-fabric 0.0.1')\n")
    lab = sshd_lab(n_hosts=1, session_env={"PYTHONPATH": str(fake),
                                           "PATH": os.environ["PATH"]})
    home = ssh_home(lab, tmp_path)
    out = subprocess.run([*FDL, "wait", "--on", "node1"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "HOME": str(home)},
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 1
    assert out.stderr.strip() == (
        "--on node1: fdl-fabric 0.0.1 is installed there, this is 0.1.0: install the same "
        "there: ssh node1 python3 -m pip install fdl-fabric==0.1.0")


def test_the_api_detaches_on_a_host_and_its_remote_handle_waits_for_the_result(
        sshd_lab, steady: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fdl_fabric

    there = tmp_path / "runs-on-node1"
    lab = sshd_lab(n_hosts=2, session_env={"FDL_FABRIC_RUNS_DIR": str(there),
                                           "PATH": os.environ["PATH"]})
    home = ssh_home(lab, tmp_path)
    monkeypatch.setenv("HOME", str(home))
    cluster = lab.write_cluster([lab.worker(lab.hosts[1], nproc=2)],
                                command=f"{sys.executable} -u {steady} 20 0.05")
    handle = fdl_fabric.launch(cluster, detach=True, on="node1")
    assert handle.on == "node1" and (there / handle.run_id).is_dir()
    result = handle.wait(timeout=60)
    assert (result.verdict, result.exit_code, result.run_id) == ("ok", 0, handle.run_id)
    assert [r.rank for r in result.ranks] == [0, 1]
    assert handle.status()["state"] == "ended"
    assert list(handle.logs(rank=0))[-1].endswith(":r0] done r0")
