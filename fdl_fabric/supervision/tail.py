"""The last stderr lines of each rank: what the root cause quotes when no error file came.

A rank that dies without torch's ``@record`` leaves its exception only on its stderr,
which on the console sits under every other rank's output (a gloo traceback per peer).
So each rank's stderr is followed as it arrives, on the session's reading thread, and
its last `TAIL_LINES` lines are kept, each cut to `LINE_CHARS` characters: a rank that
prints a 50 MB line, or a million lines, costs the launcher at most that much. A chunk
of many lines is cut from its end (`bytes.rsplit` with a bound), so the cost of a chunk
is the cost of its last lines, not of all of it.

The kept text is made inert (`visible`): the root cause is a launcher line, and nothing
a rank prints may move the operator's cursor or pass for a launcher line there.
"""

from __future__ import annotations

import threading
from collections import deque

from ..inert import latest_state, neutralize

#: Lines of a rank's stderr the root cause quotes.
TAIL_LINES = 20
#: Characters kept of each quoted line (a longer one ends in ``…``).
LINE_CHARS = 300
#: Bytes of a line decoded at most: enough for `LINE_CHARS` characters of UTF-8.
_LINE_BYTES = 4 * LINE_CHARS


def visible(text: str) -> str:
    """``text`` made inert as the console makes rank output (`inert.neutralize`: ESC
    ``^[``, DEL ``^?``, the C1 CSI ``M-^[``), a tab a space (a quoted line is indented)."""
    return neutralize(text.replace("\t", " "))


def _clip(line: str) -> str:
    return line if len(line) <= LINE_CHARS else line[:LINE_CHARS - 1] + "…"


class RankTail:
    """One rank's last stderr lines, fed chunk by chunk as the agent forwards them."""

    def __init__(self, lines: int = TAIL_LINES) -> None:
        self._lines: deque[str] = deque(maxlen=lines)
        self._size = lines
        #: The last line kept has no newline yet: the next chunk continues it.
        self._open = False
        self._lock = threading.Lock()

    def feed(self, data: bytes, partial: bool) -> None:
        """A chunk: whole lines (``partial`` false), or a piece of a line (true)."""
        body = data[:-1] if not partial and data.endswith(b"\n") else data
        pieces = body.rsplit(b"\n", self._size)
        continues = self._open
        if len(pieces) > self._size:  # the first piece will be pushed out: never decoded
            pieces, continues = pieces[1:], False
        with self._lock:
            for i, piece in enumerate(pieces):
                text = piece[:_LINE_BYTES].decode("utf-8", "replace")
                if i == 0 and continues and self._lines:
                    self._lines[-1] = _clip(latest_state(self._lines[-1] + text))
                else:
                    self._lines.append(_clip(latest_state(text)))
            self._open = partial

    def lines(self) -> list[str]:
        """The kept lines, oldest first, made inert (`visible`)."""
        with self._lock:
            return [visible(line) for line in self._lines]
