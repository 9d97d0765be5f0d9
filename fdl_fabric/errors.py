"""Exit codes and the error that carries one: what every command promises its caller.

0 all went well, 1 the run (or a host) failed, 2 bad input: a usage or config error,
reported before anything was started. Every error a command reports is an `FdlError`
carrying its exit code, so each entry point has one catch site. A launch interrupted by
a signal exits 128 + the signal's number, like a shell (`supervisor.Verdict`).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


class FdlError(Exception):
    """The one error every command turns into a clear line and an exit code.

    ``exit_code`` is what the command exits with: 2 for a usage or config error (nothing
    was started), 1 for a host that cannot be reached or used. ``details`` are lines that
    come before the message (one per host, when several failed). `ConfigError` (a bad
    cluster file) is one, with exit code 2.
    """

    def __init__(self, message: str, exit_code: int = EXIT_FAILURE,
                 details: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.details = details


def usage(flag: str, message: str) -> FdlError:
    """A bad flag or value: exit 2, the flag named first."""
    return FdlError(f"{flag}: {message}", EXIT_USAGE)
