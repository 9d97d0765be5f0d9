"""A cluster file runs nothing unasked (issue 34, item 3).

A cluster file that names an ssh_config (``ssh.config_file``) is code: that ssh_config
can run commands as the operator (``Match exec`` during a mere lookup, ``ProxyCommand``
when connecting). These tests hold the rules through the real command line (``inv``, a
process of its own) and the Python API: a dry run runs nothing of any ssh_config; a
launch and prebuild-check refuse a cluster file's ssh_config that runs commands, naming
the file, the line and the directive, unless the operator allowed it; ``setup:`` and
``on_exit:`` are shown by a dry run and never run by it. The lab tests
(tests/test_ssh_trust_lab.py) show an allowed ProxyCommand really carrying a launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fdl_fabric
from fdl_fabric.clusterfile import load_cluster
from fdl_fabric.transport.configtrust import command_directives, inert, with_trust
from fdl_fabric.transport.sshconfig import hostname_of, read_config
from labutil import ROOT

INV = (sys.executable, "-m", "invoke", "--search-root", str(ROOT))


def _hostile_config(folder: Path) -> tuple[Path, Path]:
    """An ssh_config whose line 4 runs ``touch MARK`` at lookup, and whose line 7 is a
    ProxyCommand that would leave PROXIED: (the file, the mark)."""
    mark = folder / "MARK"
    config = folder / "ssh_config"
    config.write_text(
        "# a cluster's hosts\n"
        "Host node1\n"
        "  HostName 127.0.0.1\n"
        f'Match exec "touch {mark}"\n'
        "  User attacker\n"
        "Host *\n"
        f"  ProxyCommand sh -c 'touch {folder / 'PROXIED'}; exec nc %h %p'\n")
    return config, mark


def _cluster_file(folder: Path, config: Path, *, extra: str = "", worker: str = "") -> Path:
    path = folder / "lab.yml"
    path.write_text("command: python3 train.py\n" + extra +
                    "workers:\n  - host: node1\n    nproc: 1\n    path: /tmp\n"
                    f"    ssh:\n      config_file: {config}\n{worker}")
    path.chmod(0o600)
    return path


def _inv(*words: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*INV, *words], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env, stdin=subprocess.DEVNULL)


# --------------------------------------------------------------------------------------------
# Reading an ssh_config for what it runs
# --------------------------------------------------------------------------------------------


def test_every_line_that_runs_or_loads_something_is_found_with_its_number(
        tmp_path: Path) -> None:
    config = tmp_path / "ssh_config"
    config.write_text(
        "Host a\n"
        "  ProxyCommand none\n"                       # runs nothing
        "  proxycommand=nc %h %p\n"                   # 3
        "# LocalCommand commented out\n"
        "Match host b !exec \"test -f /x\"\n"         # 5
        "  LocalCommand echo hi\n"                    # 6
        "Match host exec-box\n"                       # a host name, not the criterion
        "  KnownHostsCommand /bin/cat\n"              # 8
        "Include ~/.ssh/more\n"                       # 9
        "  PKCS11Provider /usr/lib/p11.so\n"          # 10
        "Match Exec=true\n")                          # 11
    found = [(d.line, d.name) for d in command_directives(str(config))]
    assert found == [(3, "ProxyCommand"), (5, "Match exec"), (6, "LocalCommand"),
                     (8, "KnownHostsCommand"), (9, "Include"), (10, "PKCS11Provider"),
                     (11, "Match exec")]


def test_a_lookup_inside_a_dry_run_leaves_match_exec_unrun_and_its_block_unapplied(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config, mark = _hostile_config(tmp_path)
    with inert():
        assert "user" not in read_config(str(config)).lookup("node1")
        assert hostname_of("node1", str(config)) == "127.0.0.1"
    assert not mark.exists(), "a dry run's lookup ran Match exec"
    # Outside it, the lookup is paramiko's, as ssh's own: the operator's config may say so
    # (paramiko runs the command with invoke, which reads our stdin: an empty one here).
    with open(os.devnull) as nothing:
        monkeypatch.setattr(sys, "stdin", nothing)
        assert read_config(str(config)).lookup("node1")["user"] == "attacker"
    assert mark.exists()


# --------------------------------------------------------------------------------------------
# The dry run
# --------------------------------------------------------------------------------------------


def test_a_dry_run_of_a_trusted_cluster_files_ssh_config_runs_nothing(tmp_path: Path) -> None:
    config, mark = _hostile_config(tmp_path)
    cluster = _cluster_file(tmp_path, config)
    out = _inv("launch", "-c", str(cluster), "--dry-run", "--trust-ssh-config")
    assert out.returncode == 0, out.stderr
    assert "host node1: ssh" in out.stdout and "127.0.0.1" in out.stdout
    assert not mark.exists() and not (tmp_path / "PROXIED").exists()

    result = fdl_fabric.launch(str(cluster), dry_run=True, trust_ssh_config=True, quiet=True)
    assert result.verdict == "dry-run"
    assert not mark.exists() and not (tmp_path / "PROXIED").exists()


def test_a_dry_run_of_an_untrusted_cluster_files_ssh_config_is_refused_like_a_launch(
        tmp_path: Path) -> None:
    config, mark = _hostile_config(tmp_path)
    cluster = _cluster_file(tmp_path, config)
    out = _inv("launch", "-c", str(cluster), "--dry-run")
    assert out.returncode == 2, out.stderr
    assert f"{config}:4: Match exec runs a command; a cluster file's ssh_config may not " \
           "run commands unless you allow it (--trust-ssh-config, or ssh.allow_commands: " \
           "true in a file you own)" in out.stderr
    assert f"{config}:7: ProxyCommand runs a command" in out.stderr
    assert f"{cluster}:3: workers[0].ssh.config_file:" in out.stderr
    assert not mark.exists() and not (tmp_path / "PROXIED").exists()


def test_the_operators_own_ssh_config_runs_nothing_in_a_dry_run_either(tmp_path: Path) -> None:
    config, mark = _hostile_config(tmp_path)
    out = _inv("launch", "--hosts", "node1", "-F", str(config), "--dry-run",
               "--cmd", "python3 train.py")
    assert out.returncode == 0, out.stderr
    assert "host node1:" in out.stdout
    assert not mark.exists(), "the -F file's Match exec ran in a dry run"

    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(config.read_text())
    out = _inv("launch", "--hosts", "node1", "--dry-run", "--cmd", "python3 train.py",
               env={**os.environ, "HOME": str(home)})
    assert out.returncode == 0, out.stderr
    assert not mark.exists(), "~/.ssh/config's Match exec ran in a dry run"


def test_setup_and_on_exit_are_shown_by_a_dry_run_and_never_run(tmp_path: Path) -> None:
    config, mark = _hostile_config(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    setup_mark, exit_mark = tmp_path / "SETUP_RAN", tmp_path / "ON_EXIT_RAN"
    cluster = _cluster_file(tmp_path, config, extra=(
        f"on_exit: touch {exit_mark}\nsync: true\nsetup: touch {setup_mark}\n"))
    out = _inv("launch", "-c", str(cluster), "--dry-run", "--json", "--trust-ssh-config")
    assert out.returncode == 0, out.stderr
    (plan,) = [e["data"] for e in map(json.loads, out.stdout.splitlines())
               if e["name"] == "dry_run"]
    assert plan["setup"]["command"] == f"touch {setup_mark}"
    assert plan["on_exit"] == f"touch {exit_mark}"
    assert not setup_mark.exists() and not exit_mark.exists() and not mark.exists()
    text = _inv("launch", "-c", str(cluster), "--dry-run", "--trust-ssh-config")
    assert f"setup (each host, after the sync; a dry run runs none): touch {setup_mark}" \
        in text.stdout + text.stderr
    assert f"on_exit (here, when the run ends; a dry run runs none): touch {exit_mark}" \
        in text.stdout + text.stderr
    assert not setup_mark.exists() and not exit_mark.exists()

    flag = _inv("launch", "-c", str(cluster), "--dry-run", "--json", "--trust-ssh-config",
                "--on-exit", f"touch {exit_mark}.flag")
    (plan,) = [e["data"] for e in map(json.loads, flag.stdout.splitlines())
               if e["name"] == "dry_run"]
    assert plan["on_exit"] == f"touch {exit_mark}.flag", "the flag wins, as at the run's end"
    assert not Path(f"{exit_mark}.flag").exists()


# --------------------------------------------------------------------------------------------
# A launch and prebuild-check
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["launch", "prebuild-check"])
def test_a_cluster_files_ssh_config_that_runs_commands_is_refused_naming_file_line_and_directive(
        tmp_path: Path, command: str) -> None:
    config, mark = _hostile_config(tmp_path)
    cluster = _cluster_file(tmp_path, config)
    out = _inv(command, "-c", str(cluster))
    assert out.returncode == 2, out.stdout + out.stderr
    said = out.stdout + out.stderr
    assert f"{config}:4: Match exec runs a command; a cluster file's ssh_config may not " \
           "run commands unless you allow it" in said
    assert f"{config}:7: ProxyCommand runs a command" in said
    assert not mark.exists() and not (tmp_path / "PROXIED").exists(), "nothing ran"


def test_allow_commands_counts_only_in_a_cluster_file_the_operator_owns(
        tmp_path: Path) -> None:
    config, mark = _hostile_config(tmp_path)
    cluster = _cluster_file(tmp_path, config, worker="      allow_commands: true\n")
    out = _inv("launch", "-c", str(cluster), "--dry-run")
    assert out.returncode == 0, out.stderr
    assert not mark.exists(), "allowed, and still a dry run runs nothing"

    cluster.chmod(0o666)  # anyone may now write the file, allow_commands included
    out = _inv("launch", "-c", str(cluster), "--dry-run")
    assert out.returncode == 2, out.stderr
    assert f"{cluster}:3: workers[0].ssh.allow_commands: not honoured: {cluster} can be " \
           "written by other users (mode 666)" in out.stderr
    assert f"{config}:7: ProxyCommand runs a command" in out.stderr
    out = _inv("prebuild-check", "-c", str(cluster))
    assert out.returncode == 2 and "not honoured" in out.stdout + out.stderr
    assert not mark.exists()


def test_trust_is_the_operators_decision_never_the_files(tmp_path: Path) -> None:
    config, _ = _hostile_config(tmp_path)
    cluster = load_cluster(str(_cluster_file(tmp_path, config,
                                             worker="      allow_commands: true\n")))
    (worker,) = cluster.workers
    assert worker.ssh.allow_commands and not worker.ssh.commands_trusted
    owned = with_trust(cluster, flag=False, file_untrusted=None)
    assert owned.workers[0].ssh.commands_trusted
    flagged = with_trust(load_cluster(str(_cluster_file(tmp_path, config))), flag=True,
                         file_untrusted="anything")
    assert flagged.workers[0].ssh.commands_trusted


def test_the_flag_is_in_the_help_of_launch_run_and_prebuild_check() -> None:
    for command in ("launch", "prebuild-check"):
        out = _inv(command, "--help")
        assert "--trust-ssh-config" in out.stdout, command
    run = subprocess.run([sys.executable, "-m", "fdl_fabric", "run", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert "--trust-ssh-config" in run.stdout
