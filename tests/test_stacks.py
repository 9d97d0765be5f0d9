"""Where the ranks are: grouping and rendering of per-rank stack reports
(`fdl_fabric.presentation.stacks`), and the agent's collector (`fdl_fabric.agent.stacks`)
against real sleeping processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fdl_fabric.agent import stacks as agent_stacks
from fdl_fabric.presentation import stacks


def frame(name: str, file: str, line: int) -> dict[str, Any]:
    return {"name": name, "file": file, "path": f"/srv/{file}", "line": line}


def python_rank(*frames: dict[str, Any], pid: int = 1000) -> dict[str, Any]:
    """A rank entry as the agent reports it, with a main thread whose innermost frame
    comes first."""
    return {"pid": pid, "target": pid, "proc": {"state": "S", "cpu": 0.0, "window": 1.0},
            "threads": [{"name": "MainThread", "id": pid, "active": False,
                         "frames": list(frames)}]}


def all_reduce(pid: int = 1000) -> dict[str, Any]:
    return python_rank(frame("all_reduce", "distributed_c10d.py", 2801),
                       frame("train_step", "train.py", 40), pid=pid)


def stuck(pid: int = 1000) -> dict[str, Any]:
    return python_rank(frame("stuck_here", "hang.py", 3), frame("<module>", "hang.py", 5),
                       pid=pid)


def test_the_odd_rank_out_comes_first_and_the_waiting_ranks_share_one_line() -> None:
    ranks = {"0": all_reduce(), "1": stuck(), "2": all_reduce(), "3": all_reduce(),
             "4": all_reduce()}
    hosts = {"0": "node0", "1": "node0", "2": "node1", "3": "node1", "4": "node1"}
    assert stacks.groups(ranks, hosts) == [
        ("stuck_here (hang.py:3)", [1], ["node0"]),
        ("all_reduce (distributed_c10d.py:2801)", [0, 2, 3, 4], ["node0", "node1"]),
    ]
    text = stacks.stacks_text({"reason": "hang", "ranks": ranks, "hosts": hosts,
                               "py_spy": {"node0": True, "node1": True}})
    assert text.splitlines() == [
        "cluster launcher: where each rank is (hang):",
        "  rank 1 (node0): stuck_here (hang.py:3)",
        "  ranks 0, 2-4 (node0, node1): all_reduce (distributed_c10d.py:2801)",
    ]


def test_groups_of_the_same_size_are_ordered_by_their_first_rank() -> None:
    ranks = {"5": stuck(), "2": all_reduce()}
    assert [g[1] for g in stacks.groups(ranks, {})] == [[2], [5]]
    assert stacks.groups(ranks, {})[0][2] == ["?"]  # a rank without a known host


def test_a_rank_is_placed_by_its_main_thread_not_by_a_helper_thread() -> None:
    entry = {"pid": 7, "threads": [
        {"name": "Thread-1 (loader)", "id": 8, "frames": [frame("wait", "threading.py", 320)]},
        {"name": "MainThread", "id": 7, "frames": [frame("backward", "train.py", 12)]},
    ]}
    assert stacks.where(entry) == "backward (train.py:12)"


def test_rank_lists_fold_runs_of_three_or_more() -> None:
    assert stacks.rank_list([7, 0, 2, 3, 4, 5]) == "0, 2-5, 7"
    assert stacks.rank_list([3]) == "3"
    assert stacks.rank_list([0, 1, 2, 3, 4, 5, 6, 7]) == "0-7"
    assert stacks.rank_list([10, 12, 14]) == "10, 12, 14"
    assert stacks.rank_list([]) == ""


def test_ranks_without_a_python_stack_are_grouped_by_what_proc_says() -> None:
    futex = {"state": "S", "wchan": "futex_wait_queue", "syscall": "futex"}
    ranks = {
        "0": {"pid": 1, "proc": dict(futex), "error": "py-spy is not installed on this host"},
        "1": {"pid": 2, "proc": dict(futex), "error": "py-spy is not installed on this host"},
        "2": {"pid": 3, "proc": {"state": "D", "wchan": "nfs_wait_bit_killable"},
              "error": "py-spy is not installed on this host"},
        "3": {"pid": 4, "proc": {"state": "R", "syscall": "running"}},
    }
    assert stacks.where(ranks["0"]) == \
        "no Python stack: state S, wchan futex_wait_queue, syscall futex"
    assert stacks.where(ranks["2"]) == "no Python stack: state D, wchan nfs_wait_bit_killable"
    assert stacks.where({"pid": 9}) == "no Python stack: state ?"
    found = stacks.groups(ranks, {"0": "a", "1": "a", "2": "b", "3": "b"})
    assert found == [
        ("no Python stack: state D, wchan nfs_wait_bit_killable", [2], ["b"]),
        ("no Python stack: state R, syscall running", [3], ["b"]),
        ("no Python stack: state S, wchan futex_wait_queue, syscall futex", [0, 1], ["a"]),
    ]


def test_hosts_that_gave_no_stacks_and_hosts_without_py_spy_are_named() -> None:
    text = stacks.stacks_text({
        "reason": "asked (SIGQUIT)", "ranks": {"0": all_reduce()}, "hosts": {"0": "node0"},
        "problems": {"node2": "no answer within 15s", "node1": "its agent is gone"},
        "py_spy": {"node0": True, "node3": False, "node4": False},
    })
    assert text.splitlines() == [
        "cluster launcher: where each rank is (asked (SIGQUIT)):",
        "  rank 0 (node0): all_reduce (distributed_c10d.py:2801)",
        "  node1: no stacks: its agent is gone",
        "  node2: no stacks: no answer within 15s",
        "  (no py-spy on node3, node4: `pip install fdl-fabric[stacks]` there for Python "
        "stacks)",
    ]


def test_a_report_without_any_rank_says_so() -> None:
    assert stacks.stacks_text({"reason": "hang"}).splitlines() == [
        "cluster launcher: where each rank is (hang):", "  no running rank"]


def test_the_dump_of_one_rank_holds_every_thread_and_every_frame() -> None:
    entry = {
        "pid": 4100, "target": 4107,
        "proc": {"state": "S", "wchan": "futex_wait_queue", "syscall": "futex", "cpu": 0.01,
                 "window": 1.02, "cmdline": "python train.py --epochs 3"},
        "threads": [
            {"name": "MainThread", "id": 4107, "active": True, "frames": [
                frame("all_reduce", "distributed_c10d.py", 2801),
                frame("train_step", "train.py", 40), frame("<module>", "train.py", 90)]},
            {"name": "pin_memory", "id": 4111, "active": False, "frames": [
                frame("wait", "threading.py", 320), frame("get", "queue.py", 171)]},
        ],
    }
    text = stacks.dump_text("3", "node1", entry)
    lines = text.splitlines()
    assert lines[0] == "rank 3 on node1 (pid 4100, dumped pid 4107)"
    assert lines[1] == ("state S, wchan futex_wait_queue, syscall futex, "
                        "0.01s CPU in the last 1.02s")
    assert "command: python train.py --epochs 3" in lines
    assert 'Thread 4107 (active): "MainThread"' in lines
    assert 'Thread 4111 (idle): "pin_memory"' in lines
    for thread in entry["threads"]:
        for f in thread["frames"]:
            assert f"    {stacks.frame_text(f)}" in lines
    # frames stay innermost first, under their own thread
    main_at = lines.index('Thread 4107 (active): "MainThread"')
    assert lines[main_at + 1:main_at + 4] == [
        "    all_reduce (distributed_c10d.py:2801)", "    train_step (train.py:40)",
        "    <module> (train.py:90)"]
    assert text.endswith("\n")


def test_the_dump_of_a_rank_without_python_stack_says_why() -> None:
    text = stacks.dump_text("0", "node0", {"pid": 12, "target": 12,
                                           "proc": {"state": "D"},
                                           "error": "py-spy is not installed on this host"})
    assert text.splitlines()[0] == "rank 0 on node0 (pid 12)"
    assert "no Python stack: py-spy is not installed on this host" in text.splitlines()


def test_py_spys_json_becomes_threads_main_first_innermost_frame_first() -> None:
    raw = [
        {"thread_name": "Thread-2", "os_thread_id": 11, "active": True,
         "frames": [{"name": "poll", "filename": "/usr/lib/python3/selectors.py",
                     "short_filename": "selectors.py", "line": 468}]},
        {"thread_name": "MainThread", "os_thread_id": 10, "active": False,
         "frames": [{"name": "nap", "filename": "/srv/x.py", "short_filename": "x.py",
                     "line": 3},
                    {"name": "<module>", "filename": "/srv/x.py", "line": "bad"}]},
    ]
    threads = agent_stacks._threads(raw)
    assert [t["name"] for t in threads] == ["MainThread", "Thread-2"]
    assert threads[0]["frames"] == [
        {"name": "nap", "file": "x.py", "path": "/srv/x.py", "line": 3},
        {"name": "<module>", "file": "/srv/x.py", "path": "/srv/x.py", "line": 0}]
    assert agent_stacks._threads({"not": "a list"}) == []


# -- the collector against real processes --------------------------------------------------------

SLEEPER = (
    "import time\n"
    "def nap_in_here():\n"
    "    print('ready', flush=True)\n"
    "    time.sleep(120)\n"
    "nap_in_here()\n"
)


@pytest.fixture
def sleeper(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A Python process sleeping in `nap_in_here` (sleeper.py, line 4)."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        yield proc
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_py_spy_finds_the_function_a_real_rank_sleeps_in(
        sleeper: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(agent_stacks.ENV_PY_SPY, raising=False)
    assert agent_stacks.find_py_spy(), "py-spy must be installed for this test (`which py-spy`)"
    report = agent_stacks.collect({0: sleeper.pid})
    assert report["py_spy"]
    entry = report["ranks"]["0"]
    assert "error" not in entry, entry.get("error")
    assert entry["pid"] == entry["target"] == sleeper.pid
    main = stacks.main_thread(entry)
    assert main is not None and main["name"] == "MainThread"
    assert main["frames"][0]["name"] == "nap_in_here"
    assert stacks.where(entry) == "nap_in_here (sleeper.py:4)"
    assert [f["name"] for f in main["frames"]] == ["nap_in_here", "<module>"]
    assert entry["proc"]["state"] == "S"


def test_a_rank_started_through_a_shell_is_dumped_at_its_python_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(agent_stacks.ENV_PY_SPY, raising=False)
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    # Not `exec`: the rank's leader stays a shell, its Python is a child in its group.
    shell = subprocess.Popen(["/bin/sh", "-c", f'"{sys.executable}" "{script}"; true'],
                             stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert shell.stdout is not None and shell.stdout.readline() == b"ready\n"
        report = agent_stacks.collect({5: shell.pid})
        entry = report["ranks"]["5"]
        assert entry["pid"] == shell.pid
        assert entry["target"] != shell.pid
        assert stacks.where(entry) == "nap_in_here (sleeper.py:4)"
        assert "dumped pid" in stacks.dump_text("5", "node0", entry).splitlines()[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
        shell.wait(10)
        assert shell.stdout is not None
        shell.stdout.close()


def test_without_py_spy_a_rank_is_described_by_proc_facts(
        sleeper: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(agent_stacks.ENV_PY_SPY, "none")
    report = agent_stacks.collect({0: sleeper.pid}, py_spy=None)
    assert report["py_spy"] is None
    entry = report["ranks"]["0"]
    assert "threads" not in entry
    assert entry["error"] == "py-spy is not installed on this host"
    proc = entry["proc"]
    assert proc["state"] == "S"
    assert proc["cpu"] <= 0.05
    assert proc["window"] >= agent_stacks.CPU_WINDOW * 0.9
    assert "sleeper.py" in proc["cmdline"]
    assert stacks.where(entry).startswith("no Python stack: state S")
    data = {"reason": "hang", "ranks": report["ranks"], "hosts": {"0": "node0"},
            "py_spy": {"node0": False}}
    assert "(no py-spy on node0:" in stacks.stacks_text(data)


def test_a_rank_that_is_gone_is_reported_gone_not_an_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(agent_stacks.ENV_PY_SPY, "none")
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, check=True)
    pid = int(done.stdout)
    report = agent_stacks.collect({2: pid})
    assert report["ranks"]["2"]["proc"]["state"] == "gone"
