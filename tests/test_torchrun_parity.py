"""Any torchrun script runs unchanged: the rank environment, OMP_NUM_THREADS, restarts,
error files and their root cause, env_forward, and `fdl-fabric run` as a drop-in.

Real processes throughout: real PyTorch DDP on gloo, real sshd lab hosts for the remote
ranks, real signals.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from fdl_fabric.testing import SshdLab
from labutil import ROOT, LiveLaunch, dumps, run_launch

DDP = str(ROOT / "examples" / "ddp_torch.py")
#: Every variable torchrun sets for a worker that fdl-fabric sets too.
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS")


def fdl_run(*args: str, timeout: float = 120, env: dict[str, str] | None = None,
            cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """``fdl-fabric run ...``, as `python -m fdl_fabric run ...` (the same entry point)."""
    return subprocess.run([sys.executable, "-m", "fdl_fabric", "run", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=str(cwd),
                          env={**os.environ, **(env or {})})


def _mixed_cluster(lab: SshdLab, **top: Any) -> Path:
    local = {"host": "localhost", "nproc": 2, "path": str(ROOT)}
    return lab.write_cluster([local, lab.worker(lab.hosts[0], nproc=2)], **top)


def _run_id(stderr: str) -> str:
    line = next(x for x in stderr.splitlines() if x.startswith("cluster launcher: run "))
    return line.split()[3].rstrip(":")


# -- the rank environment ------------------------------------------------------------------
@pytest.mark.lab
@pytest.mark.timeout(180)
def test_a_ddp_script_on_two_local_and_two_remote_ranks_gets_torchruns_environment(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = _mixed_cluster(lab)
    out = run_launch(cluster, "--cmd", f"python3 {DDP} --steps 10 --out {tmp_path}/p "
                     f"--dump-env {tmp_path}/e", timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    run = _run_id(out.stderr)
    envs = dumps(tmp_path / "e", 4)
    for rank, env in envs.items():
        missing = [v for v in TORCHRUN_VARS if v not in env]
        assert missing == [], (rank, missing)
        local_rank = rank % 2
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) \
            == (str(rank), str(local_rank), "4", "2")
        assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == (str(rank // 2), "2")
        assert (env["ROLE_NAME"], env["ROLE_RANK"], env["ROLE_WORLD_SIZE"]) == \
            ("default", str(rank), "4")
        assert env["TORCHELASTIC_RUN_ID"] == run
        assert (env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_MAX_RESTARTS"]) == ("0", "0")
        assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"/attempt_0/r{rank}/error.json")
        assert env["OMP_NUM_THREADS"] == "1"
        # No agent store exists: do not claim one (torch then lets rank 0 host it).
        assert "TORCHELASTIC_USE_AGENT_STORE" not in env
    assert len({e["TORCHELASTIC_ERROR_FILE"] for e in envs.values()}) == 4
    prints = {json.loads((tmp_path / "p" / f"params-r{r}.json").read_text())["fingerprint"]
              for r in range(4)}
    assert len(prints) == 1, "DDP kept every rank's parameters identical"
    assert out.stderr.count("setting OMP_NUM_THREADS=1") == 1


def test_omp_num_threads_set_by_the_user_is_respected_and_one_rank_a_host_gets_none(
        tmp_path: Path) -> None:
    cluster = tmp_path / "c.yml"
    cluster.write_text(textwrap.dedent(f"""\
        workers:
          - host: localhost
            nproc: 2
            path: {ROOT}
        """))
    probe = f"python3 {ROOT}/tests/progs/rankprobe.py --dump {tmp_path}/"
    out = run_launch(cluster, "--cmd", probe + "a", env={"OMP_NUM_THREADS": "3"})
    assert out.returncode == 0, out.stderr
    assert {e["env"]["OMP_NUM_THREADS"] for e in dumps(tmp_path / "a", 2).values()} == {"3"}
    assert "setting OMP_NUM_THREADS" not in out.stderr
    cluster.write_text(cluster.read_text().replace("nproc: 2", "nproc: 1") +
                       "env:\n  UNRELATED: x\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run([sys.executable, "-m", "invoke", "--search-root", str(ROOT), "launch",
                           "--cluster", str(cluster), "--cmd", probe + "b"], env=env,
                          capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr
    assert "OMP_NUM_THREADS" not in dumps(tmp_path / "b", 1)[0]["env"]


# -- restarts ------------------------------------------------------------------------------
FAIL_FIRST = ("import os,sys; a=int(os.environ['TORCHELASTIC_RESTART_COUNT']); "
              "print('attempt', a, 'of', os.environ['TORCHELASTIC_MAX_RESTARTS'], flush=True); "
              "sys.exit(3 if a == 0 and os.environ['RANK'] == '1' else 0)")


@pytest.mark.lab
def test_a_rank_failing_on_attempt_0_and_passing_on_attempt_1_exits_0_with_two_attempts(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = _mixed_cluster(lab, kill_grace=1)
    logs = tmp_path / "logs"
    out = run_launch(cluster, "--max-restarts", "2", "--log-dir", str(logs), "--",
                     sys.executable, "-c", FAIL_FIRST, timeout=90)
    assert out.returncode == 0, out.stderr
    restarts = [line for line in out.stderr.splitlines() if "restarting every rank" in line]
    assert len(restarts) == 1 and "attempt 0 failed" in restarts[0]
    assert "rank 1 of localhost exited with status 3" in restarts[0]
    assert any(line.startswith("attempt  hosts") and "verdict  cause" in line
               for line in out.stderr.splitlines())
    assert out.stderr.splitlines()[-1] == "cluster launcher: run completed — all 4 ranks exited 0"
    for rank in range(4):
        assert f"[{'localhost' if rank < 2 else 'lab1'}:cpu:r{rank}] attempt 1 of 2" in out.stdout
    (run_dir,) = [p for p in logs.iterdir() if p.name != "latest"]
    assert (run_dir / "attempt_0" / "r1" / "stdout.log").read_text() == "attempt 0 of 2\n"
    assert (run_dir / "attempt_1" / "r1" / "stdout.log").read_text() == "attempt 1 of 2\n"
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    restart = [e for e in events if e["kind"] == "restart"]
    assert len(restart) == 1 and restart[0]["attempt"] == 1
    assert events[-1]["kind"] == "verdict" and events[-1]["data"]["attempts"] == 2


def test_restarts_stop_after_max_restarts_with_the_last_failure_as_the_verdict(
        tmp_path: Path) -> None:
    out = fdl_run("--nproc-per-node", "2", "--max-restarts", "1", "-m", "json.tool",
                  "/nonexistent-input")
    assert out.returncode == 1, out.stderr
    assert out.stderr.count("restarting every rank") == 1
    assert "exited with status 2" in out.stderr.splitlines()[-1]


def test_ctrl_c_during_an_attempt_never_restarts(tmp_path: Path) -> None:
    launch = LiveLaunch(ROOT / "cluster.yml", "--max-restarts", "3", "--kill-grace", "1",
                        "--cmd", f"python3 {ROOT}/tests/progs/sigprobe.py {tmp_path}/d --sleep 60")
    try:
        launch.wait_line(r"cluster launcher: run ", stderr=True)
        deadline = time.monotonic() + 20
        while len(list((tmp_path / "d").glob("start-r*.json"))) < 2:
            assert time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.05)
        os.kill(launch.proc.pid, signal.SIGINT)
        assert launch.finish(30) == 130
    finally:
        launch.kill()
    assert not [line for line in launch.stderr_lines if "restarting" in line]


# -- error files and the root cause --------------------------------------------------------
RECORDED = textwrap.dedent("""\
    import os, time
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        if os.environ["RANK"] == "1":
            raise ValueError("boom from rank 1")
        time.sleep(30)

    main()
    """)


@pytest.mark.lab
@pytest.mark.timeout(120)
def test_a_failing_ranks_error_file_names_the_root_cause_and_log_dir_keeps_it(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    script = Path(lab.hosts[0].path) / "recorded.py"
    script.write_text(RECORDED)
    (tmp_path / "recorded.py").write_text(RECORDED)
    cluster = lab.write_cluster([{"host": "localhost", "nproc": 1, "path": str(tmp_path)},
                                 lab.worker(lab.hosts[0], nproc=1)], kill_grace=1)
    logs = tmp_path / "logs"
    out = run_launch(cluster, "--log-dir", str(logs), "--cmd", "python3 recorded.py",
                     timeout=110)
    assert out.returncode == 1, out.stderr
    cause = [line for line in out.stderr.splitlines() if line.startswith("root cause: ")]
    assert cause == ["root cause: rank 1 of lab1 (lab1:cpu:r1) exited with status 1: "
                     "ValueError: boom from rank 1"], out.stderr
    assert 'raise ValueError("boom from rank 1")' in out.stderr  # the traceback's tail
    (run_dir,) = [p for p in logs.iterdir() if p.name != "latest"]
    error = json.loads((run_dir / "attempt_0" / "r1" / "error.json").read_text())
    assert error["message"]["message"] == "ValueError: boom from rank 1"
    assert not (run_dir / "attempt_0" / "r0" / "error.json").exists()


def test_a_failure_without_an_error_file_quotes_the_ranks_stderr_and_says_how_to_get_one(
        tmp_path: Path) -> None:
    # An uncaught exception (status 1) of an undecorated script: @record would have helped.
    (tmp_path / "boom.py").write_text("raise ValueError('boom, undecorated')\n")
    out = fdl_run("--nproc-per-node", "1", "boom.py", cwd=tmp_path)
    assert out.returncode == 1
    lines = out.stderr.splitlines()
    head = lines.index("root cause: rank 0 of localhost (localhost:cpu:r0) exited with status 1 "
                       "(no error file: decorate the entry point with torch's @record to see "
                       "the exception here)")
    # the run's record on this controller keeps all of it
    assert lines[head + 1].startswith("  its last ") and "all of it in " in lines[head + 1]
    assert lines[head + 1].endswith("/attempt_0/r0/stderr.log):")
    assert "  | ValueError: boom, undecorated" in lines[head + 2:]
    assert lines[-1] == ("cluster launcher: failed: rank 0 of localhost exited with status 1")
    # argparse's usage error (status 2) is no exception for @record: no hint, the lines.
    out = fdl_run("--nproc-per-node", "1", "-m", "json.tool", "/nonexistent-input")
    assert out.returncode == 1
    assert "@record" not in out.stderr
    head = out.stderr.index("root cause: rank 0 of localhost (localhost:cpu:r0) exited with "
                            "status 2\n  its last ")
    assert "/nonexistent-input" in out.stderr[head:]


# -- env_forward ---------------------------------------------------------------------------
@pytest.mark.lab
def test_env_forward_carries_launcher_variables_to_remote_ranks_exactly_and_never_in_argv(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    secret = "tok 'single' \"double\"\nsecond line $HOME `id`"
    w = lab.worker(lab.hosts[0], nproc=1, env_forward=["WANDB_*"])
    cluster = lab.write_cluster([w], env_forward=["HF_TOKEN"])
    probe = f"python3 {ROOT}/tests/progs/rankprobe.py --dump {tmp_path}/d --sleep 2"
    launch = LiveLaunch(cluster, "--cmd", probe,
                        env={"HF_TOKEN": secret, "WANDB_API_KEY": "w&b", "NOT_FORWARDED": "x"})
    try:
        env = dumps(tmp_path / "d", 1)[0]["env"]
        cmdlines = []
        for proc in psutil.process_iter(["cmdline"]):
            cmdlines.append("\0".join(proc.info["cmdline"] or []))
        assert launch.finish(60) == 0
    finally:
        launch.kill()
    assert env["HF_TOKEN"] == secret and env["WANDB_API_KEY"] == "w&b"
    assert "NOT_FORWARDED" not in env
    assert not [c for c in cmdlines if "second line" in c or "w&b" in c]


# -- fdl-fabric run, the drop-in -------------------------------------------------------------
@pytest.mark.timeout(180)
def test_fdl_fabric_run_runs_the_ddp_example_like_torchrun(tmp_path: Path) -> None:
    out = fdl_run("--standalone", "--nproc_per_node=2", DDP, "--steps", "10", "--out",
                  str(tmp_path / "p"), "--dump-env", str(tmp_path / "e"), timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    envs = dumps(tmp_path / "e", 2)
    for env in envs.values():
        assert [v for v in TORCHRUN_VARS if v not in env] == []
        assert env["WORLD_SIZE"] == "2" and env["MASTER_ADDR"] == "127.0.0.1"
    assert "ranks agree: True" in out.stdout
    assert "[localhost:cpu:r1] params fingerprint" in out.stdout


def test_fdl_fabric_run_takes_a_module_like_python_dash_m(tmp_path: Path) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text("import os, sys\nprint('module rank', os.environ['RANK'], "
                                  "sys.argv[1:])\n")
    out = fdl_run("--nproc-per-node", "2", "-m", "mypkg.train", "--lr", "0.1", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for rank in range(2):
        assert f"[localhost:cpu:r{rank}] module rank {rank} ['--lr', '0.1']" in out.stdout


@pytest.mark.parametrize("flag,hint", [
    ("--rdzv-backend=c10d", "--rdzv-endpoint HOST:PORT places it"),
    ("--tee=3", "--log-dir"),
    ("--node_rank=1", "--hosts starts every host's ranks itself"),
    ("--monitor-interval=1", "the moment they happen"),
])
def test_torchrun_flags_without_meaning_here_are_refused_with_what_to_use(
        flag: str, hint: str, tmp_path: Path) -> None:
    out = fdl_run(flag, "--nproc-per-node", "2", "train.py", timeout=30)
    assert out.returncode == 2
    assert flag.split("=")[0].replace("_", "-") in out.stderr and hint in out.stderr
    assert "cluster launcher: run" not in out.stderr


def test_fdl_fabric_run_refuses_several_nodes_and_passes_the_scripts_own_flags(
        tmp_path: Path) -> None:
    out = fdl_run("--nnodes", "2", "train.py", timeout=30)
    assert out.returncode == 2 and "--nnodes" in out.stderr and "--hosts" in out.stderr
    script = tmp_path / "echo.py"
    script.write_text("import sys; print(sys.argv[1:])")
    out = fdl_run("--nproc-per-node", "1", str(script), "--nnodes", "7", "--tee", "x",
                  timeout=30)
    assert out.returncode == 0, out.stderr
    assert "['--nnodes', '7', '--tee', 'x']" in out.stdout


@pytest.mark.parametrize(("what", "args", "why"), [
    ("a missing script", ["missing.py"], "missing.py does not exist from"),
    ("a folder", ["adir"], "adir is a folder, not a script from"),
    ("a missing module", ["-m", "no_such_pkg.train"], "no module no_such_pkg.train from"),
])
def test_a_missing_script_module_or_folder_is_refused_before_any_rank_starts(
        tmp_path: Path, what: str, args: list[str], why: str) -> None:
    (tmp_path / "adir").mkdir()
    out = fdl_run("--nproc-per-node", "2", "--max-restarts", "2", *args, cwd=tmp_path)
    assert out.returncode == 1, what
    assert why in out.stderr, out.stderr
    assert out.stderr.splitlines()[-1].startswith(
        "cluster launcher: failed: pre-flight failed on 1 check(s), nothing was started")
    assert out.stdout == "" and "restarting" not in out.stderr, "no rank ever started"
