"""This machine: the agent is a process started through invoke, in a session of its own.

The launcher's own host needs no connection. Its agent gets the launcher's environment
(minus launcher-internal variables: a launcher started from inside another run must not
leak that run's identity), and the pre-flight script runs under bash.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Optional

from invoke.config import Config as InvokeConfig
from invoke.context import Context

from . import bundle, kinds
from .base import AgentProcess, ByteSink, ProbeResult, Transport
from .runners import RUN_OPTIONS, LocalAgentProcess, RawLocal


def local_environment() -> dict[str, str]:
    """The launcher's environment minus launcher-internal variables: what a local agent
    (or the srun that starts a Slurm node's agent) is given."""
    return {k: v for k, v in os.environ.items() if not k.startswith("FLODL_INTERNAL_")}


def start_local(command: str, env: Mapping[str, str], stdout: ByteSink,
                stderr: ByteSink) -> LocalAgentProcess:
    """``command`` through /bin/sh here, with exactly ``env``, streams to the sinks."""
    runner = RawLocal(Context(config=InvokeConfig()))
    promise = runner.run(command, env=dict(env), replace_env=True, shell="/bin/sh",
                         out_stream=stdout, err_stream=stderr, **RUN_OPTIONS)
    return LocalAgentProcess(promise)


def _ms(start: float) -> float:
    return (time.monotonic() - start) * 1000.0


class LocalTransport(Transport):
    """The launcher's own machine."""

    kind = kinds.LOCAL

    def __init__(self, *args: object, python: str = sys.executable, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.python = python

    def start_agent(self, stdout: ByteSink, stderr: ByteSink) -> AgentProcess:
        return start_local(bundle.local_command(self.python), local_environment(), stdout,
                           stderr)

    def probe(self, script: str, *, timed: bool, tunnel: Optional[tuple[int, int]] = None,
              timeout: float = 60.0, clock_marker: str = "") -> ProbeResult:
        shell = shutil.which("bash") or shutil.which("sh") or "/bin/sh"
        result = ProbeResult()
        if timed:
            t = time.monotonic()
            subprocess.run([shell, "-c", "true"], stdin=subprocess.DEVNULL, check=False)
            result.shell_ms = _ms(t)
        t = time.monotonic()
        try:
            proc = subprocess.run([shell, "-c", script], stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, errors="replace",
                                  timeout=timeout, check=False)
            result.out, result.err, result.exit_status = proc.stdout, proc.stderr, \
                proc.returncode
        except subprocess.TimeoutExpired:
            result.err = f"timed out after {timeout:.0f} s"
        result.probe_ms = _ms(t)
        return result

    def describe(self) -> str:
        return f"local, its agent started by invoke ({self.python} -I -S)"
