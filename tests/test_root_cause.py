"""The root cause shows the failure: each rank's stderr tail as output arrives, and the
rule for the ``@record`` hint (`supervision.tail`, `supervision.rootcause`).

The real launches that quote a rank's last lines are in tests/test_root_cause_lab.py.
"""

from __future__ import annotations

import pytest

from fdl_fabric import reports
from fdl_fabric.clusterfile import parse_cluster
from fdl_fabric.events import EventBus, EventLog, Name
from fdl_fabric.planning.plan import LaunchPlan, build_plan
from fdl_fabric.supervision.errorfile import RankError
from fdl_fabric.supervision.rankoutput import RankOutput
from fdl_fabric.supervision.records import RankExit
from fdl_fabric.supervision.rootcause import is_python, record_would_help
from fdl_fabric.supervision.tail import LINE_CHARS, TAIL_LINES, RankTail, visible


def plan_of_two() -> LaunchPlan:
    """Two ranks on this machine; no host is contacted."""
    cluster = parse_cluster("workers:\n  - host: localhost\n    nproc: 2\n    path: /srv\n",
                            local_hostname="x")
    return build_plan(cluster, argv=["python3", "t.py"], run_id="r", salt=b"\0" * 16)


def fed(*chunks: tuple[bytes, bool], lines: int = TAIL_LINES) -> list[str]:
    tail = RankTail(lines)
    for data, partial in chunks:
        tail.feed(data, partial)
    return tail.lines()


def test_a_tail_keeps_the_last_lines_of_every_chunk() -> None:
    many = b"".join(b"line %d\n" % i for i in range(1000))
    assert fed((many, False)) == [f"line {i}" for i in range(980, 1000)]
    assert fed((b"a\nb\n", False), (b"c\n", False), lines=2) == ["b", "c"]
    assert fed((b"only\n", False)) == ["only"]
    assert fed() == []


def test_a_line_forwarded_in_pieces_is_one_line_of_the_tail() -> None:
    assert fed((b"Value", True), (b"Error: bo", True), (b"om\nnext\n", False)) == [
        "ValueError: boom", "next"]
    # A last line without its newline (the rank's final flush) is kept as it is.
    assert fed((b"a\n", False), (b"no newline", True)) == ["a", "no newline"]
    # A chunk of more lines than the tail pushes an open line out whole.
    assert fed((b"open", True), (b"-rest\n" + b"x\n" * TAIL_LINES, False)) == \
        ["x"] * TAIL_LINES


def test_a_tail_is_bounded_per_line_and_per_rank() -> None:
    (line,) = fed((b"y" * 10_000_000 + b"\n", False))
    assert len(line) == LINE_CHARS and line.endswith("…")
    # A long line forwarded in many pieces stays as short.
    tail = RankTail()
    for _ in range(1000):
        tail.feed(b"z" * 65536, True)
    tail.feed(b"\n", False)
    assert [len(x) for x in tail.lines()] == [LINE_CHARS]


def test_a_tail_is_inert_and_shows_a_progress_bars_latest_state() -> None:
    assert fed((b"\x1b[2J\x1b]52;c;Y3VybA==\x07fake\n", False)) == ["^[[2J^[]52;c;Y3VybA==^Gfake"]
    assert visible("\x9b31mx\x7f\ty") == "M-^[31mx^? y"
    assert fed((b"  0%\r 50%\r100%\r\n", False)) == ["100%"]
    assert fed((b"\r 10%", True), (b"\r 90%", True), (b"\n", False)) == [" 90%"]
    assert fed((b"caf\xc3\xa9 \xff\n", False)) == ["café \ufffd"]


def test_rank_output_keeps_each_ranks_stderr_tail_whatever_the_console_shows() -> None:
    log = EventLog()
    output = RankOutput(EventBus(log))
    output.attempt(plan_of_two())
    output(reports.Output("localhost", 0, True, b"Traceback\nValueError: boom\n", False))
    output(reports.Output("localhost", 0, False, b"stdout is not quoted\n", False))
    output(reports.Output("localhost", 1, True, b"peer: gloo error\n", False))
    output(reports.Output("localhost", 7, True, b"a rank of no plan\n", False))
    assert output.tail(0) == ["Traceback", "ValueError: boom"]
    assert output.tail(1) == ["peer: gloo error"]
    assert output.tail(7) == []
    assert len(log.named(Name.RANK_OUTPUT)) == 3  # a rank of no plan reaches no sink (issue 34)
    output.attempt(plan_of_two())  # a restart: each attempt quotes its own lines
    assert output.tail(0) == []


@pytest.mark.parametrize(("argv", "python"), [
    (["python3", "train.py"], True),
    (["/usr/bin/python3.11", "-u", "-m", "pkg.train"], True),
    (["python", "-c", "raise SystemExit(1)"], True),
    (["pypy3", "t.py"], True),
    (["./train.py", "--lr", "1"], True),
    (["env", "-u", "X", "A=1", "python3", "t.py"], True),
    (["./train"], False),
    (["bash", "-c", "python3 t.py"], False),
    (["sh", "run.sh"], False),
    (["torchrun-like.sh"], False),
    ([], False),
])
def test_a_python_rank_is_known_by_its_argv(argv: list[str], python: bool) -> None:
    assert is_python(argv) is python


@pytest.mark.parametrize(("argv", "exit_", "hint"), [
    # An uncaught exception in an undecorated script: @record would have written it.
    (["python3", "t.py"], RankExit(code=1), True),
    # It wrote an error file: decorated already (or unreadable, but written).
    (["python3", "t.py"], RankExit(code=1, error=RankError("ValueError: x")), False),
    (["python3", "t.py"], RankExit(code=1, error_text="garbled"), False),
    # A native abort of a (decorated) script, a crash in an extension: a signal.
    (["python3", "t.py"], RankExit(signal=6), False),
    (["python3", "t.py"], RankExit(signal=11), False),
    # sys.exit(2), argparse's usage error: no exception for @record to write.
    (["python3", "t.py"], RankExit(code=2), False),
    # A compiled program, a shell rank.
    (["./train"], RankExit(code=1), False),
    (["sh", "-c", "exit 1"], RankExit(code=1), False),
    # A lost host: no status at all.
    (["python3", "t.py"], RankExit(lost="agent lost", host_fault="lost"), False),
])
def test_the_record_hint_is_given_only_where_record_would_have_helped(
        argv: list[str], exit_: RankExit, hint: bool) -> None:
    assert record_would_help(argv, exit_) is hint
