"""The logs' writer thread (`presentation.deferred`, `presentation.runlog`): the threads
that read ranks' output and hellos hand events over and go on; the files are written in
order, within bounds, and a disk that stalls gives the log up instead of the run."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from fdl_fabric.events import Event, Name
from fdl_fabric.presentation.deferred import WRITER_NICE, Deferred
from fdl_fabric.presentation.rotating import RotatingFile, TextLog
from fdl_fabric.presentation.runlog import RunLog

pytestmark = pytest.mark.timeout(60)


def test_calls_run_in_the_order_they_were_handed_over_on_one_other_thread() -> None:
    writer = Deferred("test-writer")
    seen: list[tuple[int, str]] = []
    for i in range(2000):
        writer.call(lambda i=i: seen.append((i, threading.current_thread().name)))
    assert writer.flush(10)
    assert [i for i, _ in seen] == list(range(2000))
    assert {name for _, name in seen} == {"test-writer"}
    writer.close(5)


def test_the_writer_runs_nicer_than_the_threads_that_hand_it_calls() -> None:
    """Where the launcher shares a core, the kernel's time making 8,192 ranks' files comes
    after the coordinator's and the readers' (issue 35)."""
    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    writer = Deferred("t")
    seen: list[int] = []
    writer.call(lambda: seen.append(nice()))
    assert writer.flush(5)
    assert seen == [min(19, nice() + WRITER_NICE)] and WRITER_NICE > 0
    assert nice() == os.getpriority(os.PRIO_PROCESS, 0), "the caller's own is untouched"
    writer.close(5)


def test_a_call_made_on_the_writer_thread_runs_at_once_and_never_waits_for_itself() -> None:
    writer = Deferred("test-writer", max_bytes=1)
    order: list[str] = []

    def outer() -> None:
        writer.call(order.append, "inner")  # a failed write's report comes back here
        assert writer.flush(5)  # the writer does not wait for itself
        order.append("outer")

    writer.call(outer)
    assert writer.flush(10)
    assert order == ["inner", "outer"]
    writer.close(5)


def test_a_stalled_disk_holds_a_producer_at_most_the_stall_bound_then_the_log_is_given_up(
        ) -> None:
    release = threading.Event()
    told: list[str] = []
    writer = Deferred("test-writer", on_stall=told.append, max_bytes=100, stall_s=0.5)
    writer.call(release.wait, 30, size=60)  # the disk hangs on this write
    writer.call(lambda: None, size=30)
    began = time.monotonic()
    writer.call(lambda: None, size=30)  # past the bound: waits for room, then gives up
    waited = time.monotonic() - began
    assert 0.4 <= waited < 5
    assert told == ["the disk took none of the log's writes for 0.5 s"]
    assert writer.stalled == told[0]
    began = time.monotonic()
    writer.call(lambda: None, size=30)  # given up: nothing more waits
    assert time.monotonic() - began < 0.2
    assert not writer.flush(0.2)  # bounded, and says the write did not finish
    release.set()
    writer.close(5)
    assert told == ["the disk took none of the log's writes for 0.5 s"]  # said once


def test_a_call_that_raises_gives_the_log_up_and_says_so_once() -> None:
    told: list[str] = []
    writer = Deferred("test-writer", on_stall=told.append)
    ran: list[int] = []
    writer.call(ran.append, 1)
    writer.call(lambda: 1 / 0)
    writer.call(ran.append, 2)
    writer.flush(5)
    time.sleep(0.1)
    writer.call(ran.append, 3)
    assert writer.flush(5)
    assert ran == [1]
    assert told == ["the log's writer failed: ZeroDivisionError('division by zero')"]
    writer.close(5)


def test_a_deferred_run_log_writes_each_attempts_output_to_its_own_folder(
        tmp_path: Path) -> None:
    log = RunLog(str(tmp_path), "run", deferred=True)
    for attempt in (0, 1):
        log.attempt = attempt
        for rank in range(3):
            log.emit(Event(Name.RANK_STARTED, host="h", rank=rank,
                           data={"pid": 100 + rank, "label": f"h:cpu:r{rank}"}))
            log.emit(Event(Name.RANK_OUTPUT, host="h", rank=rank,
                           data={"stderr": False, "raw": f"a{attempt} r{rank}\n".encode(),
                                 "text": f"a{attempt} r{rank}", "label": "h"}))
    log.close()
    folder = tmp_path / "run"
    for attempt in (0, 1):
        for rank in range(3):
            rank_dir = folder / f"attempt_{attempt}" / f"r{rank}"
            assert (rank_dir / "stdout.log").read_bytes() == f"a{attempt} r{rank}\n".encode()
            assert (rank_dir / "stderr.log").read_bytes() == b""  # exists from the start
            assert rank_dir.stat().st_mode & 0o777 == 0o700
            assert (rank_dir / "stderr.log").stat().st_mode & 0o777 == 0o600
    names = [json.loads(line)["name"]
             for line in (folder / "events.jsonl").read_text().splitlines()]
    assert names == ["rank_started"] * 6


def _rank_logs(log: RunLog, ranks: range) -> None:
    for rank in ranks:
        log.emit(Event(Name.RANK_STARTED, host="h", rank=rank,
                       data={"pid": 100 + rank, "label": f"h:cpu:r{rank}"}))
        log.emit(Event(Name.RANK_OUTPUT, host="h", rank=rank,
                       data={"stderr": False, "raw": f"r{rank}\n".encode(),
                             "text": f"r{rank}", "label": "h"}))


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077, 0o277, 0o377])
def test_rank_folders_are_0700_and_their_logs_0600_whatever_the_umask(
        tmp_path: Path, umask: int) -> None:
    """A folder the log makes skips its chmod only when the umask spares the owner's
    bits; a umask that takes them (0277: 0500 folders) is corrected after the fact."""
    previous = os.umask(umask)
    try:
        log = RunLog(str(tmp_path), "run", deferred=True)
        _rank_logs(log, range(3))
        log.close()
    finally:
        os.umask(previous)
    for rank in range(3):
        rank_dir = tmp_path / "run" / "attempt_0" / f"r{rank}"
        assert stat.S_IMODE(rank_dir.stat().st_mode) == 0o700
        for name in ("stdout.log", "stderr.log"):
            assert stat.S_IMODE((rank_dir / name).stat().st_mode) == 0o600, name
        assert (rank_dir / "stdout.log").read_bytes() == f"r{rank}\n".encode()


def test_a_rank_folder_and_logs_found_there_are_tightened_and_appended_to(
        tmp_path: Path) -> None:
    rank_dir = tmp_path / "run" / "attempt_0" / "r0"
    rank_dir.mkdir(parents=True)
    os.chmod(rank_dir, 0o755)
    (rank_dir / "stdout.log").write_bytes(b"before\n")
    os.chmod(rank_dir / "stdout.log", 0o644)
    log = RunLog(str(tmp_path), "run", deferred=True)
    _rank_logs(log, range(1))
    log.close()
    assert stat.S_IMODE(rank_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((rank_dir / "stdout.log").stat().st_mode) == 0o600
    assert (rank_dir / "stdout.log").read_bytes() == b"before\nr0\n"


@pytest.mark.parametrize("umask", [0o022, 0o277])
def test_a_rank_log_removed_while_the_rank_runs_is_made_again_0600(
        tmp_path: Path, umask: int) -> None:
    """Its descriptor released (thousands of ranks' logs share a few), a rank's log
    that a user removed is made again by its next line, private, whatever the umask."""
    previous = os.umask(umask)
    try:
        log = RunLog(str(tmp_path), "run", deferred=True)
        _rank_logs(log, range(200))  # rank 0's descriptor is released for the others'
        assert log.flush(10)
        stdout = tmp_path / "run" / "attempt_0" / "r0" / "stdout.log"
        stdout.unlink()
        log.emit(Event(Name.RANK_OUTPUT, host="h", rank=0,
                       data={"stderr": False, "raw": b"again\n", "text": "again",
                             "label": "h"}))
        log.close()
    finally:
        os.umask(previous)
    assert stdout.read_bytes() == b"again\n"
    assert stat.S_IMODE(stdout.stat().st_mode) == 0o600


def test_console_log_lines_kept_for_a_batch_are_written_before_they_pass_a_bound(
        tmp_path: Path) -> None:
    """console.log's lines wait for the end of the writer's batch, but never more than
    `TextLog.KEEP_BYTES` of them: the file's rotation bound holds within one drain."""
    file = RotatingFile(tmp_path / "console.log", max_bytes=256 << 10)
    text = TextLog(file)
    line = "x" * 99 + "\n"
    for _ in range(10_000):  # 1 MB, never drained by hand
        text.write(line)
    on_disk = (tmp_path / "console.log").stat().st_size
    assert on_disk <= (256 << 10) + TextLog.KEEP_BYTES
    assert (tmp_path / "console.log.1").exists()
    text.drain()
    file.close()
    total = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert total % 100 == 0 and total >= (256 << 10)


def test_the_after_batch_hook_runs_on_the_writer_after_each_batch_before_flush_returns(
        ) -> None:
    """A sink that buffers its lines (events.jsonl, console.log) writes them once a
    batch: a flush that returned has them on disk."""
    seen: list[tuple[str, int]] = []
    writer = Deferred("test-writer", after_batch=lambda: seen.append(
        (threading.current_thread().name, len(done))))
    done: list[int] = []
    for n in range(50):
        writer.call(done.append, n)
    assert writer.flush(10)
    assert done == list(range(50))
    assert seen and seen[-1] == ("test-writer", 50)
    writer.close(5)


def test_events_are_on_disk_once_a_flush_returns_though_written_a_batch_at_a_time(
        tmp_path: Path) -> None:
    log = RunLog(str(tmp_path), "run", deferred=True)
    events = tmp_path / "run" / "events.jsonl"
    for rank in range(300):
        log.emit(Event(Name.RANK_JOINED, host="h", rank=rank, data={"pid": rank}))
    assert log.flush(10)
    assert len(events.read_text().splitlines()) == 300
    log.emit(Event(Name.RANK_JOINED, host="h", rank=300, data={"pid": 300}))
    assert log.flush(10)
    assert len(events.read_text().splitlines()) == 301
    log.close()


def test_a_log_closed_with_writes_pending_writes_them_first(tmp_path: Path) -> None:
    log = RunLog(str(tmp_path), "run", deferred=True)
    for rank in range(500):
        log.emit(Event(Name.RANK_JOINED, host="h", rank=rank, data={"pid": rank}))
    log.close()
    lines = (tmp_path / "run" / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["rank"] for line in lines] == list(range(500))
    assert log.failed is None


def test_a_burst_of_calls_is_written_once_it_pauses_not_call_by_call() -> None:
    """While the launcher's threads hand events over in a burst, the writer takes none
    of their GIL: it writes the burst whole once it pauses."""
    writer = Deferred("test-writer")
    handed = [0]
    seen_at_run: list[int] = []
    for _ in range(200):  # a call every millisecond, for 0.2 s: no pause of QUIET_S
        handed[0] += 1
        writer.call(lambda: seen_at_run.append(handed[0]))  # how many were handed by then
        time.sleep(0.001)
    assert writer.flush(10)
    assert len(seen_at_run) == 200
    # Written in a few batches (a stalled machine may split it), never call by call:
    # a writer that took each call as it came would have seen about 200 counts.
    assert len(set(seen_at_run)) <= 10, sorted(set(seen_at_run))
    writer.close(5)


def test_a_flush_does_not_wait_for_a_burst_to_pause() -> None:
    writer = Deferred("test-writer")
    stop = threading.Event()

    def burst() -> None:
        while not stop.is_set():
            writer.call(lambda: None)
            time.sleep(0.001)  # never a pause of QUIET_S: only LATEST_S would end it

    producer = threading.Thread(target=burst, daemon=True)
    producer.start()
    try:
        time.sleep(0.05)
        done: list[int] = []
        writer.call(done.append, 1)
        assert writer.flush(10)
        assert done == [1]
    finally:
        stop.set()
        producer.join(5)
        writer.close(5)
