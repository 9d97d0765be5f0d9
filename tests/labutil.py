"""The integration tests' view of `fdl_fabric.testing.launches`: launches go through
``inv launch`` from this checkout (the user's entry point), with the test programs at hand.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Optional

from fdl_fabric.testing.launches import LiveLaunch as _LiveLaunch
from fdl_fabric.testing.launches import (  # noqa: F401  (re-exported for the tests)
    LiveProcess,
    PathLike,
    alive,
    dumps,
    processes_of_run,
    wait_for,
)
from fdl_fabric.testing.launches import launch_argv as _launch_argv
from fdl_fabric.testing.launches import run_launch as _run_launch

ROOT = Path(__file__).resolve().parent.parent
PROGS = ROOT / "tests" / "progs"
#: The test rank program: prints, sleeps, dumps its env, exits as told.
PROBE = str(PROGS / "rankprobe.py")
#: A rank that records every signal it receives.
SIGPROBE = str(PROGS / "sigprobe.py")
#: ``inv launch`` of this checkout's tasks.py.
INV_LAUNCH: tuple[str, ...] = (sys.executable, "-m", "invoke", "--search-root", str(ROOT),
                               "launch")


def gloo_run_completed(line: str, world: int) -> bool:
    """The verdict of a gloo DDP run that delivered its work: every rank exited 0, or
    one aborted in torch's own interpreter teardown after announcing its clean exit
    ("terminate called without an active exception", signal 6: seen in 7 of some 580
    lab runs, before and after issue 35), which the launcher tolerates and says so."""
    return line == f"cluster launcher: run completed — all {world} ranks exited 0" or (
        line.startswith("cluster launcher: run completed; 1 child exit(s) in the teardown "
                        "window were tolerated"))


def launch_argv(cluster: PathLike, *args: str) -> list[str]:
    return _launch_argv(cluster, *args, command=INV_LAUNCH)


def run_launch(cluster: PathLike, *args: str, timeout: float = 60,
               env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess[str]:
    return _run_launch(cluster, *args, timeout=timeout, env=env, cwd=ROOT, command=INV_LAUNCH)


class LiveLaunch(_LiveLaunch):
    """``inv launch`` running, its lines collected as they arrive."""

    def __init__(self, cluster: PathLike, *args: str,
                 env: Optional[dict[str, str]] = None) -> None:
        super().__init__(cluster, *args, env=env, cwd=ROOT, command=INV_LAUNCH)


#: A rank: ``steady.py COUNT TICK [CODE | fail-first]`` prints ``rN line I`` every TICK
#: seconds COUNT times, then ``done rN``, and exits CODE (0); ``fail-first`` fails
#: attempt 0 at once instead (exit 3), for restarts.
STEADY = """\
import os, sys, time
count, tick = int(sys.argv[1]), float(sys.argv[2])
last = sys.argv[3] if len(sys.argv) > 3 else "0"
rank = os.environ["RANK"]
if last == "fail-first" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    print(f"r{rank} fails on attempt 0", flush=True)
    sys.exit(3)
for i in range(count):
    print(f"r{rank} line {i}", flush=True)
    time.sleep(tick)
print(f"done r{rank}", flush=True)
sys.exit(0 if last == "fail-first" else int(last))
"""
