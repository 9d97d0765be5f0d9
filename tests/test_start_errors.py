"""A rank that cannot start is reported by what failed (issue 29, item 4): the fork (the
process limit), the pipes (the open-file limit), the exec (not found, not executable),
its error file. Through the real kernel limits and a real agent where this machine
allows it; the errno-to-words table as a unit (root ignores RLIMIT_NPROC, so the
process limit is reached as an unprivileged user)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

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
