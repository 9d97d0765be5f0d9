"""``--json``: every event of a real launch as one JSON line on stdout, the verdict last
(issue 21, item 3), in the one record shape events.jsonl has too (issue 29, item 7;
docs/events.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from labutil import PROBE, run_launch

pytestmark = pytest.mark.lab


def _records(stdout: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stdout.splitlines()]


def test_json_lines_of_a_launch_on_two_hosts_end_with_the_verdict(sshd_lab) -> None:
    lab = sshd_lab(n_hosts=2)
    cluster = lab.write_cluster([lab.worker(h, nproc=2) for h in lab.hosts])
    out = run_launch(cluster, "--json", "--cmd", f"python3 {PROBE}", timeout=90)
    assert out.returncode == 0, out.stderr
    records = _records(out.stdout)  # every line parses: nothing else is on stdout
    assert all(set(r) >= {"v", "time", "kind", "name", "host", "rank", "data"}
               and r["v"] == 1 for r in records)
    output = [r for r in records if r["kind"] == "output"]
    assert {(r["host"], r["rank"]) for r in output} == {
        ("lab1", 0), ("lab1", 1), ("lab2", 2), ("lab2", 3)}
    assert all(isinstance(r["data"]["text"], str) for r in output)  # type: ignore[index]
    last = records[-1]
    assert (last["kind"], last["name"]) == ("verdict", "verdict")
    assert last["data"]["exit_code"] == 0 and last["data"]["verdict"] == "ok"  # type: ignore[index]
    assert out.stderr.splitlines()[-1] == "cluster launcher: run completed — all 4 ranks exited 0"


def test_fdl_fabric_run_json_reports_a_failure_in_its_last_record(tmp_path: Path) -> None:
    (tmp_path / "boom.py").write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' "
                                      "else 0)\n")
    out = subprocess.run([sys.executable, "-m", "fdl_fabric", "run", "--json",
                          "--nproc-per-node", "2", "boom.py"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    last = _records(out.stdout)[-1]
    assert last["kind"] == "verdict" and last["data"]["exit_code"] == 1  # type: ignore[index]
    assert last["message"] == ("cluster launcher: failed: rank 1 of localhost exited with "
                               "status 3")


def test_json_lines_and_events_jsonl_of_one_run_are_the_same_records(tmp_path: Path) -> None:
    (tmp_path / "boom.py").write_text("import os, sys\nprint('hi')\n"
                                      "sys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    # Runs of its own: with 100 older records a launch would first prune one and say so
    # on stdout, before the run's log exists (the suite's shared folder reaches 100).
    out = subprocess.run([sys.executable, "-m", "fdl_fabric", "run", "--json", "--log-dir",
                          "logs", "--nproc-per-node", "2", "boom.py"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "FDL_FABRIC_RUNS_DIR": str(tmp_path / "runs")})
    assert out.returncode == 1, out.stderr
    printed = _records(out.stdout)
    (run_dir,) = [p for p in (tmp_path / "logs").iterdir() if not p.is_symlink()]
    logged = _records((run_dir / "events.jsonl").read_text())
    assert {r["kind"] for r in printed} - {r["kind"] for r in logged} == {"output"}
    assert [r for r in printed if r["kind"] != "output"] == logged
    assert logged[-1]["kind"] == "verdict" and logged[-1]["attempt"] == 0
