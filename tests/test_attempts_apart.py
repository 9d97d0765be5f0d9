"""Issue 34, item 6, on one host: two attempts of one run never touch each other.

A host cut off by a partition runs attempt 0's ranks on while attempt 1 runs elsewhere;
when it answers again (the launcher's fresh dial, `commands.healwatch`) or is re-admitted
(the next attempt's own agent), a sweep stops the earlier attempt and never the one now
running. Real processes, real signals, a private registry folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fdl_fabric.agent import pids, procs, registry

RUN = "20261205-090000-feedbeef"
HOST = "node1"


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs_: list[subprocess.Popen[bytes]] = []
    yield procs_
    for p in procs_:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def rank_of(attempt: int, started: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    """A rank of RUN on HOST, in ``attempt``, leading its own process group."""
    env = {**os.environ, "FLODL_INTERNAL_RUN_ID": RUN, "FLODL_HOST_NAME": HOST,
           "TORCHELASTIC_RESTART_COUNT": str(attempt)}
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env,
                         start_new_session=True)
    started.append(p)
    deadline = time.monotonic() + 10
    while RUN.encode() not in Path(f"/proc/{p.pid}/environ").read_bytes():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return p


def record_of(attempt: int, rank: subprocess.Popen[bytes], folder: Path,
              agent: int = 1) -> None:
    start = pids.start_time(rank.pid)
    assert start is not None
    procs.write_record({"version": procs.RECORD_VERSION, "run": RUN, "cluster": "c1",
                        "host": HOST, "agent": agent, "agent_start": 0, "launcher": None,
                        "started": time.time(), "attempt": attempt,
                        "ranks": [{"rank": 1, "pid": rank.pid, "start": start}]}, str(folder))


def gone(p: subprocess.Popen[bytes], timeout: float = 10) -> bool:
    try:
        p.wait(timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    reg = tmp_path / "reg"
    registry.make_private(str(reg))
    return reg


def test_the_processes_of_a_run_are_told_apart_by_their_attempt(
        started: list[subprocess.Popen[bytes]]) -> None:
    old, new = rank_of(0, started), rank_of(1, started)
    assert old.pid in pids.carriers(RUN, HOST, 0) and new.pid not in pids.carriers(RUN, HOST, 0)
    assert new.pid in pids.carriers(RUN, HOST, 1) and old.pid not in pids.carriers(RUN, HOST, 1)
    assert {old.pid, new.pid} <= set(pids.carriers(RUN, HOST)), "without one: the whole run"


def test_a_sweep_that_keeps_attempt_1_stops_attempt_0_and_never_touches_attempt_1(
        folder: Path, started: list[subprocess.Popen[bytes]]) -> None:
    old, new = rank_of(0, started), rank_of(1, started)
    record_of(0, old, folder)
    report = procs.sweep(keep=RUN, keep_attempt=1, folder=str(folder), grace=2.0)
    assert gone(old), "attempt 0's rank was stopped"
    assert new.poll() is None, "attempt 1's rank runs on"
    assert [s["pids"] for s in report["stopped"]] == [[old.pid]], report
    assert not (folder / f"{RUN}@{HOST}.json").exists(), "attempt 0's record went with it"


def test_a_sweep_keeps_the_attempt_it_keeps_and_every_later_one(
        folder: Path, started: list[subprocess.Popen[bytes]]) -> None:
    current = rank_of(2, started)
    record_of(2, current, folder)
    report = procs.sweep(keep=RUN, keep_attempt=2, folder=str(folder), grace=1.0)
    assert current.poll() is None and report["stopped"] == [], report
    assert (folder / f"{RUN}@{HOST}.json").exists()


def test_a_sweep_that_keeps_a_run_without_an_attempt_keeps_all_of_it(
        folder: Path, started: list[subprocess.Popen[bytes]]) -> None:
    """A cleanup of another cluster, or an agent of an older launcher: the run is kept."""
    old = rank_of(0, started)
    record_of(0, old, folder)
    procs.sweep(keep=RUN, folder=str(folder), cluster="c1", grace=1.0)
    assert old.poll() is None


def test_an_ending_attempt_never_removes_the_record_a_later_attempt_wrote(
        folder: Path, started: list[subprocess.Popen[bytes]]) -> None:
    record_of(3, rank_of(3, started), folder, agent=4242)
    assert not procs.remove_record(RUN, HOST, str(folder), agent=1111), "not its own"
    assert (folder / f"{RUN}@{HOST}.json").exists()
    assert procs.remove_record(RUN, HOST, str(folder), agent=4242)
    assert not (folder / f"{RUN}@{HOST}.json").exists()


def test_a_sweep_request_from_the_launcher_carries_what_it_keeps(
        folder: Path, started: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
        ) -> None:
    seen: dict[str, object] = {}
    monkeypatch.setattr(procs, "sweep", lambda **kw: seen.update(kw) or {})
    procs.sweep_asked({"runs": [], "keep": RUN, "keep_attempt": 1, "by": {"command": "x"}},
                      wait=time.sleep)
    assert (seen["keep"], seen["keep_attempt"], seen["by"]) == (RUN, 1, {"command": "x"})
    procs.sweep_asked({"keep_attempt": "1; rm -rf /"}, wait=time.sleep)
    assert seen["keep_attempt"] is None and seen["keep"] is None
