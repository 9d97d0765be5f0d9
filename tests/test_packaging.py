"""The wheel and the sdist install and run, with no checkout in sight.

An editable install (``make test``) imports from this checkout, which hides a wheel
that leaves out a subpackage: built with a fixed package list, the wheel had no
``agent/``, and every installed ``fdl-fabric launch`` failed with ModuleNotFoundError.
So this builds both, installs the wheel into a fresh venv, and runs the console script
from another folder, for one host and against a lab host.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from labutil import ROOT

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel built from this checkout (and nothing of it else)."""
    where = tmp_path_factory.mktemp("packaging")
    dist = where / "dist"
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel",
                    "--outdir", str(dist), str(ROOT)], check=True, capture_output=True,
                   timeout=300)
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    (wheel,) = dist.glob("*.whl")
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                    str(wheel)], check=True, capture_output=True, timeout=600)
    return venv


def test_the_wheel_and_the_sdist_hold_every_package(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    packages = {p.parent.relative_to(ROOT).as_posix()
                for p in (ROOT / "fdl_fabric").rglob("__init__.py")}
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel",
                    "--outdir", str(dist), str(ROOT)], check=True, capture_output=True,
                   timeout=300)
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    with zipfile.ZipFile(wheel) as whl, tarfile.open(sdist) as tar:
        in_wheel = {str(Path(n).parent) for n in whl.namelist()}
        in_sdist = {"/".join(Path(n).parts[1:-1]) for n in tar.getnames()}
    assert packages <= in_wheel, packages - in_wheel
    assert packages <= in_sdist, packages - in_sdist


def test_an_installed_fdl_fabric_run_works_from_another_folder(
        installed: Path, tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], 'of', "
                      "os.environ['WORLD_SIZE'])\n")
    where = subprocess.run([str(installed / "bin" / "python"), "-c",
                            "import fdl_fabric, sys; print(fdl_fabric.__file__)"],
                           capture_output=True, text=True, cwd=str(tmp_path), check=True)
    assert str(installed) in where.stdout, where.stdout  # the wheel, not this checkout
    out = subprocess.run([str(installed / "bin" / "fdl-fabric"), "run", "--nproc-per-node",
                          "2", str(script)], capture_output=True, text=True, timeout=120,
                         cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "[localhost:cpu:r1] rank 1 of 2" in out.stdout
    assert out.stderr.splitlines()[-1] == "cluster launcher: run completed — all 2 ranks " \
        "exited 0"


def test_an_installed_fdl_fabric_launch_reaches_a_lab_host(
        installed: Path, sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = lab.write_cluster([lab.worker(lab.hosts[0], nproc=1)],
                                command="python3 -c \"print('hello from the lab')\"")
    out = subprocess.run([str(installed / "bin" / "fdl-fabric"), "launch", "--cluster",
                          str(cluster)], capture_output=True, text=True, timeout=120,
                         cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "[lab1:cpu:r0] hello from the lab" in out.stdout
