"""Starting one rank: its own session and process group, stdin /dev/null, two pipes.

The agent spawns ranks itself rather than through `subprocess`: it reaps every child with
one ``waitpid(-1)`` loop (ranks, and the daemons a rank leaves behind, which the agent
adopts as a child subreaper), and `subprocess.Popen` would race it for exit statuses.

A rank is started by ``posix_spawn`` (the C library's ``vfork``): the child runs no
Python between the fork and the exec. The earlier ``fork`` ran the agent's Python in the
child (its pages copied as they were touched), 2 ms a rank on an idle host and 10-20 ms
on a loaded one, one rank after the other. An exec failure (not found, not executable)
is still an error at spawn time, by its errno. The working directory is entered by the
agent itself around the spawn (``posix_spawn`` has no chdir), which is safe because the
agent is one thread; a directory it cannot enter is named as such.

Secrets travel in the environment (readable only by the owner and root), never in argv,
and argv is passed to ``execve`` as a list: no shell, no quoting, no length limit of
ours (the kernel's ``ARG_MAX`` still applies).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
from typing import Dict, List, Sequence, Tuple, Union

#: Signals whose disposition a Python parent changes and a child must not inherit.
_RESET_SIGNALS = ("SIGPIPE", "SIGXFSZ", "SIGXFZ", "SIGINT", "SIGTERM", "SIGHUP", "SIGCHLD",
                  "SIGUSR1", "SIGUSR2", "SIGQUIT")


class SpawnError(Exception):
    """A rank could not be started; the message says which step failed and why."""


class Child:
    """A started rank: its pid (also its process group and session id) and its pipes.
    A plain class: `dataclasses` costs every agent's start 5 ms of imports."""

    __slots__ = ("pid", "start", "stdout", "stderr")

    def __init__(self, pid: int, start: int, stdout: int, stderr: int) -> None:
        self.pid, self.start, self.stdout, self.stderr = pid, start, stdout, stderr


def spawn(argv: Sequence[str], env: Dict[str, str], cwd: str) -> Child:
    """Start ``argv`` in ``cwd`` with exactly ``env``, in a new session."""
    if not argv:
        raise SpawnError("the command is empty")
    args: List[bytes] = [os.fsencode(a) for a in argv]
    envb = {os.fsencode(k): os.fsencode(v) for k, v in env.items()}
    cwd_b = os.fsencode(os.path.expanduser(cwd))
    opened: List[int] = []
    try:
        for pair in (os.pipe(), os.pipe()):  # close-on-exec: only their dup2 copies pass
            opened += pair
    except OSError as exc:
        for fd in opened:
            os.close(fd)
        raise SpawnError(describe(exc.errno or 0, "pipe", argv[0], cwd)) from None
    out_r, out_w, err_r, err_w = opened
    try:
        pid = _spawn_in(cwd_b, args, envb, out_w, err_w, argv[0], cwd)
    except SpawnError:
        os.close(out_r)
        os.close(err_r)
        raise
    finally:
        os.close(out_w)
        os.close(err_w)
    return Child(pid=pid, start=_start_of(pid), stdout=out_r, stderr=err_r)


def _spawn_in(cwd: bytes, args: List[bytes], env: Dict[bytes, bytes], out_w: int,
              err_w: int, program: str, cwd_text: str) -> int:
    """``posix_spawn`` with ``cwd`` as the working directory, entered here and left at
    once; the program is looked up on ``env``'s PATH, as ``execvpe`` does."""
    here = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            os.chdir(cwd)
        except OSError as exc:
            raise SpawnError(describe(exc.errno or 0, "cd", program, cwd_text)) from None
        path = _lookup(args[0], env)
        if isinstance(path, int):
            raise SpawnError(describe(path, "exec", program, cwd_text))
        _no_inheritance()
        try:
            return os.posix_spawn(
                path, args, env, setsid=True, setsigmask=(), setsigdef=_reset_signals(),
                file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                              (os.POSIX_SPAWN_DUP2, out_w, 1),
                              (os.POSIX_SPAWN_DUP2, err_w, 2)])
        except OSError as exc:
            code = exc.errno or 0
            step = "fork" if code in (errno.EAGAIN, errno.ENOMEM) else "exec"
            raise SpawnError(describe(code, step, program, cwd_text)) from None
    finally:
        os.fchdir(here)
        os.close(here)


def _lookup(name: bytes, env: Dict[bytes, bytes]) -> Union[bytes, int]:
    """The file ``execvpe`` would run for ``name`` (a name with a slash is itself), or
    the errno it would fail with: EACCES when a match is not executable, else ENOENT."""
    if b"/" in name:
        return name
    denied = False
    for folder in os.get_exec_path(env):  # type: ignore[arg-type]
        path = os.path.join(os.fsencode(folder), name)
        if os.path.isfile(path):
            if os.access(path, os.X_OK):
                return path
            denied = True
    return errno.EACCES if denied else errno.ENOENT


def _reset_signals() -> List[int]:
    return [getattr(signal, n) for n in _RESET_SIGNALS if hasattr(signal, n)]


def _no_inheritance() -> None:
    """Every descriptor from 3 up is close-on-exec: a rank inherits nothing of the
    agent's, even one the agent itself inherited without the flag (Python opens its own
    with it)."""
    try:
        fds = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        if fd >= 3:
            with contextlib.suppress(OSError):
                os.set_inheritable(fd, False)


#: What a failed step and its errno mean, for `describe` ({program}, {reason}, {where}).
_WHY: Dict[Tuple[str, int], str] = {
    ("fork", errno.EAGAIN): "{program}: cannot fork: the process limit (ulimit -u) was "
                            "reached ({reason})",
    ("fork", errno.ENOMEM): "{program}: cannot fork: out of memory ({reason})",
    ("exec", errno.ENOMEM): "{program}: cannot exec: out of memory ({reason})",
    ("pipe", errno.EMFILE): "{program}: cannot open its output pipes: this agent's open-file "
                            "limit (ulimit -n) was reached ({reason})",
    ("pipe", errno.ENFILE): "{program}: cannot open its output pipes: the system's open-file "
                            "limit (fs.file-max) was reached ({reason})",
    ("exec", errno.ENOENT): "{program}: not found{where}",
    ("exec", errno.EACCES): "{program}: not executable (permission denied)",
    ("exec", errno.ENOEXEC): "{program}: not an executable format (a script without a #! "
                             "line?)",
    ("exec", errno.EAGAIN): "{program}: cannot exec: the process limit (ulimit -u) was "
                            "reached ({reason})",
    ("exec", errno.E2BIG): "{program}: argument list too long for this host's kernel "
                           "({reason})",
}


def describe(code: int, step: str, program: str, cwd: str) -> str:
    """What failed while starting a rank, by the step that failed (``pipe``, ``cd``,
    ``fork``, ``exec``) and its errno: a limit is named as the
    limit it is (``ulimit -u``, ``ulimit -n``), a program as not found or not executable."""
    reason = os.strerror(code) if code else "unknown error"
    if step == "cd":
        return f"cannot enter the working directory {cwd}: {reason}"
    text = _WHY.get((step, code), "{program}: {step} failed: {reason}")
    return text.format(program=program, step=step, reason=reason,
                       where="" if "/" in program else " on PATH")


def problem(exc: BaseException) -> str:
    """Why a rank did not start, labelled by what failed: a `SpawnError` says it (`spawn`
    raises nothing else); any other error came from making its error file ready
    (TORCHELASTIC_ERROR_FILE, under the run registry), without which it is not started."""
    if isinstance(exc, SpawnError):
        return str(exc)
    reason = getattr(exc, "strerror", None) or str(exc)
    where = getattr(exc, "filename", None)
    return f"cannot prepare its error file{' ' + str(where) if where else ''}: {reason}"


def _start_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


