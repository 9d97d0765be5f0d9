"""The agent's side of issue 18 over a pipe: heartbeats, INT-first stops, stopping one
rank, suspended leases, stacks, reparented daemons, live records. Real processes, real
signals, the agent started exactly as a local launch starts it."""

from __future__ import annotations

import os
import secrets
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from test_agent import AgentPipe, carriers, spec

from fdl_fabric.agent import procs, wire

#: A Python rank that prints where it is, then sleeps in a function of its own.
STUCK = (
    "import sys, time\n"
    "def stuck_here():\n"
    "    print('up', flush=True)  # inside: a Ctrl-C after 'up' always finds it here\n"
    "    time.sleep(300)\n"
    "stuck_here()\n"
)


@pytest.fixture
def agent() -> AgentPipe:
    pipe = AgentPipe()
    yield pipe  # type: ignore[misc]
    pipe.stop()


def frames_for(agent: AgentPipe, seconds: float) -> list[tuple[int, bytes]]:
    """Every frame the agent sends during ``seconds`` (none is fine)."""
    assert agent.proc.stdout is not None
    fd = agent.proc.stdout.fileno()
    seen = list(agent.pending)
    agent.pending.clear()
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            data = os.read(fd, 1 << 20)
            if not data:
                break
            seen.extend(agent.reader.feed(data))
    return seen


def test_a_quiet_agent_answers_each_ping_with_a_heartbeat_and_nothing_else(
        agent: AgentPipe) -> None:
    agent.until(wire.HELLO)
    time.sleep(1.2)  # quiet for longer than the heartbeat interval
    agent.send(wire.PING)
    assert agent.until(wire.HEARTBEAT, timeout=5)[-1][0] == wire.HEARTBEAT
    agent.send(wire.PING)  # just answered: this one needs no answer
    frames = frames_for(agent, 2.0)
    assert [k for k, _ in frames] == [], "an idle agent sends nothing unasked"


def test_a_first_ctrl_c_reaches_each_rank_as_sigint_then_term_then_kill(
        agent: AgentPipe, tmp_path: Path) -> None:
    log = tmp_path / "signals"
    prog = (f"trap 'echo INT $(date +%s.%N) >> {log}' INT; "
            f"trap 'echo TERM $(date +%s.%N) >> {log}' TERM; echo up; "
            "while :; do sleep 0.05; done")
    agent.send(wire.SPEC, spec(["bash", "-c", prog], grace=3.0))
    agent.until(wire.OUTPUT)
    sent = time.time()
    agent.send(wire.STOP, {"signal": "INT", "rank": None})
    exits = agent.exits(agent.until(wire.DONE, timeout=10))
    took = time.time() - sent
    lines = [line.split() for line in log.read_text().splitlines()]
    assert [name for name, _ in lines] == ["INT", "TERM"]
    assert float(lines[0][1]) - sent < 0.5
    assert 0.8 < float(lines[1][1]) - sent < 1.6  # TERM one INT_GRACE later
    assert exits[0]["signal"] == signal.SIGKILL and 2.9 < took < 5.0


def test_a_python_rank_prints_where_it_was_on_the_first_ctrl_c(agent: AgentPipe) -> None:
    agent.send(wire.SPEC, spec([sys.executable, "-u", "-c", STUCK], grace=3.0))
    agent.until(wire.OUTPUT)
    agent.send(wire.STOP, {"signal": "INT"})
    frames = agent.until(wire.DONE, timeout=10)
    stderr = agent.output(frames, 0, wire.STDERR).decode()
    assert "KeyboardInterrupt" in stderr and "stuck_here" in stderr
    assert agent.exits(frames)[0]["signal"] == signal.SIGINT


def test_a_stop_of_one_rank_ends_it_after_the_grace_and_leaves_the_others_running(
        agent: AgentPipe) -> None:
    prog = 'trap "" TERM; echo up; while :; do sleep 0.05; done'
    s = spec(["bash", "-c", prog], 2, grace=1.0)
    agent.send(wire.SPEC, s)
    agent.until(wire.OUTPUT)
    agent.until(wire.OUTPUT)
    sent = time.monotonic()
    agent.send(wire.STOP, {"signal": "TERM", "rank": 1})
    frames = agent.until(wire.EXITED, timeout=10)
    took = time.monotonic() - sent
    assert agent.exits(frames) == {1: {"rank": 1, "code": None, "signal": signal.SIGKILL}}
    assert 0.9 < took < 2.5
    assert len(carriers(s["run_id"])) >= 1  # rank 0 still runs
    agent.close_input()
    assert agent.exits(agent.until(wire.DONE))[0]["signal"] == signal.SIGKILL


def test_a_suspended_launcher_keeps_the_lease_from_running_out(agent: AgentPipe) -> None:
    s = spec(["sleep", "60"], lease=wire.LEASE_MIN)
    agent.send(wire.SPEC, s)
    agent.until(wire.SPAWNED)
    agent.send(wire.SUSPEND)
    frames = frames_for(agent, wire.LEASE_MIN + 1.5)
    assert wire.EXITED not in [k for k, _ in frames], "the lease ran out while suspended"
    agent.send(wire.RESUME)
    cut = time.monotonic()
    frames = agent.until(wire.EXITED, timeout=wire.LEASE_MIN + 5)
    assert time.monotonic() - cut > wire.LEASE_MIN - 0.5  # counts again from the resume
    assert any(k == wire.ERROR and b"no word from the launcher" in b for k, b in frames)


def _stacks(agent: AgentPipe, request: int = 7) -> dict[str, object]:
    agent.send(wire.STACKS, {"id": request, "run": None})
    frames = agent.until(wire.STACKS_REPORT, timeout=20)
    report = wire.parse_json(frames[-1][1])
    assert report["id"] == request
    return report


def test_stacks_name_each_ranks_innermost_python_frame_with_py_spy(
        agent: AgentPipe) -> None:
    pytest.importorskip("fdl_fabric")  # always there; py-spy is required below
    from fdl_fabric.agent.stacks import find_py_spy

    assert find_py_spy(), "py-spy is installed with the test requirements"
    agent.send(wire.SPEC, spec([sys.executable, "-u", "-c", STUCK], 2))
    agent.until(wire.OUTPUT)
    agent.until(wire.OUTPUT)
    report = _stacks(agent)
    ranks = report["ranks"]
    assert isinstance(ranks, dict) and set(ranks) == {"0", "1"}
    for entry in ranks.values():
        main = entry["threads"][0]
        assert main["name"] == "MainThread"
        assert main["frames"][0]["name"] == "stuck_here"
        assert entry["proc"]["state"] in ("S", "R")


def test_without_py_spy_stacks_report_what_proc_says(tmp_path: Path) -> None:
    agent = AgentPipe()
    agent.proc.kill()  # restart it with py-spy switched off
    agent.proc.wait()
    env = {**os.environ, "FLODL_PY_SPY": "none"}
    from fdl_fabric.transport import bundle

    agent.proc = subprocess.Popen(["/bin/sh", "-c", bundle.local_command(sys.executable)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, start_new_session=True, env=env)
    agent.reader = wire.Reader(wire.UP_TYPES, handshake=True)
    try:
        agent.write(bundle.payload())
        agent.send(wire.SPEC, spec(["python3", "-c", STUCK]))
        agent.until(wire.OUTPUT)
        report = _stacks(agent)
        entry = report["ranks"]["0"]  # type: ignore[index]
        assert "threads" not in entry and "py-spy is not installed" in entry["error"]
        assert entry["proc"]["state"] == "S" and entry["proc"]["cpu"] < 0.5
        assert entry["proc"].get("wchan") or entry["proc"].get("syscall")
    finally:
        agent.stop()


def test_a_daemon_that_left_its_group_and_cleared_its_environment_is_stopped_at_the_end(
        agent: AgentPipe, tmp_path: Path) -> None:
    pidfile = tmp_path / "daemon.pid"
    daemon = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        open({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
        "        os.execve('/bin/sleep', ['sleep', '300'], {})\n"
        "    os._exit(0)\n"
        "time.sleep(0.5)\n"
    )
    agent.send(wire.SPEC, spec([sys.executable, "-c", daemon]))
    frames = agent.until(wire.VERIFIED, timeout=20)
    pid = int(pidfile.read_text())
    stopped = wire.parse_json(frames[-1][1])["stopped"]
    assert pid in [p["pid"] for p in stopped]
    deadline = time.monotonic() + 5
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the reparented daemon survived the run"
        time.sleep(0.05)


def test_a_live_runs_record_names_its_agent_and_a_sweep_leaves_the_run_alone(
        agent: AgentPipe) -> None:
    cluster = f"k-{secrets.token_hex(4)}"
    s = spec(["sleep", "60"], 2, cluster=cluster,
             launcher={"host": "controller", "pid": 4242, "started": time.time()})
    agent.send(wire.SPEC, s)
    agent.until(wire.SPAWNED)
    agent.until(wire.SPAWNED)
    time.sleep(0.3)
    (record,) = [r for r in procs.read_records()[0] if r["run"] == s["run_id"]]
    assert record["agent_start"] == procs.start_time(record["agent"])
    assert procs.record_live(record)
    report = procs.sweep(cluster=cluster)
    assert report["live"] == [{"run": s["run_id"], "host": "localhost",
                               "launcher": "launcher pid 4242 on controller"}]
    assert report["stopped"] == [] and len(carriers(s["run_id"])) == 2
    agent.send(wire.LIST, {"cluster": cluster})
    listed = wire.parse_json(agent.until(wire.RUNS)[-1][1])["runs"]
    assert [(r["run"], r["live"]) for r in listed] == [(s["run_id"], True)]


def test_a_live_run_named_by_a_cleanup_is_stopped_and_told_who_did_it(
        agent: AgentPipe) -> None:
    cluster = f"k-{secrets.token_hex(4)}"
    s = spec(["sleep", "60"], cluster=cluster)
    agent.send(wire.SPEC, s)
    agent.until(wire.SPAWNED)
    time.sleep(0.3)
    by = {"command": "inv cleanup --run-id " + s["run_id"], "pid": 99, "host": "ops"}
    report = procs.sweep(runs=[s["run_id"]], by=by)
    assert report["live"] == [] and report["stopped"]
    frames = agent.until(wire.DONE, timeout=10)
    told = [wire.parse_json(b) for k, b in frames if k == wire.SIGNALED]
    assert told and told[0]["by"] == by
    assert carriers(s["run_id"]) == []


def test_a_frozen_agents_run_is_not_live(agent: AgentPipe) -> None:
    s = spec(["sleep", "60"], cluster=f"k-{secrets.token_hex(4)}")
    agent.send(wire.SPEC, s)
    agent.until(wire.SPAWNED)
    time.sleep(0.3)
    (record,) = [r for r in procs.read_records()[0] if r["run"] == s["run_id"]]
    os.kill(record["agent"], signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 5
        while psutil.Process(record["agent"]).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline, "the agent did not stop"
            time.sleep(0.01)
        assert not procs.record_live(record)
    finally:
        os.kill(record["agent"], signal.SIGCONT)
