"""``fdl-fabric logs``: a run's console, from any terminal (``attach`` follows it live:
`attach`).

Both read the run's record on this controller (`runs.record`): console.log is the
console exactly as rendered (launcher lines, and every rank line behind its
``[host:device:rN]`` prefix), so what one sees attached is what the launching terminal
showed. ``logs`` prints it (``--rank``/``--host`` keep one rank's or one host's lines
and the lines that name an attempt; ``-f`` follows, as ``kubectl logs -f`` and ``sky
logs`` do, across restarts, and ends with the verdict); ``attach`` shows the last lines
and follows live, and Ctrl-C leaves the run running (``--stop``: stops it). Several may
follow one run at once: they only read.

What a rank printed was made inert by the launcher before it reached the record
(`inert`), so nothing in it moves this terminal's cursor either.
"""

from __future__ import annotations

import re
import sys
from typing import IO, Optional

from ..errors import EXIT_USAGE
from ..events import EventBus
from ..presentation.output import Console
from ..runs.ranktable import RANK_LINE
from ..runs.reading import ended_check, follow, last_lines, view
from ..runs.record import CONSOLE, RunState
from .runref import ended, find_run

#: Launcher lines a filtered view keeps: those that name an attempt (a restart).
ATTEMPT_LINE = re.compile(rb"cluster launcher: (attempt [0-9]+|run [0-9-a-f]+: )")


class LineFilter:
    """``--rank`` / ``--host``: one rank's or one host's lines, and the attempt lines."""

    def __init__(self, rank: Optional[int], host: Optional[str]) -> None:
        self.rank = rank
        self.host = host.encode("utf-8", "surrogateescape") if host is not None else None

    @property
    def active(self) -> bool:
        return self.rank is not None or self.host is not None

    def keep(self, line: bytes) -> bool:
        if not self.active:
            return True
        found = RANK_LINE.match(line)
        if found is None:
            return ATTEMPT_LINE.match(line) is not None
        if self.rank is not None and int(found.group("rank")) != self.rank:
            return False
        return self.host is None or found.group("host") == self.host

    def lines(self, data: bytes) -> bytes:
        if not self.active:
            return data
        return b"".join(line for line in data.splitlines(keepends=True) if self.keep(line))


def write(out: IO[bytes], data: bytes) -> None:
    if data:
        out.write(data)
        out.flush()


def run_logs(spec: Optional[str], *, follow_on: bool = False, rank: Optional[int] = None,
             host: Optional[str] = None, tail: Optional[int] = None,
             console: Optional[Console] = None, out: Optional[IO[bytes]] = None) -> int:
    """Print a run's console (filtered, the last ``tail`` lines); with ``follow_on``,
    follow it to the run's end. 0, or 2 when no run is named."""
    console = console or Console()
    events = EventBus(console)
    folder = find_run(spec, "logs", events)
    if folder is None:
        return EXIT_USAGE
    out = out or sys.stdout.buffer
    keep = LineFilter(rank, host)
    path = folder / CONSOLE
    if tail is None:  # all of it, a chunk at a time (the rotated part first)
        rotated = path.with_name(path.name + ".1")
        if rotated.exists():
            for chunk in follow(rotated, 0, done=lambda: True):
                write(out, keep.lines(chunk))
        offset = 0
    else:
        data, offset = last_lines(path, None if keep.active else tail)
        lines = keep.lines(data).splitlines(keepends=True)
        write(out, b"".join(lines[-tail:]) if tail else b"")
    finished = ended_check(folder) if follow_on else (lambda: True)
    for chunk in follow(path, offset, done=finished):
        write(out, keep.lines(chunk))
    if not follow_on:
        return 0
    run = view(folder)
    if run.phase is RunState.LOST or keep.active:
        # the launcher's own last line was not in what was shown: say the end here
        ended(run, events)
    return 0


__all__ = ["LineFilter", "run_logs", "write"]
