"""Shared fixtures: the sshd lab (fdl_fabric.testing) and a few helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest_plugins = ["fdl_fabric.testing.fixtures"]

# Every launch keeps a record on the controller (`fdl_fabric.runs`): the suite's go to a
# folder of its own, not to the home of whoever runs it (launchers started as processes
# inherit it).
# Under pytest-xdist each worker keeps its own below that folder: a launch prunes old
# records and `status` lists the live ones, so workers sharing one would see each
# other's runs.
if not os.environ.get("FDL_FABRIC_RUNS_DIR"):
    import tempfile

    os.environ["FDL_FABRIC_RUNS_DIR"] = tempfile.mkdtemp(prefix="fdl-fabric-runs-")
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["FDL_FABRIC_RUNS_DIR"] = os.path.join(os.environ["FDL_FABRIC_RUNS_DIR"],
                                                     os.environ["PYTEST_XDIST_WORKER"])
    os.makedirs(os.environ["FDL_FABRIC_RUNS_DIR"], mode=0o700, exist_ok=True)


@pytest.fixture
def probe() -> str:
    """Path of the test rank program."""
    from labutil import PROBE  # imported late: fdl_fabric.testing loads as a plugin first

    return PROBE


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture(autouse=True)
def _no_inherited_verbosity(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("FLODL_VERBOSITY", "FLODL_NET_TIMEOUT_SCALE", "FLODL_INTERNAL_PREBUILD_PER_HOST",
                # the run registry's place: the default, /tmp/fdl-fabric-<uid> (the lab's)
                "FDL_FABRIC_STATE_DIR", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(key, raising=False)
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")


@pytest.fixture
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's run records folder (`fdl_fabric.runs`): the launchers, supervisors and
    followers it starts inherit it."""
    folder = tmp_path / "runs"
    monkeypatch.setenv("FDL_FABRIC_RUNS_DIR", str(folder))
    return folder


@pytest.fixture
def umask_0() -> Iterator[None]:
    """The loosest umask there is: modes must come from the code, not from the umask."""
    previous = os.umask(0)
    try:
        yield
    finally:
        os.umask(previous)


@pytest.fixture
def steady(tmp_path: Path) -> Path:
    """A rank that prints a numbered line every TICK seconds COUNT times, then ``done rN``
    (`labutil.STEADY`)."""
    from labutil import STEADY

    path = tmp_path / "steady.py"
    path.write_text(STEADY)
    return path


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[Any]]]:
    """Processes a test started itself (launchers, leftovers, decoys); killed by pid at teardown."""
    procs: list[subprocess.Popen[Any]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)
