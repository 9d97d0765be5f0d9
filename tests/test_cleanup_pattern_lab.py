"""``cleanup --pattern`` is ``pkill -f`` by the operator's own request, but never for the
cleanup itself: its own command line holds the pattern, and so may the shell that runs it.
Lab hosts share this machine, so their agents see the caller's processes too."""

from __future__ import annotations

import secrets
import shlex
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from labutil import ROOT

pytestmark = pytest.mark.lab


def test_a_pattern_stops_the_matching_process_but_never_the_cleanup_or_its_shell(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = lab.write_cluster([lab.worker(h, nproc=1) for h in lab.hosts])
    marker = f"fdl-pattern-{secrets.token_hex(6)}"
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", marker],
                              start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        cleanup = shlex.join([sys.executable, "-m", "invoke", "--search-root", str(ROOT),
                              "cleanup", "--cluster", str(cluster), "--pattern", marker])
        # the shell's own command line holds the pattern: it must survive to say so
        done = subprocess.run(["bash", "-c", f"{cleanup}; echo the-shell-survived"],
                              capture_output=True, text=True, timeout=90, cwd=str(ROOT),
                              stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "the-shell-survived" in done.stdout, done.stderr
        assert "process(es) matching" in done.stderr
        assert victim.wait(10) is not None, "the matching process was stopped"
    finally:
        if victim.poll() is None:
            victim.kill()
        victim.wait()
    assert not psutil.pid_exists(victim.pid) or \
        psutil.Process(victim.pid).status() == psutil.STATUS_ZOMBIE
