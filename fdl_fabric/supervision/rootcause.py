"""The root cause of a failed run: the first failed rank, and what shows why it failed.

torchrun's summary names the first failed rank and quotes its error file. Most scripts
are not decorated with torch's ``@record``, so most failures come without one; then
the rank's own last stderr lines (`supervision.tail`) are the evidence, and the root
cause carries them, with the path of the rank's full log when ``--log-dir`` keeps one.

Whether to suggest ``@record`` is a fact decided here (`record_would_help`), so the
words (`presentation.words`) only say it. The rule:

- the rank wrote no error file (a decorated entry point writes one for any uncaught
  exception, so an error file means the decoration is there, or was not needed);
- the rank is a Python program (`is_python`): its argv runs a Python interpreter
  (``python``, ``python3.11``, ``-m module`` included), or a ``.py`` script directly;
  a compiled program or a shell command (``sh -c …``) cannot use ``@record``;
- it exited with status 1, the status of an uncaught Python exception. A signal (a
  native abort, SIGABRT, or a SIGSEGV in an extension, of a decorated script too) and
  any other status (``sys.exit(2)``, argparse's usage error) are not exceptions that
  ``@record`` would have written down.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Callable, Optional

from ..events import Event, Name, event
from .records import RankExit, RunResult
from .verdict import Verdict

#: A Python interpreter's name: python, python3, python3.11, pypy3.
_PYTHON_RE = re.compile(r"(python|pypy)[0-9.]*")
#: The options of ``env`` that take a value as the next word.
_ENV_VALUED = ("-u", "--unset", "-C", "--chdir")
#: An ``env`` prefix's assignments (``env A=1 python3 …``).
_ASSIGNMENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*", re.S)


def is_python(argv: Sequence[str]) -> bool:
    """The rank runs a Python interpreter or a ``.py`` script (after an ``env`` prefix)."""
    words = list(argv)
    if words and os.path.basename(words[0]) == "env":
        words = words[1:]
        while words and (words[0].startswith("-") or _ASSIGNMENT_RE.fullmatch(words[0])):
            words = words[2:] if words[0] in _ENV_VALUED else words[1:]
    if not words:
        return False
    program = os.path.basename(words[0])
    return bool(_PYTHON_RE.fullmatch(program)) or program.endswith(".py")


def record_would_help(argv: Sequence[str], exit_: RankExit) -> bool:
    """Whether decorating the entry point with torch's ``@record`` would have put this
    failure in an error file (the rule in the module's docstring)."""
    wrote = exit_.error is not None or bool(exit_.error_text.strip())
    return not wrote and exit_.code == 1 and exit_.signal is None and is_python(argv)


def root_error(result: RunResult) -> Optional[str]:
    """The exception the root-cause rank's error file names, if it wrote one."""
    rank = result.root_cause
    if rank is None or rank.exit is None or rank.exit.error is None:
        return None
    return rank.exit.error.message


def root_cause(result: RunResult, *, stderr_tail: Callable[[int], list[str]],
               log_of: Callable[[int], Optional[str]]) -> Optional[Event]:
    """The first failed rank, with what its error file says (as torchrun's summary) or,
    without one, its last stderr lines (``stderr_tail``) and its log (``log_of``: the
    path of its stderr.log, None without ``--log-dir``); for a rank whose host was lost
    or stopped answering, that (no error file could come)."""
    rank = result.root_cause
    if rank is None or result.verdict is Verdict.OK or rank.exit is None:
        return None
    error = rank.exit.error
    quoted = stderr_tail(rank.rank) if error is None else []
    return event(Name.ROOT_CAUSE, host=rank.host, rank=rank.rank, label=rank.plan.label,
                 exit=rank.exit.data, host_fault=rank.exit.host_fault,
                 error=error.message if error is not None else None,
                 tail=error.traceback_tail() if error is not None else [],
                 stderr_tail=quoted, log=log_of(rank.rank),
                 record_hint=record_would_help(rank.plan.argv, rank.exit))
