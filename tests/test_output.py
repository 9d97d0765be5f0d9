"""Presentation: prefixes, whole lines, colors, redaction, the summary table."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from fdl_fabric.commands import PID_MARKER
from fdl_fabric.events import Event, Kind
from fdl_fabric.output import (
    Console,
    RankStream,
    RunLog,
    redact_env,
    summary_table,
    use_color,
)


def _console(**kw: object) -> tuple[Console, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    return Console(out, err, color=False, **kw), out, err  # type: ignore[arg-type]


def test_only_whole_lines_are_written_with_the_rank_prefix() -> None:
    console, out, _ = _console()
    stream = RankStream(console, "h:cpu:r3", stderr=False)
    stream.write("par")
    assert out.getvalue() == ""
    stream.write("tial\nnext")
    assert out.getvalue() == "[h:cpu:r3] partial\n"
    stream.close()
    assert out.getvalue() == "[h:cpu:r3] partial\n[h:cpu:r3] next\n"


def test_the_pid_marker_is_consumed_not_shown() -> None:
    console, _, err = _console()
    pids: list[int] = []
    stream = RankStream(console, "h:0:r0", stderr=True, on_pid=pids.append)
    stream.write(f"{PID_MARKER}4242\nreal error\n")
    assert pids == [4242] and err.getvalue() == "[h:0:r0] real error\n"


def test_rank_output_is_also_kept_in_the_log_file(tmp_path: Path) -> None:
    console, _, _ = _console()
    log = RunLog(str(tmp_path), "run1")
    stream = RankStream(console, "h:cpu:r1", stderr=False, log=log.rank_file(1, "stdout"))
    stream.write("a\nb")
    stream.close()
    assert (tmp_path / "run1" / "r1" / "stdout.log").read_text() == "a\nb\n"


def test_events_are_written_as_timestamped_json_lines(tmp_path: Path) -> None:
    log = RunLog(str(tmp_path), "run1")
    log.emit(Event(Kind.DEATH, "rank 2 died", host="h", rank=2))
    log.close()
    line = json.loads((tmp_path / "run1" / "events.jsonl").read_text())
    assert line["event"] == "death" and line["rank"] == 2 and line["time"] > 0


def test_quiet_console_hides_rank_output_but_not_events() -> None:
    console, out, err = _console(show_rank_output=False)
    console.rank_line("h:cpu:r0", "noise", stderr=False)
    console.emit(Event(Kind.DEATH, "cluster launcher: rank 0 of h exited with status 3"))
    assert out.getvalue() == "" and "status 3" in err.getvalue()


def test_routine_events_need_verbose() -> None:
    console, _, err = _console()
    console.emit(Event(Kind.SPAWN, "started h:cpu:r0"))
    console.emit(Event(Kind.JOIN, "rank 0 joined"))
    assert err.getvalue() == ""
    verbose, _, err2 = _console(verbosity=2)
    verbose.emit(Event(Kind.SPAWN, "started h:cpu:r0"))
    assert "started" in err2.getvalue()


def test_prefix_colors_are_per_host_and_only_when_asked() -> None:
    out = io.StringIO()
    console = Console(out, io.StringIO(), color=True)
    console.rank_line("a:cpu:r0", "x", stderr=False)
    console.rank_line("b:cpu:r1", "y", stderr=False)
    first, second = out.getvalue().splitlines()
    assert first.startswith("\x1b[36m[a:cpu:r0]") and second.startswith("\x1b[33m[b:cpu:r1]")


def test_no_color_env_and_non_terminals_turn_colors_off(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert use_color(Tty())
    assert not use_color(io.StringIO())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not use_color(Tty())


def test_secret_looking_values_are_redacted() -> None:
    env = {"WANDB_API_KEY": "k", "HF_TOKEN": "t", "DB_PASSWORD": "p", "LR": "0.1",
           "FLODL_INTERNAL_CLUSTER_KEY": "abc"}
    assert redact_env(env) == {"WANDB_API_KEY": "***", "HF_TOKEN": "***", "DB_PASSWORD": "***",
                               "LR": "0.1", "FLODL_INTERNAL_CLUSTER_KEY": "abc"}


def test_summary_table_has_one_row_per_rank() -> None:
    text = summary_table([(0, "a", "0", "ok", "1.0s"), (1, "b", "signal 9", "failed", "0.5s")])
    lines = text.splitlines()
    assert lines[0].split() == ["rank", "host", "exit", "cause", "duration"]
    assert lines[2].split()[:4] == ["1", "b", "signal", "9"] and "failed" in lines[2]


def test_plot_run_draws_each_rank_the_formation_and_deaths(tmp_path: Path) -> None:
    from fdl_fabric.plot import plot_run

    run = tmp_path / "run1"
    run.mkdir()
    events = [
        {"time": 0.0, "event": "launch", "message": "run"},
        {"time": 0.1, "event": "spawn", "message": "s", "host": "a", "rank": 0},
        {"time": 0.1, "event": "spawn", "message": "s", "host": "b", "rank": 1},
        {"time": 0.5, "event": "formed", "message": "f"},
        {"time": 1.0, "event": "tolerated", "message": "t", "host": "b", "rank": 1},
        {"time": 2.0, "event": "exit", "message": "e", "host": "a", "rank": 0, "ok": True},
        {"time": 2.1, "event": "verdict", "message": "v"},
    ]
    (run / "events.jsonl").write_text("\n".join(json.dumps(e) for e in events))
    svg = plot_run(str(run)).read_text()
    assert svg.startswith("<svg") and "r0 a" in svg and "r1 b" in svg
    assert "cohort formed" in svg and "<title>tolerated</title>" in svg
