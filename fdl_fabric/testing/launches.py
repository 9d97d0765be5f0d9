"""A launch as a process, watched: the one helper tests and benchmarks drive launches with.

`LiveLaunch` starts ``fdl-fabric launch`` (or any launcher command line) in its own
process group and collects every output line with the time it arrived, so a test can wait
for a line, signal the launcher, and measure how long things took. The other helpers
look at the machine the way the reliability tests need to: which processes carry a run's
id (every lab host is this machine, so one scan of /proc covers them all).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Callable, Optional, Union

import psutil

from ..rank import ENV_RUN_ID

PathLike = Union[str, Path]

#: How a launch is started when the caller does not say: the installed package itself.
DEFAULT_COMMAND: tuple[str, ...] = (sys.executable, "-m", "fdl_fabric", "launch")


def launch_argv(cluster: PathLike, *args: str,
                command: Sequence[str] = DEFAULT_COMMAND) -> list[str]:
    return [*command, "--cluster", str(cluster), *args]


def run_launch(cluster: PathLike, *args: str, timeout: float = 60,
               env: Optional[dict[str, str]] = None, cwd: Optional[PathLike] = None,
               command: Sequence[str] = DEFAULT_COMMAND) -> subprocess.CompletedProcess[str]:
    """A launch run to its end; its output captured."""
    return subprocess.run(launch_argv(cluster, *args, command=command), capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})},
                          cwd=None if cwd is None else str(cwd), stdin=subprocess.DEVNULL)


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``predicate`` until it returns something true; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def processes_of_run(run_id: str) -> list[psutil.Process]:
    """Every live process on this machine carrying this run's id in its environment."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(ENV_RUN_ID) == run_id and \
                    proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def dumps(folder: Path, count: int, timeout: float = 20) -> dict[int, dict[str, Any]]:
    """The ``env-r<rank>.json`` files of ranks 0..count-1, once every rank wrote one."""

    def ready() -> Optional[dict[int, dict[str, Any]]]:
        found = {}
        for r in range(count):
            p = folder / f"env-r{r}.json"
            if not p.exists():
                return None
            try:
                found[r] = json.loads(p.read_text())
            except ValueError:
                return None
        return found

    result: dict[int, dict[str, Any]] = wait_for(ready, timeout, f"{count} rank dumps")
    return result


class LiveProcess:
    """A running command whose output lines are collected as they arrive.

    ``lines`` holds ``(monotonic time, "out" | "err", line)``. The process leads its own
    process group; `signal` signals its pid only (a launcher's local agents are in that
    group too), `kill` the whole group (a test's last resort).
    """

    def __init__(self, argv: Sequence[str], *, env: Optional[dict[str, str]] = None,
                 cwd: Optional[PathLike] = None) -> None:
        self.proc = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
            cwd=None if cwd is None else str(cwd), start_new_session=True)
        self.lines: list[tuple[float, str, str]] = []
        self._lock = threading.Lock()
        self._readers = [threading.Thread(target=self._read, args=(name, stream), daemon=True)
                         for name, stream in (("out", self.proc.stdout),
                                              ("err", self.proc.stderr))]
        for t in self._readers:
            t.start()

    def _read(self, name: str, stream: IO[str]) -> None:
        for line in stream:
            with self._lock:
                self.lines.append((time.monotonic(), name, line.rstrip("\n")))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _of(self, stream: Optional[str]) -> list[tuple[float, str]]:
        with self._lock:
            return [(t, line) for t, name, line in self.lines if stream in (None, name)]

    @property
    def stdout_lines(self) -> list[str]:
        return [line for _, line in self._of("out")]

    @property
    def stderr_lines(self) -> list[str]:
        return [line for _, line in self._of("err")]

    def err_lines(self) -> list[str]:
        return self.stderr_lines

    @property
    def err(self) -> str:
        return "\n".join(self.stderr_lines)

    def line_time(self, needle: str) -> Optional[float]:
        """When the first line containing ``needle`` (either stream) arrived, if it did."""
        return next((t for t, line in self._of(None) if needle in line), None)

    def wait_line(self, pattern: str, *, stderr: Optional[bool] = None,
                  timeout: float = 30) -> Any:
        """The first match of the regex ``pattern`` in a line (stdout, stderr, or either)."""
        regex = re.compile(pattern)
        stream = None if stderr is None else ("err" if stderr else "out")

        def find() -> Any:
            for _, line in self._of(stream):
                m = regex.search(line)
                if m:
                    return m
            return None

        return wait_for(find, timeout, f"a line matching {pattern!r}")

    def signal(self, sig: int) -> float:
        """Signal the launcher's pid; returns when (monotonic)."""
        os.kill(self.proc.pid, sig)
        return time.monotonic()

    def finish(self, timeout: float = 60) -> int:
        """Its exit status, once it ended and its output was read."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the launch did not end within {timeout}s:\n{self.err}") \
                from None
        for t in self._readers:
            t.join(5)
        return code

    wait = finish

    @property
    def run_id(self) -> str:
        for line in self.stderr_lines:
            m = re.match(r"cluster launcher: run (\S+): ", line)
            if m:
                return m.group(1)
        raise AssertionError(f"no run id printed yet:\n{self.err}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


class LiveLaunch(LiveProcess):
    """A running ``launch`` of a cluster file (by default ``python -m fdl_fabric launch``)."""

    def __init__(self, cluster: PathLike, *args: str, env: Optional[dict[str, str]] = None,
                 cwd: Optional[PathLike] = None,
                 command: Sequence[str] = DEFAULT_COMMAND) -> None:
        super().__init__(launch_argv(cluster, *args, command=command), env=env, cwd=cwd)
