"""Layout for a terminal: words wrapped between words, tables aligned and fitted.

The words are one line per message, whatever its length: pipes, logs and greps get them
whole. Only a terminal gets them laid out for its width (`fit`): a line that fits stays
as it is, a longer one is wrapped between words with its continuation indented, and the
end-of-run tables (`table`) wrap their cause column in place. Part of the one renderer
(`words`), which lays out what it renders with these.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Optional

#: Continuation lines of a wrapped line are indented this much more than the line.
HANG = "  "
#: Narrower than this, no layout helps: lines are left to the terminal.
MIN_WIDTH = 20


def fit(text: str, width: int) -> str:
    """``text`` for a terminal ``width`` columns wide: each line that fits stays as it is;
    a longer one is wrapped between words (never inside one, never at a hyphen, so no
    ``)`` or half a word starts a line), its continuation lines indented by `HANG` more
    than it. A word longer than a whole line is left to the terminal."""
    if width < MIN_WIDTH:
        return text
    return "\n".join(_fit_line(line, width) for line in text.split("\n"))


def _fit_line(line: str, width: int) -> str:
    if len(line) <= width:
        return line
    indent = line[:len(line) - len(line.lstrip(" "))]
    hang = indent + HANG if len(indent + HANG) < width // 2 else indent
    lines = textwrap.wrap(line, width, subsequent_indent=hang, break_long_words=False,
                          break_on_hyphens=False)
    if len(lines) > 1 and len(lines[-1].strip()) <= _WIDOW and " " in lines[-2].strip():
        # A last line of one short word (``2``, ``r1)``) takes the word before it along.
        head, word = lines[-2].rsplit(" ", 1)
        last = f"{hang}{word} {lines[-1].strip()}"
        if len(last) <= width:
            lines[-2:] = [head.rstrip(), last]
    return "\n".join(lines) if lines else line


#: A wrapped line's last line is never this short a word alone.
_WIDOW = 3


#: The column of an end-of-run table that wraps when the table is wider than the
#: terminal (the cause, in both), and the narrowest it is made.
_WRAPPED_COLUMN = 3
_WRAPPED_MIN = 16


def table(header: Sequence[str], rows: Sequence[Sequence[str]],
          width: Optional[int] = None) -> str:
    """Aligned columns, two spaces apart. With ``width`` (a terminal) and a table wider
    than that, the cause column is narrowed and its cells wrapped between words inside
    it, the other cells on their row's first line; what still does not fit is `fit`."""
    cells = [tuple(header), *[tuple(r) for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    over = sum(widths) + 2 * (len(widths) - 1) - (width or 0)
    if width is None or over <= 0 or widths[_WRAPPED_COLUMN] <= _WRAPPED_MIN:
        text = "\n".join(_row(r, widths) for r in cells)
        return text if width is None else fit(text, width)
    widths[_WRAPPED_COLUMN] = max(_WRAPPED_MIN, len(header[_WRAPPED_COLUMN]),
                                  widths[_WRAPPED_COLUMN] - over)
    return fit("\n".join(line for row in cells for line in _wrapped_row(row, widths)), width)


def _row(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()


def _wrapped_row(row: Sequence[str], widths: Sequence[int]) -> list[str]:
    """One row whose cause cell is wrapped inside its column: the other cells on the
    first line, blanks under them."""
    col = _WRAPPED_COLUMN
    pieces = textwrap.wrap(row[col], widths[col], break_on_hyphens=False) or [""]
    return [_row([piece if j == col else (c if i == 0 else "") for j, c in enumerate(row)],
                 widths)
            for i, piece in enumerate(pieces)]
