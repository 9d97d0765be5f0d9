"""A private log file that rotates past a size: what keeps a run's logs bounded.

A rank that prints without end must not fill the controller's disk: past ``max_bytes``
the file is renamed ``<name>.1`` (replacing the one before) and a new one is started,
so one log holds at most twice ``max_bytes``, the newest lines always kept. Files are
0600 and opened without following a link (`output.RunLog`'s rule: rank output may hold
tokens).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def open_private(path: Path, *, truncate: bool = False) -> int:
    """A file descriptor of ``path`` for appending (or writing afresh), 0600, never
    through a link."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (
        os.O_TRUNC if truncate else os.O_APPEND)
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)
    return fd


class RotatingFile:
    """An append-only binary file of at most ``max_bytes`` (None: no bound), rotated to
    ``<name>.1``. Not thread-safe: its owner holds the lock."""

    def __init__(self, path: Path, max_bytes: Optional[int] = None) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._fd = open_private(path)
        self._size = os.fstat(self._fd).st_size
        self.closed = False

    def write(self, data: bytes) -> None:
        if self.max_bytes is not None and self._size and \
                self._size + len(data) > self.max_bytes:
            self._rotate()
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        self._size += len(data)

    def _rotate(self) -> None:
        os.close(self._fd)
        os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        self._fd = open_private(self.path, truncate=True)
        self._size = 0

    def flush(self) -> None:
        """Every write goes straight to the file (one ``write(2)``): nothing to flush."""

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self._fd)


class TextLog:
    """A `RotatingFile` as the text stream a `output.Console` writes to."""

    def __init__(self, file: RotatingFile) -> None:
        self.file = file

    def write(self, text: str) -> int:
        if not self.file.closed:
            self.file.write(text.encode("utf-8", "replace"))
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        raise OSError("a log file, not a terminal")


__all__ = ["RotatingFile", "TextLog", "open_private"]
