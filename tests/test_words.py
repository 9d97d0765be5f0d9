"""The renderer: the one module whose tests assert English (every other test asserts data).

The lab tests check the same lines end to end on the console.
"""

from __future__ import annotations

import pytest

from fdl_fabric.events import Event, Name, event
from fdl_fabric.presentation.words import cause_data, has_words, render

EXIT_3 = {"code": 3, "signal": None, "lost": None}


def test_every_event_name_has_words() -> None:
    assert [n for n in Name if not has_words(n)] == []


@pytest.mark.parametrize(("cause", "line"), [
    (event(Name.EVERY_RANK_LOST, dead=3, world_size=3),
     "cluster launcher: every rank was lost; consensus checkpoint saved if a save path was armed"),
    (event(Name.MAX_FAILURE_EXCEEDED, dead=2, world_size=4, limit=2),
     "cluster launcher: max_failure exceeded (2/4 ranks dead, threshold 2); coordinator "
     "dispatched save-and-shutdown — consensus checkpoint saved if a save path was armed"),
    (event(Name.DEGRADED, dead=1, world_size=4),
     "cluster launcher: run completed DEGRADED — 1 of 4 ranks lost along the way (tolerated by "
     "elastic membership); survivors carried the full workload"),
    (event(Name.COMPLETED_TEARDOWN, tolerated=2, world_size=4),
     "cluster launcher: run completed; 2 child exit(s) in the teardown window were tolerated "
     "(never registered as rank deaths) — full workload delivered, nothing redistributed"),
    (event(Name.COMPLETED, world_size=4), "cluster launcher: run completed — all 4 ranks exited 0"),
    (event(Name.RANK_FAILED, host="h0", rank=1, exit=EXIT_3),
     "cluster launcher: rank 1 of h0 exited with status 3"),
    (event(Name.RANK_FAILED, host="h1", rank=1,
           exit={"code": None, "signal": None, "lost": "agent lost: connection reset"}),
     "cluster launcher: rank 1 of h1 exited with no exit status (agent lost: connection reset)"),
    (event(Name.INTERRUPTED, host="h1", signal="SIGTERM"),
     "cluster launcher: interrupted by SIGTERM on h1 — every rank was stopped"),
    (event(Name.INTERRUPTED, signal="SIGINT"),
     "cluster launcher: interrupted by SIGINT — every rank was stopped"),
    (event(Name.INTERRUPTED_BY_FORWARD, host="h1", rank=1, signal="SIGUSR1"),
     "cluster launcher: interrupted by SIGUSR1, which the launcher forwarded: rank 1 of h1 has "
     "no handler for it — every rank was stopped"),
    (event(Name.STOPPED_BY_CLEANUP, host="n1",
           by={"command": "inv cleanup --run-id r", "pid": 42, "host": "ctl"}),
     "cluster launcher: stopped by inv cleanup --run-id r (pid 42 on ctl) on n1 — every rank "
     "was stopped"),
    (event(Name.INTERRUPTED_OUTSIDE_RUN, signal="SIGINT", between_attempts=False),
     "cluster launcher: interrupted by SIGINT before any rank started — nothing is left "
     "running"),
    (event(Name.HUNG, silent=61.2, hang_timeout=60.0),
     "cluster launcher: run hung — no rank wrote a line or reported progress for 61s "
     "(hang_timeout 60s)"),
    (event(Name.COHORT_NOT_FORMED, missing=[2, 3], formation_timeout=0.3),
     "cluster launcher: cohort did not form within 0.3s: rank(s) [2, 3] never joined"),
    (event(Name.PREFLIGHT_FAILED, failures=2),
     "cluster launcher: pre-flight failed on 2 check(s), nothing was started "
     "(`fdl-fabric prebuild-check` with the same hosts checks more; --no-preflight skips "
     "this)"),
    (event(Name.RANK_START_FAILED, host="h1", rank=1, reason="train: not found on PATH"),
     "cluster launcher: host 'h1': could not start rank 1: train: not found on PATH"),
], ids=lambda v: v.name.value if isinstance(v, Event) else None)
def test_a_verdict_line_says_what_ended_the_run(cause: Event, line: str) -> None:
    assert render(cause) == line
    assert render(event(Name.VERDICT, cause=cause_data(cause), exit_code=1)) == line


def test_the_coordinator_speaks_as_the_coordinator() -> None:
    reached = event(Name.MAX_FAILURE_REACHED, dead=2, world_size=4, limit=2)
    assert render(reached) == "max_failure reached (2/4 dead, threshold 2)"
    assert render(event(Name.SHUTDOWN_BROADCAST, cause=cause_data(reached))) == (
        "cluster coordinator: max_failure reached (2/4 dead, threshold 2) — broadcasting "
        "save-and-shutdown")
    assert render(event(Name.RANK_DECLARED_DEAD, host="h1", rank=1, alive=1, world_size=2,
                        reason={"silent": 0.61, "heartbeat_timeout": 0.5})) == (
        "cluster coordinator: rank 1 declared dead (no frame for 0.6s, heartbeat timeout 0.5s); "
        "1 of 2 alive")
    assert render(event(Name.RANK_DECLARED_DEAD, host="h2", rank=2, alive=2, world_size=3,
                        reason={"exit": EXIT_3})) == (
        "cluster coordinator: rank 2 declared dead (status 3); 2 of 3 alive")


def test_the_summary_has_one_row_per_rank_with_its_exit_and_cause() -> None:
    rows = [
        {"rank": 0, "host": "a", "state": "succeeded", "exit": {"code": 0}, "duration": 1.0},
        {"rank": 1, "host": "b", "state": "failed", "exit": {"signal": 9}, "duration": 0.5},
        {"rank": 2, "host": "c", "state": "lost", "exit": {"lost": "x"}, "host_fault": "lost",
         "duration": 0.5},
        {"rank": 3, "host": "c", "state": "stopped", "exit": {"signal": 10},
         "stopped_by": "SIGUSR1", "duration": 0.5},
    ]
    lines = render(event(Name.SUMMARY, ranks=rows)).splitlines()
    assert lines[0].split() == ["rank", "host", "exit", "cause", "duration"]
    assert lines[1].split() == ["0", "a", "0", "ok", "1.0s"]
    assert lines[2].split() == ["1", "b", "signal", "9", "failed", "0.5s"]
    assert lines[3].split() == ["2", "c", "-", "host", "lost", "0.5s"]
    assert lines[4].split() == ["3", "c", "signal", "10", "stopped", "by", "SIGUSR1",
                                "(forwarded)", "0.5s"]


def test_the_attempts_table_and_a_restart_name_what_ended_each_attempt() -> None:
    cause = cause_data(event(Name.RANK_FAILED, host="h", rank=0, exit=EXIT_3),
                       error="ValueError: boom")
    table = render(event(Name.ATTEMPTS, attempts=[
        {"verdict": "failed", "cause": cause, "hosts": ["h", "g"]},
        {"verdict": "ok", "cause": cause_data(event(Name.COMPLETED, world_size=1)),
         "hosts": ["g"]}]))
    assert table.splitlines() == [
        "attempt  hosts  verdict  cause",
        "0        h,g    failed   rank 0 of h exited with status 3: ValueError: boom",
        "1        g      ok       run completed — all 1 ranks exited 0"]
    assert render(event(Name.RESTARTING, attempt=1, max_restarts=2, cause=cause,
                        hosts=["g", "s"], roster=2, world_size=4, readmitted=[],
                        spares=["s"], left_out={"h": "lost in attempt 0"})) == (
        "cluster launcher: attempt 0 failed (rank 0 of h exited with status 3: ValueError: "
        "boom); restarting every rank (restart 1 of 2) on 2 of 2 hosts (g, s), world size 4; "
        "spares in: s; left out: h lost in attempt 0")


def test_the_membership_verdicts_name_the_hosts_and_why_each_is_out() -> None:
    assert render(event(Name.NOT_ENOUGH_HOSTS, hosts=["node3"], min_hosts=2, attempt=1,
                        left_out={"node1": "lost in attempt 0", "node2": "unreachable"})) == (
        "cluster launcher: not enough hosts: 1 of min 2 (node1 lost in attempt 0, node2 "
        "unreachable)")
    assert render(event(Name.COMPLETED_ON_FEWER_HOSTS, hosts=2, roster=3, world_size=4,
                        left_out={"node2": "lost in attempt 0"})) == (
        "cluster launcher: run completed on 2 of 3 hosts (node2 lost in attempt 0) — "
        "DEGRADED: 4 ranks in the last attempt")


def test_the_root_cause_quotes_the_error_file_or_says_how_to_get_one() -> None:
    base = {"host": "h", "rank": 1, "label": "h:cpu:r1", "exit": EXIT_3, "host_fault": None}
    assert render(event(Name.ROOT_CAUSE, error="ValueError: boom",
                        tail=["File t.py, line 3", "ValueError: boom"], **base)) == (
        "root cause: rank 1 of h (h:cpu:r1) exited with status 3: ValueError: boom\n"
        "  File t.py, line 3\n  ValueError: boom")
    assert render(event(Name.ROOT_CAUSE, error=None, tail=[], record_hint=True,
                        **base)).endswith(
        "(no error file: decorate the entry point with torch's @record to see the exception "
        "here)")
    lost = {**base, "exit": {"code": None, "signal": None, "lost": "host unresponsive: x"},
            "host_fault": "unresponsive"}
    assert render(event(Name.ROOT_CAUSE, error=None, tail=[], **lost)) == (
        "root cause: rank 1 of h (h:cpu:r1) has no exit status: host unresponsive: x")


def test_without_an_error_file_the_root_cause_quotes_the_ranks_last_stderr_lines() -> None:
    base = {"host": "h", "rank": 1, "label": "h:cpu:r1", "host_fault": None, "error": None,
            "tail": []}
    exit_1 = {"code": 1, "signal": None, "lost": None}
    quoted = ["Traceback (most recent call last):", '  File "t.py", line 3, in <module>',
              "ValueError: boom"]
    assert render(event(Name.ROOT_CAUSE, exit=exit_1, stderr_tail=quoted, record_hint=True,
                        log="/logs/run/attempt_0/r1/stderr.log", **base)).splitlines() == [
        "root cause: rank 1 of h (h:cpu:r1) exited with status 1 (no error file: decorate the "
        "entry point with torch's @record to see the exception here)",
        "  its last 3 stderr line(s) (all of it in /logs/run/attempt_0/r1/stderr.log):",
        "  | Traceback (most recent call last):",
        '  |   File "t.py", line 3, in <module>',
        "  | ValueError: boom"]
    # No --log-dir: the root cause says how to keep the rest; no hint where @record would
    # not have helped (`rootcause.record_would_help`).
    text = render(event(Name.ROOT_CAUSE, exit=EXIT_3, stderr_tail=["usage: x"],
                        record_hint=False, log=None, **base))
    assert text.splitlines() == [
        "root cause: rank 1 of h (h:cpu:r1) exited with status 3",
        "  its last 1 stderr line(s) (add --log-dir to keep every rank's output):",
        "  | usage: x"]
    silent = render(event(Name.ROOT_CAUSE, exit=EXIT_3, stderr_tail=[], record_hint=False,
                          log=None, **base))
    assert silent.splitlines()[-1] == ("  it wrote nothing on stderr (add --log-dir to keep "
                                       "every rank's output)")


def test_an_error_files_root_cause_names_the_ranks_log_too() -> None:
    text = render(event(Name.ROOT_CAUSE, host="h", rank=0, label="h:cpu:r0", exit=EXIT_3,
                        host_fault=None, error="ValueError: boom", tail=["x"], stderr_tail=[],
                        record_hint=False, log="/l/r/attempt_0/r0/stderr.log"))
    assert text.splitlines() == [
        "root cause: rank 0 of h (h:cpu:r0) exited with status 3: ValueError: boom", "  x",
        "  its stderr: /l/r/attempt_0/r0/stderr.log"]


def test_the_quoted_lines_wrap_at_80_columns_under_the_root_cause() -> None:
    long = "RuntimeError: " + " ".join(["word"] * 30)
    text = render(event(Name.ROOT_CAUSE, host="h", rank=1, label="h:cpu:r1", exit=EXIT_3,
                        host_fault=None, error=None, tail=[], stderr_tail=[long],
                        record_hint=False, log=None), 80)
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), text
    assert lines[2].startswith("  | RuntimeError: word") and lines[3].startswith("    ")


@pytest.mark.parametrize(("verdict", "cause", "line"), [
    ("failed", event(Name.RANK_FAILED, host="node1", rank=3, exit={**EXIT_3, "code": 1}),
     "cluster launcher: failed: rank 3 of node1 exited with status 1"),
    ("hung", event(Name.HUNG, silent=61.2, hang_timeout=60.0),
     "cluster launcher: failed: run hung — no rank wrote a line or reported progress for 61s "
     "(hang_timeout 60s)"),
    ("failed", event(Name.LAUNCH_FAILED, error="coordinator could not bind x — nothing was "
                                              "started"),
     "cluster launcher: failed: coordinator could not bind x — nothing was started"),
    ("failed", event(Name.LAUNCH_FAILED, error="cluster launcher: cannot connect to host 'n'"),
     "cluster launcher: failed: cannot connect to host 'n'"),
    ("ok", event(Name.COMPLETED, world_size=4),
     "cluster launcher: run completed — all 4 ranks exited 0"),
    ("interrupted", event(Name.INTERRUPTED, signal="SIGINT"),
     "cluster launcher: interrupted by SIGINT — every rank was stopped"),
], ids=lambda v: v.name.value if isinstance(v, Event) else None)
def test_a_failed_runs_verdict_line_says_failed(verdict: str, cause: Event, line: str) -> None:
    assert render(event(Name.VERDICT, cause=cause_data(cause), verdict=verdict,
                        exit_code=1)) == line


def test_a_cleanup_says_per_host_what_it_stopped_and_what_it_left() -> None:
    stopped = [{"run": "r1", "ranks": [0], "pids": [41]},
               {"pattern": "train.py", "pids": [7, 8]}]
    live = [{"run": "r2", "launcher": "pid 9 on ctl"}]
    assert render(event(Name.CLEANUP_HOST, host="n1", stopped=stopped, leftovers=[],
                        error=None, live=live)) == (
        "cleanup: n1: stopped run r1 ranks [0] (pids [41]), 2 process(es) matching "
        "'train.py'; run r2 is live (pid 9 on ctl): left alone (name it with --run-id, or "
        "--force, to stop it)")
    assert render(event(Name.CLEANUP_HOST, host="n2", stopped=[], leftovers=[], error="refused",
                        live=[])) == "cleanup: n2: cleanup FAILED: refused"
    assert render(event(Name.CLEANUP_VERIFIED, hosts=2, stopped=1)) == (
        "cleanup: verified — nothing of the selected runs remains on 2 host(s) (1 run(s) "
        "stopped)")


def test_a_check_report_is_one_greppable_line_per_check_and_a_verdict() -> None:
    checks = [{"host": "n1", "check": "ssh", "status": "ok", "reason": "connected"},
              {"host": "n1", "check": "paths", "status": "FAIL", "reason": "/srv missing"}]
    lines = render(event(Name.CHECK_REPORT, checks=checks, ok=False)).splitlines()
    assert lines[0].split() == ["host", "check", "status", "detail"]
    assert lines[3].split() == ["n1", "paths", "FAIL", "/srv", "missing"]
    verdict = event(Name.CHECK_VERDICT, failed=True, counts={"FAIL": 1, "ok": 1}, hosts=1,
                    elapsed=0.5)
    assert render(verdict) == "prebuild-check: FAILED: 1 FAIL, 1 ok (1 host(s) in 0.50 s)"


def test_a_loopback_warning_names_eight_hosts_and_counts_the_rest() -> None:
    remote = {f"leaf{i:04d}": f"192.0.2.{i % 250}" for i in range(1, 993)}
    text = render(event(Name.PLAN_LOOPBACK_MASTER, address="127.0.0.1", remote=remote))
    assert "leaf0008 (192.0.2.8) and 984 more hosts dial it" in text
    assert "leaf0009" not in text and len(text) < 400
    one = render(event(Name.PLAN_LOOPBACK_MASTER, address="127.0.0.1",
                       remote={"gpu1": "192.0.2.1"}))
    assert "gpu1 (192.0.2.1) dial it" in one
