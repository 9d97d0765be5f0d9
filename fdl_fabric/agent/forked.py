"""A helper process forked by the agent, with one pipe to it: the stack collector
(`stacks`) writes its report up the pipe, the watchdog (`watchdog`) reads the agent's
notes down it. The agent is single-threaded, so forking is safe.

The child closes every descriptor it inherited but the standard streams and its pipe:
a copy of a rank's socket (`cohortrelay`) held by a stack collector would keep that
connection open after the agent closed it, and the rank would not see its end.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Optional, Set, Tuple

#: What the child runs, given the pipe's read and write ends; it returns, or raises.
Child = Callable[[int, int], None]


def fork_with_pipe(child: Child) -> Optional[Tuple[int, int, int]]:
    """(pid, read end, write end) in the agent, each end for the agent to keep or close;
    None when the pipe or the fork cannot be made (the agent carries on without the
    helper). The child runs ``child(read_fd, write_fd)`` and exits 0, or 1 if it raised:
    it never returns into the agent's code."""
    try:
        read_fd, write_fd = os.pipe()  # neither end is inherited by what the ranks exec
    except OSError:
        return None
    try:
        pid = os.fork()
    except OSError:
        os.close(read_fd)
        os.close(write_fd)
        return None
    if pid == 0:  # pragma: no cover - the helper; tested through its effects
        code = 0
        try:
            _close_inherited({read_fd, write_fd})
            child(read_fd, write_fd)
        except BaseException:
            code = 1
        os._exit(code)
    return pid, read_fd, write_fd


def _close_inherited(keep: Set[int]) -> None:  # pragma: no cover - runs in the helper
    """Close every descriptor above 2 but ``keep``."""
    try:
        found = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: the usual range
        found = list(range(3, 1024))
    for fd in found:
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):  # listdir's own, already closed
                os.close(fd)
