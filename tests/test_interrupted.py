"""Issue 29, item 6: on Ctrl-C the ranks' "where it was" tracebacks are shown, each
distinct one once with the ranks that printed it, bounded (`presentation.interrupted`)."""

from __future__ import annotations

import io

from fdl_fabric.events import Event, Name, event
from fdl_fabric.presentation.interrupted import (
    MAX_GROUPS,
    MAX_LINES,
    Interrupted,
    bounded,
    traceback_of,
)
from fdl_fabric.presentation.output import Console


def trace(where: str = "time.sleep(30)", line: int = 3) -> str:
    return ("Traceback (most recent call last):\n"
            f'  File "/w/hang.py", line {line}, in <module>\n'
            f"    {where}\n"
            "KeyboardInterrupt")


def test_the_last_traceback_is_found_from_its_head_to_its_exception() -> None:
    lines = ["step 3", *trace().split("\n"), "bye"]
    assert traceback_of(lines) == trace().split("\n")
    assert traceback_of(["just output"]) == []


def test_a_long_traceback_keeps_its_first_lines_and_its_innermost_frames() -> None:
    lines = [f"line {i}" for i in range(40)]
    shown = bounded(lines)
    assert len(shown) == MAX_LINES
    assert shown[:2] == ["line 0", "line 1"] and shown[-1] == "line 39"
    assert shown[2] == f"  … {40 - 2 - (MAX_LINES - 3)} more line(s) …"


def test_identical_tracebacks_are_shown_once_with_their_ranks_the_odd_one_first() -> None:
    kept = Interrupted()
    for rank in range(4):
        kept.add(rank, "n0" if rank < 2 else "n1", trace())
    kept.add(4, "n1", trace("dist.all_reduce(t)", 7))
    kept.add(5, "n1", "saving a checkpoint")
    text = kept.text()
    assert text.split("\n") == [
        "cluster launcher: where the ranks were when interrupted:",
        "  rank 4 (n1):",
        *["    " + line for line in trace("dist.all_reduce(t)", 7).split("\n")],
        "  ranks 0-3 (n0, n1):",
        *["    " + line for line in trace().split("\n")],
        "  rank 5 (n1): no traceback"]
    assert kept.hidden == 1  # the checkpoint line
    assert kept.text() == ""  # once
    kept.add(0, "n0", "late\nlines")
    assert kept.hidden == 3


def test_many_distinct_tracebacks_and_a_flood_stay_bounded() -> None:
    kept = Interrupted(keep=50)
    for rank in range(20):
        kept.add(rank, "h", "\n".join(f"noise {i}" for i in range(100)) + "\n"
                 + trace(line=rank))
    text = kept.text().split("\n")
    assert len(text) <= 1 + MAX_GROUPS * (1 + MAX_LINES) + 1
    assert text[-1] == f"  … {20 - MAX_GROUPS} more group(s) (--log-dir keeps every line)"
    shown_traces = MAX_GROUPS * 4
    assert kept.hidden == 20 * 104 - shown_traces


def output(rank: int, text: str) -> Event:
    return Event(Name.RANK_OUTPUT, host="h", rank=rank,
                 data={"label": f"h:cpu:r{rank}", "text": text, "stderr": True,
                       "raw": text.encode(), "partial": False})


def test_the_console_shows_the_tracebacks_grouped_before_the_summary() -> None:
    out, err = io.StringIO(), io.StringIO()
    console = Console(out, err, color=False, threaded=True)
    console.emit(event(Name.STOPPING_ON_SIGNAL, signal="SIGINT", live=2, int_grace=1.0,
                       kill_grace=10.0))
    console.emit(output(0, trace()))
    console.emit(output(1, trace()))
    console.emit(event(Name.SUMMARY, ranks=[]))
    dropped = console.dropped
    console.close()
    text = err.getvalue()
    assert "[h:cpu:r0] Traceback" not in text  # not as raw rank output
    where = text.index("cluster launcher: where the ranks were when interrupted:\n"
                       "  ranks 0, 1 (h):\n    Traceback (most recent call last):\n")
    assert where < text.index("rank  host")  # before the summary
    assert text.count("KeyboardInterrupt") == 1 and dropped == 0
