"""Issue 29, item 6, on a real terminal: Ctrl-C shows where each rank was. The ranks'
``KeyboardInterrupt`` tracebacks appear once per distinct traceback, with the ranks that
printed it, above the summary; the verdict is still the last line, within the grace;
``--log-dir`` keeps every line.

Typed into bash in an 80-column tmux pane (`test_narrow_terminal_lab.Pane`), Ctrl-C sent
with ``tmux send-keys``, the screen read with ``capture-pane``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_narrow_terminal_lab import Pane, cluster, ctrl_c, pane  # noqa: F401

from labutil import wait_for

pytestmark = pytest.mark.lab

#: Two ranks waiting in the same line; rank 1 of a 3-rank job waits somewhere else.
WAITER = """import os, time
print("ready", os.environ["RANK"], flush=True)
def elsewhere():
    time.sleep(60)
if os.environ["RANK"] == "2":
    elsewhere()
time.sleep(60)
"""


@pytest.mark.timeout(90)
def test_ctrl_c_shows_each_distinct_traceback_once_with_its_ranks_above_the_verdict(
        pane: Pane, tmp_path: Path) -> None:  # noqa: F811
    (tmp_path / "wait.py").write_text(WAITER)
    job = cluster(tmp_path, "python3 -u wait.py")
    job.write_text(job.read_text().replace("nproc: 2", "nproc: 3"))
    logs = tmp_path / "logs"
    done = pane.start("--cluster", str(job), "--log-dir", "logs")  # short: never wrapped
    wait_for(lambda: sum("] ready " in line for line in pane.lines()) == 3, 30,
             "every rank ready")
    shown = ctrl_c(pane, done)  # 130, the verdict last and on one line, wrapped cleanly
    text = "\n".join(shown)
    head = shown.index("cluster launcher: where the ranks were when interrupted:")
    assert head < next(i for i, line in enumerate(shown) if line.startswith("rank  host"))
    groups = [line for line in shown[head + 1:] if line.startswith("  rank")]
    assert groups == ["  rank 2 (localhost):", "  ranks 0, 1 (localhost):"], text
    assert text.count("KeyboardInterrupt") == 2, text  # one per distinct traceback
    assert "in elsewhere" in text and "time.sleep(60)" in text
    assert not any(line.startswith("[localhost:cpu:r") and "Traceback" in line
                   for line in shown), text
    # --log-dir keeps each rank's own traceback.
    (run,) = [p for p in logs.iterdir() if not p.is_symlink()]
    for r in range(3):
        err = (run / "attempt_0" / f"r{r}" / "stderr.log").read_text()
        assert err.rstrip().endswith("KeyboardInterrupt"), err
