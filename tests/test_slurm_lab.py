"""Tests for the Slurm lab (fdl_fabric.testing.slurm) against real Slurm daemons.

They skip, with the reason, where Slurm's daemons or munge are not installed, and fail
under CI, which installs them.  One lab serves the whole module (starting one takes
about a second, but the tests share a 2-core machine); the teardown test starts its own,
since it stops it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

import psutil
import pytest

from fdl_fabric.testing.fixtures import require_slurm
from fdl_fabric.testing.slurm import MARKER_ENV, SlurmLab, SlurmLabError, slurm_missing

pytestmark = pytest.mark.slurm


@pytest.fixture(autouse=True, scope="module")
def _slurm_installed() -> None:
    """Skip where Slurm is not installed; under CI (which installs it) fail instead."""
    require_slurm()


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmLab]:
    root = tmp_path_factory.mktemp("slurm")
    with SlurmLab(root, n_nodes=3, cpus_per_node=2, gpus_per_node=2) as started:
        yield started


@pytest.fixture
def allocation(lab: SlurmLab) -> Iterator[str]:
    """A 3-node allocation held by ``salloc --no-shell``; its job id.  Cancelled at the end.

    Steps are then started from this process with ``srun --jobid``, the way a launcher
    drives one srun per node, rather than from a shell script inside salloc.
    """
    result = lab.run(lab.salloc_argv(3, [], "--no-shell"), timeout=30)
    match = re.search(r"Granted job allocation (\d+)", result.stderr)
    assert result.returncode == 0 and match, result.stderr
    job = match.group(1)
    try:
        yield job
    finally:
        lab.run(["scancel", job], timeout=30)


def _lab_processes(lab_id: str, cluster: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose environment names the lab."""
    found = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
        except (psutil.Error, OSError):
            continue
        if env.get(MARKER_ENV) == lab_id or env.get("SLURM_CLUSTER_NAME") == cluster:
            found.append(proc)
    return found


@pytest.mark.timeout(30)
def test_three_nodes_are_idle_and_salloc_sees_them_all(lab: SlurmLab) -> None:
    states = lab.run(["sinfo", "-h", "-N", "-o", "%N %t %c"])
    assert states.stdout.split("\n")[:3] == ["n1 idle 2", "n2 idle 2", "n3 idle 2"]

    result = lab.run(lab.salloc_argv(3, 'scontrol show hostnames "$SLURM_JOB_NODELIST"'))

    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["n1", "n2", "n3"] == lab.nodes


@pytest.mark.timeout(30)
def test_the_lab_authenticates_through_its_own_munged(lab: SlurmLab) -> None:
    conf = lab.conf_path.read_text()
    assert f"AuthInfo=socket={lab.munge_socket}\n" in conf
    assert Path(lab.munge_socket).is_socket()
    munged = psutil.Process(lab.daemon_pids()["munged"])
    assert f"--key-file={lab.munge_key}" in munged.cmdline()
    assert not lab.munge_key.startswith("/etc/")


@pytest.mark.timeout(40)
def test_three_concurrent_single_node_steps_each_forward_stdin_and_stdout(
    lab: SlurmLab, allocation: str, tmp_path: Path
) -> None:
    # Each task reads one line, then waits until all three tasks have checked in: this
    # passes only if the three steps really run at the same time in the one allocation.
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    task = (
        'read -r line; touch "$0/$SLURMD_NODENAME"; '
        'for _ in $(seq 200); do [ "$(ls "$0" | wc -l)" = 3 ] && break; sleep 0.05; done; '
        'echo "$SLURMD_NODENAME step $SLURM_STEP_ID peers $(ls "$0" | wc -l) got $line"'
    )
    steps = {
        node: subprocess.Popen(
            ["srun", f"--jobid={allocation}", "-N1", "-n1", "-w", node, "--quiet",
             "bash", "-c", task, str(barrier)],
            env=lab.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )
        for node in lab.nodes
    }
    try:
        for node, proc in steps.items():
            assert proc.stdin is not None
            proc.stdin.write(f"hello {node}\n")
            proc.stdin.close()
        outputs = {}
        for node, proc in steps.items():
            assert proc.stdout is not None and proc.stderr is not None
            outputs[node] = (proc.stdout.read(), proc.stderr.read())
            proc.wait(30)
    finally:
        for proc in steps.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

    for node, (out, err) in outputs.items():
        assert steps[node].returncode == 0, err
        assert re.fullmatch(rf"{node} step \d+ peers 3 got hello {node}\n", out), (out, err)
    step_ids = {out.split()[2] for out, _ in outputs.values()}
    assert len(step_ids) == 3, "each srun must be a step of its own"


@pytest.mark.timeout(30)
def test_a_plain_step_per_node_gets_every_cpu_and_gpu_the_job_has_there(
    lab: SlurmLab, tmp_path: Path
) -> None:
    # The launcher's recipe: whole-node job, then ``srun -N1 -n1 -w node`` without -c,
    # --exact or a step --exclusive (Slurm >= 20.11.3 gives such a step the whole node).
    report = (
        'echo "$SLURMD_NODENAME cpus=$SLURM_CPUS_ON_NODE gpus=$CUDA_VISIBLE_DEVICES"; '
        'scontrol show step "$SLURM_JOB_ID.$SLURM_STEP_ID" | grep -o "TRES=cpu=[0-9]*"'
    )
    steps = " ".join(
        f"srun -N1 -n1 -w {node} bash -c '{report}' > $0/{node}.out &" for node in lab.nodes
    )
    result = lab.run(
        lab.salloc_argv(3, ["bash", "-c", f"{steps} wait", str(tmp_path)], "--gpus-per-node=2")
    )

    assert result.returncode == 0, result.stderr
    for node in lab.nodes:
        assert (tmp_path / f"{node}.out").read_text().split() == [
            node, "cpus=2", "gpus=0,1", "TRES=cpu=2"
        ]


@pytest.mark.timeout(60)
def test_a_killed_slurmd_downs_its_node_and_leaves_its_task_running_until_restart(
    slurm_lab: Callable[..., SlurmLab],  # noqa: F811 (the imported fixture)
) -> None:
    own = slurm_lab(n_nodes=2, slurmd_timeout=3, message_timeout=2, kill_wait=1)
    alloc = own.run(own.salloc_argv(2, [], "--no-shell"))
    job = re.search(r"Granted job allocation (\d+)", alloc.stderr)
    assert job, alloc.stderr
    step = subprocess.Popen(
        ["srun", f"--jobid={job.group(1)}", "-N1", "-n1", "-w", "n2", "sleep", "300"],
        env=own.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )
    try:
        def task() -> list[psutil.Process]:
            return [p for p in own.processes() if p.name() == "sleep" and "300" in p.cmdline()]

        deadline = time.monotonic() + 15
        while not task() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert task(), "the step never started"

        own.kill_slurmd("n2")
        killed = time.monotonic()
        _, err = step.communicate(timeout=20)
        detected = time.monotonic() - killed

        assert "Node failure on n2" in err
        assert detected < 10, f"SlurmdTimeout=3 should down the node in ~5 s, took {detected}"
        states = own.run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout.split("\n")
        assert "n2 down*" in states
        orphans = task()
        assert len(orphans) == 1, "nobody kills a step whose slurmd is dead"

        own.restart_slurmd("n2")  # registers, learns the job is gone, kills the step
        assert not psutil.wait_procs(orphans, timeout=15)[1]
    finally:
        if step.poll() is None:
            step.kill()
        step.wait(10)


@pytest.mark.timeout(40)
def test_stop_leaves_no_process_of_the_lab_behind(
    slurm_lab: Callable[..., SlurmLab],  # noqa: F811 (the imported fixture)
) -> None:
    own = slurm_lab(n_nodes=2)
    daemons = list(own.daemon_pids().values())
    assert len(daemons) == 4  # munged, slurmctld, 2 x slurmd
    # A job with a step on each node, one of whose tasks also escapes into its own
    # session (out of slurmstepd's process tree), and a client without the lab marker.
    env = {k: v for k, v in own.env.items() if k != MARKER_ENV}
    client = subprocess.Popen(
        own.salloc_argv(2, "srun -N2 -n2 bash -c 'setsid sleep 300 & sleep 300'"),
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 20
        sleeps: list[psutil.Process] = []
        while len(sleeps) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
            sleeps = [p for p in own.processes() if p.name() == "sleep"]
        assert len(sleeps) == 4, [p.cmdline() for p in own.processes()]
        assert sum(p.name() == "slurmstepd" for p in own.processes()) >= 2

        own.stop()
        own.stop()  # idempotent

        survivors = _lab_processes(own.lab_id, own.cluster_name)
        assert survivors == [], [(p.pid, p.cmdline()) for p in survivors]
        for pid in daemons:
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
        assert own.daemon_pids() == {}
    finally:
        if client.poll() is None:
            os.killpg(client.pid, signal.SIGKILL)
        client.wait(10)


@pytest.mark.timeout(30)
def test_a_daemon_that_cannot_start_fails_the_lab_with_its_log(tmp_path: Path) -> None:
    broken = SlurmLab(tmp_path / "broken", n_nodes=1, extra_conf=["NoSuchSlurmOption=1"])
    with pytest.raises(SlurmLabError) as failure:
        broken.start()
    message = str(failure.value)
    assert "slurmctld" in message and "NoSuchSlurmOption" in message
    assert broken.daemon_pids() == {}, "a failed start stops what it had started"


def test_without_slurm_installed_the_reason_names_the_packages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("shutil.which", lambda *_args, **_kw: None)
    reason = slurm_missing()
    assert reason is not None
    assert "slurmctld" in reason and "munged" in reason and "apt-get install" in reason
