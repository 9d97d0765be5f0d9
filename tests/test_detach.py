"""Runs outlive the terminal (issue 30), on this machine: the API's detached launch and
its handle, ``inv launch --detach``, a run started under ``nohup``, ``stop`` of a
foreground run, ``attach`` to a run that has ended, and ``status`` of a live foreground
run. Real launchers, real ranks, real signals; the lab tests (test_detach_lab.py) do the
same against sshd hosts and a real terminal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import fdl_fabric
from fdl_fabric.testing.launches import LiveProcess, processes_of_run, wait_for
from labutil import ROOT

pytestmark = pytest.mark.timeout(120)

FDL = (sys.executable, "-m", "fdl_fabric")


def fdl(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FDL, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=str(cwd), stdin=subprocess.DEVNULL)


def test_the_api_detaches_and_its_handle_follows_waits_and_reads_the_result(
        runs: Path, steady: Path) -> None:
    handle = fdl_fabric.launch(None, [sys.executable, "-u", str(steady), "20", "0.05"],
                               hosts="localhost", nproc_per_node=2, detach=True, quiet=True)
    assert isinstance(handle, fdl_fabric.RunHandle)
    assert handle.status()["state"] in ("starting", "running")
    lines = list(handle.logs(follow=True, rank=1))
    assert lines[-1].endswith(":r1] done r1") and all(":r0]" not in line for line in lines)
    result = handle.wait(timeout=60)
    assert (result.verdict, result.exit_code, result.run_id) == ("ok", 0, handle.run_id)
    assert [r.rank for r in result.ranks] == [0, 1]
    assert {r.state for r in result.ranks} == {"succeeded"}
    again = fdl_fabric.attach(handle.run_id[:20])
    assert again.wait() == result
    assert fdl_fabric.attach().run_id == handle.run_id, "None is the newest run"


def test_a_handle_stops_its_run_and_the_result_says_so(runs: Path, steady: Path) -> None:
    handle = fdl_fabric.launch(None, [sys.executable, "-u", str(steady), "2000", "0.05"],
                               hosts="localhost", detach=True, quiet=True, kill_grace=5)
    handle.stop()
    result = handle.wait(timeout=60)
    assert (result.verdict, result.exit_code) == ("interrupted", 143)
    assert result.message.startswith("cluster launcher: stopped by fdl-fabric stop (")
    wait_for(lambda: not processes_of_run(handle.run_id), 20, "the ranks to be gone")


def test_attach_to_a_run_that_failed_prints_its_end_and_exits_with_its_code(
        runs: Path, steady: Path, tmp_path: Path) -> None:
    out = fdl("run", str(steady), "2", "0.01", "7", cwd=tmp_path)
    assert out.returncode == 1
    attach = fdl("attach", cwd=tmp_path)
    assert attach.returncode == 1, attach.stderr
    assert attach.stdout.splitlines()[-1] == out.stderr.splitlines()[-1]
    assert attach.stdout.splitlines()[-1].startswith("cluster launcher: failed: ")
    wait = fdl("wait", cwd=tmp_path)
    assert wait.returncode == 1 and wait.stderr.splitlines()[-1] == out.stderr.splitlines()[-1]


def test_a_run_that_is_not_recorded_is_refused_with_exit_2(runs: Path, tmp_path: Path) -> None:
    for command in ("attach", "logs", "stop", "wait"):
        out = fdl(command, "20990101-000000-00000000", cwd=tmp_path)
        assert out.returncode == 2, (command, out.stderr)
        assert out.stderr.startswith(f"{command}: no run recorded in ")


def test_stop_of_a_foreground_run_names_the_stopper_and_exits_143(
        runs: Path, steady: Path, tmp_path: Path) -> None:
    launch = LiveProcess([*FDL, "run", str(steady), "2000", "0.05"], cwd=str(tmp_path))
    try:
        launch.wait_line("r0 line 3")
        status = fdl("status", cwd=tmp_path)
        assert "running (attempt 0)" in status.stdout and "foreground" in status.stdout
        stop = fdl("stop", cwd=tmp_path)
        assert stop.returncode == 0, stop.stderr
        assert launch.finish(60) == 143
        last = launch.err_lines()[-1]
        assert last.startswith("cluster launcher: stopped by fdl-fabric stop (")
        assert stop.stderr.splitlines()[-1] == last
    finally:
        launch.kill()


def test_a_run_started_under_nohup_keeps_sighup_ignored_and_says_so_once(
        runs: Path, steady: Path, tmp_path: Path) -> None:
    def ignore_hangup() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    proc = subprocess.Popen([*FDL, "run", str(steady), "30", "0.05"], cwd=str(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=ignore_hangup)
    try:
        wait_for(lambda: (runs.exists() and any(runs.iterdir())), 30, "the run's record")
        (record,) = list(runs.iterdir())
        wait_for(lambda: "line 2" in (record / "console.log").read_text(), 30, "output")
        proc.send_signal(signal.SIGHUP)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert err.count("SIGHUP is ignored (started under nohup or alike)") == 1
    assert err.splitlines()[-1] == "cluster launcher: run completed — all 1 ranks exited 0"


def test_inv_launch_detach_says_the_inv_commands_and_they_follow_the_run(
        runs: Path, steady: Path, tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(f"command: {sys.executable} -u {steady} 10 0.05\nkill_grace: 2\n"
                       f"workers:\n  - host: localhost\n    nproc: 2\n    path: {tmp_path}\n")
    inv = (sys.executable, "-m", "invoke", "--search-root", str(ROOT))
    out = subprocess.run([*inv, "launch", "--detach", "-c", str(cluster)], cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    (run_id,) = [p.name for p in runs.iterdir()]
    assert f"inv wait {run_id}" in out.stdout
    waited = subprocess.run([*inv, "wait", run_id], cwd=str(tmp_path), capture_output=True,
                            text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert waited.returncode == 0, waited.stderr
    assert os.path.exists(runs / run_id / "result.json")


def test_stop_kill_stops_at_once_and_wait_timeout_exits_124_while_it_runs(
        runs: Path, steady: Path, tmp_path: Path) -> None:
    handler = tmp_path / "stubborn.py"  # a rank that shrugs TERM off: only KILL ends it
    handler.write_text("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                       "print('up', flush=True)\ntime.sleep(600)\n")
    out = fdl("run", "--detach", "--kill-grace", "300", str(handler), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    (run_id,) = [p.name for p in runs.iterdir()]
    waited = fdl("wait", run_id, "--timeout", "0.5", cwd=tmp_path)
    assert waited.returncode == 124
    assert waited.stderr.strip() == (f"wait: run {run_id} is still running after 0.5s "
                                     "(exit 124)")
    stop = fdl("stop", run_id, "--kill", cwd=tmp_path)  # no 300 s grace: at once
    assert stop.returncode == 0, stop.stderr
    assert "KILL now (--kill)" in stop.stderr
    assert stop.stderr.splitlines()[-1].startswith(
        "cluster launcher: stopped by fdl-fabric stop (")
    log = (runs / run_id / "console.log").read_text()
    assert "fdl-fabric stop --kill — killing every rank's process group now" in log
    assert fdl("wait", run_id, cwd=tmp_path).returncode == 143
    wait_for(lambda: not processes_of_run(run_id), 20, "the ranks to be gone")


def test_several_followers_read_one_run_at_once(runs: Path, steady: Path,
                                                 tmp_path: Path) -> None:
    out = fdl("run", "--detach", "--nproc-per-node", "2", str(steady), "40", "0.02",
              cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    followers = [subprocess.Popen([*FDL, *words], cwd=str(tmp_path), text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  stdin=subprocess.DEVNULL)
                 for words in (["logs", "-f"], ["logs", "-f", "--rank", "0"], ["attach"])]
    outputs = [p.communicate(timeout=60) for p in followers]
    assert [p.returncode for p in followers] == [0, 0, 0], outputs
    whole, rank0, attached = (o[0].splitlines() for o in outputs)
    assert whole[-1] == attached[-1] == "cluster launcher: run completed — all 2 ranks exited 0"
    assert "[localhost:cpu:r0] done r0" in whole and "[localhost:cpu:r1] done r1" in whole
    assert rank0[-1] == "[localhost:cpu:r0] done r0"
    assert rank0 == [line for line in whole if line.startswith("[localhost:cpu:r0] ")
                     or line.startswith("cluster launcher: run ") and line != whole[-1]]


def test_detach_without_a_records_folder_is_refused_before_anything_starts(
        steady: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FDL_FABRIC_RUNS_DIR", str(blocker / "runs"))
    out = fdl("run", "--detach", str(steady), "1", "0.01", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("--detach: no folder for the run's record: ")
    assert "set FDL_FABRIC_RUNS_DIR to a folder of yours" in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
