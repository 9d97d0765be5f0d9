"""Exit codes and the error that carries one: what every command promises its caller.

0 all went well, 1 the run (or a host) failed, 2 bad input: a usage or config error,
reported before anything was started. A launch interrupted by a signal exits 128 + the
signal's number, like a shell (`supervisor.Verdict`).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


class LaunchError(Exception):
    """A launch, cleanup or check cannot go on; the message names the host, key or flag.

    ``exit_code`` is what the task exits with: 2 for a usage or config error (nothing
    was started), 1 for a host that cannot be reached or used.
    """

    def __init__(self, message: str, exit_code: int = EXIT_FAILURE,
                 details: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        #: Lines that come before the message (one per host, when several failed).
        self.details = details
