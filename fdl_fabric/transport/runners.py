"""invoke runners that hand raw bytes to a sink instead of decoding them, and the agent
process built on one.

An agent's stdout is a binary protocol, so invoke's usual output path (decode every
1000-byte chunk, keep all of it in memory for watchers, write it to a text stream)
is wrong for it twice over. These runners override invoke's public ``handle_stdout``
and ``handle_stderr`` hooks: they read 64 KiB at a time with the public
``read_proc_stdout``/``read_proc_stderr`` and pass the bytes on, keeping nothing.
Everything else (how a local process or an SSH session is started, its exit status)
is invoke's and Fabric's own. Writing bytes to a process's stdin has no public form
in invoke (``write_proc_stdin`` encodes text), so `InvokeAgentProcess.write` is the
one place that calls ``_write_proc_stdin``.
"""

from __future__ import annotations

import contextlib
from typing import IO, Any, Callable, Optional

from invoke.runners import Local

from .base import AgentProcess, ByteSink


class RawOutput:
    read_chunk_size = 64 * 1024

    def handle_stdout(self, buffer_: list[str], hide: bool, output: IO[Any]) -> None:
        self._pump(output, self.read_proc_stdout)  # type: ignore[attr-defined]

    def handle_stderr(self, buffer_: list[str], hide: bool, output: IO[Any]) -> None:
        self._pump(output, self.read_proc_stderr)  # type: ignore[attr-defined]

    def _pump(self, output: IO[Any], reader: Callable[[int], Optional[bytes]]) -> None:
        sink: ByteSink = output  # type: ignore[assignment]
        try:
            while True:
                data = reader(self.read_chunk_size)
                if not data:
                    break
                sink.feed(data)
        finally:
            sink.close()


class RawLocal(RawOutput, Local):  # type: ignore[misc]
    """A local process whose stdout and stderr go to `ByteSink`s.

    Its remote twin, `fdl_fabric.transport.ssh.RawRemote`, lives with the other Fabric
    classes, so that a launch with only local workers never imports Fabric's SSH stack;
    it has no reading threads of its own (`fdl_fabric.transport.channels`).
    """


#: Options of every agent's invoke run: asynchronous, no pty, raw sinks, nothing echoed.
RUN_OPTIONS: dict[str, Any] = {"asynchronous": True, "pty": False, "warn": True,
                               "hide": False, "echo": False, "in_stream": False}


class InvokeAgentProcess(AgentProcess):
    """An agent started through an invoke runner (a local process, an srun step, an SSH
    session): its promise, and the runner behind it."""

    def __init__(self, promise: Any) -> None:
        self.promise = promise
        self.runner: Any = promise.runner

    def write(self, data: bytes) -> None:
        self.runner._write_proc_stdin(data)

    def close_input(self) -> None:
        self.runner.close_proc_stdin()

    def kill(self) -> None:
        self.runner.kill()

    def join(self, timeout: Optional[float] = None) -> None:
        for thread in getattr(self.runner, "threads", {}).values():
            thread.join(timeout)


class LocalAgentProcess(InvokeAgentProcess):
    """A process on this machine (the local agent, or the srun carrying a node's)."""

    lost_reason = "the agent process vanished"

    def exit_status(self, timeout: float) -> Optional[int]:
        with contextlib.suppress(Exception):
            process = self.runner.process
            process.wait(timeout)
            code: Optional[int] = process.returncode  # -N after signal N, as subprocess says
            return code
        return None
