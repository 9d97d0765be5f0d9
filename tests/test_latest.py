"""``<log-dir>/latest`` points at the newest run, and the run's folder is said at its start
and its end (`presentation.latest`, `presentation.words`). A real launch's lines are
checked in tests/test_root_cause_lab.py."""

from __future__ import annotations

import os
from pathlib import Path

from fdl_fabric.events import Name, event
from fdl_fabric.presentation.latest import point_latest
from fdl_fabric.presentation.words import render


def test_latest_points_at_the_newest_run_by_a_relative_name(tmp_path: Path) -> None:
    (tmp_path / "run-a").mkdir()
    (tmp_path / "run-b").mkdir()
    first = point_latest(str(tmp_path), "run-a")
    assert first.latest == str(tmp_path / "latest") and first.latest_error is None
    assert os.readlink(tmp_path / "latest") == "run-a"
    point_latest(str(tmp_path), "run-b")
    assert os.readlink(tmp_path / "latest") == "run-b"
    assert (tmp_path / "latest").resolve() == (tmp_path / "run-b").resolve()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "run-a", "run-b"]


def test_a_latest_link_that_led_out_of_the_folder_is_replaced_not_followed(
        tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "latest").symlink_to(outside)
    point_latest(str(logs), "run-c")
    assert os.readlink(logs / "latest") == "run-c"
    assert list(outside.iterdir()) == []  # nothing was written through the old link


def test_a_latest_that_is_not_a_link_is_left_alone_and_said(tmp_path: Path) -> None:
    (tmp_path / "latest").mkdir()
    (tmp_path / "latest" / "mine.txt").write_text("keep")
    got = point_latest(str(tmp_path), "run-d")
    assert got.latest is None and "is not a link: left alone" in str(got.latest_error)
    assert (tmp_path / "latest" / "mine.txt").read_text() == "keep"
    assert point_latest(str(tmp_path), "../x").latest is None  # no run id leads out


def test_the_run_folder_is_said_at_the_start_and_before_the_verdict() -> None:
    data = {"run_id": "r1", "folder": "/l/r1", "latest": "/l/latest", "latest_error": None}
    assert render(event(Name.LOG_FOLDER, **data)) == (
        "cluster launcher: run r1: every rank's output is kept in /l/r1; /l/latest points at it")
    assert render(event(Name.LOGS_KEPT, **data, failed=None)) == (
        "cluster launcher: logs of run r1: /l/r1 (also /l/latest)")
    assert render(event(Name.LOGS_KEPT, **{**data, "latest": None}, failed="No space left")) \
        == "cluster launcher: logs of run r1: /l/r1; incomplete: writing them failed (above)"
