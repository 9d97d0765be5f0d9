"""Issue 18: every fault ends in a verdict within a stated bound, through the real thing.

Frozen agents, frozen per-connection sshds and frozen ranks (SIGSTOP), a restart after
one host's sessions were killed, a host that cannot be reached on a restart, live runs
that a second launch or a cleanup must leave alone. Real OpenSSH sshd hosts (the lab),
real processes, real signals; every lab host is this machine, so "nothing of run R is
left" is one scan of /proc for its id.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import psutil
import pytest
from test_reliability import (
    cluster_file,
    fab_cleanup,
    kill_run,
    private_lab,
    wait_run_gone,
)

from fdl_fabric.agent import procs
from fdl_fabric.testing import SshdLab
from labutil import PROBE, ROOT, LiveLaunch, alive, processes_of_run, wait_for

pytestmark = pytest.mark.lab

AGENT_TIMEOUT = 6.0
#: The bound of issue 18: a silent host is declared within agent_timeout + 1 s.
DETECT_BOUND = AGENT_TIMEOUT + 1.0


@pytest.fixture
def launches() -> Iterator[Callable[..., LiveLaunch]]:
    started: list[LiveLaunch] = []
    frozen: list[int] = []

    def start(cluster: Path, *args: str, **kw: Any) -> LiveLaunch:
        launch = LiveLaunch(cluster, *args, **kw)
        launch.frozen = frozen  # type: ignore[attr-defined]
        started.append(launch)
        return launch

    yield start
    for pid in frozen:  # never leave a process stopped behind
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    for launch in started:
        run = None
        with contextlib.suppress(AssertionError):
            run = launch.run_id
        launch.kill()
        if run:
            kill_run(run)


def rank_pids(run: str) -> dict[int, psutil.Process]:
    """The run's rank leaders (processes that lead their own group), by RANK."""
    found = {}
    for p in processes_of_run(run):
        with contextlib.suppress(psutil.Error):
            if os.getpgid(p.pid) == p.pid:
                found[int(p.environ()["RANK"])] = p
    return found


def freeze(launch: LiveLaunch, pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    launch.frozen.append(pid)  # type: ignore[attr-defined]


def agent_of(rank: psutil.Process) -> int:
    """A rank's agent: its parent (the agent forks every rank itself)."""
    return rank.ppid()


def last_line(launch: LiveLaunch) -> str:
    return launch.err_lines()[-1]


def freeze_rank1_agent(run: LiveLaunch) -> tuple[int, float]:
    """Once both ranks run, SIGSTOP the agent of rank 1 (lab2's): its pid, and when."""
    run.wait_line("hello from rank 1")
    ranks = wait_for(lambda: len(rank_pids(run.run_id)) == 2 and rank_pids(run.run_id), 20,
                     "both ranks")
    agent = agent_of(ranks[1])
    frozen_at = time.monotonic()
    freeze(run, agent)
    return agent, frozen_at


def declared_unresponsive_after(run: LiveLaunch, since: float) -> float:
    """The launch ends with exit 1; seconds from ``since`` to its "unresponsive" line."""
    assert run.finish(30) == 1, run.err
    said = run.line_time("unresponsive")
    assert said is not None, run.err
    return said - since


def test_a_frozen_agent_makes_its_host_unresponsive_within_the_agent_timeout(
        sshd_lab, launches, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 2)
    cluster = cluster_file(lab, agent_timeout=AGENT_TIMEOUT)
    run = launches(cluster, "--cmd", f"python3 {PROBE} --sleep 300")
    agent, frozen_at = freeze_rank1_agent(run)
    took = declared_unresponsive_after(run, frozen_at)
    print(f"\nfrozen agent declared unresponsive {took:.2f}s after SIGSTOP "
          f"(agent_timeout {AGENT_TIMEOUT:g})")
    assert took <= DETECT_BOUND
    assert "host 'lab2' unresponsive" in run.err
    assert "lab2" in last_line(run) and "no exit status" in last_line(run)
    assert "root cause: rank 1 of lab2 (lab2:cpu:r1) has no exit status: host unresponsive: " \
        "no word from its agent for" in run.err
    assert "@record" not in run.err
    # The launch's final sweep stopped the frozen agent's ranks; after SIGCONT the agent
    # finds its input closed and exits: nothing of the run is left.
    os.kill(agent, signal.SIGCONT)
    wait_run_gone(run.run_id, 10)
    wait_for(lambda: not alive(agent), 10, "the thawed agent to exit")


#: Rank 0 writes lines without pause; every other rank sleeps.
FLOOD_RANK = """\
import os, sys, time
if os.environ["RANK"] == "0":
    line = "x" * 100 + "\\n"
    while True:
        sys.stdout.write(line * 50)
        sys.stdout.flush()
print("hello from rank", os.environ["RANK"], flush=True)
time.sleep(300)
"""


def test_a_frozen_agent_is_found_while_another_host_floods_the_console(
        sshd_lab, launches, tmp_path: Path) -> None:
    """One thread reads every host's session (`transport.channels`): a host that never
    stops talking must not make the launcher deaf to another host's silence."""
    lab = private_lab(sshd_lab, 2)
    cluster = cluster_file(lab, agent_timeout=AGENT_TIMEOUT)
    script = tmp_path / "flood.py"
    script.write_text(FLOOD_RANK)
    run = launches(cluster, "--cmd", f"python3 {script}")
    agent, frozen_at = freeze_rank1_agent(run)
    took = declared_unresponsive_after(run, frozen_at)
    assert took <= DETECT_BOUND, f"{took:.2f}s"
    assert "host 'lab2' unresponsive" in run.err
    assert "host 'lab1' unresponsive" not in run.err, "the talking host is not silent"
    os.kill(agent, signal.SIGCONT)
    wait_run_gone(run.run_id, 10)


def test_a_frozen_sshd_makes_its_host_unresponsive_and_leaves_nothing_once_thawed(
        sshd_lab, launches, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 2)
    cluster = cluster_file(lab, agent_timeout=AGENT_TIMEOUT)
    run = launches(cluster, "--cmd", f"python3 {PROBE} --sleep 300")
    run.wait_line("hello from rank 1")
    sessions = lab.hosts[1].session_pids()
    assert sessions
    frozen_at = time.monotonic()
    for pid in sessions:
        freeze(run, pid)
    assert run.finish(30) == 1, run.err
    said = run.line_time("unresponsive")
    assert said is not None and said - frozen_at <= DETECT_BOUND, run.err
    assert "host 'lab2' unresponsive" in run.err and "lab2" in last_line(run)
    for pid in sessions:
        os.kill(pid, signal.SIGCONT)
    wait_run_gone(run.run_id, 10)


def test_a_rank_the_coordinator_declares_dead_is_stopped_and_the_run_ends_degraded(
        sshd_lab, launches, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 1)
    toy = ROOT / "examples" / "toy_train.py"
    cluster = cluster_file(lab, local=1, nproc=2, kill_grace=1,
                           elastic={"heartbeat_timeout": 6, "max_failure": "100%"})
    run = launches(cluster, "--cmd", f"python3 {toy} --steps 60 --step-time 0.2 "
                   f"--checkpoint-dir {tmp_path}")
    run.wait_line("cohort formed", stderr=True)
    ranks = rank_pids(run.run_id)
    victim = ranks[2]
    freeze(run, victim.pid)
    assert run.finish(60) == 0, run.err
    assert "rank 2 declared dead" in run.err
    assert "declared dead by the coordinator" in run.err and "was stopped" in run.err
    assert "DEGRADED" in last_line(run)
    assert not alive(victim.pid)
    assert processes_of_run(run.run_id) == []


def test_a_restart_after_one_hosts_sessions_were_killed_reconnects_and_succeeds(
        sshd_lab, launches, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 2)
    cluster = cluster_file(lab)
    prog = ("import os, time; print('attempt', os.environ['TORCHELASTIC_RESTART_COUNT'], "
            "flush=True); time.sleep(60 if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' "
            "else 0.5)")
    run = launches(cluster, "--max-restarts", "1", "--", "python3", "-c", prog)
    run.wait_line(r"lab2:cpu:r1\] attempt 0")
    for pid in lab.hosts[1].session_pids():
        os.kill(pid, signal.SIGKILL)
    assert run.finish(60) == 0, run.err
    assert "restarting every rank (restart 1 of 1)" in run.err
    assert "lab2:cpu:r1] attempt 1" in "\n".join(run.stdout_lines)
    assert last_line(run) == "cluster launcher: run completed — all 2 ranks exited 0"
    err = run.err_lines()
    header = next(line for line in err if line.startswith("attempt  hosts"))
    table = err[err.index(header) + 1:-1]
    assert [row.split()[:3] for row in table] == [["0", "lab1,lab2", "failed"],
                                                  ["1", "lab1,lab2", "ok"]], run.err


def test_a_host_unreachable_on_a_restart_ends_the_launch_with_its_verdict_last(
        sshd_lab, launches, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 2)
    cluster = cluster_file(lab)
    run = launches(cluster, "--max-restarts", "2", "--", "python3", "-c",
                   "import time; print('up', flush=True); time.sleep(60)")
    run.wait_line(r"lab2:cpu:r1\] up")
    host = lab.hosts[1]
    sessions = host.session_pids()
    host.sshd.kill()  # no new connection gets in ...
    host.sshd.wait()
    for pid in sessions:  # ... and the launcher's own is cut: the host is gone
        os.kill(pid, signal.SIGKILL)
    assert run.finish(60) == 1, run.err
    err = run.err_lines()
    assert err[-1].startswith("cluster launcher: failed: host 'lab2' unreachable: "), run.err
    assert any(line.startswith("rank  host") for line in err), "the summary is printed"
    assert any(line.startswith("attempt  hosts") for line in err), "and the attempts"
    assert "Traceback" not in run.err


def _events(log_dir: Path) -> list[dict[str, Any]]:
    (run_dir,) = [p for p in log_dir.iterdir() if not p.is_symlink()]
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_every_failed_start_writes_its_verdict_to_events_jsonl(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = cluster_file(lab)
    lab.hosts[0].stop()
    logs = tmp_path / "logs"
    out = subprocess.run(
        [sys.executable, "-m", "invoke", "--search-root", str(ROOT), "launch", "--cluster",
         str(cluster), "--log-dir", str(logs), "--cmd", "true"],
        capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    assert out.returncode == 1
    assert out.stderr.splitlines()[-1].startswith("cluster launcher: failed: cannot connect to "
                                                  "host 'lab1'")
    (verdict,) = [e["data"] for e in _events(logs) if e["kind"] == "verdict"]
    assert verdict["exit_code"] == 1 and verdict["verdict"] == "failed"


def test_a_second_run_from_the_same_folder_never_stops_the_first(
        launches, tmp_path: Path) -> None:
    run_cmd = [sys.executable, "-m", "fdl_fabric", "run", "--nproc-per-node", "1",
               "--kill-grace", "1"]
    prog = tmp_path / "job.py"
    prog.write_text("import sys, time\nprint('up', flush=True)\ntime.sleep(float(sys.argv[1]))\n")
    first = subprocess.Popen([*run_cmd, str(prog), "6"], cwd=str(tmp_path),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        time.sleep(2.0)
        second = subprocess.run([*run_cmd, str(prog), "0.2"], cwd=str(tmp_path),
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 0, second.stderr
        assert "stopped leftovers" not in second.stderr
        out, err = first.communicate(timeout=60)
        assert first.returncode == 0, err
        assert err.splitlines()[-1] == "cluster launcher: run completed — all 1 ranks exited 0"
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)


def test_fab_cleanup_leaves_a_live_run_alone_and_says_so(
        sshd_lab, launches, tmp_path: Path) -> None:
    lab: SshdLab = private_lab(sshd_lab, 1)
    cluster = cluster_file(lab)
    run = launches(cluster, "--", "python3", "-c",
                   "import time; print('up', flush=True); time.sleep(4)")
    run.wait_line("up")
    time.sleep(0.5)
    out = fab_cleanup(lab, lab.hosts, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"run {run.run_id} is live" in out.stdout + out.stderr
    assert "left alone" in out.stdout + out.stderr
    assert run.finish(30) == 0, run.err
    assert last_line(run) == "cluster launcher: run completed — all 1 ranks exited 0"


def test_a_live_run_stopped_by_a_named_cleanup_says_who_stopped_it(
        sshd_lab, launches, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 1)
    cluster = cluster_file(lab)
    run = launches(cluster, "--", "python3", "-c",
                   "import time; print('up', flush=True); time.sleep(60)")
    run.wait_line("up")
    time.sleep(0.5)
    out = fab_cleanup(lab, lab.hosts, tmp_path, "--run-id", run.run_id)
    assert out.returncode == 0, out.stdout + out.stderr
    assert run.finish(30) == 143, run.err
    assert last_line(run).startswith("cluster launcher: stopped by fab cleanup --run-id "
                                     f"{run.run_id}"), run.err
    assert procs.record_path(run.run_id, "lab1")  # a valid name; nothing else checked here


# --------------------------------------------------------------------------------------
# Hangs and stacks
# --------------------------------------------------------------------------------------

#: A gloo job where rank 1 never reaches the all_reduce the others wait in.
HANG = '''\
import os, sys, time
print("starting", flush=True)
import torch
import torch.distributed as dist

def stuck_here():
    time.sleep(600)

dist.init_process_group("gloo")
print("ready", flush=True)
if dist.get_rank() == 1:
    stuck_here()
t = torch.ones(1)
dist.all_reduce(t)
'''

#: Ranks that sleep in a function of their own (a live run to look at).
STUCK = '''\
import time
def stuck_here():
    time.sleep(float(__import__("sys").argv[1]))
print("up", flush=True)
stuck_here()
'''


def _hang_cluster(lab: SshdLab, tmp_path: Path) -> Path:
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    return lab.write_cluster([lab.worker(h, nproc=2) for h in lab.hosts], kill_grace=2,
                             hang_timeout=10, command=f"python3 -u {script}")


@pytest.mark.timeout(180)
def test_a_hung_gloo_all_reduce_ends_hung_with_every_ranks_stack_grouped(
        sshd_lab, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    lab = sshd_lab(n_hosts=2)
    cluster = _hang_cluster(lab, tmp_path)
    logs = tmp_path / "logs"
    run = LiveLaunch(cluster, "--log-dir", str(logs))
    try:
        run.wait_line(r"\] ready", timeout=90)
        code = run.finish(120)
    finally:
        run.kill()
    err = run.err_lines()
    assert code == 1, run.err
    assert err[-1].startswith("cluster launcher: failed: run hung — no rank wrote a line"), run.err
    head = err.index(next(line for line in err if "where each rank is (hang)" in line))
    assert err[head + 1].startswith("  rank 1 (lab1): stuck_here (hang.py:"), run.err
    assert err[head + 2].startswith("  ranks 0, 2, 3 (lab1, lab2): all_reduce "
                                    "(distributed_c10d.py:"), run.err
    (run_dir,) = [p for p in logs.iterdir() if not p.is_symlink()]
    dump = (run_dir / "attempt_0" / "stacks" / "r1.txt").read_text()
    assert "stuck_here (hang.py:" in dump and 'Thread' in dump and "MainThread" in dump
    events = _events(logs)
    (stacks,) = [e["data"] for e in events if e["kind"] == "stacks"]
    assert stacks["files"] == [f"attempt_0/stacks/r{r}.txt" for r in range(4)]
    (verdict,) = [e["data"] for e in events if e["kind"] == "verdict"]
    assert verdict["verdict"] == "hung" and verdict["exit_code"] == 1


@pytest.mark.timeout(180)
def test_without_py_spy_a_hang_is_explained_by_what_proc_says(
        sshd_lab, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    lab = sshd_lab(n_hosts=2, login_shell_rc="export FLODL_PY_SPY=none")
    cluster = _hang_cluster(lab, tmp_path)
    run = LiveLaunch(cluster)
    try:
        run.wait_line(r"\] ready", timeout=90)
        code = run.finish(120)
    finally:
        run.kill()
    err = run.err_lines()
    assert code == 1 and err[-1].startswith("cluster launcher: failed: run hung"), run.err
    head = err.index(next(line for line in err if "where each rank is (hang)" in line))
    view = err[head + 1:]
    assert view[0].startswith("  rank 1 (lab1): no Python stack: state S"), run.err
    assert any("no py-spy on lab1, lab2" in line for line in view), run.err


def test_inv_stacks_shows_where_every_rank_of_a_live_run_is_and_the_run_goes_on(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=2)
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    cluster = lab.write_cluster([lab.worker(h, nproc=2) for h in lab.hosts],
                                command=f"python3 -u {script} 8")
    run = LiveLaunch(cluster)
    try:
        for r in range(4):
            run.wait_line(rf"r{r}\] up")
        out = subprocess.run([sys.executable, "-m", "invoke", "--search-root", str(ROOT),
                              "stacks", "--cluster", str(cluster)], capture_output=True,
                             text=True, timeout=60, cwd=str(ROOT))
        assert out.returncode == 0, out.stdout + out.stderr
        lines = out.stdout.splitlines()
        assert lines[0] == f"cluster launcher: where each rank is (run {run.run_id}):"
        assert lines[1].startswith("  ranks 0-3 (lab1, lab2): stuck_here (stuck.py:3)"), lines
        assert run.finish(60) == 0, run.err
    finally:
        run.kill()


def test_ctrl_backslash_shows_the_stacks_and_the_run_goes_on(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    cluster = lab.write_cluster([lab.worker(lab.hosts[0], nproc=2)],
                                command=f"python3 -u {script} 5")
    run = LiveLaunch(cluster)
    try:
        run.wait_line(r"r0\] up")
        run.wait_line(r"r1\] up")
        run.signal(signal.SIGQUIT)
        run.wait_line(r"ranks 0, 1 \(lab1\): stuck_here \(stuck.py:3\)", stderr=True)
        assert run.finish(60) == 0, run.err
        assert last_line(run) == "cluster launcher: run completed — all 2 ranks exited 0"
    finally:
        run.kill()


# --------------------------------------------------------------------------------------
# A cut link
# --------------------------------------------------------------------------------------


def test_a_black_holed_host_is_unresponsive_within_the_agent_timeout(
        netns_lab, launches, tmp_path: Path) -> None:
    lab = netns_lab(n_hosts=1, private_registry=True, client_alive_interval=1,
                    client_alive_count_max=3)
    (host,) = lab.hosts
    opts = [*lab.ssh_options(), "ServerAliveInterval=0"]  # only the agent's heartbeats
    cluster = lab.write_cluster(
        [{"host": "localhost", "nproc": 1, "path": str(ROOT)},
         lab.worker(host, nproc=1, ssh={"options": opts})], kill_grace=1,
        agent_timeout=AGENT_TIMEOUT)
    run = launches(cluster, "--cmd", f"python3 {PROBE} --sleep 300")
    run.wait_line(r"ns1:cpu:r1\] hello from rank 1")
    cut = time.monotonic()
    lab.link_down(host)
    try:
        assert run.finish(30) == 1, run.err
        said = run.line_time("host 'ns1' unresponsive")
        assert said is not None, run.err
        print(f"\nblack-holed host declared unresponsive {said - cut:.2f}s after the cut "
              f"(agent_timeout {AGENT_TIMEOUT:g})")
        assert said - cut <= DETECT_BOUND
        assert "ns1" in last_line(run)
        assert "left its registry record" in run.err  # the final sweep could not reach it
    finally:
        lab.link_up(host)
    # Behind the cut, sshd's ClientAlive ended the session: the agent stopped its rank.
    wait_run_gone(run.run_id, 15)


# --------------------------------------------------------------------------------------
# Attribution and leftovers
# --------------------------------------------------------------------------------------


def test_a_forwarded_usr1_that_kills_a_rank_without_a_handler_is_an_interruption(
        sshd_lab, launches, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 1)
    cluster = cluster_file(lab, local=1)
    run = launches(cluster, "--", "python3", "-c",
                   "import time; print('up', flush=True); time.sleep(60)")
    run.wait_line(r"lab1:cpu:r1\] up")
    run.wait_line(r"localhost:cpu:r0\] up")
    run.signal(signal.SIGUSR1)
    assert run.finish(30) == 128 + signal.SIGUSR1, run.err
    assert last_line(run).startswith("cluster launcher: interrupted by SIGUSR1, which the "
                                     "launcher forwarded: rank "), run.err
    assert "failed" not in "\n".join(line for line in run.err_lines()
                                     if line.startswith(("0 ", "1 ")))
    assert "stopped by SIGUSR1 (forwarded)" in run.err


RECORDED_BOOM = '''\
import os, time
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        raise RuntimeError("boom at epoch 3")
    time.sleep(0.3)

main()
'''


@pytest.mark.timeout(120)
def test_the_restart_line_and_the_attempts_table_carry_the_exception_text(
        sshd_lab, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    lab = sshd_lab(n_hosts=1)
    script = Path(lab.hosts[0].path) / "boom.py"
    script.write_text(RECORDED_BOOM)
    cluster = lab.write_cluster([lab.worker(lab.hosts[0], nproc=2)], kill_grace=1)
    run = LiveLaunch(cluster, "--max-restarts", "1", "--cmd", "python3 boom.py")
    try:
        assert run.finish(110) == 0, run.err
    finally:
        run.kill()
    (restart,) = [line for line in run.err_lines() if "restarting every rank" in line]
    assert "rank 1 of lab1 exited with status 1: RuntimeError: boom at epoch 3" in restart
    err = run.err_lines()
    header = next(line for line in err if line.startswith("attempt  hosts"))
    row = err[err.index(header) + 1]
    assert row.split()[0] == "0" and row.split()[2] == "failed"
    assert row.endswith("RuntimeError: boom at epoch 3")


def test_a_sigkilled_hosts_leftovers_and_records_are_cleared_at_the_end_of_the_launch(
        sshd_lab, launches, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 2)
    cluster = cluster_file(lab)
    run = launches(cluster, "--", "python3", "-c",
                   "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "print('up', flush=True); time.sleep(120)")
    run.wait_line(r"lab2:cpu:r1\] up")
    ranks = wait_for(lambda: len(rank_pids(run.run_id)) == 2 and rank_pids(run.run_id), 20,
                     "both ranks")
    agent = agent_of(ranks[1])
    # The machine of lab2 "crashes" for the agent and its watchdog: nobody is left there
    # to stop the rank, which ignores TERM anyway.
    watchdogs = [c.pid for c in psutil.Process(agent).children()
                 if c.pid not in (r.pid for r in ranks.values())]
    for pid in [*watchdogs, agent]:
        os.kill(pid, signal.SIGKILL)
    assert run.finish(30) == 1, run.err
    # The launcher reaches lab2 again at once (`healwatch`: its agent was lost) and stops
    # the orphaned rank there; had that not done it, the launch's final sweep would.
    assert re.search(r"host 'lab2' reached again [\d.]+s after it was lost: stopped what "
                     rf"attempt 0 still ran there \(pids \[.*{ranks[1].pid}", run.err) \
        or ("stopped what run" in run.err and "lab2" in run.err), run.err
    assert not alive(ranks[1].pid), "the orphaned rank was stopped"
    registry = lab.hosts[1].registry
    left = [name for name in os.listdir(registry) if name.startswith(run.run_id)]
    assert left == [], left
    assert processes_of_run(run.run_id) == []


def test_a_daemon_that_cleared_its_environment_is_stopped_when_its_run_ends(
        sshd_lab, launches, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 1)
    cluster = cluster_file(lab)
    pidfile = tmp_path / "daemon.pid"
    daemon = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        open({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
        "        os.execve('/bin/sleep', ['sleep', '300'], {})\n"
        "    os._exit(0)\n"
        "time.sleep(1)\n"
    )
    run = launches(cluster, "--", "python3", "-c", daemon)
    assert run.finish(30) == 0, run.err
    pid = int(pidfile.read_text())
    assert not alive(pid), "the env-less setsid daemon outlived its run"
    assert f"{pid} (sleep 300)" in run.err  # named by the agent that stopped it


def test_a_quiet_rank_that_reports_progress_is_not_hung(sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    script = tmp_path / "quiet.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from fdl_fabric import rank\n"
        "rank.join()\n"
        "for step in range(12):\n"
        "    time.sleep(0.5)\n"
        "    rank.progress(step)\n")
    cluster = lab.write_cluster([lab.worker(lab.hosts[0], nproc=2)], kill_grace=1,
                                hang_timeout=3, command=f"python3 -u {script}")
    run = LiveLaunch(cluster)
    try:
        assert run.finish(60) == 0, run.err
    finally:
        run.kill()
    assert "hung" not in run.err


def test_a_server_that_resets_the_connection_gets_one_line_and_no_third_party_traceback(
        tmp_path: Path) -> None:
    import socket
    import struct
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]

    def reset_everyone() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")  # then the banner exchange is cut
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    threading.Thread(target=reset_everyone, daemon=True).start()
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(f"workers:\n  - host: resetter\n    nproc: 1\n    path: /tmp\n"
                       f"    ssh: {{target: 127.0.0.1, port: {port}, options: "
                       f"[StrictHostKeyChecking=no, UserKnownHostsFile=/dev/null]}}\n")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "invoke", "--search-root", str(ROOT), "launch",
             "--cluster", str(cluster), "--cmd", "true"],
            capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    finally:
        server.close()
    assert out.returncode == 1
    assert "Traceback" not in out.stderr and "paramiko" not in out.stderr, out.stderr
    lines = out.stderr.splitlines()
    assert lines[-1].startswith("cluster launcher: failed: cannot connect to host "
                               "'resetter': "), lines
    assert len(lines) <= 2, lines
