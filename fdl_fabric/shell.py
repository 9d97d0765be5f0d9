"""Shell words: the one place where values are quoted for a shell or split from one.

Every value that reaches a shell goes through `quote` exactly once (`shlex.quote`), so
env values, arguments and paths arrive byte for byte. Ranks themselves are started
without a shell (the agent execs their argv), so quoting is left for the few command
lines that still pass through a login shell: the agent's own start, and pre-flight
scripts.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from typing import Optional


def quote(value: str) -> str:
    """Quote one value for a POSIX shell."""
    return shlex.quote(value)


_SHELL_SPACE_RE = re.compile(r"[ \t\r\n]+")
_SHELL_PLAIN_RE = re.compile(r"[^ \t\r\n'\"\\]+")
_SHELL_DOUBLE_RE = re.compile(r'[^"\\]+')


def shell_words(text: str) -> list[str]:
    """Exactly ``shlex.split(text)``, in linear time.

    shlex grows each word one character at a time, which is quadratic in the length of a
    word: a 20 MB one-word command took minutes. Rules (POSIX mode, no comments): words are
    separated by space, tab, CR and LF; ``'...'`` is literal; in ``"..."`` a backslash escapes
    only ``"`` and ``\\``; elsewhere a backslash escapes any character. Raises ValueError with
    shlex's messages ("No closing quotation", "No escaped character").
    """
    words: list[str] = []
    parts: list[str] = []
    in_word = False
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in " \t\r\n":
            if in_word:
                words.append("".join(parts))
                parts, in_word = [], False
            i = _match_end(_SHELL_SPACE_RE, text, i)
            continue
        in_word = True
        if c == "'":
            end = text.find("'", i + 1)
            if end < 0:
                raise ValueError("No closing quotation")
            parts.append(text[i + 1 : end])
            i = end + 1
        elif c == '"':
            i += 1
            while True:
                end = _match_end(_SHELL_DOUBLE_RE, text, i)
                parts.append(text[i:end])
                i = end
                if i >= n:
                    raise ValueError("No closing quotation")
                if text[i] == '"':
                    i += 1
                    break
                if i + 1 >= n:  # a backslash ends the text
                    raise ValueError("No escaped character")
                escaped = text[i + 1]
                parts.append(escaped if escaped in '"\\' else "\\" + escaped)
                i += 2
        elif c == "\\":
            if i + 1 >= n:
                raise ValueError("No escaped character")
            parts.append(text[i + 1])
            i += 2
        else:
            end = _match_end(_SHELL_PLAIN_RE, text, i)
            parts.append(text[i:end])
            i = end
    if in_word:
        words.append("".join(parts))
    return words


def _match_end(pattern: re.Pattern[str], text: str, start: int) -> int:
    match = pattern.match(text, start)
    return match.end() if match else start


def split_command(command: str) -> list[str]:
    """Shell words of a ``command`` string from cluster.yml or ``--cmd``.

    The command is split into argv and each word reaches the rank exactly; shell
    syntax (pipes, ``&&``) is not interpreted. Wrap the command in ``bash -c '...'`` to
    use it.
    """
    try:
        words = shell_words(command)
    except ValueError as exc:
        raise ValueError(f"cannot split command {command!r}: {exc}") from None
    if not words:
        raise ValueError("the command is empty")
    return words


def command_words(words: Sequence[str], cmd: Optional[str],
                  file_command: Optional[str]) -> list[str]:
    """The rank program's argv: the words after ``--`` as typed, else ``--cmd``, else the
    cluster file's ``command:``. The one rule for launch, prebuild-check and dry runs;
    ValueError when there is none or it cannot be split."""
    if words:
        return list(words)
    text = cmd if cmd is not None else file_command
    if not text:
        raise ValueError("no command to run: set `command:` in the file, or pass --cmd \"...\" "
                         "or `-- prog args`")
    return split_command(text)
