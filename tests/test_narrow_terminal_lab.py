"""Issue 21, item 8, on a real terminal: text at 80 columns wraps cleanly, the verdict
stays one line when it fits, and a Ctrl-C leaves no stray header in the scrollback.

Each test runs ``inv launch`` of local ranks in an 80-column tmux pane (a tmux server
of its own, ``-L``), typed into an interactive bash as a person would, and reads the
pane twice: as shown (``capture-pane -p``) and with the terminal's own wraps undone
(``-J``). A line the terminal had to wrap is longer than 80 in the second; a word it
cut at the right edge reads as two words in the first. Piped output (logs, CI, greps)
keeps every line whole, as before, which the last tests pin.
"""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_terminal_lab import STEADY

from fdl_fabric.events import Event, Name, event
from fdl_fabric.presentation.output import Console
from fdl_fabric.presentation.words import HANG, cause_data, render
from fdl_fabric.testing import panes
from labutil import INV_LAUNCH, ROOT, run_launch, wait_for

WIDTH = 80
PROMPT = "narrow$"
#: The header of each table the launcher draws, and how a row of it begins.
TABLES = {
    "live status": (re.compile(r"host +rank +.*last output"), re.compile(r"\S+ +\d+ +")),
    "summary": (re.compile(r"rank +host +exit +cause +duration"), re.compile(r"\d+ +\S")),
    "attempts": (re.compile(r"attempt +hosts +verdict +cause"), re.compile(r"\d+ +\S")),
}


class Pane(panes.Pane):
    """bash in an 80-column tmux pane, on a tmux server of its own (killed by its socket)."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder, width=WIDTH, height=60, name="narrow", prompt=PROMPT)

    def start(self, *launch: str, prefix: str = "", redirect: str = "") -> Path:
        """Type ``bash job.sh``, a script that runs ``inv launch`` with ``launch`` and
        writes its exit status; the short command line itself never wraps."""
        done = self.folder / "rc"
        done.unlink(missing_ok=True)
        argv = " ".join(shlex.quote(a) for a in [*INV_LAUNCH, *launch])
        (self.folder / "job.sh").write_text(
            f"{prefix}{argv}{redirect}\necho $? > rc.tmp && mv rc.tmp rc\n")
        self.tmux("send-keys", "-t", "narrow", "bash job.sh", "Enter")
        return done

    def finish(self, done: Path, timeout: float = 30) -> int:
        wait_for(done.exists, timeout, "the launch to end")
        wait_for(lambda: self.lines()[-1] == PROMPT, 5, "the prompt after the launch")
        return int(done.read_text())

    def lines(self, joined: bool = False) -> list[str]:
        return super().lines(joined)


@pytest.fixture
def pane(tmp_path: Path) -> Iterator[Pane]:
    p = Pane(tmp_path)
    try:
        yield p
    finally:
        p.close()


def cluster(folder: Path, command: str) -> Path:
    """The default job (cluster.yml): two CPU ranks on this machine, a 10 s kill grace;
    the controller's port is left to the launcher (a test runs next to other launches),
    and the ranks run in ``folder`` (short paths: rank output is not the launcher's to
    wrap, so it is kept under 80 columns)."""
    path = folder / "cluster.yml"
    path.write_text(f"command: {command}\nkill_grace: 10\n"
                    f"workers:\n  - host: localhost\n    nproc: 2\n    path: {folder}\n")
    return path


def assert_wrapped_cleanly(pane: Pane) -> list[str]:
    """The pane's lines, once checked: no line the terminal had to wrap, no word cut at the
    right edge, no line of punctuation alone (an orphan ``)``, an echoed ``^C``)."""
    shown, joined = pane.lines(), pane.lines(joined=True)
    assert [line for line in joined if len(line) > WIDTH] == [], "\n".join(shown)
    assert " ".join(shown).split() == " ".join(joined).split(), "\n".join(shown)
    orphans = [line for line in shown if re.fullmatch(r"[^\w\s]+", line.strip())]
    assert orphans == [], "\n".join(shown)
    # The launcher's long lines were there, and were wrapped by it (continuation indented).
    assert any(line.startswith("  ") and line.strip() for line in shown), "\n".join(shown)
    return shown


def assert_verdict_on_one_line(shown: list[str], pattern: str) -> None:
    """The launcher's last line, just above the prompt, is the whole verdict."""
    assert shown[-1] == PROMPT, shown[-5:]
    assert re.fullmatch(pattern, shown[-2]) and len(shown[-2]) <= WIDTH, shown[-6:]


def assert_no_stray_header(shown: list[str]) -> None:
    """The live table is gone, and every table header left has its rows below it."""
    for name, (header, row) in TABLES.items():
        for i, line in enumerate(shown):
            if not header.fullmatch(line):
                continue
            text = "\n".join(shown)
            assert name != "live status", f"the live table's header stayed:\n{text}"
            following = shown[i + 1] if i + 1 < len(shown) else ""
            assert row.match(following), f"the {name} header without its rows:\n{text}"


@pytest.mark.timeout(60)
def test_a_launch_at_80_columns_wraps_between_words_and_ends_with_its_verdict_on_one_line(
        pane: Pane, tmp_path: Path) -> None:
    job = cluster(tmp_path, f"python3 {ROOT}/examples/toy_train.py --steps 3 "
                            "--checkpoint-dir checkpoints")
    assert pane.finish(pane.start("--cluster", str(job))) == 0, pane.lines()
    shown = assert_wrapped_cleanly(pane)
    assert_verdict_on_one_line(shown, "cluster launcher: run completed — all 2 ranks exited 0")
    assert_no_stray_header(shown)


@pytest.mark.timeout(60)
def test_a_failed_and_restarted_launch_at_80_columns_ends_with_its_verdict_on_one_line(
        pane: Pane, tmp_path: Path) -> None:
    job = cluster(tmp_path, "python3 -c 'import sys; sys.exit(3)'")
    done = pane.start("--cluster", str(job), "--max-restarts", "1")
    assert pane.finish(done) == 1, pane.lines()
    shown = assert_wrapped_cleanly(pane)
    assert_verdict_on_one_line(shown, "cluster launcher: failed: rank [01] of localhost exited "
                                      "with status 3")
    assert_no_stray_header(shown)
    # The restart's line, the attempts table and the root cause were all there.
    assert any(line.startswith("cluster launcher: attempt 0 failed") for line in shown), shown
    assert any(TABLES["attempts"][0].fullmatch(line) for line in shown), shown
    assert any(line.startswith("root cause: rank ") for line in shown), shown


def interrupt(pane: Pane, done: Path) -> list[str]:
    """Ctrl-C once the live table has been drawn a few times: the launch ends 130."""
    wait_for(lambda: any(TABLES["live status"][0].fullmatch(line) for line in pane.lines()),
             30, "the live table")
    time.sleep(0.6)  # a few redraws
    return ctrl_c(pane, done)


def ctrl_c(pane: Pane, done: Path) -> list[str]:
    """Ctrl-C in the pane: the launch ends 130 with its verdict on one line, the text
    wrapped cleanly, no stray header; the lines shown."""
    pane.tmux("send-keys", "-t", "narrow", "C-c")
    assert pane.finish(done) == 130, pane.lines()
    shown = assert_wrapped_cleanly(pane)
    assert_verdict_on_one_line(shown, "cluster launcher: interrupted by SIGINT — every rank "
                                      "was stopped")
    assert_no_stray_header(shown)
    return shown


@pytest.mark.timeout(60)
def test_ctrl_c_under_the_live_table_leaves_no_stray_header(pane: Pane, tmp_path: Path) -> None:
    job = cluster(tmp_path, "sleep 30")
    shown = interrupt(pane, pane.start("--cluster", str(job)))
    assert not any("^C" in line for line in shown), shown  # the key's echo was erased


@pytest.mark.timeout(60)
def test_ctrl_c_while_ranks_print_with_a_stale_columns_leaves_no_stray_header(
        pane: Pane, tmp_path: Path) -> None:
    """A ``COLUMNS`` left from a wider window must not draw the table wider than the pane
    (the pane wraps it and the erasure misses the lines it made)."""
    prog = tmp_path / "steady.py"
    prog.write_text(STEADY)
    job = cluster(tmp_path, "python3 -u steady.py 30")
    interrupt(pane, pane.start("--cluster", str(job), prefix="COLUMNS=132 LINES=50 "))


@pytest.mark.timeout(60)
def test_ctrl_c_with_rank_output_in_a_file_leaves_the_launcher_lines_whole(
        pane: Pane, tmp_path: Path) -> None:
    """No live table (stdout is a file): the terminal echoes ``^C`` where the next launcher
    line would begin, which must not push that line over the edge."""
    job = cluster(tmp_path, "python3 -c 'import time; print(1, flush=True); time.sleep(30)'")
    done = pane.start("--cluster", str(job), redirect=f" > {tmp_path}/out.txt")
    wait_for(lambda: (tmp_path / "out.txt").exists()
             and "[localhost:cpu:r1] 1" in (tmp_path / "out.txt").read_text(), 30,
             "the ranks' first line")
    ctrl_c(pane, done)


# -- what is not a terminal stays as it was ------------------------------------------------
def omp_line() -> str:
    return render(event(Name.OMP_DEFAULTED))


@pytest.mark.timeout(60)
def test_piped_output_keeps_every_launcher_line_whole(tmp_path: Path) -> None:
    job = cluster(tmp_path, "python3 -c 'import sys; sys.exit(3)'")
    out = run_launch(job, "--max-restarts", "1")
    assert out.returncode == 1, out.stderr
    lines = out.stderr.splitlines()
    assert omp_line() in lines and len(omp_line()) > WIDTH
    assert any(line.startswith("cluster launcher: attempt 0 failed (rank ") and
               line.endswith("world size 2") for line in lines), out.stderr
    # No line is wrapped in a pipe (the root cause's quoted lines are indented on purpose).
    said = lines[:next(i for i, line in enumerate(lines) if line.startswith("root cause:"))]
    assert not any(line.startswith(HANG) for line in said if not line.startswith(HANG * 2)), \
        out.stderr
    assert "\r" not in out.stderr and "\x1b" not in out.stderr


def test_a_console_that_is_not_a_terminal_writes_the_words_unchanged() -> None:
    import io

    err = io.StringIO()
    Console(io.StringIO(), err).emit(event(Name.OMP_DEFAULTED))
    assert err.getvalue() == omp_line() + "\n"


def test_laid_out_for_80_columns_a_line_wraps_between_words_and_a_fitting_one_stays() -> None:
    # 81 columns: on the terminal alone, its last ")" would make a line of its own.
    long = event(Name.LAUNCH, run_id="20261203-193724-1be21b63", world_size=2,
                 ranks={"n": [0, 1]})
    assert len(render(long)) == WIDTH + 1 and render(long).endswith(")")
    assert render(long, WIDTH).splitlines() == [
        "cluster launcher: run 20261203-193724-1be21b63: 2 rank(s) on 1 host(s) (n:",
        f"{HANG}r0-r1)"]
    fits = event(Name.COMPLETED, world_size=2)
    assert render(fits, WIDTH) == render(fits)
    lines = render(event(Name.OMP_DEFAULTED), WIDTH).splitlines()
    assert all(len(line) <= WIDTH for line in lines) and len(lines) == 3
    assert " ".join(lines).split() == omp_line().split()
    # No short word alone on the last line.
    cause = Event(Name.RANK_FAILED, host="localhost", rank=1, data={"exit": {"code": 3}})
    restart = render(event(Name.RESTARTING, attempt=1, max_restarts=1, cause=cause_data(cause),
                           hosts=["localhost"], roster=1, world_size=2), WIDTH).splitlines()
    assert restart[-1] == f"{HANG}size 2", restart


def test_laid_out_for_80_columns_the_attempts_table_wraps_its_cause_inside_its_column() -> None:
    failed = Event(Name.RANK_FAILED, host="localhost", rank=0, data={"exit": {"code": 3}})
    attempts = event(Name.ATTEMPTS, attempts=[
        {"hosts": ["node1", "node2", "node3"], "verdict": "failed",
         "cause": cause_data(failed, error="ValueError: the loss went to nan at step 1200")},
        {"hosts": ["node1", "node2"], "verdict": "ok",
         "cause": cause_data(event(Name.COMPLETED, world_size=4))}])
    assert max(len(line) for line in render(attempts).splitlines()) > WIDTH
    assert render(attempts, WIDTH).splitlines() == [
        "attempt  hosts              verdict  cause",
        "0        node1,node2,node3  failed   rank 0 of localhost exited with status 3:",
        "                                     ValueError: the loss went to nan at step",
        "                                     1200",
        "1        node1,node2        ok       run completed — all 4 ranks exited 0"]
