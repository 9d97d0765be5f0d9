"""A pre-flight probe's stdout or stderr, kept whole, with the moment the clock
sentinel's line arrived (`ProbeResult.clock_at`, for the clock-skew row).

One class for every kind: an invoke runner writes text to it (`write`, as a stream),
a gateway's relay feeds it bytes (`feed`, as a `ByteSink`).
"""

from __future__ import annotations

import time
from typing import Optional


class ClockedOutput:
    """Output kept whole; ``clock_at`` is when the line starting ``marker`` was complete."""

    def __init__(self, marker: str = "") -> None:
        self.parts: list[bytes] = []
        self.clock_at: Optional[float] = None
        self._marker = marker.encode()

    def feed(self, data: bytes) -> None:
        now = time.time()
        self.parts.append(data)
        if self.clock_at is None and self._marker:
            joined = b"".join(self.parts)
            at = joined.find(self._marker)
            if at >= 0 and b"\n" in joined[at:]:
                self.clock_at = now

    def write(self, text: str) -> int:
        self.feed(text.encode("utf-8", "surrogateescape"))
        return len(text)

    def close(self) -> None:
        return None

    def flush(self) -> None:
        return None

    def isatty(self) -> bool:
        return False

    @property
    def text(self) -> str:
        return b"".join(self.parts).decode("utf-8", "replace")
