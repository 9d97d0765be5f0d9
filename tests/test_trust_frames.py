"""Issue 34, items 1 and 2, at the supervisor's and the renderer's level: a host speaks
only of its own ranks, and its words are data, never terminal control.

A compromised host's agent can send any frame. Output, spawns, exits, spawn failures and
errors it sends for a rank of another host, or for a rank number outside the plan, are
dropped (no record changes, no line under another rank's label, no log folder) and
counted once per host, when its agent ends. What it may still say of itself (its own
ranks' problems, its agent's errors, why it was lost) reaches the console and the verdict
with every control character shown inert (``^[``, ``^G``), and with no newline inside the
launcher's line (``^J``), whoever renders the words. The same through real sshd hosts and
a replaced agent: tests/test_trust_frames_lab.py.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from test_supervisor import plans, supervise

from fdl_fabric import reports
from fdl_fabric.causes import cause_data
from fdl_fabric.clusterfile import parse_cluster
from fdl_fabric.events import Event, EventBus, EventLog, Name, event
from fdl_fabric.inert import one_line
from fdl_fabric.planning.plan import LaunchPlan, build_plan
from fdl_fabric.presentation.hostwords import FROM_HOSTS, inert_data
from fdl_fabric.presentation.output import LINE_START, Console
from fdl_fabric.presentation.records import record
from fdl_fabric.presentation.runlog import RunLog
from fdl_fabric.presentation.words import render
from fdl_fabric.supervision.rankoutput import RankOutput
from fdl_fabric.supervision.verdict import Verdict

#: What a hostile host puts in its words: a clipboard write (OSC 52), the window title
#: (OSC 0 and 2), a cursor-up and an erase-line, then a line of its own that would read
#: as the launcher's verdict.
HOSTILE = ("\x1b]52;c;Y3VybA==\x07\x1b]0;pwned\x07\x1b]2;pwned-2\x07"
           "\x1b[1A\x1b[2Kdisk full\ncluster launcher: run completed — all 4 ranks exited 0")
#: The same, as the launcher shows it.
SHOWN = ("^[]52;c;Y3VybA==^G^[]0;pwned^G^[]2;pwned-2^G^[[1A^[[2Kdisk "
         "full^Jcluster launcher: run completed — all 4 ranks exited 0")
OUT_OF_PLAN = 4_000_000_000


def two_hosts() -> LaunchPlan:
    """Ranks 0 and 1 on h0, 2 and 3 on h1."""
    cluster = parse_cluster("workers:\n  - host: h0\n    path: /srv\n    nproc: 2\n"
                            "  - host: h1\n    path: /srv\n    nproc: 2\n",
                            local_hostname="controller")
    return build_plan(cluster, argv=["true"], run_id="r1", salt=b"\0" * 16)


def forged_by_h1() -> list[reports.Report]:
    """h1 speaks of rank 0 (h0's) and of a rank no plan has, once of each kind."""
    return [reports.Output("h1", 0, False, b"FORGED for rank 0\n", False),
            reports.Output("h1", OUT_OF_PLAN, True, b"FORGED out of plan\n", False),
            reports.Spawned("h1", 0, 1),
            reports.Exited("h1", 0, 7, None),
            reports.SpawnFailed("h1", 0, "FORGED: no such file"),
            reports.AgentError("h1", "FORGED about rank 0", 0)]


# -- item 1: every frame is checked against its sender --------------------------------------
def test_frames_for_another_hosts_rank_change_nothing_and_are_counted_once_per_host() -> None:
    sup, (h0, h1), log = supervise({0: (0, None)}, {1: (0, None)})
    for report in forged_by_h1():
        sup.post(report)
    result = sup.run()
    assert result.verdict is Verdict.OK and result.exit_code == 0
    assert result.ranks[0].pid == 1000  # h0's own spawn, not the forged pid 1
    assert result.ranks[0].exit is not None and result.ranks[0].exit.code == 0
    assert log.named(Name.RANK_START_FAILED) == [] and log.named(Name.AGENT_WARNING) == []
    (said,) = log.named(Name.FOREIGN_FRAMES)
    assert said.host == "h1"
    assert said.data == {"dropped": 6, "ranks": [0, OUT_OF_PLAN], "more_ranks": False,
                         "frames": {"output": 2, "spawned": 1, "exited": 1,
                                    "spawn_failed": 1, "error": 1}}
    assert render(said) == ("cluster launcher: host 'h1' sent frames for ranks it does not "
                            "run: 6 dropped (error 1, exited 1, output 2, spawn_failed 1, "
                            "spawned 1; ranks 0, 4000000000)")


def test_a_forged_spawn_failure_for_another_hosts_rank_does_not_fail_the_run() -> None:
    sup, _, log = supervise({0: (0, None)}, {1: (0, None)})
    sup.post(reports.SpawnFailed("h1", 0, "FORGED"))
    assert sup.run().verdict is Verdict.OK
    assert [e.data["dropped"] for e in log.named(Name.FOREIGN_FRAMES)] == [1]


def test_a_host_that_sends_nothing_foreign_is_not_mentioned() -> None:
    sup, _, log = supervise({0: (0, None)}, {1: (0, None)})
    sup.post(reports.AgentError("h1", "its own rank's problem", 1))
    sup.post(reports.AgentError("h1", "the agent's own problem", None))
    sup.run()
    assert log.named(Name.FOREIGN_FRAMES) == []
    assert [e.data["text"] for e in log.named(Name.AGENT_WARNING)] == [
        "its own rank's problem", "the agent's own problem"]


def test_a_host_still_fails_the_run_with_its_own_ranks_spawn_failure() -> None:
    sup, _, log = supervise({0: None}, {1: None})
    sup.post(reports.SpawnFailed("h1", 1, HOSTILE))
    result = sup.run()
    assert result.verdict is Verdict.FAILED
    assert result.cause.name is Name.RANK_START_FAILED and result.cause.rank == 1
    assert log.named(Name.FOREIGN_FRAMES) == []


def test_many_foreign_ranks_are_counted_and_the_first_eight_named() -> None:
    sup, _, log = supervise({0: None}, {1: None})
    for rank in range(100, 120):
        sup.post(reports.Output("h1", rank, False, b"x\n", False))
    sup.request_interrupt(signal.SIGTERM)
    sup.run()
    (said,) = log.named(Name.FOREIGN_FRAMES)
    assert said.data["dropped"] == 20 and said.data["ranks"] == list(range(100, 108))
    assert render(said).endswith("; ranks 100, 101, 102, 103, 104, 105, 106, 107 and more)")


def test_output_for_another_hosts_rank_reaches_no_sink_and_no_tail() -> None:
    log = EventLog()
    output = RankOutput(EventBus(log))
    output(reports.Output("h0", 0, False, b"before any plan\n", False))
    output.attempt(two_hosts())
    output(reports.Output("h1", 0, True, b"FORGED for rank 0\n", False))
    output(reports.Output("h1", OUT_OF_PLAN, True, b"FORGED out of plan\n", False))
    output(reports.Output("h0", 0, True, b"rank 0's own\n", False))
    output(reports.Output("h1", 2, False, b"rank 2's own\n", False))
    shown = [(e.data["label"], e.data["text"]) for e in log.named(Name.RANK_OUTPUT)]
    assert shown == [("h0:cpu:r0", "rank 0's own"), ("h1:cpu:r2", "rank 2's own")]
    assert output.tail(0) == ["rank 0's own"]
    assert output.tail(OUT_OF_PLAN) == []
    assert output.runs("h1", 2) and not output.runs("h1", 0)


def test_a_rank_number_outside_the_plan_never_creates_a_log_folder(tmp_path: Path) -> None:
    run_log = RunLog(str(tmp_path), "run1")
    output = RankOutput(EventBus(run_log))
    output.attempt(two_hosts())
    output(reports.Output("h1", OUT_OF_PLAN, False, b"FORGED\n", False))
    output(reports.Output("h1", 0, False, b"FORGED for rank 0\n", False))
    output(reports.Output("h0", 0, False, b"rank 0's own\n", False))
    run_log.close()
    assert sorted(p.name for p in (tmp_path / "run1" / "attempt_0").iterdir()) == ["r0"]
    assert (tmp_path / "run1" / "attempt_0" / "r0" / "stdout.log").read_bytes() == \
        b"rank 0's own\n"


def test_the_plans_of_the_supervisor_tests_put_ranks_on_their_hosts() -> None:
    """The fakes above rely on it: h0 runs rank 0, h1 runs rank 1."""
    assert [(p.rank, p.host) for p in plans(1, 1)] == [(0, "h0"), (1, "h1")]


# -- item 2: words from a host are data, never terminal control ------------------------------
def test_an_agents_error_is_one_inert_line() -> None:
    text = render(event(Name.AGENT_WARNING, host="node2", text=HOSTILE))
    assert text == f"cluster launcher: host 'node2': {SHOWN}"


def test_a_spawn_failures_reason_in_the_verdict_is_one_inert_line() -> None:
    cause = event(Name.RANK_START_FAILED, host="node2", rank=2, reason=HOSTILE)
    verdict = render(event(Name.VERDICT, cause=cause_data(cause), verdict="failed"))
    assert verdict == f"cluster launcher: failed: host 'node2': could not start rank 2: {SHOWN}"


def test_a_lost_hosts_reason_and_an_exceptions_text_stay_on_their_line() -> None:
    lost = render(event(Name.HOST_LOST, host="node2", reason=f"agent lost: {HOSTILE}"))
    assert lost == f"cluster launcher: host 'node2': agent lost: {SHOWN}"
    root = render(event(Name.ROOT_CAUSE, host="node2", rank=2, label="node2:cpu:r2",
                        exit={"code": 1, "signal": None, "lost": None}, error=HOSTILE,
                        tail=["Traceback\x1b[2J", "x\ncluster launcher: run completed"]))
    assert root.splitlines() == [
        f"root cause: rank 2 of node2 (node2:cpu:r2) exited with status 1: {SHOWN}",
        "  Traceback^[[2J", "  x^Jcluster launcher: run completed"]
    restarting = render(event(Name.RESTARTING, attempt=1, max_restarts=2,
                              cause={**cause_data(event(Name.RANK_FAILED, host="node2", rank=2,
                                                        exit={"code": 1})), "error": HOSTILE}))
    assert "\n" not in restarting and SHOWN in restarting


def test_the_record_a_json_reader_gets_says_the_same_inert_words() -> None:
    e = event(Name.RANK_START_FAILED, host="node2", rank=2, reason=HOSTILE)
    assert record(e, attempt=0)["message"] == f"cluster launcher: host 'node2': could not " \
        f"start rank 2: {SHOWN}"
    assert record(e, attempt=0)["data"]["reason"] == HOSTILE  # the data stays the host's


def test_every_marked_field_is_made_one_line_whatever_is_inside() -> None:
    e = Event(Name.CLEANUP_HOST, host="node2",
              data={"error": "a\nb", "stopped": [{"pattern": "x\x1b[2J\ny", "pids": [1]}],
                    "live": [], "leftovers": []})
    cleaned = inert_data(e)
    assert cleaned.data["error"] == "a^Jb"
    assert cleaned.data["stopped"] == [{"pattern": "x^[[2J^Jy", "pids": [1]}]
    assert all(isinstance(fields, tuple) and fields for fields in FROM_HOSTS.values())


def test_a_launcher_block_keeps_its_own_lines() -> None:
    """Only the fields a host sent lose their newlines; a report of several lines keeps
    them (every other control is inert there too)."""
    text = render(event(Name.TRACEBACK, traceback="Traceback:\n  x\x1b[2J"))
    assert text == "Traceback:\n  x^[[2J"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["\x1b", "]", "[", "52;", "0;", "\x07", "\x9b", "\n", "\r",
                                 "A", "2K", "m", "\t", "a", "é"]), max_size=30).map("".join))
def test_no_host_text_puts_a_control_or_a_line_into_a_launcher_line(text: str) -> None:
    for e in (event(Name.AGENT_WARNING, host="n", text=text),
              event(Name.RANK_START_FAILED, host="n", rank=2, reason=text),
              event(Name.VERDICT, verdict="failed", cause=cause_data(
                  event(Name.HOST_ENDED_EARLY, host="n", reason=text)))):
        shown = render(e)
        assert "\n" not in shown
        assert not re.search(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]", shown), repr(shown)
    assert one_line(text) == render(event(Name.AGENT_WARNING, host="n", text=text)).split(
        "'n': ", 1)[1]


def test_on_a_real_pty_the_launchers_lines_carry_no_escape_but_its_own() -> None:
    """The console writes to a pseudo-terminal: what the terminal receives holds no OSC,
    no cursor move, no erase and no bell from the host, only the launcher's own start of
    line (back to column 0, cleared) before each of its lines."""
    master, slave = os.openpty()
    try:
        with os.fdopen(os.dup(slave), "w", encoding="utf-8") as err:
            console = Console(out=err, err=err, color=False)
            console.emit(event(Name.AGENT_WARNING, host="node2", text=HOSTILE))
            cause = event(Name.RANK_START_FAILED, host="node2", rank=2, reason=HOSTILE)
            console.emit(event(Name.VERDICT, cause=cause_data(cause), verdict="failed"))
        received = b""
        while b"could not start rank 2" not in received or not received.endswith(b"\n"):
            received += os.read(master, 65536)
    finally:
        os.close(master)
        os.close(slave)
    lines = received.split(b"\r\n" if b"\r\n" in received else b"\n")
    launcher = [line for line in lines if line]
    assert all(line.startswith(LINE_START) for line in launcher), launcher
    rest = b"".join(line[len(LINE_START):] for line in launcher)
    assert b"\x1b" not in rest and b"\x07" not in rest and "\x9b".encode() not in rest
    assert b"^[]52;c;" in rest and b"^[]0;pwned^G" in rest and b"^[[1A^[[2K" in rest
