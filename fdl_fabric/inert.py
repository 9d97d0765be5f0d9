"""Text that came from a host or a rank, made inert before it reaches a person's screen.

A rank's bytes go to the operator's terminal, which obeys what it is sent: ``ESC[2J``
clears it, ``ESC]0;…`` retitles the window, ``ESC]52;…`` writes the clipboard, and
``\\r`` or ``ESC[A`` move the cursor back over lines the launcher already wrote, so a
rank could paint a fake summary or a fake "run completed" under the real verdict. So
everything shown on the console (rank output, and every string of an event's data,
which came from a host: an agent's error, a spawn failure's reason, a py-spy frame)
goes through this module first:

* Every C0 control character but the newline and the tab, DEL, and every C1 control
  (U+0080 to U+009F, of which U+009B is a one-character CSI) is shown in ``cat -v``'s
  caret notation: ``ESC[2J`` reads ``^[[2J``, a BEL ``^G``, U+009B ``M-^[``. Nothing
  a rank sends can move the cursor, erase, retitle or reach the clipboard.
* SGR colour sequences (``ESC[`` digits and ``;`` or ``:`` ``m``) may be kept for rank
  output (``keep_sgr``): colours cannot move anything, and training logs use them. A
  line that kept one ends with a reset (``ESC[0m``), so a rank cannot colour the next
  line, its prefix, or the launcher's lines. An unfinished or odd one (``ESC[31``, a
  parameter list longer than 32 characters) is not SGR and is shown inert.
* A ``\\r`` inside a line is a progress bar's redraw (tqdm): the line shows its latest
  state, the text after its last ``\\r`` (a trailing ``\\r``, as in ``\\r\\n``, does not
  count).
* Words a host sent that the launcher quotes inside one of its own lines (an agent's
  error, a spawn failure's reason, an exception's text: `one_line`) keep no newline
  either: it reads ``^J``, so a host cannot begin a line of its own, at column 0, that
  reads as the launcher's (``cluster launcher: run completed``).

``--log-dir`` keeps the raw bytes; only what is shown goes through here. Pure
functions, no I/O.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, TypeVar

from rich.cells import get_character_cell_size

#: A colour sequence kept when asked: CSI, parameters only, ``m``; bounded in length.
SGR = re.compile(r"\x1b\[[0-9;:]{0,32}m")
#: What a line that kept a colour ends with.
RESET = "\x1b[0m"
#: Characters a terminal acts on (C0 but tab and newline, DEL, C1).
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")
_CONTROL_NO_NL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
#: Tokens of a line with colours: a kept SGR, or one character.
_TOKENS = re.compile(SGR.pattern + r"|[\s\S]")


def _caret(char: str) -> str:
    """``cat -v``'s name of a control character."""
    code = ord(char)
    if code < 0x20:
        return "^" + chr(code + 64)
    if code == 0x7F:
        return "^?"
    return "M-^" + chr(code - 0x80 + 64) if code < 0xA0 else char


def _inert(text: str, pattern: re.Pattern[str]) -> str:
    return pattern.sub(lambda m: _caret(m.group()), text)


def one_line(text: str) -> str:
    """``text`` from a host as the launcher quotes it inside one of its lines: every
    control character shown inert, the newline too (``^J``); tabs stay. Line ends at its
    end say nothing and are left out."""
    if "\n" not in text and is_plain(text):
        return text
    return _inert(text.rstrip("\r\n"), _CONTROL)


def neutralize(text: str, *, keep_sgr: bool = False) -> str:
    """``text`` with every control character but ``\\n`` and ``\\t`` shown visibly; with
    ``keep_sgr``, well-formed SGR colours stay, and each line that kept one ends with a
    reset."""
    if is_plain(text):
        return text  # the common case: plain text, unchanged
    if not keep_sgr:
        return _inert(text, _CONTROL_NO_NL)
    return "\n".join(_line_with_colours(line) for line in text.split("\n"))


def _line_with_colours(line: str) -> str:
    parts: list[str] = []
    kept = False
    start = 0
    for m in SGR.finditer(line):
        parts.append(_inert(line[start:m.start()], _CONTROL))
        parts.append(m.group())
        kept = True
        start = m.end()
    parts.append(_inert(line[start:], _CONTROL))
    if kept:
        parts.append(RESET)
    return "".join(parts)


def is_plain(text: str) -> bool:
    """Nothing in ``text`` a terminal would act on but newlines and tabs: it is shown as
    it is. The common case, ASCII, is one pass of `bytes.translate` in C (about 5 times
    faster than the regular expression, which the rest falls back to)."""
    if text.isascii():
        return not text.encode("ascii").translate(None, _PLAIN_ASCII)
    return _CONTROL_NO_NL.search(text) is None


#: The ASCII a terminal only prints: what `is_plain` deletes before looking for the rest.
_PLAIN_ASCII = bytes(range(0x20, 0x7F)) + b"\n\t"


def latest_state(line: str) -> str:
    """A line as a terminal would leave it after ``\\r`` redraws (a progress bar): the
    text after its last carriage return, trailing ones aside."""
    body = line.rstrip("\r")
    cut = body.rfind("\r")
    return body if cut < 0 else body[cut + 1:]


def shown_lines(text: str, *, keep_sgr: bool = True) -> list[str]:
    """Rank output (lines joined by ``\\n``, no final newline) as the lines to show: each
    at its latest state, inert."""
    if is_plain(text):
        return text.split("\n")
    return [neutralize(latest_state(line), keep_sgr=keep_sgr) for line in text.split("\n")]


def fold(line: str, width: int) -> list[str]:
    """A shown line cut into rows of at most ``width`` terminal cells (colours take
    none; a tab is expanded first), so the terminal never wraps it itself: a row the
    terminal wrapped would begin at column 0 without the rank's prefix, where a rank
    could place text that reads like a launcher line. A cut row with a colour ends with
    a reset."""
    width = max(width, 1)
    if "\t" in line:
        line = line.expandtabs(8)
    if line.isascii() and len(line) <= width:
        return [line]
    rows: list[str] = []
    row: list[str] = []
    used = 0
    coloured = False
    for m in _TOKENS.finditer(line):
        token = m.group()
        if len(token) > 1:  # a kept SGR: no width
            row.append(token)
            coloured = coloured or token != RESET
            continue
        size = get_character_cell_size(token)
        if used + size > width and row:
            rows.append("".join(row) + (RESET if coloured else ""))
            row, used = [], 0
        row.append(token)
        used += size
    rows.append("".join(row))
    return rows


T = TypeVar("T")


def clean(value: T, *, lines: bool = False) -> T:
    """Every string inside ``value`` (dicts, lists, tuples, dataclasses such as an
    `Event`) neutralized, the rest unchanged: an event's data came from hosts. With
    ``lines``, each string is one line (`one_line`): no newline survives either."""
    found: list[str] = []
    if _strings(value, found):
        text = "".join(found)
        if is_plain(text) and not (lines and "\n" in text):
            # The common case, nothing a terminal acts on: the same object, not a copy.
            # One pass in C over every string joined: every event of 8,192 ranks is made
            # inert for its JSON line's words, and walking each string alone was a tenth
            # of the launch's CPU (issue 35).
            return value
    return _clean(value, one_line if lines else neutralize)  # type: ignore[no-any-return]


def _strings(value: Any, found: list[str]) -> bool:
    """Every string inside ``value``, keys too, appended to ``found``; False when it
    holds something else than strings, atoms, mappings, lists and tuples (then
    `_clean` walks it)."""
    kind = type(value)
    if kind is str:
        found.append(value)
    elif kind in _ATOMS:
        pass
    elif isinstance(value, dict):
        for k, v in value.items():
            if not (_strings(k, found) and _strings(v, found)):
                return False
    elif kind is list or kind is tuple:
        for v in value:
            if not _strings(v, found):
                return False
    elif isinstance(value, str):
        found.append(value)
    else:
        return False
    return True


def _clean(value: Any, inert: Callable[[str], str]) -> Any:
    kind = type(value)  # the common types first, by identity: every record walks here
    if kind is str:
        return inert(value)
    if kind is dict:
        return {_clean(k, inert): _clean(v, inert) for k, v in value.items()}
    if kind in _ATOMS:
        return value
    if isinstance(value, str):
        return inert(value)
    if isinstance(value, dict):
        return {_clean(k, inert): _clean(v, inert) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clean(v, inert) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _clean(getattr(value, f.name), inert)
                   for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)
    return value


#: Values with no string inside: left as they are.
_ATOMS = frozenset({int, float, bool, type(None)})


#: DEL, C1 controls and the Unicode line separators: JSON allows them raw inside strings,
#: where a terminal (``--json`` read with ``tail``) would still act on C1.
_JSON_RAW = re.compile("[\x7f-\x9f\u2028\u2029]")


def json_inert(line: str) -> str:
    """A JSON text (``json.dumps(..., ensure_ascii=False)``, which escapes C0 already)
    with C1 controls and U+2028/9 escaped too: the same JSON value, inert on a terminal."""
    return _JSON_RAW.sub(lambda m: f"\\u{ord(m.group()):04x}", line)
