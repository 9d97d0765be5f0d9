"""Helpers for the integration tests: run `inv launch` as a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import psutil

ROOT = Path(__file__).resolve().parent.parent
PROBE = str(ROOT / "tests" / "progs" / "rankprobe.py")


def launch_argv(cluster: Path | str, *args: str) -> list[str]:
    return [sys.executable, "-m", "invoke", "--search-root", str(ROOT), "launch",
            "--cluster", str(cluster), *args]


def run_launch(cluster: Path | str, *args: str, timeout: float = 60,
               env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(launch_argv(cluster, *args), capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=str(ROOT))


def start_launch(cluster: Path | str, *args: str,
                 env: Optional[dict[str, str]] = None) -> subprocess.Popen[str]:
    full_env = {**os.environ, **(env or {})}
    return subprocess.Popen(launch_argv(cluster, *args), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=full_env, cwd=str(ROOT),
                            start_new_session=True)


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def dumps(folder: Path, count: int, timeout: float = 20) -> dict[int, dict[str, Any]]:
    """The env dumps of ranks 0..count-1, once every rank has written one."""

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


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def processes_of_run(run_id: str) -> list[psutil.Process]:
    """Every live process on this machine (all lab hosts) carrying this run's id."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("FLODL_INTERNAL_RUN_ID") == run_id and \
                    proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


class LiveLaunch:
    """A running `inv launch` whose output lines are collected as they arrive."""

    def __init__(self, cluster: Path | str, *args: str,
                 env: Optional[dict[str, str]] = None) -> None:
        self.proc = start_launch(cluster, *args, env=env)
        self._start_pumps()

    def _start_pumps(self) -> None:
        """Collect ``self.proc``'s output lines, with the time each one arrived."""
        import threading

        self.out: list[tuple[float, str]] = []
        self.err: list[tuple[float, str]] = []
        self._threads = []
        for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            t = threading.Thread(target=self._pump, args=(stream, sink), daemon=True)
            t.start()
            self._threads.append(t)

    @staticmethod
    def _pump(stream: Any, sink: list[tuple[float, str]]) -> None:
        for line in stream:
            sink.append((time.monotonic(), line.rstrip("\n")))

    def wait_line(self, pattern: str, *, stderr: bool = False, timeout: float = 30) -> Any:
        import re

        regex = re.compile(pattern)
        sink = self.err if stderr else self.out

        def find() -> Any:
            for _, line in list(sink):
                m = regex.search(line)
                if m:
                    return m
            return None

        return wait_for(find, timeout, f"a line matching {pattern!r}")

    def finish(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout)
        for t in self._threads:
            t.join(5)
        return code

    @property
    def stderr_lines(self) -> list[str]:
        return [line for _, line in self.err]

    @property
    def stdout_lines(self) -> list[str]:
        return [line for _, line in self.out]

    def kill(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
