"""The command line: every flag checked up front and named when wrong, usage errors exit 2,
-v in all its spellings, readable dry runs and live tables, consistent host names."""

from __future__ import annotations

import io
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fdl_fabric.clusterfile import parse_cluster
from fdl_fabric.commands import flags
from fdl_fabric.errors import FdlError
from fdl_fabric.planning.plan import build_plan
from labutil import ROOT, dumps, run_launch

PROBE = f"python3 {ROOT}/tests/progs/rankprobe.py"


def local_cluster(tmp_path: Path, nproc: int = 2, extra: str = "") -> Path:
    path = tmp_path / "c.yml"
    path.write_text(f"command: 'true'\nworkers:\n  - host: localhost\n    nproc: {nproc}\n"
                    f"    path: {ROOT}\n" + extra)
    return path


def fdl_fabric(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fdl_fabric", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=str(ROOT))


@pytest.mark.parametrize("flags,level", [(["-v"], "2"), (["-vv"], "3"), (["--verbose=2"], "3"),
                                         (["--verbose", "1"], "2")])
def test_v_vv_and_verbose_n_all_set_the_verbosity(flags: list[str], level: str,
                                                   tmp_path: Path) -> None:
    out = run_launch(local_cluster(tmp_path, 1), *flags, "--cmd",
                     f"{PROBE} --dump {tmp_path}/d")
    assert out.returncode == 0, out.stderr
    assert dumps(tmp_path / "d", 1)[0]["env"]["FLODL_VERBOSITY"] == level
    assert "cluster launcher: started localhost:cpu:r0" in out.stderr  # -v shows spawns


@pytest.mark.parametrize("entry", ["inv", "fdl-fabric"])
def test_an_unknown_flag_is_a_usage_error_exit_2(entry: str, tmp_path: Path) -> None:
    if entry == "inv":
        out = run_launch(local_cluster(tmp_path), "--no-such-flag")
    else:
        out = fdl_fabric("launch", "--cluster", str(local_cluster(tmp_path)), "--no-such-flag")
    assert out.returncode == 2, out.stderr
    assert "--no-such-flag" in out.stderr


def test_help_shows_a_literal_percent_and_a_percentage_is_accepted(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "invoke", "--search-root", str(ROOT), "--help",
                          "launch"], capture_output=True, text=True, cwd=str(ROOT), timeout=30)
    assert "25%)" in out.stdout and "%%" not in out.stdout
    dry = run_launch(local_cluster(tmp_path), "--max-failure", "50%", "--dry-run")
    assert dry.returncode == 0, dry.stderr


@pytest.mark.parametrize("args,flag", [
    (["--max-failure", "abc"], "--max-failure"),
    (["--kill-grace", "abc"], "--kill-grace"),
    (["--kill-grace", "nan"], "--kill-grace"),
    (["--kill-grace", "inf"], "--kill-grace"),
    (["--kill-grace=-1"], "--kill-grace"),
    (["--max-restarts", "-2"], "--max-restarts"),
    (["--cmd", "   "], "--cmd"),
    (["--cluster", ""], "--cluster"),
    (["--log-dir", "/proc/fdl-test/x"], "--log-dir"),
    (["--log-dir", "/sys/fdl-test"], "--log-dir"),
])
def test_a_bad_flag_exits_2_naming_it_before_any_output_or_connection(
        args: list[str], flag: str, tmp_path: Path) -> None:
    cluster = local_cluster(tmp_path)
    argv = [a for a in args]
    if "--cluster" in args:
        out = subprocess.run([sys.executable, "-m", "invoke", "--search-root", str(ROOT),
                              "launch", *argv, "--cmd", "true"], capture_output=True, text=True,
                             timeout=30, cwd=str(tmp_path))
    else:
        out = run_launch(cluster, *argv, "--log-dir", str(tmp_path / "logs")) \
            if "--log-dir" not in args else run_launch(cluster, *argv)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(flag) or f"\n{flag}" in out.stderr or \
        out.stderr.splitlines()[0].startswith(flag), out.stderr
    assert "cluster launcher: run" not in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "logs").exists(), "nothing may be written before the flags pass"


def test_a_log_dir_that_is_a_file_is_refused_and_left_alone(tmp_path: Path) -> None:
    target = tmp_path / "a-file"
    target.write_text("keep me")
    out = run_launch(local_cluster(tmp_path), "--log-dir", str(target / "sub"))
    assert out.returncode == 2 and "--log-dir" in out.stderr and "not a folder" in out.stderr
    assert target.read_text() == "keep me"


def test_a_dry_run_of_six_ranks_fits_one_screen_and_names_how_each_host_is_reached(
        tmp_path: Path) -> None:
    key = tmp_path / "id_test"
    key.write_text("")
    path = tmp_path / "c.yml"
    path.write_text(textwrap.dedent(f"""\
        workers:
          - host: localhost
            nproc: 2
            path: {ROOT}
          - host: gpu-a.example.invalid
            nproc: 2
            path: /srv/a
            ssh: {{user: alice, port: 2222, identity_file: {key}}}
          - host: gpu-b.example.invalid
            nproc: 2
            path: /srv/b
        """))
    out = run_launch(path, "--dry-run", "--cmd", "python3 train.py --lr 0.1")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) <= 30, out.stdout
    assert any(f"host gpu-a.example.invalid: ssh alice@gpu-a.example.invalid port 2222, "
               f"identity {key}" in line for line in lines), out.stdout
    assert any("host gpu-b.example.invalid: ssh " in line and "port 22" in line
               for line in lines)
    assert "<envelope with the salt" in out.stdout


def test_the_live_table_stays_readable_at_80_columns() -> None:
    from rich.console import Console as RichConsole

    from fdl_fabric.presentation.output import status_table
    from fdl_fabric.states import RankState
    from fdl_fabric.supervision.records import Rank

    cluster = parse_cluster("workers:\n  - host: localhost\n    nproc: 3\n    path: /srv\n",
                            local_hostname="x")
    plan = build_plan(cluster, argv=["python3", "train.py"], run_id="r", salt=b"\0" * 16)
    ranks = [Rank(p, state=RankState.RUNNING, pid=2841000 + p.rank, started=0.0,
                  last_line="epoch 3 step 1200 loss=0.1234 lr=0.001 " * 3) for p in plan.ranks]
    buf = io.StringIO()
    RichConsole(file=buf, width=80, force_terminal=False, color_system=None).print(
        status_table(ranks, 80))
    lines = buf.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines)
    for r in ranks:
        row = next(line for line in lines if str(r.pid) in line)
        assert "localhost" in row and "running" in row and "…" in row


def test_inv_cleanup_names_the_local_worker_as_the_launcher_does(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "invoke", "--search-root", str(ROOT), "cleanup",
                          "--cluster", str(local_cluster(tmp_path))], capture_output=True,
                         text=True, timeout=60, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr
    assert "cleanup: localhost: nothing to stop" in out.stderr


def test_max_failure_on_a_script_that_never_joins_the_cohort_warns_at_the_end(
        tmp_path: Path) -> None:
    out = run_launch(local_cluster(tmp_path), "--max-failure", "1", "--cmd", "true")
    assert out.returncode == 0
    assert "max_failure had no effect: no rank joined the cohort" in out.stderr


def test_a_loopback_master_addr_with_a_remote_worker_on_a_real_address_warns() -> None:
    from fdl_fabric.commands.launch import plan_warnings
    from fdl_fabric.events import event
    from fdl_fabric.presentation.words import render

    cluster = parse_cluster(textwrap.dedent("""\
        workers:
          - host: localhost
            nproc: 1
            path: /srv
          - host: gpu-b.example.invalid
            addr: 192.0.2.10
            nproc: 1
            path: /srv
        """), local_hostname="x")
    plan = build_plan(cluster, argv=["true"], run_id="r", salt=b"\0" * 16)
    warnings = [render(event(name, **data)) for name, data in plan_warnings(plan)]
    assert any("MASTER_ADDR is 127.0.0.1" in w and "gpu-b.example.invalid (192.0.2.10)" in w
               for w in warnings)
    # The coordinator on loopback is fine: ranks reach it through their host's agent.
    assert not any("controller.host" in w for w in warnings)


def test_fdl_fabric_run_exits_2_on_its_own_usage_errors() -> None:
    out = fdl_fabric("run", "--nproc-per-node", "zero", "x.py")
    assert out.returncode == 2 and "--nproc-per-node" in out.stderr
    out = fdl_fabric("run")
    assert out.returncode == 2 and "training_script" in out.stderr
    # A worker's nproc bound holds for `run` as for a cluster file: nothing is started.
    out = fdl_fabric("run", "--nproc-per-node", "2000", "x.py")
    assert out.returncode == 2
    assert out.stderr.strip().endswith("--nproc-per-node: expected a number of ranks per node, "
                                       "1-1024, got '2000'")
    assert os.environ.get("FLODL_INTERNAL_RUN_ID") is None


def test_a_dry_run_lists_spares_apart_and_plans_only_the_roster(tmp_path: Path) -> None:
    path = tmp_path / "spares.yml"
    path.write_text(textwrap.dedent("""\
        elastic: {min_hosts: 1}
        workers:
          - {host: localhost, nproc: 2}
          - {host: gpu-s.example.invalid, nproc: 4, path: /srv, spare: true}
        """))
    out = run_launch(path, "--dry-run", "--cmd", "python3 train.py")
    assert out.returncode == 0, out.stderr
    assert "2 rank(s) on 1 host(s)" in out.stdout
    assert "spares (started only in place of a lost host): gpu-s.example.invalid" in out.stdout
    assert "min_hosts 1: an attempt starts with at least that many hosts" in out.stdout
    assert "host gpu-s.example.invalid:" not in out.stdout


def test_min_hosts_above_the_roster_and_a_roster_of_spares_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.yml"
    path.write_text("elastic: {min_hosts: 2}\nworkers:\n  - {host: localhost, nproc: 1}\n"
                    "  - {host: spare-a.example.invalid, nproc: 1, path: /x, spare: true}\n")
    out = run_launch(path, "--dry-run", "--cmd", "true")
    assert out.returncode == 2
    assert "elastic: min_hosts is 2, but only 1 worker(s) are not spares" in out.stderr
    path.write_text("workers:\n  - {host: localhost, nproc: 1, spare: true}\n")
    out = run_launch(path, "--dry-run", "--cmd", "true")
    assert out.returncode == 2 and "every worker is a spare" in out.stderr


@pytest.mark.parametrize(("flag", "call"), [
    ("--max-restarts", lambda v: flags.restarts("--max-restarts", v)),
    ("--verbose", flags.verbosity),
    ("--nproc-per-node", lambda v: flags.nproc_per_node("--nproc-per-node", v))])
@pytest.mark.parametrize("value", ["²", "٣", "１"])
def test_digits_that_are_not_ascii_are_a_usage_error_naming_the_flag(flag, call, value) -> None:
    # str.isdigit() accepts them; int() takes some and not others: neither is a number here.
    with pytest.raises(FdlError) as refused:
        call(value)
    assert refused.value.exit_code == 2 and str(refused.value).startswith(flag)


def test_fdl_fabric_help_lists_every_command_in_one_line_each_and_no_invoke_internals() -> None:
    out = fdl_fabric("--help")
    assert out.returncode == 0
    listed = [line.split()[0] for line in out.stdout.splitlines() if line.startswith("  ")]
    assert listed == ["run", "launch", "attach", "logs", "stop", "wait", "cleanup",
                      "prebuild-check", "stacks", "status", "plot-run"]
    assert "--prompt-for-sudo-password" not in out.stdout and "core-opts" not in out.stdout
    run_help = fdl_fabric("--help", "run")
    assert run_help.returncode == 0 and run_help.stdout.startswith("usage: fdl-fabric run")
    assert "--hosts LIST" in run_help.stdout
    bare = fdl_fabric()
    assert bare.returncode == 2 and "commands:" in bare.stderr


@pytest.mark.parametrize("before", [[], ["--nproc-per-node", "2"], ["--max_restarts", "1", "-v"],
                                    ["--log-dir", "/tmp/x", "--nnodes=1"]])
def test_a_refused_torchrun_flag_keeps_its_explanation_wherever_it_stands(
        before: list[str]) -> None:
    out = fdl_fabric("run", *before, "--tee", "3", "x.py")
    assert out.returncode == 2
    assert out.stderr.strip().endswith("--tee: not supported by `fdl-fabric run`: every rank's "
                                       "output is forwarded with a [host:device:rN] prefix; "
                                       "--log-dir keeps each rank's stdout and stderr")


def test_launchs_short_flags_do_not_contradict_torchrun_or_srun() -> None:
    out = subprocess.run([sys.executable, "-m", "invoke", "--search-root", str(ROOT), "launch",
                          "--help"], capture_output=True, text=True, timeout=30)
    shorts = {line.split()[0].rstrip(",") for line in out.stdout.splitlines()
              if line.startswith("  -") and not line.startswith("  --")}
    assert {"-c", "-H", "-F", "-v", "-q", "-d", "-i", "-l", "-p", "-h"} <= shorts
    assert "  -h, --help" in out.stdout, "-h is help, and only help"
    assert not shorts & {"-m", "-n"}, "torchrun's -m, srun's -n"


def _complete(shell: str, words: list[str]) -> list[str]:
    """What Tab offers after ``words`` (the last one being completed), in a real shell."""
    setup = "setopt ksharrays; " if shell == "zsh" else ""  # bashcompinit's 0-based arrays
    quoted = " ".join(shlex.quote(w) for w in words)
    code = (f'eval "$({shlex.quote(sys.executable)} -m fdl_fabric --completion {shell})"; '
            f"{setup}COMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}; _fdl_fabric; "
            'printf "%s\\n" "${COMPREPLY[@]}"')
    out = subprocess.run([shell, "-c", code], capture_output=True, text=True, timeout=30,
                         cwd=str(ROOT))
    assert out.returncode == 0 and out.stderr == "", out.stderr
    return out.stdout.split()


def test_bash_completes_the_commands_including_run_and_each_commands_flags() -> None:
    assert _complete("bash", ["fdl-fabric", "ru"]) == ["run"]
    assert _complete("bash", ["fdl-fabric", "st"]) == ["stop", "stacks", "status", "start"]
    assert _complete("bash", ["fdl-fabric", "run", "--nproc"]) == [
        "--nproc-per-node", "--nproc_per_node"]
    assert _complete("bash", ["fdl-fabric", "launch", "--host"]) == ["--hostfile", "--hosts"]


def test_zsh_loads_the_completion_and_offers_the_same_words() -> None:
    # zsh filters the candidates by what is typed itself (compadd); all must be there.
    assert {"run", "launch", "status", "plot-run"} <= set(_complete("zsh", ["fdl-fabric", ""]))
    assert {"--hosts", "--json", "-F"} <= set(_complete("zsh", ["fdl-fabric", "run", "--"]))
