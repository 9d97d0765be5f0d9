"""Rank output as the console shows it: every row behind the rank's prefix, inert.

A launcher line begins at column 0 with ``cluster launcher:`` (or ``root cause:``, a
table of the summary); a rank's row always begins with its ``[host:device:rN]``
prefix. For that to hold on the screen, three things must hold for what a rank sends:

* it cannot move the cursor or rewrite the screen (`inert.shown_lines`: controls
  and escapes shown inert, a ``\\r`` redraw shown as its latest state);
* it cannot start a row of its own: on a terminal a line longer than the width is cut
  here into rows that each carry the prefix (`inert.fold`), so the terminal never
  wraps it to a row that begins with the rank's own text;
* it cannot colour what follows it: a line that kept a colour ends with a reset.

Pure functions, no I/O: `output.Console` writes the block.
"""

from __future__ import annotations

from typing import Optional

from rich.cells import cell_len

from ..inert import fold, is_plain, shown_lines


def rank_block(label: str, text: str, *, width: Optional[int] = None,
               colour: Optional[str] = None) -> tuple[str, int]:
    """The rows of one chunk of a rank's output (``text``: lines joined by ``\\n``, no
    final newline), each behind ``[label]``, and how many rows: the whole lines when
    ``width`` is None (a pipe, a file), else rows that fit ``width`` terminal cells.
    ``colour`` is the prefix's ANSI colour code on a terminal."""
    tag = f"[{label}]"
    head = (f"\x1b[{colour}m{tag}\x1b[0m " if colour else tag + " ")
    room = None if width is None else width - cell_len(tag) - 1
    if is_plain(text) and (room is None or (text.isascii() and room >= 8 and max(
            map(len, text.split("\n"))) <= room)):
        # Plain lines that fit (every line of a pipe fits): one replace in C, as a chunk
        # of 8,192 lines must cost no more than a copy.
        return head + text.replace("\n", "\n" + head) + "\n", text.count("\n") + 1
    lines = shown_lines(text)
    if width is not None and room is not None:
        if room < 8:  # a terminal too narrow for the prefix: the rows wrap, prefix first
            room = max(width, 8)
        lines = [row for line in lines for row in fold(line, room)]
    return "".join(head + line + "\n" for line in lines), len(lines)


def cut_to_width(text: str, width: int) -> str:
    """Launcher text already laid out between words (`words.fit`), with each line that is
    still wider than ``width`` (one word longer than the line: a path in a traceback)
    cut at the edge here, its rows indented under it, so the terminal never wraps a row
    to column 0."""
    out: list[str] = []
    for line in text.split("\n"):
        if line.isascii() and len(line) <= width:
            out.append(line)
            continue
        indent = " " * min(len(line) - len(line.lstrip(" ")) + 2, width // 2)
        first, *rest = fold(line, width)
        rows = [first, *(fold("".join(rest), width - len(indent)) if rest else [])]
        short = ORPHAN - len(rows[-1])
        if len(rows) > 1 and short > 0 and len(rows[-2]) > 2 * ORPHAN:
            # No row of a lone '",' or ')': the last one takes a few characters more.
            rows[-2], rows[-1] = rows[-2][:-short], rows[-2][-short:] + rows[-1]
        out.append(rows[0])
        out += [indent + row for row in rows[1:]]
    return "\n".join(out)


#: The fewest characters the last row of a cut line gets.
ORPHAN = 8
