"""Operator experience through real sshd: logs, dry-run, summary, exit codes, task library."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fdl_fabric.testing import SshdLab
from labutil import PROBE, ROOT, LiveLaunch, run_launch

pytestmark = pytest.mark.lab

TOY = str(ROOT / "examples" / "toy_train.py")


def _cluster(lab: SshdLab) -> Path:
    local = {"host": "localhost", "nproc": 1, "path": str(ROOT)}
    w = lab.worker(lab.hosts[0], nproc=2, env={"WANDB_API_KEY": "wandb-secret-123", "LR": "0.1"})
    return lab.write_cluster([local, w], env={"HF_TOKEN": "hf-secret-456"})


def test_log_dir_keeps_every_rank_output_the_events_and_the_redacted_cluster(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = _cluster(lab)
    run = LiveLaunch(cluster, "--log-dir", str(tmp_path / "logs"), "--cmd",
                     f"python3 {TOY} --steps 30 --step-time 0.1 --checkpoint-dir {tmp_path}")
    try:
        pid = int(run.wait_line(r":r2\] rank 2/3 joined on .* \(pid (\d+)\)").group(1))
        run.wait_line("cohort formed", stderr=True)
        os.kill(pid, signal.SIGKILL)
        assert run.finish(60) == 0
    finally:
        run.kill()
    (run_dir,) = [p for p in (tmp_path / "logs").iterdir() if not p.is_symlink()]
    for r in range(3):
        assert "joined on" in (run_dir / "attempt_0" / f"r{r}" / "stdout.log").read_text()
        assert (run_dir / "attempt_0" / f"r{r}" / "stderr.log").exists()
    assert "[lab1" not in (run_dir / "attempt_0" / "r1" / "stdout.log").read_text()  # unprefixed
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    kinds = {e["kind"] for e in events}
    assert {"launch", "spawn", "join", "formed", "tolerated", "verdict"} <= kinds
    assert all(isinstance(e["time"], float) and e["v"] == 1 for e in events)
    assert events[-1]["kind"] == "verdict" and events[-1]["data"]["exit_code"] == 0
    text = (run_dir / "cluster.json").read_text()
    assert "wandb-secret-123" not in text and "hf-secret-456" not in text
    data = json.loads(text)
    assert data["run_id"] == run_dir.name and len(data["ranks"]) == 3
    assert data["ranks"][1]["env"]["WANDB_API_KEY"] == "***"
    assert data["ranks"][1]["env"]["LR"] == "0.1"


def test_dry_run_prints_the_plan_and_connects_nowhere(sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = _cluster(lab)
    before = lab.hosts[0].log_text()
    out = run_launch(cluster, "--dry-run", "--cmd", f"python3 {PROBE} --dump {tmp_path}/d")
    assert out.returncode == 0, out.stderr
    assert lab.hosts[0].log_text() == before  # sshd saw no connection at all
    assert not (tmp_path / "d").exists()
    text = out.stdout
    h = lab.hosts[0]
    assert f"host lab1: ssh {lab.user}@{h.addr} port {h.port}, identity {lab.identity_file}" \
        in text
    assert "ranks 1-2 (cpu)" in text and "rank 2: FLODL_INTERNAL_LOCAL_RANK=1 RANK=2" in text
    assert "WANDB_API_KEY='***'" in text and "wandb-secret-123" not in text
    assert "hf-secret-456" not in text
    assert "one session runs the agent" in text and "rankprobe.py" in text
    assert len(text.splitlines()) <= 20


def test_the_run_summary_names_each_rank_exit_and_cause(sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = _cluster(lab)
    out = run_launch(cluster, "--kill-grace", "1", "--cmd",
                     f"python3 {PROBE} --sleep 60 --exit-rank 2 --exit-code 7")
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert lines[-1] == "cluster launcher: failed: rank 2 of lab1 exited with status 7"
    head = lines.index(next(x for x in lines if x.split() == ["rank", "host", "exit", "cause",
                                                               "duration"]))
    table = lines[head:head + 4]
    assert lines[head + 4].startswith("root cause: rank 2 of lab1 (lab1:cpu:r2) exited with "
                                      "status 7")
    assert table[3].split()[:4] == ["2", "lab1", "7", "failed"]
    assert "stopped by the launcher" in table[1] and "signal 15" in table[1]


@pytest.mark.parametrize("case,code", [("ok", 0), ("failure", 1), ("config", 2),
                                       ("usage", 2), ("sigint", 130), ("sigterm", 143)])
def test_exit_codes_follow_the_documented_rule(sshd_lab, tmp_path: Path, case: str,
                                                code: int) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = _cluster(lab)
    if case == "ok":
        assert run_launch(cluster, "--cmd", f"python3 {PROBE}").returncode == code
    elif case == "failure":
        assert run_launch(cluster, "--cmd", f"python3 {PROBE} --exit-rank 0 --exit-code 5",
                          ).returncode == code
    elif case == "config":
        bad = tmp_path / "bad.yml"
        bad.write_text("workers:\n  - host: x\n    nproc: two\n")
        assert run_launch(bad, "--cmd", "true").returncode == code
    elif case == "usage":
        assert run_launch(cluster, "--cmd", "python3 'unbalanced").returncode == code
    else:
        run = LiveLaunch(cluster, "--cmd", f"python3 {PROBE} --sleep 60")
        try:
            run.wait_line("hello from rank 2")
            run.proc.send_signal(signal.SIGINT if case == "sigint" else signal.SIGTERM)
            assert run.finish(30) == code
            assert sum("received — stopping" in line for line in run.stderr_lines) == 1
        finally:
            run.kill()


def test_the_collection_imports_into_an_ops_repo_and_launches(sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    ops = tmp_path / "ops"
    ops.mkdir()
    (ops / "tasks.py").write_text(textwrap.dedent("""\
        from invoke import Collection, task

        import fdl_fabric.tasks


        @task
        def deploy(c):
            print("deployed")


        ns = Collection(deploy)
        ns.add_collection(fdl_fabric.tasks.ns, "fdl")
        """))
    w = lab.worker(lab.hosts[0], nproc=2)
    lab.write_cluster([w], filename="lab.yml", command=f"python3 {PROBE}")
    (ops / "invoke.yaml").write_text(f"fdl:\n  cluster: {lab.root / 'lab.yml'}\n")
    env = {**os.environ, "INVOKE_FDL_LOG_DIR": str(tmp_path / "logs")}
    listing = subprocess.run([sys.executable, "-m", "invoke", "--list"], cwd=ops, env=env,
                             capture_output=True, text=True, timeout=30)
    assert "fdl.launch" in listing.stdout and "fdl.cleanup" in listing.stdout
    out = subprocess.run([sys.executable, "-m", "invoke", "fdl.launch"], cwd=ops, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "[lab1:cpu:r1] hello from rank 1" in out.stdout
    # the log dir came from INVOKE_FDL_LOG_DIR
    (run_dir,) = [p for p in (tmp_path / "logs").iterdir() if not p.is_symlink()]
    assert (run_dir / "attempt_0" / "r1" / "stdout.log").exists()


def test_the_python_api_gives_an_ops_repos_task_a_result_and_raises_on_bad_config(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=2)
    cluster = lab.write_cluster([lab.worker(h, nproc=2) for h in lab.hosts])
    ops = tmp_path / "ops"
    ops.mkdir()
    (ops / "tasks.py").write_text(textwrap.dedent(f"""\
        import json

        from invoke import task

        import fdl_fabric
        from fdl_fabric.errors import FdlError

        FAIL_RANK_2 = "import os, sys; sys.exit(4 if os.environ['RANK'] == '2' else 0)"


        @task
        def train(c):
            ok = fdl_fabric.launch({str(cluster)!r}, ["python3", "-c", "print('hi')"],
                                   quiet=True)
            bad = fdl_fabric.launch({str(cluster)!r}, ["python3", "-c", FAIL_RANK_2],
                                    max_restarts=1, quiet=True)
            try:
                fdl_fabric.launch({str(ops / 'missing.yml')!r}, ["true"])
                refused = None
            except FdlError as exc:
                refused = [type(exc).__name__, exc.exit_code, str(exc)]
            print(json.dumps({{
                "ok": [ok.verdict, ok.exit_code, ok.message, len(ok.ranks)],
                "bad": [bad.verdict, bad.exit_code, bad.message, len(bad.attempts),
                        bad.root_cause.rank, bad.root_cause.exit_code,
                        [a.hosts for a in bad.attempts]],
                "refused": refused}}))
        """))
    out = subprocess.run([sys.executable, "-m", "invoke", "train"], cwd=ops,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["ok"] == ["ok", 0, "cluster launcher: run completed — all 4 ranks exited 0", 4]
    # the message is the verdict line, as the command line's last line and the record's
    assert got["bad"] == ["failed", 1,
                          "cluster launcher: failed: rank 2 of lab2 exited with status 4",
                          2, 2, 4, [["lab1", "lab2"], ["lab1", "lab2"]]]
    assert got["refused"] == ["ConfigError", 2, f"{ops / 'missing.yml'}: file not found"]


def test_verbose_shows_routine_events_and_sets_flodl_verbosity(sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = lab.write_cluster([lab.worker(lab.hosts[0], nproc=1)])
    quiet = run_launch(cluster, "--cmd", f"python3 {PROBE} --dump {tmp_path}/q")
    assert "started lab1:cpu:r0" not in quiet.stderr
    out = run_launch(cluster, "-vv", "--cmd", f"python3 {PROBE} --dump {tmp_path}/v")
    assert out.returncode == 0, out.stderr
    assert "cluster launcher: started lab1:cpu:r0" in out.stderr
    assert "connected to lab1" in out.stderr
    env = json.loads((tmp_path / "v" / "env-r0.json").read_text())["env"]
    assert env["FLODL_VERBOSITY"] == "3"
    assert "FLODL_VERBOSITY" not in json.loads((tmp_path / "q" / "env-r0.json").read_text())["env"]


def test_invalid_utf8_never_stops_forwarding(sshd_lab) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = lab.write_cluster([lab.worker(lab.hosts[0], nproc=1)])
    prog = ("import sys; sys.stdout.buffer.write(b'bad \\xff\\xfe bytes\\n'); "
            "sys.stdout.buffer.write('ok é 日本\\n'.encode()); sys.stdout.flush()")
    out = run_launch(cluster, "--", "python3", "-c", prog)
    assert out.returncode == 0, out.stderr
    assert "[lab1:cpu:r0] bad \ufffd\ufffd bytes\n" in out.stdout
    assert "[lab1:cpu:r0] ok é 日本\n" in out.stdout
