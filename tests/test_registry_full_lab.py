"""The run registry on a full disk: a live run is still seen by ``status`` (the record
falls back to the next private folder), and where no folder can take it, the launch
refuses to start rather than run unseen. A real tmpfs, filled to the last byte."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fdl_fabric.testing.launches import wait_for
from labutil import ROOT, LiveLaunch, run_launch

pytestmark = pytest.mark.lab


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs, filled: nothing more can be written there."""
    if os.geteuid() != 0:
        pytest.fail("mounting a tmpfs needs root (CI runs as root)")
    mount = tmp_path / "full"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(mount)],
                   check=True, timeout=30)
    try:
        (mount / "state").mkdir(mode=0o700)
        fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass  # ENOSPC: full
        finally:
            os.close(fd)
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, timeout=30)


def _cluster(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.yml"
    path.write_text(f"controller: {{host: 127.0.0.1}}\nkill_grace: 1\n"
                    f"workers:\n  - {{host: localhost, nproc: 1, path: {tmp_path}}}\n")
    return path


def test_a_full_disk_under_the_registry_falls_back_and_status_still_sees_the_live_run(
        full_disk: Path, tmp_path: Path) -> None:
    env = {**os.environ, "XDG_RUNTIME_DIR": str(full_disk)}
    env.pop("FDL_FABRIC_STATE_DIR", None)
    cluster = _cluster(tmp_path)
    run = LiveLaunch(cluster, "--cmd", "sleep 120", env=env)
    try:
        run_id = run.wait_line(r"cluster launcher: run (\S+): 1 rank", timeout=60).group(1)

        def listed() -> str:
            status = subprocess.run(
                [sys.executable, "-m", "invoke", "--search-root", str(ROOT), "status",
                 "--cluster", str(cluster)], env=env, capture_output=True, text=True,
                timeout=60, cwd=str(ROOT), stdin=subprocess.DEVNULL)
            shown = status.stdout + status.stderr
            return shown if run_id in shown and "localhost" in shown else ""

        assert wait_for(listed, 60, f"status listing run {run_id}")
        assert not any((full_disk / "fdl-fabric").glob("*.json")), "no record on the full disk"
    finally:
        run.kill()


def test_a_registry_that_cannot_be_written_anywhere_refuses_the_launch(
        full_disk: Path, tmp_path: Path) -> None:
    env = {**os.environ, "FDL_FABRIC_STATE_DIR": str(full_disk / "state")}
    marker = tmp_path / "started"
    done = run_launch(_cluster(tmp_path), "--cmd", f"touch {marker}", env=env, timeout=60)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "the run registry cannot be written on this host" in out
    assert "status and cleanup would not see this run, so it was not started" in out
    assert not marker.exists()
