"""Presentation: prefixes, whole lines, colors, redaction, the summary table."""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
from pathlib import Path

import pytest

from fdl_fabric import limits
from fdl_fabric.events import Event, Name, event
from fdl_fabric.presentation.output import Console, redact_env, use_color
from fdl_fabric.presentation.runlog import RunLog
from fdl_fabric.presentation.words import render


def _console(**kw: object) -> tuple[Console, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    return Console(out, err, color=False, **kw), out, err  # type: ignore[arg-type]


def output(host: str, rank: int, text: str, *, stderr: bool = False,
           raw: bytes = b"") -> Event:
    return Event(Name.RANK_OUTPUT, host=host, rank=rank,
                 data={"label": f"{host}:cpu:r{rank}", "text": text, "stderr": stderr,
                       "raw": raw or (text + "\n").encode(), "partial": False})


def failed(host: str, rank: int, code: int) -> Event:
    return event(Name.RANK_FAILED, host=host, rank=rank,
                 exit={"code": code, "signal": None, "lost": None}, ok=False)


def test_each_line_of_a_chunk_gets_the_rank_prefix_in_one_write() -> None:
    console, out, err = _console()
    writes: list[str] = []
    real = out.write
    out.write = lambda text: (writes.append(text), real(text))[1]  # type: ignore[method-assign]
    console.emit(output("h", 3, "first\nsecond"))
    console.emit(output("h", 3, "oops", stderr=True))
    assert out.getvalue() == "[h:cpu:r3] first\n[h:cpu:r3] second\n"
    assert err.getvalue() == "[h:cpu:r3] oops\n"
    assert len(writes) == 1


def test_rank_output_is_kept_byte_for_byte_in_a_private_log_file(tmp_path: Path) -> None:
    log = RunLog(str(tmp_path), "run1")
    log.emit(output("h", 1, "a", raw=b"a\n"))
    log.emit(output("h", 1, "b \ufffd", raw=b"b \xff"))
    log.emit(output("h", 1, "e", stderr=True, raw=b"e\n"))
    log.close()
    folder = tmp_path / "run1"
    rank = folder / "attempt_0" / "r1"
    assert (rank / "stdout.log").read_bytes() == b"a\nb \xff"
    assert (rank / "stderr.log").read_bytes() == b"e\n"
    assert not (folder / "events.jsonl").read_text()  # output is not an event line
    for path in (folder, folder / "attempt_0", rank):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
    for path in (rank / "stdout.log", folder / "events.jsonl"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


def _held_under(folder: Path) -> int:
    """This process's descriptors open on files under ``folder`` (other tests' threads
    may open and close theirs meanwhile: only the log's are counted)."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            held += os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder) + os.sep)
    return held


def test_a_log_of_many_ranks_holds_a_few_files_open_and_loses_no_byte(tmp_path: Path) -> None:
    log = RunLog(str(tmp_path), "run1", max_bytes=64)
    for turn in range(3):  # every rank writes in turn, so each file is opened again
        for rank in range(200):
            log.emit(output("h", rank, f"t{turn}", raw=f"{turn}:{rank}\n".encode()))
    held = _held_under(tmp_path)
    assert 1 < held <= limits.LOG_FILES_OPEN + 1, "the pool's files and events.jsonl, not 200"
    log.close()
    assert _held_under(tmp_path) == 0
    for rank in (0, 77, 199):
        text = (tmp_path / "run1" / "attempt_0" / f"r{rank}" / "stdout.log").read_text()
        assert text == "".join(f"{turn}:{rank}\n" for turn in range(3))


def test_events_are_written_as_timestamped_json_lines_with_their_data_and_words(
        tmp_path: Path) -> None:
    log = RunLog(str(tmp_path), "run1")
    log.emit(failed("h", 2, 3))
    log.close()
    line = json.loads((tmp_path / "run1" / "events.jsonl").read_text())
    assert line["v"] == 1 and line["time"] > 0
    assert line["kind"] == "death" and line["name"] == "rank_failed"
    assert line["rank"] == 2 and line["data"]["exit"] == {"code": 3, "signal": None,
                                                          "lost": None}
    assert line["message"] == render(failed("h", 2, 3))


# -- issue 29, item 7: one record shape for --json and events.jsonl ----------------------------
def _both(tmp_path: Path, *events: Event) -> tuple[list[dict[str, object]],
                                                   list[dict[str, object]]]:
    """What events.jsonl and ``--json`` wrote for ``events``."""
    from fdl_fabric.presentation.output import JsonConsole

    log = RunLog(str(tmp_path), "run1")
    out = io.StringIO()
    console = JsonConsole(out=out, err=io.StringIO())
    for e in events:
        log.emit(e)
        console.emit(e)
    log.close()
    logged = [json.loads(x) for x in (tmp_path / "run1" / "events.jsonl").read_text().splitlines()]
    return logged, [json.loads(x) for x in out.getvalue().splitlines()]


def test_json_and_events_jsonl_write_the_same_record_for_the_same_event(tmp_path: Path) -> None:
    from fdl_fabric.presentation.records import FIELDS
    from fdl_fabric.presentation.words import cause_data

    cause = cause_data(failed("h", 1, 3))
    run = [event(Name.LAUNCH, run_id="r1", world_size=2, ranks={"h": [0, 1]}),
           failed("h", 1, 3),
           event(Name.RESTARTING, attempt=1, max_restarts=1, cause=cause, error=None,
                 hosts=["h"], roster=1, world_size=2, left_out={}),
           event(Name.RANK_STARTED, host="h", rank=0, pid=7, label="h:cpu:r0"),
           event(Name.VERDICT, cause=cause_data(event(Name.COMPLETED, world_size=2)),
                 exit_code=0, verdict="ok", attempts=2, run_id="r1", faults={})]
    logged, printed = _both(tmp_path, *run)
    assert logged == printed
    assert all(list(r) == list(FIELDS) for r in logged)
    assert [r["attempt"] for r in logged] == [0, 0, 1, 1, 1]
    assert logged[-1]["data"]["exit_code"] == 0  # type: ignore[index]


def test_only_rank_output_and_bulky_values_differ_and_each_is_said(tmp_path: Path) -> None:
    crashed = event(Name.RANK_FAILED, host="h", rank=1, ok=False, error_file='{"message": 1}',
                    exit={"code": 1, "signal": None, "lost": None})
    logged, printed = _both(tmp_path, event(Name.LAUNCH, run_id="r1", world_size=2,
                                            ranks={"h": [0, 1]}),
                            output("h", 0, "hi"), crashed)
    assert [r["kind"] for r in printed] == ["launch", "output", "death"]
    assert [r["kind"] for r in logged] == ["launch", "death"]  # output: in r0/stdout.log
    out = printed[1]
    assert out["message"] is None and "raw" not in out["data"]  # type: ignore[operator]
    assert out["data"]["text"] == "hi"  # type: ignore[index]
    assert printed[2]["data"]["error_file"] == '{"message": 1}'  # type: ignore[index]
    assert "error_file" not in logged[1]["data"]  # type: ignore[operator]
    assert logged[1]["data"]["error_json"] == "attempt_0/r1/error.json"  # type: ignore[index]
    assert (tmp_path / "run1" / "attempt_0" / "r1" / "error.json").read_text() == \
        '{"message": 1}'


def test_quiet_console_hides_rank_output_but_not_events() -> None:
    console, out, err = _console(show_rank_output=False)
    console.emit(output("h", 0, "noise"))
    console.emit(failed("h", 0, 3))
    assert out.getvalue() == "" and err.getvalue() == render(failed("h", 0, 3)) + "\n"


def test_routine_events_need_verbose() -> None:
    console, _, err = _console()
    started = event(Name.RANK_STARTED, host="h", rank=0, pid=7, label="h:cpu:r0")
    console.emit(started)
    console.emit(event(Name.RANK_JOINED, host="h", rank=0, pid=7, peer="127.0.0.1:9"))
    assert err.getvalue() == ""
    verbose, _, err2 = _console(verbosity=2)
    verbose.emit(started)
    assert err2.getvalue() == render(started) + "\n"


def test_prefix_colors_are_per_host_and_only_when_asked() -> None:
    out = io.StringIO()
    console = Console(out, io.StringIO(), color=True)
    console.emit(output("a", 0, "x"))
    console.emit(output("b", 1, "y"))
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


def test_the_end_of_run_tables_are_hidden_by_quiet_only() -> None:
    summary = event(Name.SUMMARY, ranks=[])
    console, _, err = _console(verbosity=0)
    console.emit(summary)
    assert err.getvalue() == render(summary) + "\n"
    quiet, _, err2 = _console(verbosity=-1)
    quiet.emit(summary)
    assert err2.getvalue() == ""


def test_what_a_command_was_asked_for_goes_to_stdout() -> None:
    console, out, err = _console(verbosity=-1)
    console.emit(event(Name.PLOT_DRAWN, path="/tmp/x.svg"))
    assert out.getvalue() == "/tmp/x.svg\n" and err.getvalue() == ""


# -- issue 29, item 8: only the truth on the console ------------------------------------------
def test_rank_output_in_a_pipe_is_inert_too_and_shows_a_progress_bar_at_its_latest_state() -> None:
    console, out, _ = _console()
    console.emit(output("h", 0, "\x1b[2J\x1b]52;c;eA==\x07cleared\n\r 10%\r100%|####|"))
    assert out.getvalue() == ("[h:cpu:r0] ^[[2J^[]52;c;eA==^Gcleared\n"
                              "[h:cpu:r0] 100%|####|\n")


def test_a_launcher_line_quoting_a_host_shows_its_escapes_inert() -> None:
    console, _, err = _console()
    console.emit(event(Name.AGENT_WARNING, host="h", text="\x1b[2J\x1b]0;t\x07bad"))
    assert "\x1b" not in err.getvalue() and "\x07" not in err.getvalue()
    assert "^[[2J^[]0;t^Gbad" in err.getvalue()


def test_a_result_keeps_its_colours_but_nothing_that_moves_the_cursor() -> None:
    console, out, _ = _console()
    console.result("\x1b[32mok\x1b[0m \x1b[1A")
    assert out.getvalue() == "\x1b[32mok\x1b[0m ^[[1A\x1b[0m\n"


def test_the_live_tables_last_output_is_inert() -> None:
    from types import SimpleNamespace

    from fdl_fabric.presentation.output import render_status
    from fdl_fabric.states import RankState

    rank = SimpleNamespace(host="h", rank=0, device_name="cpu", pid=7,
                           state=RankState.RUNNING, duration=1.0,
                           last_line="\r 10%\r\x1b[2J 50%")
    text = render_status([rank], 100, 10, False)  # type: ignore[list-item]
    assert "^[[2J 50%" in text and "\x1b" not in text


def test_json_lines_escape_c1_controls_too(tmp_path: Path) -> None:
    from fdl_fabric.presentation.output import JsonConsole

    out, err = io.StringIO(), io.StringIO()
    JsonConsole(out=out, err=err).emit(output("h", 0, "a\x9b2J\x1b[2J"))
    line = out.getvalue()
    assert "\x9b" not in line and "\x1b" not in line
    assert json.loads(line)["data"]["text"] == "a\x9b2J\x1b[2J"
