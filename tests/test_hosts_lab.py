"""Hosts from the command line (issue 21, item 1): ``--hosts`` ranges and ``--hostfile``,
the hosts named only in an ssh_config file given with ``-F``/``--ssh-config``, against
real sshd lab hosts; ``fdl-fabric run --hosts`` as a multi-host torchrun."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from labutil import INV_LAUNCH, PROBE, ROOT

pytestmark = pytest.mark.lab


def _ranks(dump: Path) -> dict[int, dict[str, str]]:
    return {int(p.stem.split("-r")[1]): json.loads(p.read_text())["env"]
            for p in dump.glob("env-r*.json")}


def test_hosts_ranges_through_an_ssh_config_file_run_every_rank(sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=2)
    config = lab.write_ssh_config(tmp_path / "ssh_config")
    dump = tmp_path / "d"
    out = subprocess.run([*INV_LAUNCH, "--hosts", "node[1-2]", "--ssh-config", str(config),
                          "--nproc-per-node", "2", "--cmd", f"python3 {PROBE} --dump {dump}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    ranks = _ranks(dump)
    assert sorted(ranks) == [0, 1, 2, 3]
    assert {r: e["WORLD_SIZE"] for r, e in ranks.items()} == dict.fromkeys(range(4), "4")
    assert [ranks[r]["GROUP_RANK"] for r in range(4)] == ["0", "0", "1", "1"]
    assert "4 rank(s) on 2 host(s) (node1: r0-r1, node2: r2-r3)" in out.stderr


def test_a_hostfile_gives_each_host_its_slots_and_the_dry_run_shows_them(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=2)
    config = lab.write_ssh_config(tmp_path / "ssh_config")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# DeepSpeed / MPI style\nnode1 slots=1\nnode2 slots=3 max_slots=8\n")
    base = [*INV_LAUNCH, "--hostfile", str(hostfile), "--ssh-config", str(config)]
    dry = subprocess.run([*base, "--dry-run", "--cmd", "python3 train.py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert "4 rank(s) on 2 host(s)" in dry.stdout
    assert "host node1:" in dry.stdout and "host node2:" in dry.stdout
    dump = tmp_path / "d"
    out = subprocess.run([*base, "--cmd", f"python3 {PROBE} --dump {dump}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    assert [e["LOCAL_WORLD_SIZE"] for _, e in sorted(_ranks(dump).items())] == [
        "1", "3", "3", "3"]


def test_fdl_fabric_run_with_hosts_is_a_multi_host_torchrun(sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=2)
    config = lab.write_ssh_config(tmp_path / "ssh_config")
    script = tmp_path / "train.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], 'of', "
                      "os.environ['WORLD_SIZE'], 'on', os.environ['GROUP_RANK'], flush=True)\n")
    out = subprocess.run([sys.executable, "-m", "fdl_fabric", "run", "--hosts", "node1,node2",
                          "-F", str(config), "--nproc-per-node", "2", str(script)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    lines = sorted(x.split("] ", 1)[1] for x in out.stdout.splitlines())
    assert lines == ["rank 0 of 4 on 0", "rank 1 of 4 on 0", "rank 2 of 4 on 1",
                     "rank 3 of 4 on 1"]
    assert out.stderr.splitlines()[-1] == "cluster launcher: run completed — all 4 ranks exited 0"


@pytest.mark.parametrize(("args", "words"), [
    (["--hosts", "node[1-"], "--hosts: 'node[1-': missing bracket"),
    (["--hosts", "a,b,a"], "--hosts: host 'a' is named twice"),
    (["--hosts", "a", "--hostfile", "x"], "--hosts: give --hosts or --hostfile, not both"),
    (["--hosts", "a", "--cluster", "cluster.yml"], "--hosts: the hosts come from the command "
                                                   "line or from --cluster, not both"),
    (["--ssh-config", "x"], "--ssh-config: only with --hosts or --hostfile"),
])
def test_bad_hosts_are_refused_with_exit_2_naming_the_flag(args: list[str], words: str) -> None:
    out = subprocess.run([*INV_LAUNCH, *args, "--cmd", "true"], cwd=ROOT, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 2 and words in out.stderr, out.stderr


def test_a_bad_hostfile_line_is_refused_naming_the_file_and_line(tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=2\nnode2 gpus=4\n")
    out = subprocess.run([*INV_LAUNCH, "--hostfile", str(hostfile), "--cmd", "true"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert f"{hostfile}:2: expected `host slots=N`, got 'gpus=4'" in out.stderr


def test_status_shows_a_live_run_on_two_hosts_and_nothing_once_it_ended(
        sshd_lab, tmp_path: Path) -> None:
    from labutil import LiveLaunch

    lab = sshd_lab(n_hosts=2)
    cluster = lab.write_cluster([lab.worker(h, nproc=2) for h in lab.hosts])
    status = [sys.executable, "-m", "invoke", "--search-root", str(ROOT), "status",
              "--cluster", str(cluster), "--json"]
    run = LiveLaunch(cluster, "--", "python3", "-c",
                     "import time; print('up', flush=True); time.sleep(6)")
    try:
        run.wait_line(r"lab2:cpu:r3\] up", stderr=False)
        out = subprocess.run(status, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        (live,) = json.loads(out.stdout)["runs"]
        assert live["run"] == run.run_id and live["launcher"]["pid"] == run.proc.pid
        assert {h: [r["rank"] for r in ranks] for h, ranks in live["hosts"].items()} == {
            "lab1": [0, 1], "lab2": [2, 3]}
        assert all(r["state"] == "running" for rs in live["hosts"].values() for r in rs)
        assert live["uptime"] >= 0
        assert run.finish(60) == 0, run.err
    finally:
        run.kill()
    after = subprocess.run(status, capture_output=True, text=True, timeout=60)
    assert after.returncode == 0 and json.loads(after.stdout)["runs"] == []
