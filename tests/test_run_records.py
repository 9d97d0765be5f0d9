"""Every run keeps a record on the controller (issue 30, item 2): a private folder (0700,
files 0600, whatever the umask; a records folder that is not this user's is refused),
logs that rotate and are read and followed across the rotation, pruning by count and by
size that never touches a live run, and what a real launch leaves there: its state, its
console as rendered, every rank's output and ``result.json`` written last, atomically."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Optional

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fdl_fabric.agent.registry import RegistryError
from fdl_fabric.api import launch
from fdl_fabric.events import Event, Name
from fdl_fabric.handle import attach
from fdl_fabric.limits import RECORDS_KEPT
from fdl_fabric.masking import mask_data
from fdl_fabric.presentation.rotating import RotatingFile
from fdl_fabric.presentation.runlog import RunLog, cluster_json
from fdl_fabric.runs import place
from fdl_fabric.runs.reading import follow, is_live, last_lines, launcher_alive, view
from fdl_fabric.runs.record import CONSOLE, RESULT, STATE, RunRecord, RunState, write_json

FDL = (sys.executable, "-m", "fdl_fabric")


# -- helpers -------------------------------------------------------------------------------

@pytest.fixture
def root(runs: Path) -> Path:
    """This test's records folder (`conftest.runs`)."""
    return runs



def run_id(n: int) -> str:
    """A well-formed run id; a larger ``n`` sorts later (a newer run)."""
    return f"20260101-{n:06d}-{n:08x}"


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def ended_record(root: Path, n: int, size: int = 0, exit_code: int = 0) -> Path:
    """A record whose run ended (its result written), holding about ``size`` bytes."""
    folder = root / run_id(n)
    folder.mkdir(parents=True, mode=0o700)
    write_json(folder / STATE, {"run_id": folder.name, "state": "ended", "attempt": 0,
                                "launcher": {"host": socket.gethostname(), "pid": 1,
                                             "pid_started": 0.0}})
    write_json(folder / RESULT, {"run_id": folder.name, "verdict": "ok",
                                 "exit_code": exit_code})
    if size:
        (folder / CONSOLE).write_bytes(b"x" * size)
    return folder


def unended_record(root: Path, n: int, pid: int, pid_started: Optional[float],
                   host: Optional[str] = None, state: str = "running") -> Path:
    """A record with no result whose launcher is ``pid`` (started at ``pid_started``)."""
    folder = root / run_id(n)
    folder.mkdir(parents=True, mode=0o700)
    write_json(folder / STATE, {
        "run_id": folder.name, "state": state, "attempt": 0,
        "launcher": {"host": host or socket.gethostname(), "pid": pid,
                     "pid_started": pid_started, "user": "me"}})
    return folder


def live_process(spawned: list[subprocess.Popen[Any]]) -> tuple[int, float]:
    """A real process of this test that stays up: its pid and its start time."""
    proc = subprocess.Popen(["sleep", "60"])
    spawned.append(proc)
    return proc.pid, psutil.Process(proc.pid).create_time()


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait(10)
    return proc.pid


def output(rank: int, raw: bytes, stderr: bool = False) -> Event:
    """A rank's output as the launch emits it."""
    text = raw.decode("utf-8", "replace").rstrip("\n")
    return Event(Name.RANK_OUTPUT, host="localhost", rank=rank,
                 data={"label": f"localhost:cpu:r{rank}", "text": text, "raw": raw,
                       "stderr": stderr, "partial": not raw.endswith(b"\n")})


def tree(folder: Path) -> tuple[list[Path], list[Path]]:
    """Every folder (``folder`` itself included) and every file under ``folder``."""
    folders, files = [folder], []
    for base, dirs, names in os.walk(folder):
        folders += [Path(base, d) for d in dirs]
        files += [Path(base, n) for n in names]
    return folders, files


# Rank 1 fails only once rank 0 has said all it says (a file beside the script tells it,
# waited for at most 10 s): a failing rank ends its peers at once, and a record must hold
# what the peers said before that, not what a race let them say.
RANK_SCRIPT = textwrap.dedent("""\
    import os, sys, time
    rank = os.environ["RANK"]
    said = os.path.join(os.path.dirname(os.path.abspath(sys.argv[0])), "rank0-said")
    print(f"hello from rank {rank}", flush=True)
    print(f"second line of rank {rank}", flush=True)
    print(f"complaint of rank {rank}", file=sys.stderr, flush=True)
    if rank == "0":
        open(said, "w").close()
    elif int(sys.argv[1]):
        deadline = time.monotonic() + 10
        while not os.path.exists(said) and time.monotonic() < deadline:
            time.sleep(0.01)
    sys.exit(int(sys.argv[1]) if rank == "1" else 0)
    """)


def fdl_run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FDL, "run", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=60)


# -- a private place -----------------------------------------------------------------------

def test_a_record_is_a_0700_folder_of_0600_files_even_with_umask_0(
        root: Path, tmp_path: Path, umask_0: None) -> None:
    root.mkdir(mode=0o777)
    os.chmod(root, 0o777)  # a records folder left open is tightened, not trusted as is
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    result = launch(None, [sys.executable, str(script), "0"], hosts="localhost",
                    nproc_per_node=2, quiet=True, on_exit="echo said")
    assert result.exit_code == 0, result.message
    assert mode(root) == 0o700
    folder = root / str(result.run_id)
    folders, files = tree(folder)
    names = {p.relative_to(folder).as_posix() for p in files}
    assert {STATE, RESULT, CONSOLE, "events.jsonl", "cluster.json", "on_exit.log",
            "attempt_0/r0/stdout.log", "attempt_0/r1/stderr.log"} <= names
    assert {p.relative_to(folder).as_posix(): oct(mode(p)) for p in folders} == {
        p.relative_to(folder).as_posix(): oct(0o700) for p in folders}
    assert {n: oct(mode(folder / n)) for n in names} == {n: oct(0o600) for n in names}


def test_a_rotated_log_and_its_successor_are_0600_even_with_umask_0(
        tmp_path: Path, umask_0: None) -> None:
    log = RotatingFile(tmp_path / "stdout.log", max_bytes=10)
    for _ in range(3):
        log.write(b"0123456789")
    log.close()
    assert mode(tmp_path / "stdout.log") == 0o600
    assert mode(tmp_path / "stdout.log.1") == 0o600


@pytest.fixture
def foreign_folder(tmp_path: Path) -> tuple[Path, str]:
    """A folder that exists and is not this user's, and the owner words that name it."""
    if os.getuid() == 0:
        folder = tmp_path / "theirs"
        folder.mkdir(mode=0o700)
        os.chown(folder, 65534, 65534)
        return folder, "uid 65534"
    return Path("/"), "uid 0"  # as anyone but root: root's own folder is not one's own


def test_a_records_folder_owned_by_another_user_is_refused_naming_its_owner(
        foreign_folder: tuple[Path, str], monkeypatch: pytest.MonkeyPatch) -> None:
    folder, owner = foreign_folder
    monkeypatch.setenv(place.ENV_RUNS_DIR, str(folder))
    for create in (True, False):
        with pytest.raises(RegistryError, match=owner):
            place.runs_root(create=create)
    assert place.records() == [], "a reader trusts nothing in it either"


def test_a_records_folder_that_is_a_symlink_is_refused_even_to_a_folder_of_ours(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ours = tmp_path / "real"
    ours.mkdir(mode=0o700)
    ended_record(ours, 1)
    (tmp_path / "link").symlink_to(ours)
    monkeypatch.setenv(place.ENV_RUNS_DIR, str(tmp_path / "link"))
    for create in (True, False):
        with pytest.raises(RegistryError, match="symbolic link"):
            place.runs_root(create=create)
    assert place.records() == []


def test_a_launch_whose_records_folder_is_foreign_says_so_runs_and_writes_nothing_there(
        foreign_folder: tuple[Path, str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    folder, owner = foreign_folder
    monkeypatch.setenv(place.ENV_RUNS_DIR, str(folder))
    before = sorted(os.listdir(folder))
    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    out = fdl_run(tmp_path, "rank.py", "0")
    assert out.returncode == 0, out.stderr
    assert f"the run's record in {folder}" in out.stderr and owner in out.stderr
    assert "the run goes on" in out.stderr
    assert out.stderr.splitlines()[-1].startswith("cluster launcher: run completed")
    assert sorted(os.listdir(folder)) == before


# -- logs that rotate ----------------------------------------------------------------------

def test_cluster_json_is_the_masked_plan_with_one_rank_a_line() -> None:
    ranks = [{"rank": r, "host": "h\u00e9", "argv": ["train.py", "--url",
                                                 "https://bob:hunter2@example.invalid/x"],
              "env": {"HF_TOKEN": "hf_abcdefghijklmnopqrstuvwxyz", "RANK": str(r)}}
             for r in range(3)]
    data = {"run_id": "r1", "env": {"WANDB_API_KEY": "k" * 40}, "workers": [], "ranks": ranks}
    text = cluster_json(data).decode("utf-8")
    assert json.loads(text) == mask_data(data), "the same data as before, masked"
    assert "hunter2" not in text and "hf_abc" not in text and "k" * 40 not in text
    lines = text.splitlines()
    assert [line for line in lines if '"rank": ' in line] == [
        line for line in lines if line.startswith('    {"rank"')], "one rank a line"
    assert len([line for line in lines if '"rank": ' in line]) == 3
    assert "h\u00e9" in text, "kept readable, not escaped"


def test_result_json_keeps_one_rank_a_line_and_reads_back_as_written(tmp_path: Path) -> None:
    rows = [{"rank": r, "host": f"n\u00e9{r}", "state": "exited", "code": 0} for r in range(5)]
    result = {"run_id": "r1", "verdict": "ok", "faults": {"n1": "lost"}, "ranks": rows,
              "attempt_list": [], "when": Path("/x")}
    write_json(tmp_path / RESULT, result)
    text = (tmp_path / RESULT).read_text(encoding="utf-8")
    assert json.loads(text) == {**result, "when": "/x"}, "what cannot be JSON is its str"
    assert [line.strip().rstrip(",") for line in text.splitlines()
            if line.lstrip().startswith('{"rank"')] == [json.dumps(r, ensure_ascii=False)
                                                          for r in rows], "one rank a line"
    assert oct((tmp_path / RESULT).stat().st_mode & 0o777) == oct(0o600)


@settings(max_examples=60, deadline=None)
@given(max_bytes=st.integers(1, 64),
       writes=st.lists(st.binary(min_size=1, max_size=64), max_size=40))
def test_a_rotating_file_keeps_the_newest_bytes_within_twice_its_bound(
        max_bytes: int, writes: list[bytes]) -> None:
    writes = [w[:max_bytes] for w in writes]  # no single write is larger than the bound
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "stdout.log")
        log = RotatingFile(path, max_bytes=max_bytes)
        for data in writes:
            log.write(data)
        log.close()
        rotated = Path(tmp, "stdout.log.1")
        kept = (rotated.read_bytes() if rotated.exists() else b"") + path.read_bytes()
        assert path.stat().st_size <= max_bytes
        assert not rotated.exists() or rotated.stat().st_size <= max_bytes
        assert len(kept) <= 2 * max_bytes
        assert b"".join(writes).endswith(kept), "the newest bytes, in order, none lost"
        assert sorted(os.listdir(tmp)) in (["stdout.log"], ["stdout.log", "stdout.log.1"])


def test_a_rotating_file_past_its_bound_renames_to_dot_1_and_starts_afresh(
        tmp_path: Path) -> None:
    path = tmp_path / "console.log"
    log = RotatingFile(path, max_bytes=100)
    log.write(b"a" * 60)
    log.write(b"b" * 30)
    assert not (tmp_path / "console.log.1").exists(), "90 bytes: within the bound"
    log.write(b"c" * 20)
    assert (tmp_path / "console.log.1").read_bytes() == b"a" * 60 + b"b" * 30
    assert path.read_bytes() == b"c" * 20
    log.write(b"d" * 90)
    assert (tmp_path / "console.log.1").read_bytes() == b"c" * 20, "the older .1 is replaced"
    assert path.read_bytes() == b"d" * 90
    log.close()


def test_a_record_rotates_each_ranks_stdout_log_past_its_bound(tmp_path: Path) -> None:
    log = RunLog(str(tmp_path), run_id(1), max_bytes=100)
    lines = [f"rank 0 line {i:02d} ".encode() + b"." * 20 + b"\n" for i in range(12)]
    for line in lines:
        log.emit(output(0, line))
    log.emit(output(1, b"rank 1 says little\n"))
    log.close()
    r0 = tmp_path / run_id(1) / "attempt_0" / "r0"
    current, rotated = (r0 / "stdout.log").read_bytes(), (r0 / "stdout.log.1").read_bytes()
    assert len(current) <= 100 and len(rotated) <= 100
    assert b"".join(lines).endswith(rotated + current)
    assert current.endswith(lines[-1])
    assert (tmp_path / run_id(1) / "attempt_0" / "r1" / "stdout.log").read_bytes() == \
        b"rank 1 says little\n"
    assert not (tmp_path / run_id(1) / "attempt_0" / "r1" / "stdout.log.1").exists()


def test_last_lines_reads_the_rotated_file_when_more_lines_are_needed(tmp_path: Path) -> None:
    path = tmp_path / "console.log"
    log = RotatingFile(path, max_bytes=50)
    lines = [f"line {i}\n".encode() for i in range(10)]  # 7 bytes each: 7 fit, then rotate
    for line in lines:
        log.write(line)
    log.close()
    assert path.read_bytes() == b"".join(lines[7:]), "the premise: lines 7-9 after rotation"
    size = len(b"".join(lines[7:]))
    assert last_lines(path, 2) == (b"".join(lines[8:]), size)
    assert last_lines(path, 3) == (b"".join(lines[7:]), size)
    assert last_lines(path, 5) == (b"".join(lines[5:]), size)
    assert last_lines(path, None) == (b"".join(lines), size)
    assert last_lines(path, 100) == (b"".join(lines), size)
    assert last_lines(path, 0) == (b"", size)
    assert last_lines(tmp_path / "missing.log", 5) == (b"", 0)


def _followed(path: Path, steps: list[bytes], max_bytes: int, offset: int = 0) -> bytes:
    """What `follow` yields of ``path`` while ``steps`` are written to it one per look
    (one look of the follower, one write of the writer: never two rotations between two
    looks), the run ending after the last write."""
    log = RotatingFile(path, max_bytes=max_bytes)
    pending = list(steps)

    def done() -> bool:
        if pending:
            log.write(pending.pop(0))
            return False
        return True

    try:
        got = []
        for chunk in follow(path, offset, done=done, poll=0.001):
            assert chunk.endswith(b"\n") or not pending, "whole lines only until the end"
            got.append(chunk)
        return b"".join(got)
    finally:
        log.close()


def test_follow_yields_every_line_written_across_rotations_exactly_once(
        tmp_path: Path) -> None:
    text = b"".join(f"line {i:03d} {'x' * (i % 9)}\n".encode() for i in range(80))
    steps = [text[i:i + 23] for i in range(0, len(text), 23)]  # lines cut anywhere
    path = tmp_path / "console.log"
    got = _followed(path, steps, max_bytes=64)
    assert (tmp_path / "console.log.1").exists(), "the premise: it rotated"
    assert got == text


@settings(max_examples=40, deadline=None)
@given(max_bytes=st.integers(8, 80),
       lines=st.lists(st.text("abc xyz", max_size=20), min_size=1, max_size=30),
       cut=st.integers(1, 40), tail=st.sampled_from([b"", b"no newline at the end"]))
def test_follow_across_rotations_loses_and_repeats_nothing(
        max_bytes: int, lines: list[str], cut: int, tail: bytes) -> None:
    text = b"".join(f"{line}\n".encode() for line in lines) + tail
    steps = [text[i:i + min(cut, max_bytes)] for i in range(0, len(text), min(cut, max_bytes))]
    with tempfile.TemporaryDirectory() as tmp:
        assert _followed(Path(tmp, "console.log"), steps, max_bytes=max_bytes) == text


def test_follow_from_an_offset_starts_there_and_ends_when_the_run_is_done(
        tmp_path: Path) -> None:
    path = tmp_path / "console.log"
    path.write_bytes(b"seen before\n")
    os.chmod(path, 0o600)
    _, offset = last_lines(path, 1)
    assert _followed(path, [b"first ", b"new line\n", b"second\n"], max_bytes=1000,
                     offset=offset) == b"first new line\nsecond\n"


def test_follow_of_a_run_already_done_drains_what_is_there_and_ends(tmp_path: Path) -> None:
    path = tmp_path / "console.log"
    log = RotatingFile(path, max_bytes=1000)
    log.write(b"a whole line\nand a last one with no newline")
    log.close()
    assert b"".join(follow(path, 0, done=lambda: True)) == \
        b"a whole line\nand a last one with no newline"


# -- which runs live, and pruning ----------------------------------------------------------

def test_a_record_whose_launcher_runs_is_alive_and_says_its_state(
        root: Path, spawned: list[subprocess.Popen[Any]]) -> None:
    pid, started = live_process(spawned)
    folder = unended_record(root, 1, pid, started, state="running")
    run = view(folder)
    assert run.alive and launcher_alive(run.state)
    assert run.phase is RunState.RUNNING and not run.ended and run.exit_code is None
    assert is_live(folder)


def test_a_run_whose_state_says_ended_before_its_result_is_written_is_still_stopping(
        root: Path, spawned: list[subprocess.Popen[Any]]) -> None:
    """The launcher saves state.json's ``ended`` a moment before result.json: a `wait`
    that looks in between must not read it as ended without a verdict (it did once,
    under load, in a fresh-clone run)."""
    pid, started = live_process(spawned)
    folder = unended_record(root, 1, pid, started, state="ended")
    run = view(folder)
    assert run.alive and run.phase is RunState.STOPPING and not run.ended


def test_a_record_whose_launcher_died_without_a_result_reads_as_lost(root: Path) -> None:
    folder = unended_record(root, 1, dead_pid(), time.time() - 5)
    run = view(folder)
    assert not run.alive
    assert run.phase is RunState.LOST and run.ended and run.exit_code is None
    assert not is_live(folder)


def test_a_reused_pid_is_not_the_launcher_that_wrote_the_record(
        root: Path, spawned: list[subprocess.Popen[Any]]) -> None:
    pid, started = live_process(spawned)
    folder = unended_record(root, 1, pid, started - 100.0)  # right pid, wrong start time
    assert not launcher_alive(view(folder).state)
    assert view(folder).phase is RunState.LOST
    assert not is_live(folder)


def test_an_ended_record_reads_as_ended_with_its_exit_code(root: Path) -> None:
    run = view(ended_record(root, 1, exit_code=143))
    assert run.phase is RunState.ENDED and run.ended and run.exit_code == 143
    assert run.row()["exit_code"] == 143 and run.row()["state"] == "ended"


def test_records_are_listed_oldest_first_and_found_by_id_or_its_unique_start(
        root: Path) -> None:
    for n in (3, 1, 2):
        ended_record(root, n)
    (root / "not-a-run").mkdir()
    (root / run_id(9)).symlink_to(root / run_id(1))  # a link is never a record
    assert [p.name for p in place.records()] == [run_id(1), run_id(2), run_id(3)]
    assert place.find(None).name == run_id(3)
    assert place.find("latest").name == run_id(3)
    assert place.find(run_id(2)).name == run_id(2)
    assert place.find(run_id(2)[:-3]).name == run_id(2)
    with pytest.raises(LookupError, match="names 3 runs"):
        place.find("20260101")
    with pytest.raises(LookupError, match="no run"):
        place.find("1999")
    with pytest.raises(ValueError):
        place.record_folder("../escape")


def test_pruning_by_count_removes_the_oldest_ended_records_first(root: Path) -> None:
    for n in range(1, 7):
        ended_record(root, n)
    removed = place.prune(is_live, keep=4, root=root)
    assert removed == [run_id(1), run_id(2)]
    assert [p.name for p in place.records(root)] == [run_id(n) for n in range(3, 7)]
    assert place.prune(is_live, keep=4, root=root) == [], "within the count: nothing"


def test_a_pruned_record_leaves_the_listing_at_once_and_its_files_after(root: Path) -> None:
    """A launch prunes before its first connect: the files of a big old record are
    removed by a daemon thread, and a removal cut short is finished by the next prune."""
    for n in range(1, 4):
        ended_record(root, n)
    assert place.prune(is_live, keep=2, root=root, background=True) == [run_id(1)]
    assert [p.name for p in place.records(root)] == [run_id(2), run_id(3)]
    deadline = time.monotonic() + 10
    while (root / (place.PRUNED_PREFIX + run_id(1))).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not (root / (place.PRUNED_PREFIX + run_id(1))).exists()
    cut_short = root / (place.PRUNED_PREFIX + run_id(9))  # a launcher killed mid-removal
    (cut_short / "r0").mkdir(parents=True)
    (cut_short / "r0" / "stdout.log").write_text("x")
    assert place.prune(is_live, keep=2, root=root) == []
    assert not cut_short.exists()
    assert sorted(p.name for p in root.iterdir()) == [run_id(2), run_id(3)]
    place.prune(is_live, keep=2, root=root, background=True)
    assert not [t for t in threading.enumerate() if t.name == "fdl-prune"], \
        "nothing to remove: no thread is started (a launch holds one thread per host)"


def test_pruning_by_size_removes_the_oldest_until_the_rest_fit(root: Path) -> None:
    for n in range(1, 6):
        ended_record(root, n, size=1000)
    each = place.size_of(root / run_id(1))
    assert 1000 < each < 2000, "the premise: a record is its 1000 bytes and its json"
    removed = place.prune(is_live, keep=100, max_bytes=2 * each + each // 2, root=root)
    assert removed == [run_id(1), run_id(2), run_id(3)]
    assert [p.name for p in place.records(root)] == [run_id(4), run_id(5)]


def test_an_ended_records_size_is_measured_once_and_kept_in_it(root: Path) -> None:
    ended = ended_record(root, 1, size=1000)
    lost = unended_record(root, 2, dead_pid(), time.time() - 5)  # no result: may change
    assert place.prune(is_live, keep=100, root=root) == []
    measured = int((ended / place.SIZE_FILE).read_text())
    assert measured == place.size_of(ended) - len(str(measured))  # all but itself
    assert stat.S_IMODE((ended / place.SIZE_FILE).stat().st_mode) == 0o600
    assert not (lost / place.SIZE_FILE).exists()
    (ended / CONSOLE).write_bytes(b"x" * 50_000)  # not walked again: the kept size counts
    assert place.record_size(ended) == measured
    fits = measured + place.size_of(lost) + 10  # with the kept size; not with 50 kB more
    assert place.prune(is_live, keep=100, max_bytes=fits, root=root) == []


def test_a_live_record_is_never_pruned_nor_counted_against_the_others(
        root: Path, spawned: list[subprocess.Popen[Any]]) -> None:
    pid, started = live_process(spawned)
    live = unended_record(root, 1, pid, started)  # the oldest of all
    (live / CONSOLE).write_bytes(b"x" * 10_000)  # and the largest
    for n in range(2, 6):
        ended_record(root, n, size=100)
    assert place.prune(is_live, keep=0, max_bytes=0, root=root) == [
        run_id(n) for n in range(2, 6)]
    assert [p.name for p in place.records(root)] == [run_id(1)]
    for n in range(6, 9):
        ended_record(root, n, size=100)
    assert place.prune(is_live, keep=2, root=root) == [run_id(6)], \
        "the live one is not one of the 2 kept"


def test_a_lost_record_and_one_of_a_reused_pid_are_pruned_as_ended_ones(
        root: Path, spawned: list[subprocess.Popen[Any]]) -> None:
    pid, started = live_process(spawned)
    unended_record(root, 1, dead_pid(), time.time() - 5)
    unended_record(root, 2, pid, started - 100.0)
    ended_record(root, 3)
    assert place.prune(is_live, keep=1, root=root) == [run_id(1), run_id(2)]


def test_a_spared_record_is_never_pruned(root: Path) -> None:
    for n in range(1, 4):
        ended_record(root, n)
    assert place.prune(is_live, keep=0, root=root, spare=[run_id(1)]) == [run_id(2),
                                                                         run_id(3)]
    assert [p.name for p in place.records(root)] == [run_id(1)]


def test_a_record_of_a_launcher_on_another_host_is_never_pruned(
        root: Path, spawned: list[subprocess.Popen[Any]]) -> None:
    """A home (where records live by default) is often shared over NFS: this host cannot
    tell whether another host's launcher still runs, so its record, without a result,
    must be kept."""
    pid, started = live_process(spawned)
    unended_record(root, 1, pid, started, host="gpu-b.example.invalid")
    ended_record(root, 2)
    place.prune(is_live, keep=0, root=root)
    assert [p.name for p in place.records(root)] == [run_id(1)]


def test_a_launch_prunes_old_records_and_keeps_the_live_one(
        root: Path, tmp_path: Path, spawned: list[subprocess.Popen[Any]]) -> None:
    pid, started = live_process(spawned)
    unended_record(root, 1, pid, started)  # the oldest: a run still going elsewhere
    for n in range(2, RECORDS_KEPT + 3):  # one more ended run than is kept
        ended_record(root, n)
    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    result = launch(None, [sys.executable, str(tmp_path / "rank.py"), "0"],
                    hosts="localhost", quiet=True)
    assert result.exit_code == 0, result.message
    names = [p.name for p in place.records(root)]
    assert run_id(1) in names, "the live record is kept"
    assert run_id(2) not in names, "the oldest ended one is pruned"
    assert names == [run_id(1), *(run_id(n) for n in range(3, RECORDS_KEPT + 3)),
                     str(result.run_id)]


# -- what a real launch leaves -------------------------------------------------------------

@pytest.mark.parametrize("code,verdict", [(0, "ok"), (1, "failed")])
def test_a_foreground_run_leaves_its_state_console_rank_logs_and_result(
        code: int, verdict: str, root: Path, tmp_path: Path) -> None:
    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    proc = subprocess.Popen([*FDL, "run", "--nproc-per-node", "2", "rank.py", str(code)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr
    verdict_line = stderr.splitlines()[-1]

    [folder] = place.records(root)
    state = json.loads((folder / STATE).read_text())
    assert state["state"] == "ended" and state["attempt"] == 0
    assert state["world_size"] == 2 and state["hosts"] == ["localhost"]
    assert state["launcher"]["pid"] == proc.pid and state["detached"] is False
    assert state["cwd"] == str(tmp_path)

    result = json.loads((folder / RESULT).read_text())
    assert (result["run_id"], result["verdict"], result["exit_code"]) == (
        folder.name, verdict, code)
    assert result["message"] == verdict_line
    assert result["attempts"] == 1
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    if code:
        assert "rank 1" in result["root_cause"]

    console = (folder / CONSOLE).read_text().splitlines()
    assert console[-1] == verdict_line, "the verdict is the console's last line"
    for rank in (0, 1):
        assert f"[localhost:cpu:r{rank}] hello from rank {rank}" in console
        assert f"[localhost:cpu:r{rank}] hello from rank {rank}" in stdout.splitlines()
        r = folder / "attempt_0" / f"r{rank}"
        assert (r / "stdout.log").read_bytes() == \
            f"hello from rank {rank}\nsecond line of rank {rank}\n".encode()
        assert (r / "stderr.log").read_bytes() == f"complaint of rank {rank}\n".encode()
    events = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]
    assert events[-1]["name"] == "verdict" and events[-1]["message"] == verdict_line

    run = view(folder)
    assert run.phase is RunState.ENDED and run.exit_code == code and not run.alive
    _, files = tree(folder)
    assert [p for p in files if p.name.startswith(".") and p.name != place.SIZE_FILE] == [], \
        "no temporary file is left"
    kept = int((folder / place.SIZE_FILE).read_text())
    assert kept == place.size_of(folder) - len(str(kept)), \
        "its size is kept at its end: the next launch's prune does not walk its files"


def test_result_and_state_are_never_seen_half_written(
        root: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Readers (attach, wait, status) read while the launcher writes: every read of
    state.json or result.json is a whole JSON document."""
    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    stop = threading.Event()
    whole: list[str] = []
    broken: list[bytes] = []

    def reader() -> None:
        while not stop.is_set():
            for folder in place.records(root):
                for name in (STATE, RESULT):
                    try:
                        data = (folder / name).read_bytes()
                    except FileNotFoundError:
                        continue
                    try:
                        json.loads(data)
                        whole.append(name)
                    except ValueError:
                        broken.append(data)
            time.sleep(0.001)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        result = launch(None, [sys.executable, str(tmp_path / "rank.py"), "1"],
                        hosts="localhost", nproc_per_node=2, quiet=True)
    finally:
        stop.set()
        thread.join(10)
    assert broken == []
    assert STATE in whole, "the premise: the reader read while the run went on"
    folder = place.record_folder(str(result.run_id), root)
    recorded = json.loads((folder / RESULT).read_text())
    verdict_line = capfd.readouterr().err.splitlines()[-1]
    assert (recorded["verdict"], recorded["exit_code"], recorded["message"]) == (
        result.verdict, result.exit_code, verdict_line)
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == [
        place.SIZE_FILE], "no temporary file is left; the record's size is kept"


@pytest.mark.parametrize("code", [0, 1])
def test_a_runs_record_read_back_by_attach_is_the_result_its_launch_returned(
        code: int, root: Path, tmp_path: Path) -> None:
    """One run, one `LaunchResult`: from ``launch()`` in the foreground, or from its
    record through ``fdl_fabric.attach(run_id).wait()`` (what a detached run gives)."""
    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    result = launch(None, [sys.executable, str(tmp_path / "rank.py"), str(code)],
                    hosts="localhost", nproc_per_node=2, quiet=True)
    assert result.exit_code == code
    again = attach(result.run_id).wait(timeout=10)
    assert (again.run_id, again.verdict, again.exit_code) == (
        result.run_id, result.verdict, result.exit_code)
    assert again.ranks == result.ranks
    assert again.root_cause == result.root_cause
    assert again.message == result.message


def test_a_record_opened_says_starting_and_who_runs_it(root: Path) -> None:
    folder = place.record_folder(run_id(1))
    record = RunRecord(folder, run_id(1), detached=True, verbosity=0,
                       about={"command": "python train.py"})
    try:
        run = view(folder)
        assert run.phase is RunState.STARTING and run.alive
        assert run.launcher["pid"] == os.getpid()
        assert run.state["detached"] is True and run.state["command"] == "python train.py"
        assert mode(folder) == 0o700 and mode(folder / STATE) == 0o600
    finally:
        record.close()
