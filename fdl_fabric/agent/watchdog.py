"""The leash's backstop: stops the host's ranks if the agent itself is SIGKILLed.

The agent stops its ranks when the launcher goes away (EOF on its input) or when it
is told to. A SIGKILLed agent can do nothing, so before it starts any rank it forks
this watchdog: a separate process, in its own session (a terminal's Ctrl-C does not
reach it), holding the read end of a pipe from the agent. The agent writes each
rank's process group (pid and start time) to the pipe as it starts it, and ``done``
when it exits normally. If the pipe reaches EOF without ``done``, the agent died:
the watchdog sends TERM to every process of the run on this host, KILL after the
kill grace, removes the run's record and the ranks' socket (and its own temp folder, an
``fdlr-`` one, when the registry's path was too long for a socket) and exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
from typing import List, Optional, Set, Tuple

from fdl_fabric.agent import procs
from fdl_fabric.agent.forked import fork_with_pipe


class Watchdog:
    """The agent's handle on its watchdog process."""

    def __init__(self, pid: int, fd: int) -> None:
        self.pid = pid
        self._fd = fd

    def watch(self, pgid: int, start: int) -> None:
        """Tell the watchdog about a rank's process group."""
        self._write(f"{pgid} {start}\n")

    def remove_at_end(self, socket_path: str) -> None:
        """The ranks' socket (`cohortrelay`): removed if the agent dies, with its folder
        when that is a temp folder of its own (``fdlr-``)."""
        if "\n" not in socket_path:
            self._write(f"rm {socket_path}\n")

    def done(self) -> None:
        """The agent is exiting normally: nothing is left for the watchdog to do."""
        self._write("done\n")
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1

    def _write(self, text: str) -> None:
        if self._fd < 0:
            return
        try:
            os.write(self._fd, text.encode("ascii"))
        except OSError:  # the watchdog is gone; the agent carries on without it
            self.close()


def start(run_id: str, host: str, kill_grace: float, attempt: int = 0) -> Optional[Watchdog]:
    """Fork the watchdog; None if it cannot be started (the agent still works). It stops
    this ``attempt``'s processes only, and removes the record only while it is its
    agent's: a later attempt of the run may share the host."""
    agent = os.getpid()
    forked = fork_with_pipe(lambda read_fd, write_fd: _watch(read_fd, write_fd, run_id, host,
                                                             kill_grace, (attempt, agent)))
    if forked is None:
        return None
    pid, read_fd, write_fd = forked
    os.close(read_fd)
    return Watchdog(pid, write_fd)


def _watch(read_fd: int, write_fd: int, run_id: str, host: str, kill_grace: float,
           whose: Tuple[int, int]) -> None:  # pragma: no cover - runs in the watchdog
    os.close(write_fd)
    _detach(read_fd)
    _run(read_fd, run_id, host, kill_grace, whose)


def _detach(keep: int) -> None:  # pragma: no cover - runs in the watchdog
    """Own session, no terminal signals, no inherited fds (sshd must not wait for us):
    `forked.fork_with_pipe` closed all but the pipe; the standard streams go here."""
    os.setsid()
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    if null > 2 and null != keep:
        os.close(null)


def _run(fd: int, run_id: str, host: str, kill_grace: float,
         whose: Tuple[int, int]) -> None:  # pragma: no cover
    groups: List[Tuple[int, int]] = []
    sockets: List[str] = []
    buf = b""
    while True:
        try:
            data = os.read(fd, 4096)
        except InterruptedError:
            continue
        if not data:
            break
        buf += data
        *lines, rest = buf.split(b"\n")
        buf = rest
        for line in lines:
            if line == b"done":
                return
            if line.startswith(b"rm "):
                sockets.append(os.fsdecode(line[3:]))
                continue
            parts = line.split()
            if len(parts) == 2:
                groups.append((int(parts[0]), int(parts[1])))

    def current() -> List[int]:
        found: Set[int] = set(procs.carriers(run_id, host, attempt))
        for pgid, start in groups:
            found.update(procs.group_members(pgid, start))
        return sorted(found)

    attempt, agent = whose
    procs.stop(current, kill_grace)
    procs.remove_record(run_id, host, agent=agent)
    for path in sockets:
        _remove_socket(path)


def _remove_socket(path: str) -> None:  # pragma: no cover - runs in the watchdog
    """A dead agent's socket, and its folder when that is an ``fdlr-`` temp folder (only
    ever emptied by this: `os.rmdir`)."""
    with contextlib.suppress(OSError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    folder = os.path.dirname(path)
    if os.path.basename(folder).startswith("fdlr-"):
        with contextlib.suppress(OSError):
            os.rmdir(folder)
