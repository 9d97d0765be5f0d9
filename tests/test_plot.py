"""`plot-run` tells the truth: each rank's attempts against time, coloured by how they
ended (completed, failed, tolerated, stopped by the launcher, lost), with the attempts,
the cohort formations, a time axis and a legend, as SVG and PNG."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from fdl_fabric.events import Name
from fdl_fabric.presentation.plot import OUTCOMES, read_timeline
from fdl_fabric.testing.processes import free_port
from labutil import ROOT, run_launch


def _record(t: float, name: Name, *, host: str | None = None, rank: int | None = None,
            **data: Any) -> dict[str, Any]:
    """A record as the run log writes it (`records.record`, docs/events.md), its words
    left out: the attempt it belongs to at the top, the rest of the data nested."""
    attempt = data.get("attempt", 0) if name is Name.RESTARTING else data.pop("attempt", 0)
    return {"v": 1, "time": 1000.0 + t, "kind": name.kind.value, "name": name.value,
            "host": host, "rank": rank, "attempt": attempt, "data": data}


def _flat(record: dict[str, Any]) -> dict[str, Any]:
    """The same record as events.jsonl wrote it before version 1: ``event`` for the kind,
    the data at the top."""
    flat = {"time": record["time"], "event": record["kind"], "name": record["name"],
            "attempt": record["attempt"]}
    flat.update({k: record[k] for k in ("host", "rank") if record[k] is not None})
    return {**flat, **record["data"]}


def _exit(code: int | None = None, lost: str | None = None) -> dict[str, Any]:
    return {"code": code, "signal": None if code is not None or lost else 15, "lost": lost}


RESTART_THEN_TOLERATE = [
    _record(0.0, Name.LAUNCH, run_id="r1", world_size=3, ranks={}, attempt=0),
    *[_record(0.1, Name.RANK_STARTED, host="a", rank=r, pid=10 + r, label="x", attempt=0)
      for r in range(3)],
    _record(0.5, Name.RANK_FAILED, host="a", rank=1, exit=_exit(3), ok=False, attempt=0),
    _record(0.6, Name.RANK_EXITED, host="a", rank=0, stopped=True, exit=_exit(), ok=False,
            attempt=0),
    _record(0.6, Name.RANK_EXITED, host="a", rank=2, stopped=True, exit=_exit(), ok=False,
            attempt=0),
    _record(0.7, Name.RESTARTING, attempt=1, max_restarts=1),
    *[_record(0.8, Name.RANK_STARTED, host="b" if r == 2 else "a", rank=r, pid=20 + r,
              label="x", attempt=1) for r in range(3)],
    _record(0.9, Name.COHORT_FORMED, world_size=3, attempt=1),
    _record(1.2, Name.RANK_DECLARED_DEAD, host="b", rank=2, reason={}, alive=2, world_size=3,
            attempt=1),
    _record(1.3, Name.RANK_TOLERATED, host="b", rank=2, exit=_exit(lost="host gone"),
            ok=False, attempt=1),
    _record(1.5, Name.RANK_TOLERATED, host="a", rank=1, exit=_exit(5), ok=False, attempt=1),
    _record(2.0, Name.RANK_EXITED, host="a", rank=0, exit=_exit(0), ok=True, attempt=1),
    _record(2.1, Name.VERDICT, verdict="degraded", exit_code=0, attempt=1),
]


def test_each_attempt_of_each_rank_ends_as_the_log_says() -> None:
    line = read_timeline(RESTART_THEN_TOLERATE)
    ends = {(s.attempt, s.rank): s.outcome for s in line.segments}
    assert ends == {(0, 0): "stopped", (0, 1): "failed", (0, 2): "stopped",
                    (1, 0): "ok", (1, 1): "tolerated", (1, 2): "lost"}
    assert [a.number for a in line.attempts] == [0, 1]
    assert line.attempts[0].formed is None and line.attempts[1].formed == pytest.approx(0.9)
    assert line.attempts[0].end == pytest.approx(0.7)
    assert (line.verdict, line.exit_code, line.run_id) == ("degraded", 0, "r1")
    assert line.span == pytest.approx(2.1)


def test_a_death_is_crossed_where_it_happened() -> None:
    deaths = {(s.attempt, s.rank): s.death for s in read_timeline(RESTART_THEN_TOLERATE).segments}
    assert deaths[(0, 1)] == pytest.approx(0.5) and deaths[(0, 0)] is None
    assert deaths[(1, 1)] == pytest.approx(1.5) and deaths[(1, 0)] is None


def test_a_rank_still_running_when_the_log_ends_is_drawn_as_running() -> None:
    line = read_timeline(RESTART_THEN_TOLERATE[:4])
    assert {s.outcome for s in line.segments} == {"running"} and line.verdict == ""


def test_a_host_lost_without_rank_records_ends_its_open_ranks_as_lost() -> None:
    records = [*RESTART_THEN_TOLERATE[:4],
               _record(0.4, Name.HOST_LOST, host="a", reason="gone", host_fault="lost",
                       attempt=0)]
    assert {s.outcome for s in read_timeline(records).segments} == {"lost"}


def _plot(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "invoke", "--search-root", str(ROOT),
                           "plot-run", *args], capture_output=True, text=True, timeout=60)


def test_a_log_that_is_not_json_is_refused_with_its_line(tmp_path: Path) -> None:
    (tmp_path / "events.jsonl").write_text(json.dumps(RESTART_THEN_TOLERATE[0]) + "\n{oops\n")
    done = _plot(str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].endswith("events.jsonl line 2 is not JSON")


def test_a_picture_name_that_is_neither_svg_nor_png_is_refused(tmp_path: Path) -> None:
    (tmp_path / "events.jsonl").write_text(json.dumps(RESTART_THEN_TOLERATE[0]) + "\n")
    done = _plot(str(tmp_path), "--output", str(tmp_path / "t.jpg"))
    assert done.returncode == 2 and "must end in .svg or .png" in done.stderr
    assert not (tmp_path / "t.jpg").exists()


def _colours_in(png: Path) -> set[str]:
    from matplotlib import image

    pixels = image.imread(str(png))[:, :, :3]
    return {"#{:02x}{:02x}{:02x}".format(*(round(v * 255) for v in px))
            for px in {tuple(p) for p in pixels.reshape(-1, 3).tolist()}}


@pytest.mark.timeout(120)
def test_a_run_with_a_restart_and_a_tolerated_death_is_drawn_truthfully(tmp_path: Path) -> None:
    """A real launch: attempt 0 fails before the cohort forms (rank 1 exits 3: kill-all,
    restart), attempt 1 tolerates rank 3's death; the PNG shows every outcome's colour.

    No outcome hangs on which process the machine starts first: in attempt 0 the others
    wait to be stopped, and in attempt 1 rank 3 dies only once every rank has joined (a
    file each after `join()`), so the cohort has formed and its death is tolerated."""
    (tmp_path / "job.py").write_text(textwrap.dedent(f"""
        import os, sys, time
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})
        from fdl_fabric import rank as cohort
        r, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if attempt == 0 and r == 1:
            time.sleep(0.3); sys.exit(3)
        cohort.join()
        if attempt == 0:
            time.sleep(60)
        marks = Path({str(tmp_path)!r})
        (marks / f"joined-{{r}}").touch()
        if r == 3:
            deadline = time.monotonic() + 30
            while len(list(marks.glob("joined-*"))) < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3); sys.exit(5)
        time.sleep(1.0)
    """))
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(textwrap.dedent(f"""
        controller: {{host: 127.0.0.1, port: {free_port("127.0.0.1")}}}
        command: {sys.executable} {tmp_path / "job.py"}
        kill_grace: 2
        elastic: {{max_failure: 2, max_restarts: 1, formation_timeout: 30}}
        workers: [{{host: localhost, nproc: 4}}]
    """))
    done = run_launch(cluster, "--log-dir", str(tmp_path / "logs"), timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    (run,) = [p for p in (tmp_path / "logs").iterdir() if not p.is_symlink()]

    drawn = _plot(str(run))
    assert drawn.returncode == 0, drawn.stderr
    png, svg = run / "timeline.png", run / "timeline.svg"
    assert drawn.stdout.split() == [str(svg), str(png)]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert svg.read_text().lstrip().startswith("<?xml")
    for picture in (png, svg):
        assert stat.S_IMODE(picture.stat().st_mode) == 0o600

    from fdl_fabric.presentation.plot import load_records

    line = read_timeline(load_records(run))
    ends = {(s.attempt, s.rank): s.outcome for s in line.segments}
    assert ends[(0, 1)] == "failed" and ends[(1, 3)] == "tolerated"
    assert {ends[(0, r)] for r in (0, 2, 3)} == {"stopped"}
    assert {ends[(1, r)] for r in (0, 1, 2)} == {"ok"}
    assert line.verdict == "degraded" and line.exit_code == 0

    colours = _colours_in(png)
    for outcome in ("ok", "failed", "tolerated", "stopped"):
        assert OUTCOMES[outcome][1] in colours, outcome
    svg_text = svg.read_text()
    for words in ("attempt 0", "attempt 1", "seconds since the launch", "cohort formed",
                  "tolerated death", "stopped by the launcher", "degraded (exit 0)"):
        assert words in svg_text, words


def test_help_after_the_command_shows_its_usage() -> None:
    done = _plot("--help")
    assert done.returncode == 0 and "plot-run RUN_DIR [options]" in done.stdout.split("\n")[0]


def test_a_log_written_before_the_versioned_records_still_reads_the_same() -> None:
    new = read_timeline(RESTART_THEN_TOLERATE)
    old = read_timeline([_flat(r) for r in RESTART_THEN_TOLERATE])
    assert old == new and old.verdict == "degraded" and len(old.attempts) == 2
