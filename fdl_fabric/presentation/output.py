"""Presentation: the one place that writes what a run says, for every command.

Transport and supervision never print: they emit events (`events.py`), and the sinks
here render them. Rank output arrives as ``Kind.OUTPUT`` events, each a chunk of whole
lines of one rank, printed with the prefix ``[host:device:rN] `` in one write, so two
ranks never mix inside a line and 100k lines cost 100 writes, not 100k. `Console`
writes plain lines (CI, pipes) and, on a terminal, keeps a status table refreshed in
place while rank output scrolls above it; during a launch it writes through one writer
thread (`screen`), so a stalled terminal never stalls supervision. `RunLog` keeps what
a run said on disk (``--log-dir``): rank output byte for byte, and every other event as
JSON; a disk that fills up is reported once and the run goes on.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional, Protocol, TextIO

from ..events import Event, Kind, Name
from ..inert import json_inert, neutralize, shown_lines
from ..masking import mask_env
from ..states import RankState
from .hostwords import inert_data
from .interrupted import Interrupted
from .layout import fit
from .ranklines import cut_to_width, rank_block
from .records import Attempts, record
from .screen import ERR, OUT, Screen
from .words import render

#: Event kinds shown only with -v: routine progress that would drown the rank output.
_VERBOSE_KINDS = {Kind.DEBUG, Kind.SPAWN, Kind.CONNECT, Kind.JOIN}

#: Per-host prefix colors on a terminal (ANSI codes, and the rich style names).
_PALETTE = ["36", "33", "35", "32", "34", "91", "96", "93"]

def redact_env(env: dict[str, str]) -> dict[str, str]:
    """An environment as it may be shown: the one rule of `masking` (by name, by
    ``secret_env``, by value)."""
    return mask_env(env)


def is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (OSError, ValueError):
        return False


def terminal_width(stream: Any) -> Optional[int]:
    """The columns of the terminal ``stream`` writes to, asked of its file descriptor (a
    stale ``COLUMNS`` does not count); None for a pipe or a file, whose lines are never
    wrapped."""
    if not is_terminal(stream):
        return None
    try:
        return os.get_terminal_size(stream.fileno()).columns or None
    except (AttributeError, OSError, ValueError):
        return None


#: Before a launcher line on a terminal: back to the start of the line, cleared. The
#: cursor is there already, unless the terminal echoed a key meanwhile (``^C``), which
#: would push the line to the right and a line that fits over the edge.
LINE_START = b"\r\x1b[K"


def use_color(stream: Any) -> bool:
    """Colors only for a person at a terminal, and never when NO_COLOR is set to anything
    (no-color.org: "present and not an empty string")."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and not os.environ.get("NO_COLOR")


class Console:
    """The one place that writes to the launcher's stdout and stderr.

    ``threaded`` (a launch): every write goes through a `screen.Screen`, so a stalled
    terminal holds up nobody but the one agent whose output waits; ``live`` also keeps
    the status table drawn in place on a terminal. Without it (cleanup, checks, tests)
    writes are direct.
    """

    def __init__(
        self,
        out: Optional[TextIO] = None,
        err: Optional[TextIO] = None,
        *,
        verbosity: int = 1,
        show_rank_output: bool = True,
        color: Optional[bool] = None,
        threaded: bool = False,
        live: bool = False,
        dropped_hint: str = "",
    ) -> None:
        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else sys.stderr
        self.verbosity = verbosity
        self.show_rank_output = show_rank_output
        self.color = use_color(self.out) if color is None else color
        self._hosts: dict[str, int] = {}
        self._lock = threading.Lock()
        self.live = live and threaded
        #: Launcher lines go to a terminal: laid out for its width (`words.fit`). Asked
        #: once: rank output asks for each chunk, thousands a second at 8,192 ranks.
        self.err_terminal = is_terminal(self.err)
        self.out_terminal = is_terminal(self.out)
        self.screen: Optional[Screen] = None
        #: Rank output since an interrupt, shown grouped before the summary.
        self._interrupted: Optional[Interrupted] = None
        if threaded:
            self.screen = Screen(self.out, self.err, dropped_hint=dropped_hint,
                                 notice=self._notice)

    def host_color(self, host: str) -> int:
        return self._hosts.setdefault(host, len(self._hosts)) % len(_PALETTE)

    def rank_output(self, event: Event) -> None:
        """A chunk of one rank's lines, each behind the rank's prefix, in one write.

        Called on a session's reading thread; with a screen it may wait while the console
        is slow (never while it is stalled: then the lines are counted, not shown)."""
        if not self.show_rank_output:
            return
        data = event.data
        interrupted = self._interrupted
        if interrupted is not None:  # kept, shown grouped before the summary
            interrupted.add(event.rank if event.rank is not None else -1, event.host or "?",
                            data["text"])
            return
        stream = self.err if data["stderr"] else self.out
        colour = _PALETTE[self.host_color(event.host or "")] if self.color else None
        terminal = self.err_terminal if data["stderr"] else self.out_terminal
        block, rows = rank_block(data["label"], data["text"], colour=colour,
                                 width=terminal_width(stream) if terminal else None)
        if self.screen is not None:
            self.screen.put_output(ERR if data["stderr"] else OUT,
                                   block.encode("utf-8", "replace"), rows)
            return
        with self._lock:
            stream.write(block)
            stream.flush()

    def emit(self, event: Event) -> None:
        if event.kind is Kind.OUTPUT:
            self.rank_output(event)
            return
        if event.kind in (Kind.SUMMARY, Kind.VERDICT) and self._interrupted is not None:
            where = self._interrupted.text()
            if where and self.verbosity >= 0:
                self.message(where)
        if event.kind is Kind.RESULT:
            self.result(self._result_text(event))
            return
        if event.kind in (Kind.STACKS, Kind.SUMMARY):
            if self.verbosity >= 0:
                self._say(event)
            return
        self._tell_screen(event)
        if self._shown(event):
            self._say(event)

    def _tell_screen(self, event: Event) -> None:
        """What the writer thread must know before the line: an interrupt, the verdict."""
        if event.kind is Kind.STOPPING and event.data.get("signal") and self.screen is not None:
            # Ctrl-C or TERM: the verdict must show within the grace, whatever the
            # terminal still has to take of the ranks' output; what the ranks print now
            # (where they were) is kept and shown grouped (`interrupted`).
            if self._interrupted is None:
                self._interrupted = Interrupted()
            self.screen.give_up_output(f"the run was interrupted "
                                       f"({event.data['signal']})")
        if event.kind is Kind.VERDICT and self.screen is not None:
            self.screen.seal()

    def _shown(self, event: Event) -> bool:
        """Whether the verbosity (``-q``, ``-v``) shows this event's line."""
        if self.verbosity <= 0 and event.kind not in (Kind.VERDICT, Kind.WARNING, Kind.DEATH):
            return False
        return not (self.verbosity < 2 and (
            event.kind in _VERBOSE_KINDS or (event.kind is Kind.EXIT and event.data.get("ok"))))

    def _result_text(self, event: Event) -> str:
        event = inert_data(event)  # its strings came from hosts
        if event.name is Name.CHECK_REPORT and self.color:
            return check_table(event.data["checks"])
        return render(event)

    def message(self, text: str) -> None:
        """A line for the operator (status, warnings, verdicts): on stderr, laid out for
        the terminal's width when it is one (`words.fit`), whole in a pipe or a file."""
        width = self.err_width()
        text = neutralize(text)
        self._write_message(text if width is None else fit(text, width))

    def err_width(self) -> Optional[int]:
        """The width launcher lines are laid out for: None (whole lines) unless stderr is
        a terminal."""
        return terminal_width(self.err) if self.err_terminal else None

    def _say(self, event: Event) -> None:
        self._write_message(render(event, self.err_width()))  # its strings made inert there

    def _notice(self, event: Event) -> bytes:
        """A notice of the writer thread itself (`screen`), laid out as `message` does."""
        return self._message_bytes(render(event, self.err_width()))

    def _message_bytes(self, text: str) -> bytes:
        """A launcher line: whatever its words quote from a host (an agent's error, a
        spawn failure's reason) was made inert with the event's data (`words.render`);
        this last pass makes sure no control but the newline and the tab reaches the
        terminal."""
        text = neutralize(text)
        width = self.err_width()
        if width is not None:
            text = cut_to_width(text, width)
        data = (text + "\n").encode("utf-8", "replace")
        return LINE_START + data if self.err_terminal else data

    def _write_message(self, text: str) -> None:
        data = self._message_bytes(text)
        if self.screen is not None:
            self.screen.put_message(ERR, data)
            return
        with self._lock:
            self.err.write(data.decode("utf-8", "replace"))
            self.err.flush()

    def result(self, text: str) -> None:
        """What a command was asked for (a report, a path): on stdout, so it can be piped."""
        text = neutralize(text, keep_sgr=True)  # a check table's colours stay
        text = text if text.endswith("\n") else text + "\n"
        if self.screen is not None:
            self.screen.put_message(OUT, text.encode("utf-8", "replace"))
            return
        with self._lock:
            self.out.write(text)
            self.out.flush()

    def json(self, data: Any) -> None:
        """The ``--json`` form of a command's result."""
        self.result(json.dumps(data, indent=2, ensure_ascii=False))

    def start_status(self, rows: Callable[[], Sequence[RankLike]]) -> None:
        """On a terminal, the live table (host, rank, pid, state, last line) below the
        output; plain consoles have none, the event lines tell the story."""
        if self.live and self.screen is not None:
            self.screen.set_status(lambda width, height: render_status(rows(), width,
                                                                        height, self.color))

    def stop_status(self) -> None:
        if self.screen is not None:
            self.screen.set_status(None)

    @property
    def dropped(self) -> int:
        """Lines of rank output the console did not show (a stall, a closed stdout)."""
        hidden = self._interrupted.hidden if self._interrupted is not None else 0
        return hidden + (self.screen.dropped if self.screen is not None else 0)

    def close(self) -> None:
        """Write what is queued (bounded by `screen.FINAL_DRAIN`) and stop the writer."""
        if self.screen is not None:
            self.screen.close()


def render_status(ranks: Sequence[RankLike], width: int, height: int, color: bool) -> str:
    """The live table as terminal text: at most ``height - 1`` lines (the ranks that do
    not fit are counted), and the empty line below them.

    It ends with a newline: the cursor waits at the start of the empty line below the
    table, where the terminal's echo of a key (``^C`` when the operator interrupts) lands
    and is erased with the table. Left at the end of a full-width last row, the echo
    would wrap onto a line of its own, and the erasure, one line short, would leave the
    table's header behind in the scrollback."""
    from rich.console import Console as RichConsole

    keep = max(1, height - 3)
    shown = list(ranks)
    more = len(shown) - keep
    if more > 0:
        shown = shown[:keep]
    buf = io.StringIO()
    rich = RichConsole(file=buf, force_terminal=True, width=width, highlight=False,
                       color_system="standard" if color else None, no_color=not color,
                       soft_wrap=False)
    rich.print(status_table(shown, width), end="")
    text = buf.getvalue().rstrip("\n")
    if more > 0:
        text += f"\n… {more} more rank(s)"
    return text + "\n"


def _uptime(rank: RankLike) -> str:
    seconds = int(rank.duration)
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


#: How each rank state looks in the live table.
_STATE_STYLES = {
    RankState.PENDING: "cyan", RankState.RUNNING: "green", RankState.JOINED: "bold green",
    RankState.SUCCEEDED: "dim", RankState.FAILED: "bold red", RankState.LOST: "red",
    RankState.STOPPED: "yellow", RankState.TOLERATED: "magenta", RankState.NOT_STARTED: "dim",
}


#: A check's status (its value) to its color.
_CHECK_STYLES = {"ok": "green", "warn": "yellow", "FAIL": "bold red"}


def check_table(checks: Sequence[Mapping[str, str]]) -> str:
    """A pre-flight report as a rich table with colors, for a person at a terminal (plain
    output, one check a line, is `words`')."""
    from rich import box
    from rich.console import Console as RichConsole
    from rich.table import Table
    from rich.text import Text

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("host", style="bold", no_wrap=True)
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for c in checks:
        # Text(), not str: a reason such as "[127.0.0.1]:22" is not rich markup.
        table.add_row(Text(c["host"]), Text(c["check"]),
                      Text(c["status"], style=_CHECK_STYLES[c["status"]]), Text(c["reason"]))
    out = io.StringIO()
    width = shutil.get_terminal_size((120, 24)).columns
    RichConsole(file=out, force_terminal=True, color_system="standard", width=width,
                highlight=False).print(table)
    return out.getvalue()


#: Below this terminal width the live table drops its device and uptime columns.
NARROW_WIDTH = 100


class RankLike(Protocol):
    """What the live table shows of a rank: the supervisor's `Rank`, or a row rebuilt
    from a run's record by a follower (`runs.ranktable`)."""

    @property
    def host(self) -> str: ...

    @property
    def pid(self) -> Optional[int]: ...

    @property
    def state(self) -> RankState: ...

    @property
    def last_line(self) -> str: ...

    @property
    def rank(self) -> int: ...

    @property
    def device_name(self) -> str: ...

    @property
    def duration(self) -> float: ...


def status_table(ranks: Sequence[RankLike], width: int) -> Any:
    """The live view: one line per rank, fitted to ``width`` columns.

    Every column but the last output keeps its full values (a host, pid or state cut to
    ``localh…`` helps nobody); the last output line gets what is left. Below
    `NARROW_WIDTH` the device and uptime columns go, so 80 columns still read well.
    """
    from rich.table import Table
    from rich.text import Text

    narrow = width < NARROW_WIDTH
    cells: list[list[Any]] = []
    for r in ranks:
        row: list[Any] = [Text(r.host), str(r.rank)]
        if not narrow:
            row.append(r.device_name)
        row += [str(r.pid or "-"), Text(r.state.value, style=_STATE_STYLES.get(r.state, ""))]
        if not narrow:
            row.append(_uptime(r))
        row.append(Text(shown_lines(r.last_line, keep_sgr=False)[-1]))
        cells.append(row)
    names = ["host", "rank", *([] if narrow else ["device"]), "pid", "state",
             *([] if narrow else ["uptime"]), "last output"]
    table = Table(box=None, pad_edge=False, header_style="bold dim", expand=True, width=width)
    for i, name in enumerate(names[:-1]):
        longest = max([len(name), *(len(str(row[i])) for row in cells)])
        table.add_column(name, no_wrap=True, min_width=longest)
    table.add_column(names[-1], no_wrap=True, overflow="ellipsis", ratio=1)
    for row in cells:
        table.add_row(*row)
    return table


class JsonConsole(Console):
    """``--json``: every event as one JSON line on stdout (rank output too, as kind
    ``output``), the verdict record last; the operator's words stay on stderr.

    Lines go through the same writer thread as the text console, so a slow reader of
    stdout holds up nobody but the agent whose output waits (`screen`)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs["show_rank_output"] = False
        kwargs["live"] = False
        super().__init__(**kwargs)
        self.color = False
        self._attempts = Attempts()

    def emit(self, event: Event) -> None:
        # Bad input too: its `refused` record on stdout (the only one: nothing started),
        # and its one line on stderr.
        line = json_inert(json.dumps(record(event, attempt=self._attempts.see(event)),
                                     default=str, ensure_ascii=False)) + "\n"
        data = line.encode("utf-8", "replace")
        if self.screen is None:
            with self._lock:
                self.out.write(line)
                self.out.flush()
        elif event.kind is Kind.OUTPUT:
            self.screen.put_output(OUT, data, 1)
        else:
            self.screen.put_message(OUT, data)
        super().emit(event)

    def result(self, text: str) -> None:
        """A report's words go to stderr: stdout carries only JSON lines."""
        self.message(text.rstrip("\n"))

