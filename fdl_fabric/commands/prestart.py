"""The detached supervisor's interpreter, started as early as the command line allows.

``--detach`` re-executes the launcher (`detach`, `supervise`). Its imports (invoke,
Fabric, paramiko, cryptography) cost as much again as the starting process's own, and
would come one after the other; so ``fdl-fabric``'s ``main`` starts the supervisor's
interpreter first thing when ``--detach`` is among its words (`prestart`), and the two
import side by side. The supervisor then waits for its options on stdin: a command that
ends without handing them over (bad input, ``--help``) closes that stdin, and the
supervisor ends having started nothing. Standard library only: it runs before the rest
(the console script, `fdl_fabric.__main__.main`, imports it first).
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

#: The environment variable naming the supervisor's ``ready`` pipe.
READY_FD = "FDL_FABRIC_READY_FD"


class Started:
    """A supervisor's interpreter and the read end of its ``ready`` pipe."""

    #: Set once a detached launch handed over and returned: the starting process has
    #: nothing left to tear down (`commands.cli.main` then ends it at once).
    handed_over = False

    def __init__(self, proc: subprocess.Popen[bytes], ready_fd: int) -> None:
        self.proc = proc
        self.ready_fd = ready_fd


_early: Optional[Started] = None


def spawn() -> Started:
    """Start ``python -m fdl_fabric.commands.supervise`` in a session of its own, its
    stdin, stdout and stderr piped to this process."""
    ready_r, ready_w = os.pipe()
    env = dict(os.environ)
    env[READY_FD] = str(ready_w)
    package_parent = str(Path(__file__).resolve().parents[2])  # the same code, installed or not
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent,
                                                    env.get("PYTHONPATH", "")) if p)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fdl_fabric.commands.supervise"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=(ready_w,), start_new_session=True, env=env)
    except BaseException:
        os.close(ready_r)
        raise
    finally:
        os.close(ready_w)
    return Started(proc, ready_r)


def prestart() -> None:
    """Start the supervisor now, for `take` later; released at exit if never taken."""
    global _early
    if _early is None:
        _early = spawn()
        atexit.register(_release)


def take() -> Optional[Started]:
    """The supervisor started early, once; None if none was."""
    global _early
    started, _early = _early, None
    return started


def _release() -> None:
    """Never handed its options: its stdin closed, it ends having started nothing."""
    started = take()
    if started is None:
        return
    for stream in (started.proc.stdin, started.proc.stdout, started.proc.stderr):
        if stream is not None:
            stream.close()
    os.close(started.ready_fd)
    try:
        started.proc.wait(10)
    except subprocess.TimeoutExpired:
        started.proc.kill()


def asked(argv: list[str]) -> bool:
    """``--detach`` among a command line's own words (not the rank's, after ``--``)."""
    words = argv[:argv.index("--")] if "--" in argv else argv
    return "--detach" in words


__all__ = ["READY_FD", "Started", "asked", "prestart", "spawn", "take"]
