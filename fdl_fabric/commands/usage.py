"""invoke's parse errors in the user's words, one line naming the flag as typed: the
same for ``fdl-fabric`` (`cli`) and ``inv`` (`fdl_fabric.tasks`), which both import it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence

from invoke.exceptions import ParseError


def usage_line(exc: ParseError, argv: Sequence[str] = (), binary: str = "fdl-fabric") -> str:
    """invoke's parse error as one line that names the flag as typed: ``--kill-grace:
    expected a value``, not ``Flag <Argument: kill_grace (k)> needed value ...``."""
    text = str(exc)
    task = getattr(exc.context, "name", None)
    where = f"{binary} {task} --help" if task else f"{binary} --help"
    flag = re.fullmatch(r"Flag <Argument: ([\w-]+)[^>]*> (needed value and was not given one|"
                        r"doesn't take any value)!", text)
    if flag is not None:
        name = f"--{flag.group(1).replace('_', '-')}"
        what = "expected a value" if flag.group(2).startswith("needed") else "takes no value"
        return f"{name}: {what} ({where} lists the flags)"
    unknown = re.fullmatch(r"No idea what (.*) is!", text, re.DOTALL)
    try:
        word = ast.literal_eval(unknown.group(1)) if unknown is not None else None
    except (ValueError, SyntaxError):
        word = None
    if not isinstance(word, str):
        return " ".join(text.split())
    if word.startswith("-"):
        return f"{word}: no such flag ({where} lists the flags)"
    for given in argv:  # `--dry-run=1`: invoke hands the value on as a word of its own
        if given.endswith(f"={word}") and given.startswith("-"):
            return (f"{given.split('=', 1)[0]}: takes no value, got {given!r} ({where} "
                    "lists the flags)")
    if task is None:
        return f"{word}: no such command ({binary} --help lists them)"
    return f"{word!r}: unexpected word ({where} lists the flags and arguments)"
