"""The versions a host's ranks see are asked of their interpreter once, then kept while
nothing they rest on changed (`agent.versioncache`): real venvs, real interpreters,
counted by a wrapper that notes each start."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any, Optional

import pytest
from venvutil import install, make_venv

from fdl_fabric.agent import registry, versioncache
from fdl_fabric.agent.versions import gather


@pytest.fixture(autouse=True)
def _private_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(registry.ENV_STATE_DIR, str(tmp_path / "state"))
    monkeypatch.setattr(registry._Choice, "folder", None)


def _counted(tmp_path: Path, packages: Optional[dict[str, str]] = None) -> tuple[Path, Path]:
    """A venv, and a wrapper of its python that notes every start in a file."""
    python = make_venv(tmp_path / "v", packages or {})
    starts = tmp_path / "starts"
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\necho x >> "{starts}"\nexec "{python}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, starts


def _ask(python: Path, cwd: Path, packages: Optional[list[str]] = None,
         **extra: Any) -> dict[str, Any]:
    return gather({"python": str(python), "cwd": str(cwd), "packages": packages,
                   "timeout": 30, **extra})


def _starts(counter: Path) -> int:
    return len(counter.read_text().split()) if counter.exists() else 0


def test_a_second_launch_starts_no_interpreter_and_gets_the_same_answer(
        tmp_path: Path) -> None:
    python, starts = _counted(tmp_path, {"fdl-probe-pkg": "1.2.3"})
    first = _ask(python, tmp_path, ["fdl-probe-pkg"])
    second = _ask(python, tmp_path, ["fdl-probe-pkg"])
    assert first == second and first["packages"] == {"fdl-probe-pkg": "1.2.3"}
    assert versioncache.PATHS not in first, "the interpreter's sys.path is not sent"
    assert _starts(starts) == 1


def test_installing_a_package_is_seen_by_the_next_launch(tmp_path: Path) -> None:
    python, starts = _counted(tmp_path, {"fdl-probe-pkg": "1.0"})
    assert _ask(python, tmp_path, ["fdl-probe-pkg"])["packages"] == {"fdl-probe-pkg": "1.0"}
    site = next((tmp_path / "v").glob("lib/python*/site-packages"))
    for old in site.glob("fdl_probe_pkg-1.0.dist-info"):  # pip's upgrade: old out, new in
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    install(tmp_path / "v", "fdl-probe-pkg", "2.0")
    assert _ask(python, tmp_path, ["fdl-probe-pkg"])["packages"] == {"fdl-probe-pkg": "2.0"}
    assert _starts(starts) == 2


def test_a_changed_interpreter_is_asked_again(tmp_path: Path) -> None:
    python, starts = _counted(tmp_path)
    _ask(python, tmp_path)
    text = python.read_text()
    os.utime(python, ns=(time.time_ns(), time.time_ns() + 10**9))
    python.write_text(text)
    _ask(python, tmp_path)
    assert _starts(starts) == 2


def test_other_variables_or_packages_are_another_question(tmp_path: Path) -> None:
    python, starts = _counted(tmp_path)
    _ask(python, tmp_path, ["a"])
    _ask(python, tmp_path, ["a", "b"])
    _ask(python, tmp_path, ["a"], env={"PYTHONPATH": str(tmp_path)})
    _ask(python, tmp_path, ["a"], env={"MY_SECRET": "hunter2-value"})
    _ask(python, tmp_path, ["a"], env={"MY_SECRET": "hunter2-value"})
    assert _starts(starts) == 4


def test_kept_answers_are_private_and_hold_no_variable(tmp_path: Path) -> None:
    python, _ = _counted(tmp_path)
    _ask(python, tmp_path, env={"MY_SECRET": "hunter2-value"})
    kept = list((tmp_path / "state" / "cache").iterdir())
    assert len(kept) == 1
    assert stat.S_IMODE(kept[0].stat().st_mode) == 0o600
    assert stat.S_IMODE(kept[0].parent.stat().st_mode) == 0o700
    assert "hunter2" not in kept[0].read_text()
    assert json.loads(kept[0].read_text())["answer"]["python"]


_CUDA_TORCH = {
    "torch/version.py": "cuda = '12.4'\n",
    "torch/__init__.py": "from . import version, cuda\n",
    "torch/cuda/__init__.py": "from . import nccl\ndef is_available():\n    return {avail}\n",
    "torch/cuda/nccl.py": "def version():\n    return (2, 21, 5)\n",
}


def test_a_gpu_build_that_sees_no_gpu_is_asked_again(tmp_path: Path) -> None:
    python, starts = _counted(tmp_path)
    install(tmp_path / "v", "torch", "2.13.0+cu124",
            {k: v.format(avail=False) for k, v in _CUDA_TORCH.items()})
    assert _ask(python, tmp_path)["cuda_available"] is False
    _ask(python, tmp_path)
    assert _starts(starts) == 2, "no GPU may be a passing state: not kept"


def test_a_gpu_build_that_sees_its_gpu_is_kept(tmp_path: Path) -> None:
    python, starts = _counted(tmp_path)
    install(tmp_path / "v", "torch", "2.13.0+cu124",
            {k: v.format(avail=True) for k, v in _CUDA_TORCH.items()})
    assert _ask(python, tmp_path)["nccl"] == "2.21.5"
    assert _ask(python, tmp_path)["nccl"] == "2.21.5"
    assert _starts(starts) == 1


def test_an_error_is_never_kept(tmp_path: Path) -> None:
    broken = tmp_path / "python"
    broken.write_text('#!/bin/sh\necho x >> "$0.starts"\necho "no module named encodings" >&2\n'
                      'exit 1\n')
    broken.chmod(0o755)
    assert "exited 1" in _ask(broken, tmp_path)["error"]
    assert "exited 1" in _ask(broken, tmp_path)["error"]
    assert _starts(tmp_path / "python.starts") == 2


def test_an_answer_older_than_a_day_is_asked_again_and_forgotten(tmp_path: Path) -> None:
    python, starts = _counted(tmp_path)
    _ask(python, tmp_path)
    kept = next((tmp_path / "state" / "cache").iterdir())
    body = json.loads(kept.read_text())
    body["made"] -= versioncache.MAX_AGE_S + 1
    kept.write_text(json.dumps(body))
    _ask(python, tmp_path)
    assert _starts(starts) == 2
    stale = kept.with_name("versions-" + "0" * 64 + ".json")
    stale.write_text("{}")
    old = time.time() - versioncache.MAX_AGE_S - 5
    os.utime(stale, (old, old))
    _ask(python, tmp_path, ["another"])
    assert not stale.exists()
