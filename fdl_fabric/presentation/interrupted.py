"""Where each rank was when the run was interrupted: its traceback, grouped, bounded.

On the first Ctrl-C (or a TERM, a HUP) every rank gets SIGINT, and a Python rank prints
its ``KeyboardInterrupt`` traceback: where it was. The console must still show the
verdict within the grace, whatever the terminal has left to take of the output before
(`screen.Screen.give_up_output`), and 64 ranks printing the same 20-line traceback
would flood it. So once interrupted, the console stops writing rank output and keeps
it here instead, per rank (its last `KEEP` lines); before the summary it shows each
distinct traceback once, with the ranks that printed it, as `stacks` groups identical
stacks (`stacks.groups`)::

    cluster launcher: where the ranks were when interrupted:
      ranks 0-2 (node0, node1):
        Traceback (most recent call last):
          File "/work/train.py", line 41, in <module>
            loss.backward()
        KeyboardInterrupt
      rank 3 (node1): no traceback

A traceback longer than `MAX_LINES` shows its first lines and its last (the innermost
frames and the exception, which say where); at most `MAX_GROUPS` groups are shown.
Every line not shown is counted in the console's "not shown" line; ``--log-dir``
keeps every byte. Text only, no I/O: `output.Console` writes it.
"""

from __future__ import annotations

import threading

from ..inert import shown_lines
from .stacks import rank_list

#: Lines of each rank's output kept after the interrupt (its last ones).
KEEP = 200
#: Lines of one traceback shown at most.
MAX_LINES = 12
#: Distinct tracebacks shown at most.
MAX_GROUPS = 6
#: How a Python traceback begins.
HEAD = "Traceback (most recent call last):"


def traceback_of(lines: list[str]) -> list[str]:
    """The last Python traceback in ``lines``: from its head to its exception line (the
    first line after it that is not indented), or [] when there is none."""
    starts = [i for i, line in enumerate(lines) if line.strip() == HEAD]
    if not starts:
        return []
    found = lines[starts[-1]:]
    for i, line in enumerate(found[1:], 1):
        if line and not line[0].isspace():
            return found[:i + 1]
    return found


def bounded(lines: list[str], limit: int = MAX_LINES) -> list[str]:
    """``lines``, or their first two and last ``limit - 3`` around a count of the rest."""
    if len(lines) <= limit:
        return lines
    tail = limit - 3
    return [*lines[:2], f"  … {len(lines) - 2 - tail} more line(s) …", *lines[-tail:]]


class Interrupted:
    """Rank output after the interrupt, kept per rank until `text` shows it grouped.
    Called from the sessions' reading threads (`add`) and the console's (`text`)."""

    def __init__(self, keep: int = KEEP) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._lines: dict[int, list[str]] = {}
        self._hosts: dict[int, str] = {}
        self._shown = False
        #: Lines of rank output that were not (and will not be) shown.
        self.hidden = 0

    def add(self, rank: int, host: str, text: str) -> None:
        """One chunk of a rank's output (lines joined by ``\\n``)."""
        lines = shown_lines(text, keep_sgr=False)
        with self._lock:
            if self._shown:
                self.hidden += len(lines)
                return
            kept = self._lines.setdefault(rank, [])
            self._hosts[rank] = host
            kept.extend(lines)
            if len(kept) > self._keep:
                self.hidden += len(kept) - self._keep
                del kept[:len(kept) - self._keep]

    def text(self) -> str:
        """The grouped view, once ("" when no rank printed anything); what comes after
        is counted, not shown."""
        with self._lock:
            if self._shown:
                return ""
            self._shown = True
            by_trace: dict[tuple[str, ...], list[int]] = {}
            for rank, lines in self._lines.items():
                by_trace.setdefault(tuple(traceback_of(lines)), []).append(rank)
            shown = 0
            out = ["cluster launcher: where the ranks were when interrupted:"]
            found = sorted(by_trace.items(), key=lambda kv: (not kv[0], len(kv[1]), min(kv[1])))
            for i, (trace, ranks) in enumerate(found):
                if i == MAX_GROUPS:
                    out.append(f"  … {len(found) - i} more group(s) (--log-dir keeps every "
                               "line)")
                    break
                ranks.sort()
                hosts = ", ".join(dict.fromkeys(self._hosts[r] for r in ranks))
                who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_list(ranks)}"
                if not trace:
                    out.append(f"  {who} ({hosts}): no traceback")
                    continue
                out.append(f"  {who} ({hosts}):")
                lines = bounded(list(trace))
                out += ["    " + line for line in lines]
                each = len(trace) if len(lines) == len(trace) else len(lines) - 1
                shown += each * len(ranks)  # one copy stands for every rank of the group
            total = sum(len(lines) for lines in self._lines.values())
            self.hidden += total - shown
            return "\n".join(out) if self._lines else ""
