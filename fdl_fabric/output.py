"""Presentation: prefixed rank output, launcher messages, live status, logs.

Rank output is forwarded line by line with the prefix ``[host:device:rN] ``.
Only whole lines are written, under one lock, so two ranks never mix inside a
line; a last line without a newline is flushed when the stream ends.

Workers never print; they emit events (`events.py`) and hand output lines to
a `Console`. `Console` writes plain lines (CI, pipes); `LiveConsole` keeps a
status table refreshed in place on a terminal while rank output scrolls above
it. `RunLog` keeps what a run said on disk (``--log-dir``).
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Optional, TextIO

from .commands import PID_MARKER
from .events import Event, Kind

#: Event kinds shown only with -v: routine progress that would drown the rank output.
_VERBOSE_KINDS = {Kind.DEBUG, Kind.SPAWN, Kind.CONNECT, Kind.RUNNING, Kind.JOIN}

#: Per-host prefix colors on a terminal (ANSI codes, and the rich style names).
_PALETTE = ["36", "33", "35", "32", "34", "91", "96", "93"]
_RICH_PALETTE = ["cyan", "yellow", "magenta", "green", "blue", "bright_red", "bright_cyan",
                 "bright_yellow"]

#: Env keys whose values are shown as *** in dry-run, logs and cluster.json.
SECRET_KEY_RE = re.compile(r"SECRET|TOKEN|PASSW|KEY|CREDENTIAL|AUTH|COOKIE|PRIVATE", re.I)


def redact_env(env: dict[str, str]) -> dict[str, str]:
    """Values of secret-looking keys replaced by ``***`` (the names stay visible)."""
    return {k: ("***" if SECRET_KEY_RE.search(k) and not k.startswith("FLODL_INTERNAL_") else v)
            for k, v in env.items()}


def use_color(stream: IO[str]) -> bool:
    """Colors only on a terminal, and never with NO_COLOR set (no-color.org)."""
    return "NO_COLOR" not in os.environ and hasattr(stream, "isatty") and stream.isatty()


@dataclass
class RankRow:
    """One line of the live status table."""

    host: str
    rank: int
    device: str
    pid: Optional[int]
    state: str
    started: float
    ended: Optional[float]
    last_line: str


class Console:
    """The one place that writes to the launcher's stdout and stderr."""

    def __init__(
        self,
        out: Optional[TextIO] = None,
        err: Optional[TextIO] = None,
        *,
        verbosity: int = 1,
        show_rank_output: bool = True,
        color: Optional[bool] = None,
    ) -> None:
        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else sys.stderr
        self.verbosity = verbosity
        self.show_rank_output = show_rank_output
        self.color = use_color(self.out) if color is None else color
        self._hosts: dict[str, int] = {}
        self._lock = threading.Lock()

    def host_color(self, host: str) -> int:
        return self._hosts.setdefault(host, len(self._hosts)) % len(_PALETTE)

    def rank_line(self, prefix: str, line: str, *, stderr: bool) -> None:
        if not self.show_rank_output:
            return
        stream = self.err if stderr else self.out
        tag = f"[{prefix}]"
        if self.color:
            tag = f"\x1b[{_PALETTE[self.host_color(prefix.split(':')[0])]}m{tag}\x1b[0m"
        with self._lock:
            stream.write(f"{tag} {line}\n")
            stream.flush()

    def emit(self, event: Event) -> None:
        if self.verbosity <= 0 and event.kind not in (Kind.VERDICT, Kind.WARNING, Kind.DEATH):
            return
        if self.verbosity < 2 and (
            event.kind in _VERBOSE_KINDS or (event.kind is Kind.EXIT and event.data.get("ok"))
        ):
            return
        self.message(event.message)

    def message(self, text: str) -> None:
        with self._lock:
            self.err.write(text + "\n")
            self.err.flush()

    def start_status(self, rows: Callable[[], list[RankRow]]) -> None:
        """Plain consoles have no live view; the event lines tell the story."""

    def stop_status(self) -> None:
        pass


class LiveConsole(Console):
    """On a terminal: a status table refreshed in place, output scrolling above.

    Everything goes through one rich console on stdout, because writing to
    stderr behind rich's back would tear the live region.
    """

    def __init__(self, *, verbosity: int = 1, show_rank_output: bool = True) -> None:
        super().__init__(verbosity=verbosity, show_rank_output=show_rank_output)
        from rich.console import Console as RichConsole

        self._rich = RichConsole(file=self.out, no_color="NO_COLOR" in os.environ,
                                 highlight=False, soft_wrap=True)
        self._live: Any = None

    def rank_line(self, prefix: str, line: str, *, stderr: bool) -> None:
        if not self.show_rank_output:
            return
        from rich.text import Text

        host = prefix.split(":")[0]
        text = Text(f"[{prefix}]", style=_RICH_PALETTE[self.host_color(host)])
        text.append(" ")
        text.append(line, style="red" if stderr else "")
        with self._lock:
            self._rich.print(text)

    def message(self, text: str) -> None:
        from rich.text import Text

        with self._lock:
            self._rich.print(Text(text, style="bold"))

    def start_status(self, rows: Callable[[], list[RankRow]]) -> None:
        from rich.live import Live

        self._live = Live(get_renderable=lambda: status_table(rows(), self), console=self._rich,
                          refresh_per_second=4, transient=True, redirect_stdout=False,
                          redirect_stderr=False)
        self._live.start()

    def stop_status(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


def _uptime(row: RankRow) -> str:
    seconds = int((row.ended or time.monotonic()) - row.started)
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def status_table(rows: Sequence[RankRow], console: Console) -> Any:
    """The live view: one line per rank."""
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold dim", expand=False)
    for col in ("host", "rank", "device", "pid", "state", "uptime", "last output"):
        table.add_column(col, no_wrap=True, overflow="ellipsis",
                         max_width=60 if col == "last output" else None)
    styles = {"running": "green", "joined": "bold green", "exited": "dim", "failed": "bold red",
              "lost": "red", "stopped": "yellow", "dead-tolerated": "magenta",
              "starting": "cyan"}
    for r in rows:
        table.add_row(r.host, str(r.rank), r.device, str(r.pid or "-"),
                      f"[{styles.get(r.state, '')}]{r.state}[/]", _uptime(r), r.last_line,
                      style=None)
    return table


class RankStream:
    """A write()-able stream that turns chunks of rank output into whole lines.

    It is handed to invoke/Fabric as ``out_stream``/``err_stream``. On stderr
    it also picks out the wrapper's pid marker line. With a log file, every
    line is also appended there, unprefixed.
    """

    def __init__(
        self,
        console: Console,
        prefix: str,
        *,
        stderr: bool,
        on_pid: Optional[Callable[[int], None]] = None,
        on_line: Optional[Callable[[str], None]] = None,
        log: Optional[IO[str]] = None,
    ) -> None:
        self._console = console
        self._prefix = prefix
        self._stderr = stderr
        self._on_pid = on_pid
        self._on_line = on_line
        self._log = log
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
        if self._log is not None:
            self._log.close()
            self._log = None

    def _line(self, line: str) -> None:
        if self._stderr and line.startswith(PID_MARKER) and self._on_pid is not None:
            try:
                self._on_pid(int(line[len(PID_MARKER):]))
                return
            except ValueError:
                pass
        if self._on_line is not None:
            self._on_line(line)
        if self._log is not None:
            self._log.write(line + "\n")
            self._log.flush()
        self._console.rank_line(self._prefix, line, stderr=self._stderr)


class RunLog:
    """``--log-dir``: per-rank output, an events.jsonl timeline, the resolved cluster.

    Layout (like torchrun's ``--log-dir``)::

        <dir>/<run_id>/r<rank>/stdout.log
        <dir>/<run_id>/r<rank>/stderr.log
        <dir>/<run_id>/events.jsonl
        <dir>/<run_id>/cluster.json
    """

    def __init__(self, root: str, run_id: str) -> None:
        self.folder = Path(root) / run_id
        self.folder.mkdir(parents=True, exist_ok=True)
        self._events = open(self.folder / "events.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self._lock = threading.Lock()

    def rank_file(self, rank: int, stream: str) -> IO[str]:
        folder = self.folder / f"r{rank}"
        folder.mkdir(exist_ok=True)
        return open(folder / f"{stream}.log", "a", encoding="utf-8")  # noqa: SIM115

    def emit(self, event: Event) -> None:
        with self._lock:
            if self._events.closed:
                return
            self._events.write(json.dumps(event.to_json(), ensure_ascii=False) + "\n")
            self._events.flush()

    def write_cluster(self, data: dict[str, Any]) -> None:
        (self.folder / "cluster.json").write_text(json.dumps(data, indent=2, ensure_ascii=False))

    def close(self) -> None:
        with self._lock:
            self._events.close()


def summary_table(rows: Sequence[tuple[int, str, str, str, str]]) -> str:
    """The end-of-run table: rank, host, exit, cause, duration; plain aligned text."""
    header = ("rank", "host", "exit", "cause", "duration")
    table = [header, *[tuple(str(c) for c in row) for row in rows]]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in table]
    return "\n".join(lines)
