"""Presentation: prefixed rank output and the launcher's own messages.

Rank output is forwarded line by line with the prefix ``[host:device:rN] ``.
Only whole lines are written, under one lock, so two ranks never mix inside a
line; a last line without a newline is flushed when the stream ends.
"""

from __future__ import annotations

import sys
import threading
from typing import Callable, Optional, TextIO

from .commands import PID_MARKER
from .events import Event, Kind

#: Event kinds shown only with -v: routine progress that would drown the rank output.
_VERBOSE_KINDS = {Kind.DEBUG, Kind.SPAWN, Kind.CONNECT, Kind.RUNNING, Kind.JOIN}


class Console:
    """The one place that writes to the launcher's stdout and stderr."""

    def __init__(
        self,
        out: Optional[TextIO] = None,
        err: Optional[TextIO] = None,
        *,
        verbosity: int = 1,
        show_rank_output: bool = True,
    ) -> None:
        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else sys.stderr
        self.verbosity = verbosity
        self.show_rank_output = show_rank_output
        self._lock = threading.Lock()

    def rank_line(self, prefix: str, line: str, *, stderr: bool) -> None:
        if not self.show_rank_output:
            return
        stream = self.err if stderr else self.out
        with self._lock:
            stream.write(f"[{prefix}] {line}\n")
            stream.flush()

    def emit(self, event: Event) -> None:
        if self.verbosity < 2 and (
            event.kind in _VERBOSE_KINDS or (event.kind is Kind.EXIT and event.data.get("ok"))
        ):
            return
        self.message(event.message)

    def message(self, text: str) -> None:
        with self._lock:
            self.err.write(text + "\n")
            self.err.flush()


class RankStream:
    """A write()-able stream that turns chunks of rank output into whole lines.

    It is handed to invoke/Fabric as ``out_stream``/``err_stream``. On stderr
    it also picks out the wrapper's pid marker line.
    """

    def __init__(
        self,
        console: Console,
        prefix: str,
        *,
        stderr: bool,
        on_pid: Optional[Callable[[int], None]] = None,
        on_line: Optional[Callable[[str], None]] = None,
    ) -> None:
        self._console = console
        self._prefix = prefix
        self._stderr = stderr
        self._on_pid = on_pid
        self._on_line = on_line
        self._partial = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            data = self._partial + text
            *lines, self._partial = data.split("\n")
        for line in lines:
            self._line(line)
        return len(text)

    def flush(self) -> None:
        """Part of the file API; partial lines wait for their newline."""

    def close(self) -> None:
        """End of stream: a last line without a newline is still delivered."""
        with self._lock:
            rest, self._partial = self._partial, ""
        if rest:
            self._line(rest)

    def _line(self, line: str) -> None:
        if self._stderr and line.startswith(PID_MARKER) and self._on_pid is not None:
            try:
                self._on_pid(int(line[len(PID_MARKER):]))
                return
            except ValueError:
                pass
        if self._on_line is not None:
            self._on_line(line)
        self._console.rank_line(self._prefix, line, stderr=self._stderr)
