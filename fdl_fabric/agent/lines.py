"""Rank output as whole-line chunks: what the agent forwards, in linear time.

A rank writes bytes; the launcher prints lines, prefixed per rank, and two ranks
must never mix inside a line. So the agent cuts each stream at its last newline and
forwards everything before it as one chunk of whole lines. The unfinished tail waits
for more bytes, as a list of pieces that is joined once (re-joining it for every read
made a 50 MB line cost minutes). A line longer than `wire.MAX_LINE_PIECE` is
forwarded in pieces of that size, so neither end ever holds more than that of it.
"""

from __future__ import annotations

from typing import List, Tuple


class LineSplitter:
    """Cuts one stream into chunks that end at a line boundary."""

    def __init__(self, max_piece: int) -> None:
        self.max_piece = max_piece
        self._pending: List[bytes] = []
        self._pending_size = 0

    def feed(self, data: bytes) -> List[Tuple[bytes, bool]]:
        """Chunks ready to forward, each with ``partial`` (true: no newline at its end)."""
        cut = data.rfind(b"\n")
        if cut < 0:
            self._pending.append(data)
            self._pending_size += len(data)
            if self._pending_size < self.max_piece:
                return []
            return self._pieces()
        head = data[:cut + 1]
        if self._pending:
            self._pending.append(head)
            head = b"".join(self._pending)
            self._pending = []
            self._pending_size = 0
        tail = data[cut + 1:]
        if tail:
            self._pending = [tail]
            self._pending_size = len(tail)
        return [(head, False)]

    def _pieces(self) -> List[Tuple[bytes, bool]]:
        joined = b"".join(self._pending)
        out = []
        start = 0
        while len(joined) - start >= self.max_piece:
            out.append((joined[start:start + self.max_piece], True))
            start += self.max_piece
        rest = joined[start:]
        self._pending = [rest] if rest else []
        self._pending_size = len(rest)
        return out

    def flush(self) -> List[Tuple[bytes, bool]]:
        """At end of stream: the last line, even without its newline."""
        if not self._pending:
            return []
        rest = b"".join(self._pending)
        self._pending = []
        self._pending_size = 0
        return [(rest, True)]
