"""Issue 29, item 5, through real launches: a rank that fails without torch's ``@record``,
its peers alive and printing tracebacks of their own, is shown under the root cause by
its own last stderr lines, on an 80-column tmux pane as in a pipe, with ``--quiet`` too;
the verdict line is last and says failed; ``--log-dir`` is named at the start and the
end, and ``latest`` points at the run.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_narrow_terminal_lab import (
    Pane,
    assert_no_stray_header,
    assert_verdict_on_one_line,
    assert_wrapped_cleanly,
)

from labutil import run_launch

#: Rank 1 raises (no @record: no error file); ranks 0 and 2 print a traceback of their
#: own first, as gloo peers do, and stay alive until the launcher stops them.
FAILING = textwrap.dedent("""\
    import os, sys, time
    rank = int(os.environ["RANK"])
    if rank != 1:
        print("Traceback (most recent call last):", file=sys.stderr)
        print(f"RuntimeError: peer {rank}: gloo connection closed", file=sys.stderr)
        sys.stderr.flush()
        time.sleep(60)
    time.sleep(0.5)
    print("rank 1 loading the batch", file=sys.stderr)
    def step():
        raise ValueError("boom in rank 1")
    step()
    """)

VERDICT = "cluster launcher: failed: rank 1 of localhost exited with status 1"


@pytest.fixture
def job() -> Iterator[Path]:
    """A short folder (the ranks' traceback paths stay under 80 columns) with the script
    and a cluster.yml of three local ranks."""
    folder = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))
    try:
        (folder / "f.py").write_text(FAILING)
        (folder / "cluster.yml").write_text(
            "command: python3 f.py\nkill_grace: 5\n"
            f"workers:\n  - host: localhost\n    nproc: 3\n    path: {folder}\n")
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def quoted(lines: list[str]) -> list[str]:
    """The lines quoted under the root cause (between it and the verdict)."""
    head = next(i for i, line in enumerate(lines) if line.startswith("root cause: "))
    return [line for line in lines[head:] if line.startswith("  | ")]


@pytest.mark.timeout(90)
def test_a_failed_rank_without_record_is_quoted_under_the_root_cause_at_80_columns(
        job: Path, tmp_path: Path) -> None:
    pane = Pane(tmp_path)
    try:
        done = pane.start("--cluster", str(job / "cluster.yml"))
        assert pane.finish(done, timeout=60) == 1, pane.lines()
        shown = assert_wrapped_cleanly(pane)
    finally:
        pane.close()
    assert_verdict_on_one_line(shown, VERDICT)
    assert_no_stray_header(shown)
    text = "\n".join(shown)
    lines = quoted(shown)
    assert lines[0] == "  | rank 1 loading the batch", text
    assert lines[-1] == "  | ValueError: boom in rank 1", text
    assert "  |     raise ValueError(\"boom in rank 1\")" in lines, text
    assert not [line for line in lines if "gloo" in line], "only the failed rank is quoted"
    head = next(i for i, line in enumerate(shown) if line.startswith("root cause: "))
    said = " ".join(line.strip() for line in shown[head:head + 3])
    assert said.startswith("root cause: rank 1 of localhost (localhost:cpu:r1) exited with "
                           "status 1 (no error file: decorate the entry point with torch's "
                           "@record"), text
    # No --log-dir: the run's record on this controller keeps every line.
    assert "all of it in " in " ".join(shown[head:]) and "/attempt_0/r1/stderr.log" in \
        "".join(line.strip() for line in shown[head:]), text


@pytest.mark.timeout(90)
def test_with_quiet_and_log_dir_the_tail_is_quoted_and_the_folder_said_at_start_and_end(
        job: Path, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    out = run_launch(job / "cluster.yml", "--quiet", "--log-dir", str(logs), timeout=80)
    assert out.returncode == 1, out.stderr
    lines = out.stderr.splitlines()
    assert lines[-1] == VERDICT, out.stderr
    assert "[localhost:cpu:r1]" not in out.stderr, "--quiet shows no rank output"
    assert quoted(lines)[-1] == "  | ValueError: boom in rank 1", out.stderr
    (run_dir,) = [p for p in logs.iterdir() if p.name != "latest"]
    assert os.readlink(logs / "latest") == run_dir.name
    start = [line for line in lines if "every rank's output is kept in" in line]
    assert start == [f"cluster launcher: run {run_dir.name}: every rank's output is kept in "
                     f"{run_dir}; {logs / 'latest'} points at it"], out.stderr
    assert lines[-2] == (f"cluster launcher: logs of run {run_dir.name}: {run_dir} (also "
                         f"{logs / 'latest'})"), out.stderr
    stderr_log = run_dir / "attempt_0" / "r1" / "stderr.log"
    assert f"(all of it in {stderr_log}):" in out.stderr
    assert stderr_log.read_text().endswith("ValueError: boom in rank 1\n")


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("command", "head"), [
    ("python3 -c 'import os, sys; print(\"native crash\", file=sys.stderr); os.abort()'",
     "exited with signal 6"),
    ("sh -c 'echo oops from the shell >&2; exit 1'", "exited with status 1"),
])
def test_a_native_abort_or_a_shell_rank_gets_its_lines_but_no_record_hint(
        tmp_path: Path, command: str, head: str) -> None:
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(f"kill_grace: 5\nworkers:\n  - host: localhost\n    nproc: 1\n"
                       f"    path: {tmp_path}\n")
    out = run_launch(cluster, "--cmd", command, timeout=80)
    assert out.returncode == 1, out.stderr
    lines = out.stderr.splitlines()
    (cause,) = [line for line in lines if line.startswith("root cause: ")]
    assert cause == f"root cause: rank 0 of localhost (localhost:cpu:r0) {head}", out.stderr
    assert "@record" not in out.stderr
    assert quoted(lines)[-1] in ("  | native crash", "  | oops from the shell"), out.stderr
    assert lines[-1].startswith("cluster launcher: failed: rank 0 of localhost exited with ")
