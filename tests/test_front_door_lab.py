"""One front door (issue 29, item 1): hosts from the command line, complete, against real
sshd lab hosts and real torch gloo DDP ranks (examples/ddp_torch.py).

- An ssh_config alias is resolved to its HostName for MASTER_ADDR, so ranks that cannot
  resolve the alias still meet; a MASTER_ADDR no host resolves is refused by the
  pre-flight before any rank starts.
- ``user@host:port`` entries with ``--identity`` need no ssh_config, and two such runs at
  once from one folder each get a coordinator port of their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fdl_fabric.testing.processes import master_port
from labutil import ROOT, gloo_run_completed

pytestmark = [pytest.mark.lab, pytest.mark.timeout(240)]

DDP = str(ROOT / "examples" / "ddp_torch.py")
FDL_RUN = (sys.executable, "-m", "fdl_fabric", "run")


def _envs(dump: Path) -> dict[int, dict[str, str]]:
    return {int(p.stem.split("-r")[1]): json.loads(p.read_text())
            for p in dump.glob("env-r*.json")}


def _coordinator_port(env: dict[str, str]) -> int:
    """The coordinator's port, as the rank's envelope gives it to `fdl_fabric.rank`."""
    envelope = json.loads(bytes.fromhex(env["FLODL_INTERNAL_CLUSTER_JSON"]).decode())
    return int(envelope["controller"]["port"])


def _home(tmp_path: Path) -> dict[str, str]:
    """A HOME of the test's own: its ~/.ssh/known_hosts takes the lab's keys (accept-new)."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True, exist_ok=True)
    return {**os.environ, "HOME": str(home)}


def test_ssh_config_aliases_become_their_hostname_and_gloo_ddp_completes(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=2)
    config = lab.write_ssh_config(tmp_path / "ssh_config")
    dump = tmp_path / "env"
    out = subprocess.run([*FDL_RUN, "--hosts", "node[1-2]", "-F", str(config),
                          "--nproc-per-node", "1", "--master-port", str(master_port()),
                          DDP, "--steps", "3", "--dump-env",
                          str(dump)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=200)
    assert out.returncode == 0, out.stderr
    envs = _envs(dump)
    assert {e["MASTER_ADDR"] for e in envs.values()} == {lab.hosts[0].addr}, \
        "the alias node1 is its HostName, which every rank resolves"
    assert gloo_run_completed(out.stderr.splitlines()[-1], 2), out.stderr


def test_a_master_addr_no_host_resolves_is_refused_before_any_rank_starts(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=2)
    config = lab.write_ssh_config(tmp_path / "ssh_config")
    out = subprocess.run([*FDL_RUN, "--hosts", "node[1-2]", "-F", str(config),
                          "--master-addr", "rank0.invalid", DDP, "--steps", "3"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "MASTER_ADDR rank0.invalid does not resolve here" in out.stderr
    assert "node1" in out.stderr and "node2" in out.stderr, "each host is named"
    assert out.stdout == "", "no rank started"
    assert out.stderr.splitlines()[-1].startswith("cluster launcher: failed: pre-flight failed")


def test_two_runs_at_once_from_one_folder_with_user_host_port_and_identity_complete(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=2)
    hosts = ",".join(f"{lab.user}@{h.addr}:{h.port}" for h in lab.hosts)
    env = _home(tmp_path)
    joiner = tmp_path / "join.py"  # each rank joins its run's cohort: the port must be right
    joiner.write_text("import json, os, sys\nfrom fdl_fabric import rank\nrank.join()\n"
                      "os.makedirs(sys.argv[1], exist_ok=True)\n"
                      "with open(os.path.join(sys.argv[1], 'env-r%s.json' % "
                      "os.environ['RANK']), 'w') as f:\n    json.dump(dict(os.environ), f)\n")
    runs = []
    for n in range(2):
        argv = [*FDL_RUN, "--hosts", hosts, "--identity", lab.identity_file,
                "--nproc-per-node", "2", str(joiner), str(tmp_path / f"env{n}")]
        runs.append(subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True))
    outs = [run.communicate(timeout=200) for run in runs]
    for run, (_, err) in zip(runs, outs):
        assert run.returncode == 0, err
        assert err.splitlines()[-1] == "cluster launcher: run completed — all 4 ranks exited 0"
    ports = [{_coordinator_port(e) for e in _envs(tmp_path / f"env{n}").values()}
             for n in range(2)]
    assert all(len(p) == 1 for p in ports), ports
    assert ports[0] != ports[1], "each run binds a free coordinator port of its own"
    masters = [{e["MASTER_PORT"] for e in _envs(tmp_path / f"env{n}").values()}
               for n in range(2)]
    assert masters[0] != masters[1], "and a MASTER_PORT of its own on this machine"


def test_the_python_api_launches_hosts_with_the_command_lines_options(
        sshd_lab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fdl_fabric
    from labutil import PROBE

    lab = sshd_lab(n_hosts=2)
    monkeypatch.setenv("HOME", _home(tmp_path)["HOME"])
    dump = tmp_path / "env"
    seen: list[str] = []
    result = fdl_fabric.launch(
        None, [sys.executable, PROBE, "--dump", str(dump)],
        hosts=",".join(f"{h.addr}:{h.port}" for h in lab.hosts), user=lab.user,
        identity=lab.identity_file, nproc_per_node=2, controller_port=None,
        master_port=29517, kill_grace=5, max_restarts=0, max_failure=1, agent_timeout=12,
        hang_timeout=0, fanout=64, log_dir=tmp_path / "logs", quiet=True, preflight=True,
        on_event=lambda e: seen.append(e.name.value))
    assert result.ok, result.message
    assert len(result.ranks) == 4 and {r.host for r in result.ranks} == {
        h.addr for h in lab.hosts}
    envs = {int(p.stem.split("-r")[1]): json.loads(p.read_text())["env"]
            for p in dump.glob("env-r*.json")}
    assert {e["MASTER_PORT"] for e in envs.values()} == {"29517"}
    assert "verdict" in seen and (tmp_path / "logs" / "latest").is_symlink()
