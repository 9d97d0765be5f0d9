"""The rank wrapper, run by a real bash with real signals (no SSH needed).

These pin the behaviour remote ranks rely on: stdin EOF stops the rank and its
children, TERM escalates to KILL after the grace, control lines reach the
whole process group, and a signal death is reported as a signal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fdl_fabric import commands
from fdl_fabric.spawn import ExitInfo


def _start(argv: list[str], *, grace: float = 1.0, cwd: str = "/",
           preamble: str | None = None) -> subprocess.Popen[bytes]:
    wrapper = commands.rank_wrapper(cwd=cwd, argv=argv, kill_grace=grace,
                                    read_preamble=preamble is not None)
    proc = subprocess.Popen(["bash", "-c", wrapper], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if preamble is not None:
        assert proc.stdin is not None
        proc.stdin.write(preamble.encode())
        proc.stdin.flush()
    return proc


def _rank_pid(proc: subprocess.Popen[bytes]) -> int:
    assert proc.stderr is not None
    line = proc.stderr.readline().decode()
    assert line.startswith(commands.PID_MARKER), line
    return int(line[len(commands.PID_MARKER):])


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_wrapper_exits_with_the_rank_status() -> None:
    proc = _start(["sh", "-c", "exit 3"])
    assert proc.wait(10) == 3
    assert ExitInfo.from_status(3).describe() == "status 3"


def test_a_rank_killed_by_a_signal_is_reported_as_that_signal() -> None:
    proc = _start(["sleep", "30"])
    os.kill(_rank_pid(proc), signal.SIGKILL)
    status = proc.wait(10)
    assert ExitInfo.from_status(status).describe() == "signal 9"


def test_rank_leads_its_own_session_and_process_group() -> None:
    proc = _start(["sleep", "30"])
    pid = _rank_pid(proc)
    deadline = time.monotonic() + 2
    while os.getsid(pid) != pid and time.monotonic() < deadline:
        time.sleep(0.01)  # the marker is printed just before setsid runs
    assert os.getpgid(pid) == pid and os.getsid(pid) == pid
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(10)


def test_stdin_eof_stops_the_rank_and_its_grandchildren() -> None:
    proc = _start([sys.executable, "-c",
                   "import subprocess,time; p=subprocess.Popen(['sleep','300']); "
                   "print(p.pid, flush=True); time.sleep(300)"])
    pid = _rank_pid(proc)
    assert proc.stdout is not None
    grandchild = int(proc.stdout.readline())
    assert proc.stdin is not None
    proc.stdin.close()
    assert ExitInfo.from_status(proc.wait(10)).describe() == "signal 15"
    assert _gone(pid, 2) and _gone(grandchild, 2)


def test_a_rank_ignoring_term_is_killed_after_the_grace() -> None:
    proc = _start([sys.executable, "-c",
                   "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "print('ready', flush=True); time.sleep(300)"], grace=1.0)
    _rank_pid(proc)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    t0 = time.monotonic()
    assert proc.stdin is not None
    proc.stdin.close()
    status = proc.wait(10)
    elapsed = time.monotonic() - t0
    assert ExitInfo.from_status(status).describe() == "signal 9"
    assert 0.9 <= elapsed < 2.5


@pytest.mark.parametrize("sig", ["HUP", "TERM", "INT"])
def test_hangup_terminate_or_interrupt_of_the_wrapper_stops_the_rank(sig: str) -> None:
    proc = _start(["sleep", "30"])
    pid = _rank_pid(proc)
    proc.send_signal(getattr(signal, f"SIG{sig}"))
    assert ExitInfo.from_status(proc.wait(10)).describe() == "signal 15"
    assert _gone(pid, 2)


@pytest.mark.parametrize("how", ["signal", "control-line"])
def test_usr1_is_forwarded_to_the_rank_group(how: str, tmp_path: Path) -> None:
    marker = tmp_path / "usr1"
    proc = _start([sys.executable, "-c",
                   "import signal,sys,time,pathlib\n"
                   f"signal.signal(signal.SIGUSR1, lambda *a: (pathlib.Path({str(marker)!r})"
                   ".write_text('x'), sys.exit(0)))\n"
                   "print('ready', flush=True)\ntime.sleep(30)"])
    _rank_pid(proc)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    assert proc.stdin is not None
    if how == "signal":
        proc.send_signal(signal.SIGUSR1)
    else:
        proc.stdin.write(b"USR1\n")
        proc.stdin.flush()
    assert proc.wait(10) == 0
    assert marker.read_text() == "x"


def test_kill_control_line_kills_at_once() -> None:
    proc = _start([sys.executable, "-c",
                   "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "time.sleep(300)"], grace=30)
    _rank_pid(proc)
    assert proc.stdin is not None
    proc.stdin.write(b"KILL\n")
    proc.stdin.flush()
    assert ExitInfo.from_status(proc.wait(5)).describe() == "signal 9"


def test_missing_working_directory_fails_before_the_rank_starts(tmp_path: Path) -> None:
    proc = _start(["true"], cwd=str(tmp_path / "nope"))
    assert proc.wait(10) == commands.EXIT_BAD_CWD
    assert proc.stderr is not None
    assert b"nope" in proc.stderr.read()


def test_remote_preamble_puts_envelope_and_env_in_environ_not_argv(tmp_path: Path) -> None:
    out = tmp_path / "env"
    proc = _start([sys.executable, "-c",
                   "import os,sys,pathlib; pathlib.Path(sys.argv[1]).write_text("
                   "os.environ['FLODL_INTERNAL_CLUSTER_JSON'] + '|' + os.environ['SECRET'] + '|' "
                   "+ open('/proc/self/cmdline').read())", str(out)],
                  preamble=commands.stdin_preamble("c0ffee", {"SECRET": "hunter2 'x'"}))
    assert proc.wait(10) == 0, proc.stderr.read() if proc.stderr else ""
    envelope, secret, cmdline = out.read_text().split("|", 2)
    assert envelope == "c0ffee" and secret == "hunter2 'x'"
    assert "c0ffee" not in cmdline and "hunter2" not in cmdline
    wrapper_cmdline = " ".join(psutil.Process().cmdline())
    assert "hunter2" not in wrapper_cmdline


def test_a_missing_preamble_is_a_clear_error() -> None:
    proc = _start(["true"], preamble="")
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(10) == commands.EXIT_NO_PREAMBLE
