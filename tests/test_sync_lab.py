"""Issue 31: code reaches every host as part of the launch (``sync:``), through the real
thing: sshd lab hosts whose ``path`` starts empty, real git work trees, real agents.

Every lab host is this machine, so what a host has is read straight from its ``path``;
what it was sent is what its agent counted (``code_synced`` in the ``--json`` events).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fdl_fabric.testing import SshdLab
from fdl_fabric.testing.processes import master_port
from labutil import LiveLaunch, alive, gloo_run_completed, run_launch, wait_for

pytestmark = [pytest.mark.lab, pytest.mark.timeout(180)]

#: The synced program: says its version and where it runs.
TRAIN = """\
import os, sys, time, version
print(f"rank {os.environ['RANK']} runs {version.V} in {os.getcwd()}", flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""


def _git(folder: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(folder), "-c", "user.name=t", "-c", "user.email=t@t",
                    *args], check=True, capture_output=True)


def project(root: Path, version: str = "v1") -> Path:
    """A small git project: code, an ignored log, an excluded data folder."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.py").write_text(TRAIN)
    (root / "version.py").write_text(f"V = {version!r}\n")
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    (root / "pkg").mkdir(exist_ok=True)
    (root / "pkg" / "helper.py").write_text("X = 1\n")
    (root / "link.py").symlink_to("pkg/helper.py") if not (root / "link.py").is_symlink() \
        else None
    (root / ".gitignore").write_text("*.log\n")
    (root / "debug.log").write_text("not sent\n")
    (root / "data").mkdir(exist_ok=True)
    (root / "data" / "big.bin").write_bytes(b"\0" * 4096)
    _git(root, "init", "-q")
    return root


def commit(root: Path) -> None:
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "a version")


def sync_cluster(lab: SshdLab, src: Path, filename: str = "", **top: Any) -> Path:
    """A cluster file in ``src`` (so ``sync: true`` sends ``src``), each its own port."""
    workers = [lab.worker(h, nproc=1) for h in lab.hosts]
    top.setdefault("sync", {"exclude": ["data/"]})
    return lab.write_cluster(workers, filename=filename or f"{src.name}/cluster.yml",
                             command="python3 train.py", **top)


def events(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def named(stdout: str, name: str) -> list[dict[str, Any]]:
    return [e for e in events(stdout) if e["name"] == name]


def rank_lines(stdout: str) -> list[str]:
    """Every line the ranks wrote (an output event may carry several)."""
    return [line for e in named(stdout, "rank_output") for line in e["data"]["text"].splitlines()]


def launched(cluster: Path, *args: str) -> subprocess.CompletedProcess[str]:
    done = run_launch(cluster, "--json", *args, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_a_launch_with_sync_runs_the_synced_code_and_the_next_sends_only_what_changed(
        sshd_lab: Any) -> None:
    lab = sshd_lab(n_hosts=3)
    src = project(lab.root / "proj")
    cluster = sync_cluster(lab, src)
    commit(src)
    first = launched(cluster)
    code = named(first.stdout, "code")[0]["data"]
    assert code["code_id"].startswith("git:") and "+" not in code["code_id"]
    outputs = rank_lines(first.stdout)
    assert sum("runs v1 in" in line and "/.fdl-code/trees/" in line for line in outputs) == 3
    synced = {e["host"]: e["data"] for e in named(first.stdout, "code_synced")}
    assert set(synced) == {h.name for h in lab.hosts}
    for host in lab.hosts:
        tree = Path(synced[host.name]["dir"])
        assert tree.is_relative_to(Path(host.path).resolve())
        names = {str(p.relative_to(tree)) for p in tree.rglob("*")}
        assert {"train.py", "version.py", "run.sh", "pkg/helper.py", "link.py",
                ".gitignore", "cluster.yml"} <= names
        assert not names & {"debug.log", "data", "data/big.bin", ".git"}
        assert os.access(tree / "run.sh", os.X_OK)
        assert os.readlink(tree / "link.py") == "pkg/helper.py"
    (src / "version.py").write_text("V = 'v2'\n")
    second = launched(cluster)
    assert named(second.stdout, "code")[0]["data"]["code_id"].endswith(
        "+" + named(second.stdout, "code")[0]["data"]["tree"][:8])
    for e in named(second.stdout, "code_synced"):
        assert (e["data"]["files"], e["data"]["bytes"]) == (1, len("V = 'v2'\n")), e
    outputs = rank_lines(second.stdout)
    assert sum("runs v2 in" in line for line in outputs) == 3
    third = launched(cluster)
    assert all(e["data"]["had"] and e["data"]["bytes"] == 0
               for e in named(third.stdout, "code_synced"))


def _sent(pid: int) -> int:
    """Bytes process ``pid`` sent so far on its TCP connections (the kernel's count,
    ``ss -ti``'s bytes_sent), SSH framing and all."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    total, mine = 0, False
    for line in out.splitlines():
        if not line.startswith((" ", "\t")):
            mine = f"pid={pid}," in line
        elif mine:
            m = re.search(r"bytes_sent:(\d+)", line)
            total += int(m.group(1)) if m else 0
    return total


def test_through_a_gateway_tree_the_launcher_sends_each_gateway_one_copy(
        sshd_lab: Any) -> None:
    lab = sshd_lab(n_hosts=5)
    src = project(lab.root / "proj")
    size = 4 << 20
    (src / "weights.bin").write_bytes(os.urandom(size))
    cluster = sync_cluster(lab, src, fanout=2)
    commit(src)
    run = LiveLaunch(cluster, "--cmd", "python3 train.py 4")
    try:
        run.wait_line(r"cluster launcher: code in place on 5 host", timeout=60)
        sent = _sent(run.pid)
        assert run.finish(60) == 0, run.err
    finally:
        run.kill()
    # two gateways (lab1, lab2) get one copy each; their relays serve the three leaves
    assert 2 * size <= sent < 3 * size, f"the launcher sent {sent} bytes for {size}"
    assert sum("runs v1 in" in line for line in run.stderr_lines + run.stdout_lines) == 5
    for host in lab.hosts:
        trees = list(Path(host.path, ".fdl-code", "trees").glob("*/weights.bin"))
        assert len(trees) == 1 and trees[0].stat().st_size == size, host.name
    # a leaf that lost its store, behind a gateway that has the tree: served all the same
    leaf = lab.hosts[-1]
    subprocess.run(["rm", "-rf", str(Path(leaf.path, ".fdl-code"))], check=True)
    again = launched(cluster)
    got = {e["host"]: e["data"] for e in named(again.stdout, "code_synced")}
    assert got[leaf.name]["bytes"] >= size and not got[leaf.name]["had"], got
    assert got["lab1"]["had"] and got["lab2"]["had"]


# -- setup: once per host ----------------------------------------------------------------------

SETUP = "python3 -m venv .venv && .venv/bin/pip install -q --no-index --find-links wheels " \
        "-r requirements.txt && echo setup-ran"


def test_setup_runs_once_is_skipped_next_time_and_runs_again_when_its_input_changes(
        sshd_lab: Any) -> None:
    from venvutil import make_wheel

    lab = sshd_lab(n_hosts=2)
    src = project(lab.root / "proj")
    make_wheel(src / "wheels", "tinypkg", "1.0.0")
    make_wheel(src / "wheels", "tinypkg", "2.0.0")
    (src / "requirements.txt").write_text("tinypkg==1.0.0\n")
    (src / "train.py").write_text(
        "import os, sys, tinypkg\nprint('rank', os.environ['RANK'], 'runs tinypkg', "
        "tinypkg.VERSION, 'from', sys.prefix, flush=True)\n")
    cluster = sync_cluster(lab, src, setup=SETUP, setup_inputs=["requirements.txt"],
                           python=".venv/bin/python", setup_timeout=120)
    first = launched(cluster)
    assert len(named(first.stdout, "setup_done")) == 2
    assert all(not e["data"]["skipped"] and ".venv" in e["data"]["made"]
               for e in named(first.stdout, "setup_done"))
    ran = [e for e in named(first.stdout, "setup_output") if e["data"]["text"] == "setup-ran"]
    assert {e["host"] for e in ran} == {"lab1", "lab2"}
    texts = rank_lines(first.stdout)
    assert sum("runs tinypkg 1.0.0 from" in t and ".venv" in t for t in texts) == 2, texts
    # a code change that leaves requirements.txt alone: setup is skipped, the venv linked
    (src / "version.py").write_text("V = 'v2'\n")
    second = launched(cluster)
    assert all(e["data"]["skipped"] for e in named(second.stdout, "setup_done"))
    assert not named(second.stdout, "setup_output")
    texts = rank_lines(second.stdout)
    assert sum("runs tinypkg 1.0.0" in t for t in texts) == 2, texts
    # the input changed: setup runs again, in the new tree
    (src / "requirements.txt").write_text("tinypkg==2.0.0\n")
    third = launched(cluster)
    assert all(not e["data"]["skipped"] for e in named(third.stdout, "setup_done"))
    texts = rank_lines(third.stdout)
    assert sum("runs tinypkg 2.0.0" in t for t in texts) == 2, texts


def test_a_failing_setup_names_its_host_and_no_rank_starts_anywhere(sshd_lab: Any) -> None:
    lab = sshd_lab(n_hosts=3)
    src = project(lab.root / "proj")
    marker = lab.root / "ranks-started"
    (src / "train.py").write_text(f"open({str(marker)!r}, 'a').write('x')\n")
    pids = lab.root / "setup-pids"
    pids.mkdir()
    setup = ('if [ "$FDL_FAIL_HOST" = "$LAB_HOST" ]; then sleep 1; '
             'echo "pip: no matching distribution" >&2; exit 3; fi; '
             f'echo $$ > {pids}/$LAB_HOST; exec sleep 60')
    lab_env = {"FDL_FAIL_HOST": "lab2"}
    workers = [lab.worker(h, nproc=1, env={"LAB_HOST": h.name, **lab_env}) for h in lab.hosts]
    cluster = lab.write_cluster(workers, filename="proj/cluster.yml", command="python3 train.py",
                                sync=True, setup=setup)
    done = run_launch(cluster, timeout=120)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "failed: setup on lab2: exit 3" in last, done.stderr
    assert "pip: no matching distribution" in done.stderr
    assert "[lab2:setup] pip: no matching distribution" in done.stderr
    assert not marker.exists(), "a rank started"
    others = {p.name: int(p.read_text()) for p in pids.iterdir()}
    assert set(others) == {"lab1", "lab3"}
    wait_for(lambda: not any(alive(pid) for pid in others.values()), 15,
             "the other hosts' setups stopped")


# -- the same interpreter and libraries everywhere -----------------------------------------

def test_a_host_whose_python_has_another_version_of_a_package_is_named_in_the_preflight(
        sshd_lab: Any, tmp_path: Path) -> None:
    from venvutil import make_venv

    lab = sshd_lab(n_hosts=3)
    good, odd = tmp_path / "good", tmp_path / "odd"
    make_venv(good, {"tinypkg": "1.0.0"})
    make_venv(odd, {"tinypkg": "0.9.1"})
    project(lab.root / "proj")
    workers = [lab.worker(h, nproc=1, python=str((odd if h.name == "lab3" else good)
                                                 / "bin" / "python"))
               for h in lab.hosts]
    cluster = lab.write_cluster(workers, filename="proj/cluster.yml",
                                command="python3 train.py", sync=True,
                                check_packages=["tinypkg"])
    done = run_launch(cluster, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "pre-flight: lab3: versions: tinypkg 0.9.1 on lab3, 1.0.0 on 2 others" in \
        done.stderr, done.stderr
    strict = lab.write_cluster(workers, filename="proj/strict.yml",
                               command="python3 train.py", sync=True,
                               check_packages=["tinypkg"], strict_versions=True)
    done = run_launch(strict, timeout=120)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "tinypkg 0.9.1 on lab3" in last and "nothing was started" in last, last


# -- two versions at once --------------------------------------------------------------------

def test_two_runs_of_two_versions_on_the_same_hosts_each_see_their_own_code(
        sshd_lab: Any) -> None:
    lab = sshd_lab(n_hosts=2)
    src = project(lab.root / "proj")
    (src / "train.py").write_text(
        "import os, sys, time, version\n"
        "print('start', os.environ['RANK'], version.V, flush=True)\n"
        "time.sleep(float(sys.argv[1]))\n"
        "print('end', os.environ['RANK'], open('version.py').read().strip(), flush=True)\n")
    cluster = sync_cluster(lab, src)
    commit(src)
    first = LiveLaunch(cluster, "--cmd", "python3 train.py 6")
    try:
        first.wait_line(r"start 1 v1", timeout=60)
        first.wait_line(r"start 0 v1", timeout=60)
        (src / "version.py").write_text("V = 'v2'\n")
        other_port = sync_cluster(lab, src, filename="proj/second.yml")
        second = launched(other_port, "--cmd", "python3 train.py 0")
        texts = rank_lines(second.stdout)
        assert sorted(t for t in texts if t.startswith("end")) == \
            ["end 0 V = 'v2'", "end 1 V = 'v2'"], texts
        assert first.finish(60) == 0, first.err
    finally:
        first.kill()
    ends = sorted(line.split("] ", 1)[-1] for line in first.stdout_lines + first.stderr_lines
                  if "] end " in line)
    assert ends == ["end 0 V = 'v1'", "end 1 V = 'v1'"], first.err


# -- what goes wrong, said clearly, nothing started ---------------------------------------

def _marking(src: Path, marker: Path) -> None:
    (src / "train.py").write_text(f"open({str(marker)!r}, 'a').write('x')\n")


def test_a_missing_src_and_a_symlink_out_of_it_are_refused_before_anything_starts(
        sshd_lab: Any, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    src = project(lab.root / "proj")
    cluster = sync_cluster(lab, src, sync={"src": "nowhere"})
    done = run_launch(cluster, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"sync: {src / 'nowhere'} (sync.src, line" in done.stderr.strip().splitlines()[-1]
    assert lab.hosts[0].session_pids() == [] and not Path(lab.hosts[0].path, ".fdl-code").exists()
    (tmp_path / "secret.txt").write_text("s")
    (src / "leak.txt").symlink_to(tmp_path / "secret.txt")
    cluster = sync_cluster(lab, src)
    done = run_launch(cluster, timeout=60)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert f"{src / 'leak.txt'} is a symlink to {tmp_path / 'secret.txt'}, outside {src}" in last
    assert not Path(lab.hosts[0].path, ".fdl-code").exists()


def test_a_host_without_rsync_on_its_path_gets_the_code_all_the_same(
        sshd_lab: Any, tmp_path: Path) -> None:
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python3").symlink_to(os.path.realpath(sys.executable))
    (bare / "sh").symlink_to("/bin/sh")
    lab = sshd_lab(n_hosts=2, session_env={"PATH": str(bare)})
    src = project(lab.root / "proj")
    (src / "train.py").write_text("import shutil\nprint('rsync here:', shutil.which('rsync'), "
                                  "flush=True)\n")
    workers = [lab.worker(h, nproc=1, env={"PATH": str(bare)}) for h in lab.hosts]
    cluster = lab.write_cluster(workers, filename="proj/cluster.yml", sync=True,
                                command="python3 train.py")
    done = launched(cluster)
    texts = rank_lines(done.stdout)
    assert texts.count("rsync here: None") == 2, texts
    assert len(named(done.stdout, "code_synced")) == 2


def test_an_unwritable_path_is_named_and_nothing_starts(sshd_lab: Any) -> None:
    lab = sshd_lab(n_hosts=2)
    src = project(lab.root / "proj")
    marker = lab.root / "ranks-started"
    _marking(src, marker)
    blocker = lab.root / "a-file"
    blocker.write_text("not a folder")
    workers = [lab.worker(h, nproc=1) for h in lab.hosts]
    workers[1]["path"] = str(blocker / "work")
    cluster = lab.write_cluster(workers, filename="proj/cluster.yml", sync=True,
                                command="python3 train.py")
    done = run_launch(cluster, "--no-preflight", timeout=60)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert f"sync to lab2: cannot write under {blocker / 'work'}: Not a directory" in last
    assert not marker.exists()


def _tmpfs(path: Path, size: str) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                   check=True, capture_output=True)


def test_a_full_disk_on_a_host_is_named_with_its_free_space_and_nothing_starts(
        sshd_lab: Any) -> None:
    lab = sshd_lab(n_hosts=2)
    src = project(lab.root / "proj")
    marker = lab.root / "ranks-started"
    _marking(src, marker)
    (src / "weights.bin").write_bytes(os.urandom(24 << 20))
    small = Path(lab.hosts[1].path)
    _tmpfs(small, "20m")
    try:
        cluster = sync_cluster(lab, src)
        done = run_launch(cluster, timeout=60)
    finally:
        subprocess.run(["umount", "-l", str(small)], capture_output=True)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert re.search(rf"sync to lab2: not enough space under {re.escape(str(small))}: "
                     r"the sync needs 24\.\d MiB, 20\.0 MiB free", last), last
    assert not marker.exists()


def test_a_host_whose_sshd_dies_mid_sync_is_named_and_nothing_starts(sshd_lab: Any) -> None:
    lab = sshd_lab(n_hosts=3)
    src = project(lab.root / "proj")
    marker = lab.root / "ranks-started"
    _marking(src, marker)
    (src / "weights.bin").write_bytes(os.urandom(96 << 20))
    cluster = sync_cluster(lab, src)
    run = LiveLaunch(cluster)
    victim = lab.hosts[1]
    incoming = Path(victim.path, ".fdl-code", "tmp")
    try:
        wait_for(lambda: incoming.is_dir() and any(p.stat().st_size > 0 for p in
                                                    incoming.iterdir()),
                 60, "lab2 receiving")
        victim.lose()
        assert run.finish(60) == 1, run.err
    finally:
        run.kill()
    last = run.err_lines()[-1]
    print("VERDICT:", last)
    assert "sync to lab2: the host dropped during the sync" in last, run.err
    assert not marker.exists()
    assert wait_for(lambda: all(h.session_pids() == [] for h in lab.hosts if h is not victim),
                    20, "the other hosts' agents gone")


def test_a_file_that_changes_while_it_is_sent_is_refused_and_nothing_starts(
        sshd_lab: Any) -> None:
    import threading

    lab = sshd_lab(n_hosts=2)
    src = project(lab.root / "proj")
    marker = lab.root / "ranks-started"
    _marking(src, marker)
    hot = src / "weights.bin"
    hot.write_bytes(os.urandom(16 << 20))
    cluster = sync_cluster(lab, src)
    stop = threading.Event()

    def keep_writing() -> None:  # a training job still writing its checkpoint
        while not stop.is_set():
            with open(hot, "r+b") as f:
                f.write(os.urandom(1 << 20))

    writer = threading.Thread(target=keep_writing, daemon=True)
    writer.start()
    try:
        done = run_launch(cluster, timeout=120)
    finally:
        stop.set()
        writer.join(10)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "weights.bin changed while it was sent" in last, done.stderr
    assert not marker.exists()


# -- every run says which code it ran ----------------------------------------------------------

def test_the_code_id_is_in_the_record_in_status_and_a_dry_run_lists_what_would_be_sent(
        sshd_lab: Any, runs: Path) -> None:
    lab = sshd_lab(n_hosts=2)
    src = project(lab.root / "proj")
    cluster = sync_cluster(lab, src)
    commit(src)
    dry = run_launch(cluster, "--dry-run", timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert "code git:" in dry.stdout and "train.py" in dry.stdout, dry.stdout
    assert "/.fdl-code/trees/" in dry.stdout  # each host's cwd: its tree
    assert all(h.session_pids() == [] for h in lab.hosts)
    assert not any(Path(h.path, ".fdl-code").exists() for h in lab.hosts), "a dry run sent"
    done = launched(cluster)
    code_id = named(done.stdout, "code")[0]["data"]["code_id"]
    assert events(done.stdout)[0]["name"] == "code", "the code id comes first"
    run_id = named(done.stdout, "verdict")[0]["data"]["run_id"]
    record = runs / run_id
    assert json.loads((record / "state.json").read_text())["code_id"] == code_id
    assert json.loads((record / "result.json").read_text())["code_id"] == code_id
    status = subprocess.run([sys.executable, "-m", "fdl_fabric", "status", "--all", "-c",
                             str(cluster)], capture_output=True, text=True, timeout=60)
    assert f"code {code_id}" in status.stdout + status.stderr, status.stdout + status.stderr


def test_fdl_fabric_run_with_hosts_and_sync_sends_the_current_folder(
        sshd_lab: Any, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=2)
    config = lab.write_ssh_config(tmp_path / "ssh_config")
    src = project(tmp_path / "work")
    done = subprocess.run([sys.executable, "-m", "fdl_fabric", "run", "--hosts", "node1,node2",
                           "-F", str(config), "--sync", "--nproc-per-node", "1", "--json",
                           "train.py"], cwd=src, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert named(done.stdout, "code")[0]["data"]["src"] == str(src)
    lines = rank_lines(done.stdout)
    assert sum("runs v1 in" in t and f"{src}/.fdl-code/trees/" in t for t in lines) == 2, lines
    plain = subprocess.run([sys.executable, "-m", "fdl_fabric", "run", "--hosts", "node1",
                            "-F", str(config), "--nproc-per-node", "1", "--json", "train.py"],
                           cwd=src, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr
    assert not named(plain.stdout, "code"), "no sync unless asked"
    assert any(f"runs v1 in {src}" == t.split(" ", 3)[-1] or t.endswith(f"in {src}")
               for t in rank_lines(plain.stdout))


def test_torch_gloo_ddp_runs_from_the_synced_folder_and_the_hosts_agree_on_torch(
        sshd_lab: Any, tmp_path: Path) -> None:
    import shutil

    import torch  # requirements-torch.txt: the CPU wheel, installed for the tests
    lab = sshd_lab(n_hosts=2)
    config = lab.write_ssh_config(tmp_path / "ssh_config")
    src = tmp_path / "ddp-project"
    src.mkdir()
    shutil.copy(Path(__file__).resolve().parent.parent / "examples" / "ddp_torch.py", src)
    done = subprocess.run([sys.executable, "-m", "fdl_fabric", "run", "--hosts", "node[1-2]",
                           "-F", str(config), "--sync", "--nproc-per-node", "1",
                           "--master-port", str(master_port()), "ddp_torch.py",
                           "--steps", "3"], cwd=src, capture_output=True, text=True,
                          timeout=200)
    assert done.returncode == 0, done.stderr
    version = torch.__version__
    assert f"versions: python {sys.version.split()[0]}, torch {version} on all 2 hosts" in \
        done.stderr, done.stderr
    assert gloo_run_completed(done.stderr.splitlines()[-1], 2), done.stderr


def test_ctrl_c_during_setup_stops_it_on_every_host_and_the_verdict_says_interrupted(
        sshd_lab: Any) -> None:
    import signal

    lab = sshd_lab(n_hosts=2)
    src = project(lab.root / "proj")
    pids = lab.root / "setup-pids"
    pids.mkdir()
    cluster = sync_cluster(lab, src, setup=f"echo $$ > {pids}/$(mktemp -u XXXXXX); "
                                           "echo setting up; exec sleep 60")
    run = LiveLaunch(cluster)
    try:
        wait_for(lambda: len(list(pids.iterdir())) == 2, 60, "both setups running")
        run.wait_line(r"\[lab\d:setup\] setting up", timeout=30)
        run.signal(signal.SIGINT)
        assert run.finish(60) == 130, run.err
    finally:
        run.kill()
    running = [int(p.read_text()) for p in pids.iterdir()]
    wait_for(lambda: not any(alive(pid) for pid in running), 15, "every setup stopped")
    assert "interrupted" in run.err_lines()[-1], run.err
