"""Launching inside a Slurm allocation, against a real Slurm cluster (the Slurm lab).

Every test drives ``inv launch`` as a process inside an allocation of the lab: three
slurmd posing as nodes n1-n3 on this machine, real srun steps, real scancel. Most tests
hold their allocation with ``salloc --no-shell`` and run the launcher with the job's
variables, as ``salloc`` would, so the test sees the launcher's own exit status; one test
runs the documented ``salloc -N 3 inv launch --slurm ...`` itself.

After each test nothing of the run is left (``processes_of_run``) and the job has no agent
step left (``squeue --steps``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from fdl_fabric.agent import procs as procs_module
from fdl_fabric.testing.fixtures import require_slurm
from fdl_fabric.testing.slurm import SlurmLab
from fdl_fabric.transport import slurm
from labutil import (
    PROBE,
    ROOT,
    SIGPROBE,
    LiveLaunch,
    LiveProcess,
    dumps,
    processes_of_run,
    wait_for,
)

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(120)]

TOY = str(ROOT / "examples" / "toy_train.py")
INV = [sys.executable, "-m", "invoke", "--search-root", str(ROOT)]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmLab]:
    require_slurm()
    with SlurmLab(tmp_path_factory.mktemp("slurm"), n_nodes=3, gpus_per_node=2) as started:
        yield started


class Job:
    """An allocation held by ``salloc --no-shell``; cancelled when the test ends."""

    def __init__(self, lab: SlurmLab, n_nodes: int = 3, *options: str) -> None:
        self.lab = lab
        result = lab.run(lab.salloc_argv(n_nodes, [], "--no-shell", *options), timeout=60)
        match = re.search(r"Granted job allocation (\d+)", result.stderr)
        assert result.returncode == 0 and match, result.stderr
        self.id = match.group(1)
        nodes = lab.run(["squeue", "--noheader", f"--jobs={self.id}", "--format=%N"])
        self.nodelist = nodes.stdout.strip()

    @property
    def env(self) -> dict[str, str]:
        """What salloc gives the command it runs."""
        return {**self.lab.env, "SLURM_JOB_ID": self.id, "SLURM_JOB_NODELIST": self.nodelist}

    def agent_steps(self) -> list[str]:
        out = self.lab.run(["squeue", "--noheader", "--steps", f"--jobs={self.id}",
                            "--format=%i %j"])
        return [line.split()[0] for line in out.stdout.splitlines()
                if line.split()[1:] == [slurm.AGENT_STEP]]

    def state(self) -> str:
        out = self.lab.run(["squeue", "--noheader", f"--jobs={self.id}", "--format=%T"])
        return out.stdout.strip()

    def cancel(self) -> None:
        self.lab.run(["scancel", self.id], timeout=30)


@pytest.fixture
def jobs(lab: SlurmLab) -> Iterator[Any]:
    made: list[Job] = []

    def make(n_nodes: int = 3, *options: str, on: SlurmLab = lab) -> Job:
        job = Job(on, n_nodes, *options)
        made.append(job)
        return job

    yield make
    for job in made:
        job.cancel()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def slurm_cluster(tmp_path: Path, **top: Any) -> Path:
    """A ``scheduler: slurm`` cluster file with free ports and a short kill grace."""
    data = {"scheduler": "slurm", "nproc_per_node": 2, "kill_grace": 2,
            "controller": {"port": _port()}, "master_port": _port(), **top}
    path = tmp_path / "slurm.yml"
    path.write_text(yaml.safe_dump(data))
    return path


def launched(job: Job, cluster: Path, *args: str) -> LiveLaunch:
    return LiveLaunch(cluster, *args, env=job.env)


def assert_nothing_left(job: Job, run: str) -> None:
    wait_for(lambda: not processes_of_run(run), 20, f"no process of run {run}")
    wait_for(lambda: not job.agent_steps(), 20, f"no agent step of job {job.id}")


def test_three_nodes_of_two_ranks_run_with_the_torchrun_environment_and_every_cpu(
        jobs: Any, tmp_path: Path) -> None:
    job = jobs(3)
    cluster = slurm_cluster(tmp_path)
    run = launched(job, cluster, "--log-dir", str(tmp_path / "logs"), "--cmd",
                   f"python3 {PROBE} --dump {tmp_path}/d")
    assert run.finish(90) == 0, run.err
    ranks = dumps(tmp_path / "d", 6)
    for r, dump in ranks.items():
        env = dump["env"]
        node = f"n{r // 2 + 1}"
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"],
                env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == \
            (str(r), str(r % 2), "6", "2", str(r // 2), "3")
        assert env["FLODL_HOST_NAME"] == node
        assert env["MASTER_ADDR"] == "127.0.0.1"  # n1's NodeAddr in the lab
        assert env["SLURM_JOB_ID"] == job.id and env["SLURMD_NODENAME"] == node
        # The agent's step holds every CPU the job has on the node (2), not one.
        assert env["SLURM_CPUS_ON_NODE"] == "2"
        assert not any(k in env for k in ("SLURM_EXACT", "SRUN_CPUS_PER_TASK"))
        # The agent step's "task 0 of 1" is not what a rank is: it sees the job's
        # variables, never the step's task ones (Lightning would read those as its rank).
        assert env["SLURM_JOB_NODELIST"] == job.nodelist == "n[1-3]"
        assert not any(k in env for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))
    assert run.err_lines()[-1] == "cluster launcher: run completed — all 6 ranks exited 0"
    assert (tmp_path / "logs" / "latest" / "attempt_0" / "r5" / "stdout.log").is_file()
    assert_nothing_left(job, run.run_id)


def test_every_gpu_of_the_job_on_a_node_is_a_rank_with_local_devices_all(
        jobs: Any, tmp_path: Path) -> None:
    job = jobs(2, "--gres=gpu:2")
    cluster = slurm_cluster(tmp_path, nproc_per_node=None, local_devices="all")
    cluster.write_text(cluster.read_text().replace("nproc_per_node: null\n", ""))
    run = launched(job, cluster, "--cmd", f"python3 {PROBE} --dump {tmp_path}/d")
    assert run.finish(90) == 0, run.err
    ranks = dumps(tmp_path / "d", 4)
    assert [ranks[r]["env"]["CUDA_VISIBLE_DEVICES"] for r in range(4)] == ["0", "1", "0", "1"]
    assert_nothing_left(job, run.run_id)


def test_a_rank_that_exits_3_stops_every_rank_and_the_launch_exits_1_naming_it(
        jobs: Any, tmp_path: Path) -> None:
    job = jobs(3)
    cluster = slurm_cluster(tmp_path)
    run = launched(job, cluster, "--cmd", f"python3 {PROBE} --dump {tmp_path}/d --sleep 60 "
                   "--exit-rank 3 --exit-code 3 --exit-after 1")
    assert run.finish(90) == 1, run.err
    assert run.err_lines()[-1] == "cluster launcher: failed: rank 3 of n2 exited with status 3"
    assert "peer failure — terminating all still-running ranks" in run.err
    assert_nothing_left(job, run.run_id)
    assert job.state() == "RUNNING", "Slurm itself never ended the job"


def test_an_elastic_run_that_loses_a_rank_after_the_cohort_formed_ends_degraded(
        jobs: Any, tmp_path: Path) -> None:
    job = jobs(3)
    cluster = slurm_cluster(tmp_path)
    run = launched(job, cluster, "--cmd", f"python3 {TOY} --steps 40 --step-time 0.1 "
                   f"--checkpoint-dir {tmp_path}/ck")
    try:
        run.wait_line("cohort formed — 6 ranks", stderr=True, timeout=60)
        pid = int(run.wait_line(r":r4\] rank 4/\d+ joined on .* \(pid (\d+)\)").group(1))
        os.kill(pid, signal.SIGKILL)
        code = run.finish(90)
    finally:
        run.kill()
    assert code == 0, run.err
    assert run.err_lines()[-1].startswith(
        "cluster launcher: run completed DEGRADED — 1 of 6 ranks lost")
    assert_nothing_left(job, run.run_id)


def test_scancel_of_the_job_stops_every_rank_and_the_launch_exits_143(
        jobs: Any, tmp_path: Path) -> None:
    job = jobs(3)
    cluster = slurm_cluster(tmp_path)
    run = launched(job, cluster, "--cmd", f"python3 {SIGPROBE} {tmp_path}/sig --sleep 60")
    wait_for(lambda: len(list((tmp_path / "sig").glob("start-r*"))) == 6, 60, "6 ranks")
    run_id = run.run_id
    job.cancel()
    assert run.finish(60) == 143, run.err
    assert re.fullmatch(r"cluster launcher: interrupted by SIGTERM on n[123] — every rank "
                        r"was stopped", run.err_lines()[-1]), run.err
    assert "received SIGTERM from outside (scancel, a time limit, kill)" in run.err
    for r in range(6):  # each rank was told once, by Slurm: the agent did not repeat it
        lines = (tmp_path / "sig" / f"sig-r{r}.log").read_text().split("\n")
        assert [line.split()[2] for line in lines if line] == ["SIGTERM"]
    wait_for(lambda: not processes_of_run(run_id), 20, "no process of the run")


def test_a_slurm_signal_reaches_every_rank_once_and_the_run_goes_on(
        jobs: Any, tmp_path: Path) -> None:
    job = jobs(2)
    cluster = slurm_cluster(tmp_path)
    run = launched(job, cluster, "-vv", "--cmd", f"python3 {SIGPROBE} {tmp_path}/sig --sleep 60")
    wait_for(lambda: len(list((tmp_path / "sig").glob("start-r*"))) == 4, 60, "4 ranks")
    job.lab.run(["scancel", "--signal=USR1", job.id])  # what sbatch --signal=USR1@T sends
    logs = [tmp_path / "sig" / f"sig-r{r}.log" for r in range(4)]
    wait_for(lambda: all(p.exists() for p in logs), 30, "USR1 at every rank")
    run.wait_line("SIGUSR1 from outside, which Slurm delivered to its ranks too", stderr=True)
    time.sleep(0.5)  # a second (forwarded) USR1 would land now
    assert run.proc.poll() is None, "USR1 does not stop the run"
    for log in logs:
        assert [line.split()[2] for line in log.read_text().splitlines()] == ["SIGUSR1"]
    run.signal(signal.SIGTERM)
    assert run.finish(60) == 143, run.err
    assert_nothing_left(job, run.run_id)


def test_an_sbatch_script_gets_its_time_limit_signal_at_every_rank_and_scancel_ends_it_143(
        lab: SlurmLab, tmp_path: Path) -> None:
    """The sbatch example of docs/slurm.md: ``exec inv launch --slurm`` as the script,
    ``--signal=USR1@55`` on a 1-minute job (Slurm checks limits about every 30 s)."""
    out = tmp_path / "job.out"
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n"
                      "#SBATCH --nodes=2\n#SBATCH --exclusive\n#SBATCH --time=1\n"
                      "#SBATCH --signal=USR1@55\n"
                      f"cd {shlex.quote(str(ROOT))}\n"
                      f"exec {shlex.join(INV)} launch --slurm --nproc-per-node 1 -vv "
                      f"--kill-grace 1 --cmd 'python3 {SIGPROBE} {tmp_path}/sig --sleep 90'\n")
    submitted = lab.run(["sbatch", "--parsable", f"--output={out}", str(script)])
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    try:
        logs = [tmp_path / "sig" / f"sig-r{r}.log" for r in range(2)]
        wait_for(lambda: all(p.exists() for p in logs), 75, "USR1 at both ranks")
        for log in logs:
            assert [line.split()[2] for line in log.read_text().splitlines()] == ["SIGUSR1"]
        lab.run(["scancel", job])
        wait_for(lambda: "interrupted by SIGTERM" in (out.read_text() if out.exists() else ""),
                 30, "the verdict in the job's output")
    finally:
        lab.run(["scancel", job])
    text = out.read_text()
    assert "SIGUSR1 from outside, which Slurm delivered to its ranks too" in text
    assert text.rstrip().splitlines()[-1].startswith("cluster launcher: interrupted by SIGTERM")


def test_slurm_outside_an_allocation_is_refused_with_exit_2_and_starts_nothing(
        lab: SlurmLab, tmp_path: Path) -> None:
    proc = LiveProcess([*INV, "launch", "--slurm", "--nproc-per-node", "2", "--cmd",
                        f"python3 {PROBE} --dump {tmp_path}/d"],
                       env={**lab.env, "SLURM_JOB_ID": ""}, cwd=ROOT)
    assert proc.finish(60) == 2
    assert proc.err_lines()[-1] == ("--slurm: not inside a Slurm allocation (SLURM_JOB_ID is "
                                    "not set): run it under salloc, or in an sbatch script")
    assert not (tmp_path / "d").exists()
    steps = lab.run(["squeue", "--noheader", "--steps"]).stdout
    assert slurm.AGENT_STEP[:8] not in steps


def test_a_bad_nproc_per_node_and_a_file_with_workers_are_refused_with_exit_2(
        jobs: Any, tmp_path: Path) -> None:
    job = jobs(1)
    bad = LiveProcess([*INV, "launch", "--slurm", "--nproc-per-node", "two", "--cmd", "true"],
                      env=job.env, cwd=ROOT)
    assert bad.finish(60) == 2
    assert "--nproc-per-node: expected a number of ranks per node" in bad.err
    with_workers = tmp_path / "ssh.yml"
    with_workers.write_text("workers:\n  - host: localhost\n    nproc: 1\n")
    run = launched(job, with_workers, "--slurm", "--cmd", "true")
    assert run.finish(60) == 2
    assert "--slurm takes the workers from the allocation, but this file lists workers" \
        in run.err
    assert job.agent_steps() == []


def test_the_dry_run_prints_the_srun_command_of_every_node(jobs: Any, tmp_path: Path) -> None:
    job = jobs(3)
    proc = LiveProcess([*INV, "launch", "--slurm", "--nproc-per-node", "2", "--dry-run",
                        "--cmd", "python3 train.py"], env=job.env, cwd=ROOT)
    assert proc.finish(60) == 0, proc.err
    out = "\n".join(proc.stdout_lines)
    for node in ("n1", "n2", "n3"):
        assert (f"setsid srun --jobid={job.id} --nodes=1 --ntasks=1 --nodelist={node} "
                "--overlap --unbuffered --kill-on-bad-exit=0 --wait=0 --mpi=none "
                "--job-name=fdl-fabric-agent /bin/sh -c") in out
    assert "6 rank(s) on 3 host(s)" in out
    assert job.agent_steps() == []


def test_a_node_whose_slurmd_dies_has_its_ranks_reported_lost_and_none_outlives_the_lease(
        jobs: Any, tmp_path: Path) -> None:
    # A lab of its own: a short SlurmdTimeout, so the dead node is noticed in seconds.
    with SlurmLab(tmp_path / "lab", n_nodes=3, slurmd_timeout=5, message_timeout=3) as lab:
        job = jobs(3, "--no-kill", on=lab)  # --no-kill: the job outlives a node
        cluster = slurm_cluster(tmp_path, elastic={"heartbeat_timeout": 3})
        run = launched(job, cluster, "--cmd", f"python3 {PROBE} --dump {tmp_path}/d --sleep 90")
        try:
            dumps(tmp_path / "d", 6, timeout=60)
            run_id = run.run_id
            lab.kill_slurmd("n2")
            code = run.finish(60)
        finally:
            run.kill()
        assert code == 1, run.err
        assert "host 'n2': agent lost" in run.err and "Node failure on n2" in run.err
        assert re.search(r"cluster launcher: failed: (rank [23] of n2|host 'n2').*",
                         run.err_lines()[-1])
        # Slurm leaves the dead node's step running until its slurmd returns; the agent
        # there stops hearing the launcher and stops its ranks once its lease runs out.
        wait_for(lambda: not processes_of_run(run_id), 30, "the dead node's ranks to stop")
        lab.restart_slurmd("n2")


def test_inv_cleanup_slurm_stops_this_jobs_runs_and_never_another_jobs(
        jobs: Any, tmp_path: Path) -> None:
    from test_reliability import run_env, start_time, write_record

    mine, other = jobs(1), jobs(1)  # two jobs: n1 and n2
    registry = procs_module.registry_dir()
    procs: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    for job, name in ((mine, "mine"), (other, "other")):
        run = f"cleanup-{name}-{time.monotonic_ns()}"
        proc = subprocess.Popen([sys.executable, SIGPROBE, str(tmp_path / name), "--sleep", "60"],
                                env=run_env(run, f"slurm-{job.id}", job.nodelist, 0),
                                start_new_session=True, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda p=proc: start_time(p.pid), 10, "the leftover to start")
        write_record(registry, pgid=proc.pid, start=start_time(proc.pid), run=run,
                     cluster=f"slurm-{job.id}", host=job.nodelist, rank=0)
        procs[name] = (proc, run)
    try:
        refused = LiveProcess([*INV, "cleanup", "--slurm", "--all"], env=mine.env, cwd=ROOT)
        assert refused.finish(60) == 2
        assert "--all: not with --slurm" in refused.err
        done = LiveProcess([*INV, "cleanup", "--slurm"], env=mine.env, cwd=ROOT)
        assert done.finish(60) == 0, done.err
        assert procs["mine"][0].wait(10) is not None
        assert procs["other"][0].poll() is None, "another job's run was touched"
        assert f"run {procs['mine'][1]}" in done.err
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for _, run in procs.values():
            Path(registry, f"{run}@{mine.nodelist}.json").unlink(missing_ok=True)
            Path(registry, f"{run}@{other.nodelist}.json").unlink(missing_ok=True)


def test_salloc_runs_the_documented_command(lab: SlurmLab) -> None:
    inv = shutil.which("inv")
    command = [inv] if inv else [sys.executable, "-m", "invoke"]
    result = lab.run(lab.salloc_argv(3, [*command, "launch", "--slurm", "--nproc-per-node", "2",
                                         "--cmd", "python3 examples/toy_train.py --steps 5"]),
                     cwd=str(ROOT), timeout=90)
    assert result.returncode == 0, result.stderr
    assert "cluster launcher: run completed — all 6 ranks exited 0" in result.stderr
    assert result.stdout.count("done: saved") == 6


def test_prebuild_check_of_a_slurm_file_checks_every_node_of_the_allocation(
        jobs: Any, tmp_path: Path) -> None:
    job = jobs(3)
    cluster = slurm_cluster(tmp_path, command="python3 train.py", path=str(tmp_path))
    (tmp_path / "train.py").write_text("print('hi')\n")
    out = subprocess.run([*INV, "prebuild-check", "--cluster", str(cluster), "--json"],
                         env=job.env, cwd=ROOT, capture_output=True, text=True, timeout=90)
    report = json.loads(out.stdout)
    hosts = {row["host"] for row in report["checks"]}
    assert {"n1", "n2", "n3"} <= hosts, report
    programs = [row for row in report["checks"] if row["check"] == "program"]
    assert {row["host"] for row in programs} == {"n1", "n2", "n3"}
    assert all(row["status"] == "ok" for row in programs), programs
    assert out.returncode == (0 if report["ok"] else 1)
    assert job.agent_steps() == []


def test_a_node_lost_mid_run_is_left_out_and_the_next_attempt_runs_on_the_other_two(
        jobs: Any, tmp_path: Path) -> None:
    with SlurmLab(tmp_path / "lab", n_nodes=3, slurmd_timeout=5, message_timeout=3) as lab:
        job = jobs(3, "--no-kill", on=lab)  # --no-kill: the job outlives a node
        cluster = slurm_cluster(tmp_path, elastic={"heartbeat_timeout": 3, "min_hosts": 2})
        prog = ("import os, time; k = os.environ['TORCHELASTIC_RESTART_COUNT']; "
                "print('attempt', k, 'rank', os.environ['RANK'], 'of', "
                "os.environ['WORLD_SIZE'], flush=True); time.sleep(90 if k == '0' else 0.5)")
        run = launched(job, cluster, "--max-restarts", "1", "--", "python3", "-c", prog)
        try:
            run.wait_line(r"n3:cpu:r5\] attempt 0 rank 5 of 6", stderr=False)
            run_id = run.run_id
            lab.kill_slurmd("n2")
            code = run.finish(90)
        finally:
            run.kill()
        assert code == 0, run.err
        (restart,) = [x for x in run.err_lines() if "restarting every rank" in x]
        assert "on 2 of 3 hosts (n1, n3), world size 4; left out: n2 lost in attempt 0" \
            in restart
        out = "\n".join(run.stdout_lines)
        assert sorted(re.findall(r"attempt 1 rank (\d) of 4", out)) == ["0", "1", "2", "3"]
        assert run.err_lines()[-1].startswith("cluster launcher: run completed on 2 of 3 hosts "
                                              "(n2 lost in attempt 0)")
        wait_for(lambda: not processes_of_run(run_id), 30, "the dead node's ranks to stop")
        lab.restart_slurmd("n2")
