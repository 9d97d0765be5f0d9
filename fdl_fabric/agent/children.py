"""Starting one rank: its own session and process group, stdin /dev/null, two pipes.

The agent forks and execs ranks itself rather than through `subprocess`: it reaps every
child with one ``waitpid(-1)`` loop (ranks, and the daemons a rank leaves behind, which
the agent adopts as a child subreaper), and `subprocess.Popen` would race it for exit
statuses. The child reports an exec failure (errno and step) through a close-on-exec
pipe, so a missing program is an error at spawn time, as with `subprocess`.

Secrets travel in the environment (readable only by the owner and root), never in argv,
and argv is passed to ``execve`` as a list: no shell, no quoting, no length limit of
ours (the kernel's ``ARG_MAX`` still applies).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
from typing import Dict, List, Sequence, Tuple

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
    """Fork and exec ``argv`` in ``cwd`` with exactly ``env``, in a new session."""
    if not argv:
        raise SpawnError("the command is empty")
    args: List[bytes] = [os.fsencode(a) for a in argv]
    envb = {os.fsencode(k): os.fsencode(v) for k, v in env.items()}
    cwd_b = os.fsencode(os.path.expanduser(cwd))
    opened: List[int] = []
    try:
        for pair in (os.pipe(), os.pipe(), os.pipe2(os.O_CLOEXEC)):
            opened += pair
        out_r, out_w, err_r, err_w, status_r, status_w = opened
        pid = os.fork()
    except OSError as exc:  # nothing started: say which limit stopped it
        for fd in opened:
            os.close(fd)
        raise SpawnError(describe(exc.errno or 0, "fork" if len(opened) == 6 else "pipe",
                                  argv[0], cwd)) from None
    if pid == 0:  # pragma: no cover - the child; observed through its effects
        _exec_child(args, envb, cwd_b, (out_w, err_w, status_w))
    os.close(out_w)
    os.close(err_w)
    os.close(status_w)
    report = _read_all(status_r)
    if report:
        os.close(out_r)
        os.close(err_r)
        _reap(pid)
        code, _, step = report.decode("ascii", "replace").partition(":")
        raise SpawnError(describe(int(code or 0), step, argv[0], cwd))
    started = _start_of(pid)
    return Child(pid=pid, start=started, stdout=out_r, stderr=err_r)


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
    """What failed while starting a rank, by the step that failed (``pipe``, ``fork``,
    ``setsid``, ``cd``, ``redirect``, ``exec``) and its errno: a limit is named as the
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


def _exec_child(args: List[bytes], envb: Dict[bytes, bytes], cwd: bytes,
                pipes: Tuple[int, int, int]) -> None:  # pragma: no cover - runs in the child
    """The child's side: its own session, ``cwd``, stdin /dev/null, the pipes, default
    signals, then exec; a failed step is written to the status pipe as ``errno:step``."""
    out_w, err_w, status_w = pipes
    step = "setsid"
    try:
        os.setsid()
        step = "cd"
        os.chdir(cwd)
        step = "redirect"
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        _close_fds_except(status_w)
        for name in _RESET_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        step = "exec"
        os.execvpe(args[0], args, envb)  # type: ignore[arg-type]
    except OSError as exc:
        os.write(status_w, f"{exc.errno or 0}:{step}".encode())
    except BaseException:
        os.write(status_w, b"0:exec")
    os._exit(127)


def _read_all(fd: int) -> bytes:
    """Everything until EOF on a blocking pipe (the child's exec report), then closed."""
    report = b""
    while True:
        try:
            chunk = os.read(fd, 256)
        except InterruptedError:
            continue
        if not chunk:
            break
        report += chunk
    os.close(fd)
    return report


def _reap(pid: int) -> None:
    while True:
        try:
            os.waitpid(pid, 0)
            return
        except InterruptedError:
            continue
        except ChildProcessError:
            return


def _start_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def _close_fds_except(keep: int) -> None:  # pragma: no cover - runs in the child
    """Close every fd from 3 up but ``keep``: a rank inherits nothing of the agent's."""
    try:
        fds = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 1024))
    for fd in fds:
        if fd >= 3 and fd != keep:
            with contextlib.suppress(OSError):
                os.close(fd)
