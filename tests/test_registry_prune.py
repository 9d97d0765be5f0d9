"""A killed agent leaves its ranks' error-file folders in the host's registry; the next
sweep removes those that hold nothing, and only those."""

from __future__ import annotations

import os
import time
from pathlib import Path

from fdl_fabric.agent import procs, registry


def _aged(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    for root, dirs, files in os.walk(path, topdown=False):
        for name in dirs + files:
            os.utime(os.path.join(root, name), (then, then), follow_symlinks=False)
        os.utime(root, (then, then))


def test_the_next_sweep_removes_run_folders_that_hold_nothing_and_keeps_the_rest(
        tmp_path: Path) -> None:
    reg = tmp_path / "reg"
    registry.make_private(str(reg))
    empty = reg / "20261205-000000-aaaa@node0" / "attempt_0" / "r1"
    empty.mkdir(parents=True)
    recorded = reg / "20261205-000000-bbbb@node0" / "attempt_0" / "r0"
    recorded.mkdir(parents=True)
    (reg / "20261205-000000-bbbb@node0.json").write_text("{}")
    with_file = reg / "20261205-000000-cccc@node0" / "attempt_0" / "r0"
    with_file.mkdir(parents=True)
    (with_file / "error.json").write_text("{}")
    for run in ("aaaa", "bbbb", "cccc"):
        _aged(reg / f"20261205-000000-{run}@node0", 3600)
    starting = reg / "20261205-000000-dddd@node0" / "attempt_0" / "r0"
    starting.mkdir(parents=True)  # just made: its agent is about to write its record

    report = procs.sweep(folder=str(reg), cluster="some-cluster")

    assert not (reg / "20261205-000000-aaaa@node0").exists(), report
    assert recorded.is_dir() and with_file.is_dir() and starting.is_dir()
    assert procs.prune_empty_run_folders(str(reg)) == 0, "a second sweep finds nothing"
