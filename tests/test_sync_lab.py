"""Issue 31: code reaches every host as part of the launch (``sync:``), through the real
thing: sshd lab hosts whose ``path`` starts empty, real git work trees, real agents.

Every lab host is this machine, so what a host has is read straight from its ``path``;
what it was sent is what its agent counted (``code_synced`` in the ``--json`` events).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from fdl_fabric.testing import SshdLab
from labutil import run_launch

pytestmark = [pytest.mark.lab, pytest.mark.timeout(180)]

#: The synced program: says its version and where it runs.
TRAIN = """\
import os, version
print(f"rank {os.environ['RANK']} runs {version.V} in {os.getcwd()}", flush=True)
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


def sync_cluster(lab: SshdLab, src: Path, **top: Any) -> Path:
    workers = [lab.worker(h, nproc=1) for h in lab.hosts]
    top.setdefault("sync", {"exclude": ["data/"]})
    return lab.write_cluster(workers, filename=f"{src.name}/cluster.yml",
                             command="python3 train.py", **top)


def events(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def named(stdout: str, name: str) -> list[dict[str, Any]]:
    return [e for e in events(stdout) if e["name"] == name]


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
    outputs = [e["data"]["text"] for e in named(first.stdout, "rank_output")]
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
    outputs = [e["data"]["text"] for e in named(second.stdout, "rank_output")]
    assert sum("runs v2 in" in line for line in outputs) == 3
    third = launched(cluster)
    assert all(e["data"]["had"] and e["data"]["bytes"] == 0
               for e in named(third.stdout, "code_synced"))
