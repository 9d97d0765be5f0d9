"""Starting ranks: local ones through invoke, remote ones through Fabric.

Each rank is one asynchronous ``run()`` of the rank wrapper (see
`commands`): ``invoke.Context.run`` for a local rank, ``Connection.run`` for a
remote one, with one Connection per host (a second one when the server's
MaxSessions is reached) and one SSH session per rank. A `RankProcess` wraps
the resulting Promise behind the small interface the supervisor needs.

The wrapper's stdin is our control channel. It stays open for the whole run:
closing it is how we stop a rank (the wrapper sends TERM, then KILL after the
kill grace), and it closes by itself when the launcher dies or the SSH
connection drops, which is what makes orphans impossible.
"""

from __future__ import annotations

import codecs
import collections
import contextlib
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from typing import IO, Any, Callable, Optional

import paramiko
import psutil
from fabric.runners import Remote
from invoke.config import Config as InvokeConfig
from invoke.context import Context
from invoke.runners import Local, Promise

from . import commands
from .envelope import ENV_RUN_ID
from .output import Console, RankStream, RunLog
from .plan import LaunchPlan, RankPlan
from .ssh import FdlConnection, SshSettings, open_connection


class _Streaming:
    """Runner mix-in: stream output without keeping it, decode incrementally.

    invoke keeps every byte of output in memory and re-joins the whole buffer
    for every chunk (for its watchers): fine for a command, quadratic for a
    training run that prints for days. It also decodes each 1000-byte chunk on
    its own, which mangles a UTF-8 character split between two chunks. Rank
    output is streamed and never kept; hidden output (``hide=True``: short
    helper commands such as cleanup or nvidia-smi) is kept as the result.
    """

    input_sleep = 0.05

    def _handle_output(
        self, buffer_: list[str], hide: bool, output: IO[str], reader: Callable[[int], bytes]
    ) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        while True:
            data = reader(self.read_chunk_size)  # type: ignore[attr-defined]
            if not data:
                break
            text = decoder.decode(data)
            if text:
                self._deliver(text, buffer_, hide, output)
        tail = decoder.decode(b"", final=True)
        if tail:
            self._deliver(tail, buffer_, hide, output)
        if isinstance(output, RankStream):
            output.close()

    @staticmethod
    def _deliver(text: str, buffer_: list[str], hide: bool, output: IO[str]) -> None:
        """Stream visible output; keep hidden output (short helper commands) as a result."""
        if hide:
            buffer_.append(text)
        else:
            output.write(text)


class StreamingLocal(_Streaming, Local):  # type: ignore[misc]
    pass


class StreamingRemote(_Streaming, Remote):  # type: ignore[misc]
    pass


class ControlStdin:
    """The ``in_stream`` of one wrapper: a preamble, control lines, then EOF.

    invoke polls ``read()`` from its stdin thread; returning None means
    "nothing yet", and "" means EOF, on which invoke closes the process's
    stdin (or the SSH channel's write side).
    """

    def __init__(self, preamble: str = "") -> None:
        self._queue: collections.deque[str] = collections.deque([preamble] if preamble else [])
        self._closed = False
        self._cond = threading.Condition()

    def read(self, size: int = -1) -> Optional[str]:
        with self._cond:
            if not self._queue and not self._closed:
                self._cond.wait(0.25)
            if self._queue:
                return self._queue.popleft()
            return "" if self._closed else None

    def send(self, line: str) -> None:
        with self._cond:
            if not self._closed:
                self._queue.append(line + "\n")
                self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    @property
    def closed(self) -> bool:
        return self._closed


@dataclass(frozen=True)
class ExitInfo:
    """How a rank ended, as the wrapper reported it."""

    code: Optional[int] = None
    signal: Optional[int] = None
    lost: bool = False

    @classmethod
    def from_status(cls, status: Optional[int]) -> ExitInfo:
        """Interpret a wrapper's exit status.

        The wrapper exits with the rank's status, and a shell reports a rank
        killed by signal N as 128+N. A negative status is the wrapper itself
        killed by a signal; -1 from paramiko or None means no status arrived
        at all (the connection or the session went away).
        """
        if status is None or status == -1:
            return cls(lost=True)
        if status < 0:
            return cls(signal=-status)
        if 128 < status <= 128 + 64:
            return cls(signal=status - 128)
        return cls(code=status)

    @property
    def ok(self) -> bool:
        return self.code == 0

    def describe(self) -> str:
        if self.lost:
            return "no exit status (connection or session lost)"
        if self.signal is not None:
            return f"signal {self.signal}"
        return f"status {self.code}"


class RankProcess:
    """One running rank, local or remote, behind the supervisor's interface."""

    def __init__(self, plan: RankPlan, run_id: str, kill_grace: float = 10.0) -> None:
        self.plan = plan
        self.run_id = run_id
        self.pid: Optional[int] = None
        self.last_line = ""
        self.stdin = ControlStdin()
        self.promise: Optional[Promise] = None
        self.kill_grace = kill_grace
        self._orphan_handled = False
        self._on_pid: Optional[Callable[[int], None]] = None

    # -- wiring -----------------------------------------------------------
    def streams(self, console: Console,
                log: Optional[RunLog] = None) -> tuple[RankStream, RankStream]:
        def got_pid(pid: int) -> None:
            self.pid = pid
            if self._on_pid is not None:
                self._on_pid(pid)

        def got_line(line: str) -> None:
            self.last_line = line

        prefix = self.plan.label
        rank = self.plan.rank
        out = RankStream(console, prefix, stderr=False, on_line=got_line,
                         log=log.rank_file(rank, "stdout") if log else None)
        err = RankStream(console, prefix, stderr=True, on_pid=got_pid, on_line=got_line,
                         log=log.rank_file(rank, "stderr") if log else None)
        return out, err

    def on_pid(self, callback: Callable[[int], None]) -> None:
        self._on_pid = callback
        if self.pid is not None:
            callback(self.pid)

    # -- supervisor interface ---------------------------------------------
    @property
    def is_remote(self) -> bool:
        return not self.plan.worker.is_local

    def poll(self) -> Optional[ExitInfo]:
        """The rank's exit, or None while it runs. Never blocks."""
        if self.promise is None:
            return ExitInfo(lost=True)
        runner = self.promise.runner
        try:
            if not runner.process_is_finished:
                return None
            status = runner.returncode()
        except Exception:
            status = None
        info = ExitInfo.from_status(status)
        wrapper_killed = status is not None and status < 0  # local: the wrapper got a signal
        if self.is_remote:
            wrapper_killed = getattr(getattr(runner, "channel", None), "exit_signal", None) \
                is not None
        if info.lost or wrapper_killed:
            self._reap_orphan()
        return info

    def _reap_orphan(self) -> None:
        """The wrapper itself died (killed, or its session vanished): its rank may live on.

        A local rank's group is stopped here (TERM, KILL after the grace),
        touching only processes that carry this run's id. A remote one is
        left to the host's wrapper (stdin EOF) and the post-run sweep; its
        session is closed so that joining its output cannot hang.
        """
        if self._orphan_handled:
            return
        self._orphan_handled = True
        if self.is_remote:
            with contextlib.suppress(Exception):
                self.promise.runner.channel.close()  # type: ignore[union-attr]
            return
        if self.pid is None:
            return
        pid, run_id, grace = self.pid, self.run_id, self.kill_grace

        def reap() -> None:
            if kill_run_group(pid, run_id, signal.SIGTERM):
                time.sleep(grace)
                kill_run_group(pid, run_id, signal.SIGKILL)

        threading.Thread(target=reap, name=f"fdl-reap-r{self.plan.rank}", daemon=True).start()

    def stop(self) -> None:
        """Graceful stop: the wrapper sends TERM, then KILL after the kill grace.

        A control line rather than EOF, so that a later `kill` can still
        reach the wrapper (a second Ctrl-C).
        """
        self.stdin.send("TERM")

    def kill(self) -> None:
        """Immediate KILL of the rank's process group, then EOF."""
        self.stdin.send("KILL")
        self.stdin.close()

    def send_signal(self, name: str) -> None:
        """Forward a signal (USR1, USR2, ...) to the rank's process group."""
        if name not in commands.CONTROL_SIGNALS:
            raise ValueError(f"cannot forward signal {name}")
        self.stdin.send(name)

    def abandon(self) -> None:
        """Last resort when a wrapper no longer answers.

        Remote: close the session; sshd then closes the wrapper's stdin.
        Local: kill the wrapper shell and, if it left its rank behind, the
        rank's process group, after checking that every process we signal
        carries this run's id (a recycled pid is never touched).
        """
        self.stdin.close()
        if self.promise is None:
            return
        runner = self.promise.runner
        with contextlib.suppress(Exception):
            runner.kill()
        if not self.is_remote and self.pid is not None:
            kill_run_group(self.pid, self.run_id, signal.SIGKILL)

    def finish(self) -> None:
        """Reap the runner and join its output threads (all output delivered).

        The rank has exited, so its stdin is closed first: invoke's stdin
        thread would otherwise sit in `ControlStdin.read` until its timeout.
        """
        self.stdin.close()
        if self.promise is None:
            return
        with contextlib.suppress(Exception):
            self.promise.join()


def kill_run_group(pgid: int, run_id: str, sig: int) -> int:
    """Signal the members of process group ``pgid`` that belong to ``run_id``.

    Returns how many processes were signalled.
    """
    count = 0
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) != pgid:
                continue
            if proc.environ().get(ENV_RUN_ID) != run_id:
                continue
            proc.send_signal(sig)
            count += 1
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return count


def local_context() -> Context:
    config = InvokeConfig(overrides={"runners": {"local": StreamingLocal}})
    return Context(config=config)


def fabric_config() -> Any:
    from fabric import Config

    return Config(overrides={"runners": {"remote": StreamingRemote}})


def inherited_environment() -> dict[str, str]:
    """The launcher's environment minus launcher-internal variables.

    A launcher started from inside another run must not leak that run's
    envelope or identity into its own ranks.
    """
    return {k: v for k, v in os.environ.items() if not k.startswith("FLODL_INTERNAL_")}


def start_local(rank: RankProcess, plan: LaunchPlan, console: Console, ctx: Context,
                log: Optional[RunLog] = None) -> None:
    """Start a local rank; its environment (envelope included) goes by env, never argv."""
    env = {**inherited_environment(), **plan.rank_environment(rank.plan)}
    rank.promise = ctx.run(  # type: ignore[assignment]
        rank.plan.wrapper(plan.cluster.kill_grace),
        shell=shutil.which("bash") or "/bin/bash",
        env=env,
        replace_env=True,
        **_run_options(rank, console, log),
    )


def _run_options(rank: RankProcess, console: Console, log: Optional[RunLog]) -> dict[str, Any]:
    """What every rank's ``run()`` shares: async, no pty, our stdin and line streams."""
    out, err = rank.streams(console, log)
    return {"asynchronous": True, "pty": False, "warn": True, "hide": False, "echo": False,
            "in_stream": rank.stdin, "out_stream": out, "err_stream": err,
            "encoding": "utf-8"}


class HostSessions:
    """The Connections of one remote host, opened on demand.

    One Connection carries many sessions, but OpenSSH refuses the eleventh
    (MaxSessions defaults to 10); when the server says no, we open another
    Connection to the same host and carry on.
    """

    def __init__(self, settings: SshSettings, config: Any, first: FdlConnection) -> None:
        self.settings = settings
        self.config = config
        self.connections = [first]
        self._lock = threading.Lock()

    def run(self, command: str, **kwargs: Any) -> Promise:
        with self._lock:
            conn = self.connections[-1]
            try:
                promise: Promise = conn.run(command, **kwargs)
                return promise
            except paramiko.ChannelException as exc:
                if exc.code != paramiko.common.OPEN_FAILED_CONNECT_FAILED:
                    raise
            conn = open_connection(self.settings, self.config)
            self.connections.append(conn)
            promise = conn.run(command, **kwargs)
            return promise

    def close(self) -> None:
        for conn in self.connections:
            with contextlib.suppress(Exception):
                conn.close()


def start_remote(
    rank: RankProcess, plan: LaunchPlan, console: Console, sessions: HostSessions,
    log: Optional[RunLog] = None,
) -> None:
    """Start a remote rank: the wrapper in argv, envelope and env on stdin."""
    rank.stdin = ControlStdin(
        commands.stdin_preamble(plan.envelope_hex(rank.plan.host), rank.plan.env))
    rank.promise = sessions.run(
        commands.remote_command(rank.plan.wrapper(plan.cluster.kill_grace)),
        **_run_options(rank, console, log),
    )
