"""``python:`` (cluster-wide or per worker) is the interpreter of ranks whose command
starts with ``python``/``python3``/``python3.N``, and of ``fdl-fabric run``'s ranks: in
the plan, in what the agent is told, in the dry run, and in the process that runs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from venvutil import make_venv

from fdl_fabric.agent import children
from fdl_fabric.clusterfile import parse_cluster
from fdl_fabric.commands import run as run_command
from fdl_fabric.planning.envelope import PrebuiltBinary
from fdl_fabric.planning.plan import build_plan, is_interpreter, with_interpreter
from labutil import ROOT

SALT = bytes(range(16))

CLUSTER = textwrap.dedent("""\
    controller: {host: 10.0.0.1, port: 1337}
    python: .venv/bin/python
    workers:
      - host: ctl
        nproc: 1
      - host: gpu-a
        path: /srv/a
        nproc: 2
        python: /opt/conda/envs/train/bin/python
      - host: gpu-b
        path: /srv/b
        nproc: 1
""")


def _plan(text: str = CLUSTER, argv: tuple[str, ...] = ("python3", "train.py", "--lr", "0.1"),
          **kw: object):  # type: ignore[no-untyped-def]
    cluster = parse_cluster(text, file="cluster.yml", folder="/proj", local_hostname="ctl")
    return build_plan(cluster, argv=argv, run_id="run1", salt=SALT,  # type: ignore[arg-type]
                      launcher_env={}, **kw)


def _argv_by_host(plan) -> dict[str, tuple[str, ...]]:  # type: ignore[no-untyped-def]
    return {r.host: r.argv for r in plan.ranks}


@pytest.mark.parametrize("word", ["python", "python3", "python3.11", "python3.9",
                                  "/usr/bin/python3", "/opt/py/bin/python", ".venv/bin/python3.12",
                                  sys.executable])
def test_these_first_words_are_the_interpreter(word: str) -> None:
    assert is_interpreter(word)


@pytest.mark.parametrize("word", ["python2", "python3.11-config", "pythonw", "ipython",
                                  "python3.", "torchrun", "bash", "python-train.py", "env",
                                  "./train.py"])
def test_these_first_words_are_not(word: str) -> None:
    assert not is_interpreter(word)


def test_a_worker_python_wins_over_the_cluster_python() -> None:
    assert _argv_by_host(_plan()) == {
        "ctl": (".venv/bin/python", "train.py", "--lr", "0.1"),
        "gpu-a": ("/opt/conda/envs/train/bin/python", "train.py", "--lr", "0.1"),
        "gpu-b": (".venv/bin/python", "train.py", "--lr", "0.1")}


@pytest.mark.parametrize("first", ["python", "python3", "python3.11", "/usr/bin/python3"])
def test_every_spelling_of_python_runs_the_configured_one(first: str) -> None:
    plan = _plan(argv=(first, "-u", "-m", "pkg.train"))
    assert plan.ranks[-1].argv == (".venv/bin/python", "-u", "-m", "pkg.train")


@pytest.mark.parametrize("argv", [("torchrun", "--nproc-per-node", "2", "train.py"),
                                  ("./train.sh", "python3"), ("env", "python3", "train.py")])
def test_a_command_that_does_not_start_with_python_is_left_alone(argv: tuple[str, ...]) -> None:
    assert {r.argv for r in _plan(argv=argv).ranks} == {argv}


def test_without_python_the_command_runs_as_written() -> None:
    text = "\n".join(line for line in CLUSTER.splitlines() if "python:" not in line)
    assert {r.argv for r in _plan(text).ranks} == {("python3", "train.py", "--lr", "0.1")}
    assert with_interpreter(("python3", "x.py"), None) == ("python3", "x.py")
    assert with_interpreter((), ".venv/bin/python") == ()


def test_a_prebuilt_binary_replaces_the_program_not_the_interpreter() -> None:
    entry = PrebuiltBinary(bin="bin/train", ld_library_path="/srv/a/lib")
    plan = _plan(argv=("python3", "train.py"), prebuilt={"gpu-a": entry})
    assert _argv_by_host(plan)["gpu-a"] == ("/srv/a/bin/train", "train.py")
    assert _argv_by_host(plan)["gpu-b"] == (".venv/bin/python", "train.py")


def test_the_agent_is_told_the_interpreter_and_the_folder_it_is_relative_to() -> None:
    spec = _plan().agent_spec("gpu-b")
    assert spec["argv"][0] == ".venv/bin/python" and spec["cwd"] == "/srv/b"


def test_fdl_fabric_run_ranks_run_the_configured_python() -> None:
    words = run_command.worker_argv(run_command.parser().parse_args(["train.py", "--lr", "1"]))
    assert words[0] == sys.executable and is_interpreter(words[0])
    module = run_command.worker_argv(run_command.parser().parse_args(["-m", "pkg.train"]))
    assert _plan(argv=tuple(words)).ranks[-1].argv == (".venv/bin/python", "-u", "train.py",
                                                       "--lr", "1")
    assert _plan(argv=tuple(module)).ranks[-1].argv == (".venv/bin/python", "-u", "-m",
                                                        "pkg.train")
    no_python = run_command.worker_argv(run_command.parser().parse_args(
        ["--no-python", "python3", "x.py"]))
    assert _plan(argv=tuple(no_python)).ranks[-1].argv == (".venv/bin/python", "x.py")


# -- through real processes -----------------------------------------------------------------

SHOW = "import sys\nprint('interpreter', sys.executable, 'prefix', sys.prefix)\n"


def test_a_relative_python_is_run_from_the_ranks_folder_not_searched_on_path(
        tmp_path: Path) -> None:
    """The agent's own spawn, as it starts every rank: chdir, then exec the word as a path."""
    make_venv(tmp_path / "proj" / ".venv")
    decoy = tmp_path / "decoy" / ".venv" / "bin"
    decoy.mkdir(parents=True)
    (decoy / "python").write_text("#!/bin/sh\necho decoy\n")
    (decoy / "python").chmod(0o755)
    env = {"PATH": f"{tmp_path / 'decoy'}:{decoy}:/usr/bin:/bin"}
    child = children.spawn([".venv/bin/python", "-c", SHOW], env, str(tmp_path / "proj"))
    out = b""
    while chunk := os.read(child.stdout, 4096):
        out += chunk
    os.close(child.stdout)
    os.close(child.stderr)
    assert os.waitpid(child.pid, 0)[1] == 0
    venv = tmp_path / "proj" / ".venv"
    assert out.decode() == f"interpreter {venv}/bin/python prefix {venv}\n"


def _fdl_fabric(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "fdl_fabric", *args], capture_output=True,
                          text=True, timeout=90, cwd=str(cwd), env=env)


def _local_project(tmp_path: Path, python: str) -> Path:
    make_venv(tmp_path / ".venv")
    (tmp_path / "show.py").write_text(SHOW)
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(f"python: {python}\nworkers:\n  - host: localhost\n    nproc: 2\n"
                       f"    path: {tmp_path}\n")
    return cluster


def test_a_launch_runs_its_python_ranks_with_the_configured_interpreter(
        tmp_path: Path) -> None:
    cluster = _local_project(tmp_path, ".venv/bin/python")
    out = _fdl_fabric("launch", "-c", str(cluster), "--cmd", "python3 show.py")
    assert out.returncode == 0, out.stderr
    venv = tmp_path / ".venv"
    for rank in (0, 1):
        assert f"[localhost:cpu:r{rank}] interpreter {venv}/bin/python prefix {venv}\n" \
            in out.stdout


def test_the_dry_run_shows_the_interpreter_the_ranks_will_run(tmp_path: Path) -> None:
    cluster = _local_project(tmp_path, ".venv/bin/python")
    out = _fdl_fabric("launch", "-c", str(cluster), "--cmd", "python3 -u show.py", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "  argv .venv/bin/python -u show.py\n" in out.stdout


def test_fdl_fabric_run_with_a_cluster_file_runs_its_python(tmp_path: Path) -> None:
    cluster = _local_project(tmp_path, f"{tmp_path}/.venv/bin/python")
    out = _fdl_fabric("run", "-c", str(cluster), "show.py", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    venv = tmp_path / ".venv"
    assert f"[localhost:cpu:r0] interpreter {venv}/bin/python prefix {venv}\n" in out.stdout


@pytest.mark.lab
def test_each_host_runs_its_own_python_over_ssh(sshd_lab, tmp_path: Path) -> None:
    """Two lab hosts reached over SSH: one takes the cluster's relative ``python:``
    (a venv in its own folder), the other its worker's absolute one."""
    lab = sshd_lab(n_hosts=2)
    one, two = lab.hosts
    for host in lab.hosts:
        make_venv(Path(host.path) / ".venv")
        (Path(host.path) / "show.py").write_text(SHOW)
    other = tmp_path / "conda-like"
    make_venv(other)
    cluster = lab.write_cluster([lab.worker(one, nproc=1),
                                 lab.worker(two, nproc=1, python=f"{other}/bin/python")],
                                python=".venv/bin/python")
    out = _fdl_fabric("launch", "-c", str(cluster), "--cmd", "python3 show.py")
    assert out.returncode == 0, out.stderr
    venv = Path(one.path) / ".venv"
    assert f"[{one.name}:cpu:r0] interpreter {venv}/bin/python prefix {venv}\n" in out.stdout
    assert f"[{two.name}:cpu:r1] interpreter {other}/bin/python prefix {other}\n" in out.stdout


def test_the_python_flag_gives_every_host_the_interpreter_and_is_checked(
        tmp_path: Path) -> None:
    import subprocess
    import sys

    (tmp_path / "show.py").write_text("print(1)\n")
    dry = subprocess.run([sys.executable, "-m", "fdl_fabric", "run", "--dry-run",
                          "--python", "venv/bin/python", "show.py"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert "argv venv/bin/python -u show.py" in dry.stdout, dry.stdout
    bad = subprocess.run([sys.executable, "-m", "fdl_fabric", "run", "--python", "~/v/python",
                          "show.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--python: ~ is not expanded" in bad.stderr, bad.stderr
