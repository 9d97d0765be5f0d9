"""A private log file that rotates past a size: what keeps a run's logs bounded.

A rank that prints without end must not fill the controller's disk: past ``max_bytes``
the file is renamed ``<name>.1`` (replacing the one before) and a new one is started,
so one log holds at most twice ``max_bytes``, the newest lines always kept. Files are
0600 and opened without following a link (`runlog.RunLog`'s rule: rank output may hold
tokens).
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Dict, Hashable, Optional


def open_private(path: str | Path, *, truncate: bool = False, new: bool = False) -> int:
    """A file descriptor of ``path`` for appending (or writing afresh), 0600, never
    through a link. ``new``: no chmod, as the caller knows the file is 0600 already, or
    will be made so (it made the folder, and the umask spares the owner:
    `umask_spares_owner`); a file made again in its place is never more open than 0600."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (
        os.O_TRUNC if truncate else os.O_APPEND)
    fd = os.open(path, flags, 0o600)
    if not new:
        os.fchmod(fd, 0o600)
    return fd


def umask_spares_owner() -> bool:
    """Whether this process's umask leaves the owner's bits alone, so that a folder made
    0700 and a file made 0600 get exactly those modes (read from ``/proc/self/status``:
    setting the umask to read it would change it for every thread meanwhile). False
    where it cannot be read: then every mode is set after the fact, as before."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8) & 0o700 == 0
    except (OSError, ValueError, IndexError):
        pass
    return False


class RotatingFile:
    """An append-only binary file of at most ``max_bytes`` (None: no bound), rotated to
    ``<name>.1``. Not thread-safe: its owner holds the lock.

    Its descriptor can be released and is opened again by the next write, so a log of
    thousands of ranks holds only the few files being written (`FilePool`)."""

    def __init__(self, path: str | Path, max_bytes: Optional[int] = None, *,
                 hold: bool = True, new: bool = False) -> None:
        """``path`` made (or opened) now; ``hold=False``: its descriptor released at
        once, until the first write (which learns the file's size then). ``new``: made
        in a folder the caller has just made (`open_private`), so it is empty. The path
        is kept as a string: a burst of 8,192 ranks' files is made here (issue 35), and
        `pathlib` cost more than the system calls."""
        self.path = str(path)
        self.max_bytes = max_bytes
        self.closed = False
        fd = open_private(self.path, new=new)
        #: Made new with its mode right (`open_private`): were it made again in its
        #: place (a user removed it), that mode would be right too, so a descriptor
        #: opened again needs no chmod.
        self._new = new
        #: The file's size is known: this object is its one writer from then on, so a
        #: descriptor opened again needs no fstat.
        self._known = new
        self._size = 0
        if hold:
            self._fd: Optional[int] = fd
            if not new:
                self._size = os.fstat(fd).st_size
                self._known = True
        else:
            os.close(fd)
            self._fd = None

    @property
    def holds_fd(self) -> bool:
        return self._fd is not None

    def _descriptor(self) -> int:
        if self._fd is None:
            self._fd = open_private(self.path, new=self._new)
            if not self._known:
                self._size = os.fstat(self._fd).st_size
                self._known = True
        return self._fd

    def write(self, data: bytes) -> None:
        fd = self._descriptor()
        if self.max_bytes is not None and self._size and \
                self._size + len(data) > self.max_bytes:
            fd = self._rotate(fd)
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        self._size += len(data)

    def _rotate(self, fd: int) -> int:
        os.close(fd)
        os.replace(self.path, self.path + ".1")
        self._fd = open_private(self.path, truncate=True)
        self._size = 0
        return self._fd

    def flush(self) -> None:
        """Every write goes straight to the file (one ``write(2)``): nothing to flush."""

    def release(self) -> None:
        """Close the descriptor; the file stays writable (reopened on the next write)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.release()


class FilePool:
    """Rotating files by key, at most ``open_max`` of them holding a descriptor: the
    least recently written is released first. Why: a run log of 8,192 ranks would
    otherwise hold 16,384 files open in the launcher, past a default RLIMIT_NOFILE."""

    def __init__(self, open_max: int) -> None:
        self.open_max = open_max
        self.files: Dict[Hashable, RotatingFile] = {}
        self._open: OrderedDict[Hashable, RotatingFile] = OrderedDict()

    def get(self, key: Hashable, make: Callable[[], RotatingFile]) -> RotatingFile:
        """The file of ``key`` (made by ``make`` the first time), counted as open."""
        file = self.files.get(key)
        if file is None:
            file = self.files[key] = make()
        self._open[key] = file
        self._open.move_to_end(key)
        while len(self._open) > self.open_max:
            _, oldest = self._open.popitem(last=False)
            oldest.release()
        return file

    def keep(self, key: Hashable, make: Callable[[], RotatingFile]) -> RotatingFile:
        """The file of ``key`` (made by ``make`` the first time, which must leave it
        without a descriptor), not counted as open until it is written."""
        file = self.files.get(key)
        if file is None:
            file = self.files[key] = make()
        return file

    def close(self) -> None:
        for file in self.files.values():
            with contextlib.suppress(OSError):
                file.close()
        self._open.clear()


class TextLog:
    """A `RotatingFile` as the text stream a `output.Console` writes to. Its lines are
    kept until `drain` (the run record drains it once per batch of its log's writer: a
    line per rank started and joined is 16,384 writes at 8,192 ranks, issue 35)."""

    #: Bytes kept at most before they are written anyway: a drain stays a small part of
    #: the file's bound, which it may pass by one drain.
    KEEP_BYTES = 64 << 10

    def __init__(self, file: RotatingFile) -> None:
        self.file = file
        self._lines: list[bytes] = []
        self._kept = 0

    def write(self, text: str) -> int:
        if not self.file.closed:
            data = text.encode("utf-8", "replace")
            self._lines.append(data)
            self._kept += len(data)
            if self._kept >= self.KEEP_BYTES:
                self.drain()
        return len(text)

    def drain(self) -> None:
        """What was written since, in one write (`RotatingFile.write` may raise). Called
        by the one thread that writes it (the log's writer, or its owner once that
        thread is gone)."""
        if self._lines:
            data, self._lines, self._kept = b"".join(self._lines), [], 0
            if not self.file.closed:
                self.file.write(data)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        raise OSError("a log file, not a terminal")


__all__ = ["FilePool", "RotatingFile", "TextLog", "open_private", "umask_spares_owner"]
