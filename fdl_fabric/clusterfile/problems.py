"""Problems in a cluster file, and the one error that carries them all (exit 2).

A bad file never half-loads: every problem found is collected with its file, key path
and line, sorted, and raised together as one `ConfigError`, so a user fixes the file in
one pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import EXIT_USAGE, FdlError
from ..limits import FILE_MAX_BYTES
from .names import KEY_MAX, MESSAGE_MAX, clip


@dataclass(frozen=True)
class Problem:
    """One mistake, located well enough that an editor can jump to it (``file:line:``)."""

    file: str
    key: str
    line: Optional[int]
    message: str

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        # A problem with the file as a whole (not found, not a mapping) has no key path.
        return f"{where}: {self.key}: {self.message}" if self.key else f"{where}: {self.message}"


class ConfigError(FdlError):
    """One or more problems in a cluster file. str() lists every problem, one per line."""

    def __init__(self, problems: list[Problem]) -> None:
        # Passing the list (not the rendered text) to Exception keeps the error picklable,
        # so it survives being raised inside a worker process.
        Exception.__init__(self, list(problems))
        self.problems: list[Problem] = list(problems)
        self.exit_code = EXIT_USAGE
        self.details = ()

    def __str__(self) -> str:
        return "\n".join(str(p) for p in self.problems)


def make_problem(file: str, key: str, line: Optional[int], message: str) -> Problem:
    """A problem with every part shortened and printable (see `names.clip`)."""
    return Problem(clip(file, 4096), clip(key, KEY_MAX), line, clip(message, MESSAGE_MAX))


def file_too_big(size: int, at_least: bool = False) -> str:
    """``at_least``: reading stopped early, so ``size`` is a lower bound."""
    more = "at least " if at_least else ""
    return (
        f"file is {more}{size} bytes; a cluster file may have at most {FILE_MAX_BYTES} "
        f"bytes ({FILE_MAX_BYTES >> 20} MiB)"
    )
