"""The pure parts of a Slurm launch: the allocation read from the environment and Slurm's
client commands (given here as canned answers), the cluster made of its nodes, the srun
command line of an agent's step and its environment, the cluster file's Slurm keys."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

import pytest

from fdl_fabric.clusterfile import ConfigError, parse_cluster
from fdl_fabric.errors import EXIT_USAGE, FdlError
from fdl_fabric.planning.plan import build_plan, cluster_key
from fdl_fabric.transport import for_worker, slurm

NODE_LINES = {
    "n1,n2,n3": "NodeName=n1 Arch=x86_64 NodeAddr=10.0.0.1 NodeHostName=n1\n"
                "NodeName=n2 Arch=x86_64 NodeAddr=10.0.0.2 NodeHostName=n2\n"
                "NodeName=n3 Arch=x86_64 NodeHostName=n3\n",
}


def canned(argv: Sequence[str]) -> str:
    """What scontrol answers for the allocation n[1-3]."""
    if list(argv[:3]) == ["scontrol", "show", "hostnames"]:
        assert argv[3] == "n[1-3]"
        return "n1\nn2\nn3\n"
    if list(argv[:4]) == ["scontrol", "--oneliner", "show", "node"]:
        return NODE_LINES[argv[4]]
    raise AssertionError(f"unexpected command {argv}")


ALLOC_ENV = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-3]"}


def test_the_allocation_is_the_jobs_nodes_in_nodelist_order_with_their_addresses() -> None:
    alloc = slurm.allocation(ALLOC_ENV, run=canned)
    assert alloc.job_id == "42"
    assert alloc.nodes == ("n1", "n2", "n3")
    assert dict(alloc.addrs) == {"n1": "10.0.0.1", "n2": "10.0.0.2", "n3": "n3"}


@pytest.mark.parametrize("env", [{}, {"SLURM_JOB_ID": ""}, {"SLURM_JOB_ID": "  "}])
def test_outside_an_allocation_slurm_is_a_usage_error_naming_the_flag(
        env: dict[str, str]) -> None:
    with pytest.raises(FdlError) as err:
        slurm.allocation(env, run=canned)
    assert err.value.exit_code == EXIT_USAGE
    assert str(err.value).startswith("--slurm: not inside a Slurm allocation")


def test_a_job_id_that_is_not_a_number_is_refused_before_any_command_runs() -> None:
    with pytest.raises(FdlError) as err:
        slurm.allocation({"SLURM_JOB_ID": "42; rm -rf /", "SLURM_JOB_NODELIST": "n1"},
                         run=canned)
    assert err.value.exit_code == EXIT_USAGE and "is not a job id" in str(err.value)


def test_each_node_becomes_a_worker_with_the_same_ranks_and_rank_0_on_the_first_node() -> None:
    cluster = parse_cluster("scheduler: slurm\nnproc_per_node: 2\ncontroller: {host: 10.0.0.9}\n",
                            folder="/work")
    resolved = slurm.cluster_for(cluster, slurm.allocation(ALLOC_ENV, run=canned))
    assert [(w.host, w.nproc, w.addr, w.slurm_job, w.is_local) for w in resolved.workers] == [
        ("n1", 2, "10.0.0.1", "42", False), ("n2", 2, "10.0.0.2", "42", False),
        ("n3", 2, "n3", "42", False)]
    assert all(w.path == "/work" for w in resolved.workers)
    assert cluster_key(resolved) == "slurm-42"
    plan = build_plan(resolved, argv=["python3", "train.py"], run_id="r", salt=b"s" * 16)
    assert [r.host for r in plan.ranks] == ["n1", "n1", "n2", "n2", "n3", "n3"]
    assert {r.env["MASTER_ADDR"] for r in plan.ranks} == {"10.0.0.1"}
    assert plan.envelopes["n3"].controller_host == "10.0.0.9"


def test_the_flag_wins_over_the_files_ranks_per_node_and_a_missing_count_is_refused() -> None:
    alloc = slurm.allocation(ALLOC_ENV, run=canned)
    gpus = parse_cluster("scheduler: slurm\nlocal_devices: [0, 1, 2]\n")
    assert {w.local_devices for w in slurm.cluster_for(gpus, alloc).workers} == {(0, 1, 2)}
    flagged = slurm.cluster_for(gpus, alloc, nproc_per_node=4).workers
    assert {(w.nproc, w.local_devices) for w in flagged} == {(4, None)}
    with pytest.raises(FdlError) as err:
        slurm.cluster_for(parse_cluster("scheduler: slurm\n"), alloc)
    assert err.value.exit_code == EXIT_USAGE and "--nproc-per-node N" in str(err.value)


def test_the_coordinator_listens_on_this_machines_address_toward_the_first_node() -> None:
    loopback = slurm.Allocation("7", ("n1",), {"n1": "127.0.0.1"})
    resolved = slurm.cluster_for(parse_cluster("scheduler: slurm\nnproc_per_node: 1\n"),
                                 loopback)
    assert resolved.controller.host == "127.0.0.1"
    assert slurm.launcher_address("127.0.0.1") == "127.0.0.1"


def test_an_agents_step_holds_its_whole_node_and_never_ends_the_job_on_failure() -> None:
    argv = slurm.step_argv("42", "n2")
    assert argv[:2] == ["setsid", "srun"]
    assert {"--jobid=42", "--nodes=1", "--ntasks=1", "--nodelist=n2", "--overlap",
            "--unbuffered", "--kill-on-bad-exit=0", "--wait=0", "--mpi=none",
            "--job-name=fdl-fabric-agent"} <= set(argv)
    options = argv[:argv.index("/bin/sh")]
    assert not any(a.startswith(("--exact", "-c", "--cpus-per-task", "--exclusive"))
                   for a in options)
    assert argv[-3:-1] == ["/bin/sh", "-c"]
    assert shlex.split(slurm.step_command("42", "n2"))[1:] == argv  # quoted exactly


def test_variables_that_would_shrink_the_agents_step_are_not_given_to_srun() -> None:
    env = {"SLURM_EXACT": "1", "SRUN_CPUS_PER_TASK": "1", "SLURM_CPUS_PER_TASK": "1",
           "SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_ID": "42", "PATH": "/usr/bin"}
    assert slurm.step_env(env) == {"SLURM_JOB_ID": "42", "PATH": "/usr/bin"}


def test_a_slurm_workers_agent_is_reached_by_its_srun_step_never_over_ssh() -> None:
    worker = slurm.cluster_for(parse_cluster("scheduler: slurm\nnproc_per_node: 1\n"),
                               slurm.allocation(ALLOC_ENV, run=canned)).workers[1]
    transport = for_worker(worker)
    assert isinstance(transport, slurm.SlurmTransport) and transport.job == "42"
    assert "srun --jobid=42" in transport.describe() and "--nodelist=n2" in transport.describe()


def test_cleanup_lists_and_cancels_only_this_jobs_agent_steps() -> None:
    calls: list[list[str]] = []

    def squeue(argv: Sequence[str]) -> str:
        calls.append(list(argv))
        return "42.0 fdl-fabric-agent\n42.1 fdl-fabric-cleanup\n42.2 train\n"

    assert slurm.agent_steps("42", run=squeue) == ["42.0"]
    assert "--jobs=42" in calls[0]
    slurm.cancel_steps(["42.0"], run=squeue)
    assert calls[-1] == ["scancel", "42.0"]
    with pytest.raises(ValueError):
        slurm.cancel_steps(["42"], run=squeue)  # a whole job is never cancelled


@pytest.mark.parametrize("text, key, message", [
    ("scheduler: pbs\nworkers: [{host: localhost, nproc: 1}]\n", "scheduler",
     'expected "slurm"'),
    ("scheduler: slurm\nworkers: [{host: localhost, nproc: 1}]\n", "workers",
     "a Slurm launch takes its workers from the allocation"),
    ("nproc_per_node: 2\nworkers: [{host: localhost, nproc: 1}]\n", "nproc_per_node",
     "nproc_per_node at the top level is for scheduler: slurm"),
    ("scheduler: slurm\nnproc_per_node: 2\nlocal_devices: all\n", "scheduler",
     "set either nproc_per_node (CPU ranks) or local_devices (GPU ranks), not both"),
    ("scheduler: slurm\nnproc_per_node: 0\n", "nproc_per_node", ""),
])
def test_the_slurm_keys_of_a_cluster_file_are_checked_naming_the_key(
        text: str, key: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_cluster(text)
    assert any(p.key == key and message in p.message for p in err.value.problems), err.value


def test_a_slurm_cluster_file_keeps_its_path_env_and_elastic_settings() -> None:
    cluster = parse_cluster("scheduler: slurm\nnproc_per_node: 1\npath: runs\n"
                            "env: {A: b}\nelastic: {max_failure: 1}\n", folder="/work")
    resolved = slurm.cluster_for(cluster, slurm.allocation(ALLOC_ENV, run=canned))
    assert {w.path for w in resolved.workers} == {"/work/runs"}
    assert resolved.env == {"A": "b"} and resolved.elastic.max_failure == 1


def test_a_launch_of_512_nodes_raises_the_open_file_limit_it_needs() -> None:
    import subprocess
    import sys

    code = ("import resource; from fdl_fabric.transport.fanout import ensure_fd_limit, "
            "FDS_PER_HOST, FDS_MARGIN; s, h = resource.getrlimit(resource.RLIMIT_NOFILE); "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (1024, h)); ensure_fd_limit(512); "
            "s2 = resource.getrlimit(resource.RLIMIT_NOFILE)[0]; "
            "need = 512 * FDS_PER_HOST + FDS_MARGIN; "
            "print(s2 >= need if h == resource.RLIM_INFINITY or h >= need else s2 == h)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "True"
