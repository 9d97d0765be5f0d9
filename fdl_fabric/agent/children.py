"""Starting one rank: its own session and process group, stdin /dev/null, two pipes.

The agent spawns ranks itself rather than through `subprocess`: it reaps every child with
one ``waitpid(-1)`` loop (ranks, and the daemons a rank leaves behind, which the agent
adopts as a child subreaper), and `subprocess.Popen` would race it for exit statuses.

A rank is started by ``posix_spawn`` (the C library's ``vfork``): the child runs no
Python between the fork and the exec. A ``fork`` runs the agent's Python in the child
(its pages copied as they are touched): 2 ms a rank on an idle host and 10-20 ms on a
loaded one, one rank after the other. An exec failure (not found, not executable) is an
error at spawn time, by its errno. Where the C library's ``posix_spawn`` cannot start a
session or report a failed exec (glibc before 2.26), the agent forks and execs itself,
and the child reports a failed step through a close-on-exec pipe. With ``posix_spawn``,
the working directory is entered by the agent itself around the spawn (it has no
chdir), which is safe because the agent is one thread; a directory it cannot enter is
named as such. (glibc's ``posix_spawn`` leaves its own two internal signals, 32 and 33,
ignored in the child; glibc re-arms them. Every other signal starts at its default.)

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
#: Those of them this platform has, as numbers: set to their default in every rank.
_DEFAULT_SIGNALS = tuple(getattr(signal, n) for n in _RESET_SIGNALS if hasattr(signal, n))


def _spawns() -> bool:
    """Whether this host's ``posix_spawn`` starts a session and reports a failed exec,
    as `subprocess` asks before it uses it: glibc 2.26 or newer."""
    if not hasattr(os, "posix_spawn"):
        return False
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # type: ignore[union-attr]
        major, minor = (int(x) for x in version.split(".")[:2])
    except (AttributeError, OSError, ValueError):  # not glibc
        return False
    return name == "glibc" and (major, minor) >= (2, 26)


#: How ranks start here (`spawn`); tests run both ways.
SPAWNS = _spawns()


class SpawnError(Exception):
    """A rank could not be started; the message says which step failed and why."""


class Child:
    """A started rank: its pid (also its process group and session id) and its pipes.
    A plain class: `dataclasses` costs every agent's start 5 ms of imports."""

    __slots__ = ("pid", "start", "stdout", "stderr")

    def __init__(self, pid: int, start: int, stdout: int, stderr: int) -> None:
        self.pid, self.start, self.stdout, self.stderr = pid, start, stdout, stderr


def spawn(argv: Sequence[str], env: Dict[str, str], cwd: str) -> Child:
    """Start ``argv`` in ``cwd`` with exactly ``env``, in a new session: by
    ``posix_spawn`` where the C library can (`SPAWNS`), else by ``fork`` and ``exec``."""
    if not argv:
        raise SpawnError("the command is empty")
    args: List[bytes] = [os.fsencode(a) for a in argv]
    envb = {os.fsencode(k): os.fsencode(v) for k, v in env.items()}
    cwd_b = os.fsencode(os.path.expanduser(cwd))
    if not SPAWNS:
        return _fork_exec(args, envb, cwd_b, argv[0], cwd)
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


def _fork_exec(args: List[bytes], envb: Dict[bytes, bytes], cwd_b: bytes, program: str,
               cwd: str) -> Child:
    """`spawn` where ``posix_spawn`` cannot start a session or report a failed exec
    (glibc before 2.26, other C libraries): the child reports an exec failure (errno and
    step) through a close-on-exec pipe."""
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
                                  program, cwd)) from None
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
        raise SpawnError(describe(int(code or 0), step, program, cwd))
    started = _start_of(pid)
    return Child(pid=pid, start=started, stdout=out_r, stderr=err_r)


def _spawn_in(cwd: bytes, args: List[bytes], env: Dict[bytes, bytes], out_w: int,
              err_w: int, program: str, cwd_text: str) -> int:
    """``posix_spawn`` with ``cwd`` as the working directory, entered here and left at
    once; the program is looked up on ``env``'s PATH, as ``execvpe`` does."""
    # O_PATH: coming back needs no read permission on the agent's own folder.
    here = os.open(".", getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC)
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
                path, args, env, setsid=True, setsigmask=(), setsigdef=_DEFAULT_SIGNALS,
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
    ``fork``, ``exec``, and in the fork-and-exec way ``setsid`` and ``redirect``) and its
    errno: a limit is named as the
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
        for sig in _DEFAULT_SIGNALS:
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
