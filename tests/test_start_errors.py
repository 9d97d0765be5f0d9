"""A rank that cannot start is reported by what failed (issue 29, item 4): the fork (the
process limit), the pipes (the open-file limit), the exec (not found, not executable),
its error file. Through the real kernel limits and a real agent where this machine
allows it; the errno-to-words table as a unit (root ignores RLIMIT_NPROC, so the
process limit is reached as an unprivileged user)."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import pytest
from test_agent import AgentPipe, spec

from fdl_fabric.agent import children, wire
from labutil import ROOT

NOBODY = 65534


@pytest.fixture
def agent() -> Iterator[AgentPipe]:
    pipe = AgentPipe()
    yield pipe
    pipe.stop()


def _spawn_under_limit(limit: str, value: int) -> subprocess.CompletedProcess[str]:
    """`children.spawn` of ``true`` in a fresh Python whose ``limit`` is ``value``; as an
    unprivileged user when this runs as root (root is exempt from RLIMIT_NPROC)."""
    script = textwrap.dedent(f"""\
        import os, resource, sys
        sys.path.insert(0, {str(ROOT)!r})
        from fdl_fabric.agent import children
        if {limit!r} == "NOFILE":
            resource.setrlimit(resource.RLIMIT_NOFILE, ({value}, {value}))
            held = []
            try:  # every descriptor up to the limit in use, but one: no pipe fits
                while True:
                    held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                os.close(held.pop())
        else:
            resource.setrlimit(resource.RLIMIT_NPROC, ({value}, {value}))
        try:
            children.spawn(["true"], {{}}, "/")
        except children.SpawnError as exc:
            print(exc)
        """)
    python, user = sys.executable, None
    if os.geteuid() == 0 and limit == "NPROC":
        python = shutil.which("python3", path="/usr/bin:/bin") or ""
        if not python:
            pytest.skip("no /usr/bin/python3 that an unprivileged user may run")
        user = NOBODY
    return subprocess.run([python, "-I", "-c", script], capture_output=True, text=True,
                          timeout=30, user=user, group=user)


def test_the_process_limit_at_fork_is_named_as_the_process_limit() -> None:
    done = _spawn_under_limit("NPROC", 1)
    assert done.stdout.strip() == ("true: cannot fork: the process limit (ulimit -u) was "
                                   "reached (Resource temporarily unavailable)"), done


def test_the_open_file_limit_at_the_pipes_is_named_as_the_open_file_limit() -> None:
    done = _spawn_under_limit("NOFILE", 32)
    assert done.stdout.startswith("true: cannot open its output pipes: this agent's "
                                  "open-file limit (ulimit -n) was reached"), done


def test_a_file_that_is_not_executable_is_named_so_through_a_real_agent(
        agent: AgentPipe, tmp_path: Path) -> None:
    program = tmp_path / "train.sh"
    program.write_text("#!/bin/sh\necho hi\n")
    program.chmod(0o644)
    agent.send(wire.SPEC, spec([str(program)], 2))
    frames = agent.until(wire.DONE)
    failed = [wire.parse_json(b) for k, b in frames if k == wire.SPAWN_FAILED]
    assert failed == [{"rank": 0, "reason": f"{program}: not executable (permission denied)"}]
    assert not [k for k, _ in frames if k == wire.SPAWNED]


@pytest.mark.parametrize(("step", "code", "words"), [
    ("fork", errno.EAGAIN, "p: cannot fork: the process limit (ulimit -u) was reached"),
    ("exec", errno.EAGAIN, "p: cannot exec: the process limit (ulimit -u) was reached"),
    ("fork", errno.ENOMEM, "p: cannot fork: out of memory"),
    ("pipe", errno.EMFILE, "p: cannot open its output pipes: this agent's open-file limit "
                           "(ulimit -n) was reached"),
    ("pipe", errno.ENFILE, "p: cannot open its output pipes: the system's open-file limit"),
    ("exec", errno.ENOENT, "p: not found on PATH"),
    ("exec", errno.EACCES, "p: not executable (permission denied)"),
    ("exec", errno.ENOEXEC, "p: not an executable format (a script without a #! line?)"),
    ("cd", errno.ENOENT, "cannot enter the working directory /w: No such file or directory"),
])
def test_each_start_error_is_labelled_by_what_failed(step: str, code: int, words: str) -> None:
    assert children.describe(code, step, "p", "/w").startswith(words)


def test_only_an_error_file_problem_is_labelled_error_file() -> None:
    denied = PermissionError(errno.EACCES, "Permission denied", "/run/fdl/r1")
    assert children.problem(denied) == "cannot prepare its error file /run/fdl/r1: " \
                                       "Permission denied"
    forked = children.SpawnError(children.describe(errno.EAGAIN, "fork", "p", "/"))
    assert children.problem(forked).startswith("p: cannot fork: the process limit")


# -- both ways of starting a rank: posix_spawn (glibc 2.26+), and fork and exec ------------

@pytest.fixture(params=[True, False], ids=["posix_spawn", "fork_exec"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """`children.spawn` one way, then the other (the fallback of older C libraries)."""
    if request.param and not children._spawns():
        pytest.skip("this host's C library has no posix_spawn with a session")
    monkeypatch.setattr(children, "SPAWNS", request.param)
    return bool(request.param)


def _run(argv: list[str], cwd: str, env: Optional[dict[str, str]] = None) -> tuple[str, int]:
    child = children.spawn(argv, env if env is not None else {"PATH": "/usr/bin:/bin"}, cwd)
    _, status = os.waitpid(child.pid, 0)
    out = b""
    while chunk := os.read(child.stdout, 65536):
        out += chunk
    os.close(child.stdout)
    os.close(child.stderr)
    return out.decode(), os.waitstatus_to_exitcode(status)


def test_a_rank_starts_in_its_own_session_and_folder_with_exactly_its_environment(
        way: bool, tmp_path: Path) -> None:
    out, code = _run(["sh", "-c", "echo $$ $(ps -o sid= -p $$) $(ps -o pgid= -p $$); pwd; "
                                  "env | sort; readlink /proc/self/fd/0"],
                     str(tmp_path), {"PATH": "/usr/bin:/bin", "SECRET": "a b'c"})
    ids, folder, *rest = out.splitlines()
    pid, sid, pgid = ids.split()
    assert code == 0 and pid == sid == pgid
    assert folder == str(tmp_path)
    assert "SECRET=a b'c" in rest and rest[-1] == "/dev/null"
    assert os.getcwd() != str(tmp_path)  # the agent's own folder is as it was


def test_a_rank_inherits_no_descriptor_ignored_signal_or_blocked_signal_of_the_agent(
        way: bool, tmp_path: Path) -> None:
    leaked = os.open(os.devnull, os.O_RDONLY)
    os.set_inheritable(leaked, True)  # as a descriptor the agent itself inherited
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
    try:
        fds, _ = _run(["ls", "/proc/self/fd"], str(tmp_path))
        masks, _ = _run(["grep", "-E", "^Sig(Ign|Blk)", "/proc/self/status"], str(tmp_path))
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGUSR2])
        signal.signal(signal.SIGHUP, old)
        os.close(leaked)
    assert sorted(int(n) for n in fds.split()) == [0, 1, 2, 3]  # 3: ls's own listing
    seen = {line.split(":")[0]: _signals(line.split()[1]) for line in masks.splitlines()}
    assert seen["SigBlk"] == set()
    # glibc's posix_spawn leaves its own two internal signals (32 and 33: thread
    # cancellation and set*id) ignored in the child, and glibc re-arms them: nothing else.
    assert seen["SigIgn"] <= {32, 33}


def _signals(mask: str) -> set[int]:
    """The signal numbers of a /proc status mask (hex, bit n-1 is signal n)."""
    bits = int(mask, 16)
    return {n + 1 for n in range(64) if bits >> n & 1}


@pytest.mark.parametrize(("argv", "folder", "words"), [
    (["no-such-program"], "", "no-such-program: not found on PATH"),
    (["./data.txt"], "", "./data.txt: not executable (permission denied)"),
    (["true"], "missing", "cannot enter the working directory "),
])
def test_each_way_names_what_stopped_the_start(way: bool, tmp_path: Path, argv: list[str],
                                               folder: str, words: str) -> None:
    (tmp_path / "data.txt").write_text("not a program\n")
    with pytest.raises(children.SpawnError) as refused:
        children.spawn(argv, {"PATH": "/usr/bin:/bin"}, str(tmp_path / folder))
    assert str(refused.value).startswith(words)
    assert os.getcwd() != str(tmp_path)


def test_an_agent_in_a_folder_it_may_not_read_still_starts_ranks_and_stays_there(
        tmp_path: Path) -> None:
    """posix_spawn's working directory is entered and left by the agent: coming back
    needs no read permission on the agent's own folder (a home without ``r``)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the agent as another user")
    folder = tmp_path / "x-only"
    folder.mkdir(mode=0o711)
    tmp_path.chmod(0o711)
    folder.chmod(0o111)
    script = textwrap.dedent(f"""\
        import os, sys
        sys.path.insert(0, {str(ROOT)!r})
        from fdl_fabric.agent import children
        child = children.spawn(["pwd"], {{"PATH": "/usr/bin:/bin"}}, "/")
        os.waitpid(child.pid, 0)
        print(os.read(child.stdout, 100).decode().strip(), os.getcwd())
        """)
    done = subprocess.run(["/usr/bin/python3", "-I", "-c", script], capture_output=True,
                          text=True, timeout=30, user=NOBODY, group=NOBODY, cwd=folder)
    assert done.stdout.split() == ["/", str(folder)], done
