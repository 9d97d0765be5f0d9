"""A helper process forked by the agent, with one pipe to it: the stack collector
(`stacks`) writes its report up the pipe, the watchdog (`watchdog`) reads the agent's
notes down it. The agent is single-threaded, so forking is safe.
"""

from __future__ import annotations

import os
from typing import Callable, Optional, Tuple

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
            child(read_fd, write_fd)
        except BaseException:
            code = 1
        os._exit(code)
    return pid, read_fd, write_fd
