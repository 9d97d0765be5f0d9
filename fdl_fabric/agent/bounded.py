"""A command the agent waits for under a bound, staying heard: nvidia-smi, the ranks'
interpreter asked for its versions or a matmul. Standard library only.

The one wait-and-kill rule: ``communicate`` in steps of `BEAT_EVERY` seconds (nothing
read is lost between them), a heartbeat between steps, and at the bound the command's
whole process group KILLed and reaped, its pipes closed unread (a grandchild that left
the group may hold them open, and must not keep the agent).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Callable, Optional, Tuple

#: Seconds between heartbeats while a command runs.
BEAT_EVERY = 0.5

Beat = Callable[[float], None]


def communicate(proc: subprocess.Popen[bytes], timeout: float,
                beat: Optional[Beat] = None) -> Optional[Tuple[bytes, Optional[bytes]]]:
    """``(stdout, stderr)`` once ``proc`` (started with ``start_new_session=True``) ends;
    None when it did not within ``timeout`` (it and its group were then killed)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            out, err = proc.communicate(timeout=max(0.0, min(BEAT_EVERY, left)))
            return out, err
        except subprocess.TimeoutExpired:
            if left <= BEAT_EVERY:
                kill_group(proc)
                return None
            if beat is not None:
                beat(0.0)


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """KILL the command's process group, reap it, close its pipes without reading them."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
