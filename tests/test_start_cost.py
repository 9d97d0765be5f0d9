"""A command's start pays only for what it uses (issue 35, the small launch): the launcher
starts before anything reaches a host, so each module it imports and does not need is
time on every launch's critical path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import fdl_fabric.preflight as preflight

ROOT = Path(__file__).resolve().parents[1]

#: What only other commands, or other launches, need: the prebuild-check command (its
#: modules import the table's renderer and psutil's probes) and the sync's matcher.
NOT_FOR_A_PLAIN_LAUNCH = ("fdl_fabric.preflight.command", "fdl_fabric.preflight.run",
                          "pathspec")


def test_every_name_of_the_preflight_package_is_found_where_it_says() -> None:
    assert set(preflight.__all__) == set(preflight._HOME)
    for name, home in preflight._HOME.items():
        module = __import__(f"fdl_fabric.preflight.{home}", fromlist=[name])
        assert getattr(preflight, name) is getattr(module, name)


def test_a_plain_launch_loads_neither_the_prebuild_check_nor_the_sync_matcher(
        tmp_path: Path) -> None:
    program = (
        "import sys\n"
        "from fdl_fabric.api import launch\n"
        "r = launch(None, [sys.executable, '-c', 'pass'], hosts='localhost',\n"
        "           nproc_per_node=2, quiet=True)\n"
        f"loaded = [m for m in {NOT_FOR_A_PLAIN_LAUNCH!r} if m in sys.modules]\n"
        "print('exit', r.exit_code, 'loaded', loaded)\n")
    done = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "exit 0 loaded []" in done.stdout, done.stdout + done.stderr
