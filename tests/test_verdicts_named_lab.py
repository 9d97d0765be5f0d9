"""Issue 34, item 5, through the real thing: a verdict names what really happened.

Real OpenSSH sshd hosts (the lab), a real ``inv launch``, real signals:

* the launcher SIGSTOPped for 25 s with a 10 s lease: every agent stops its ranks on its
  own; after SIGCONT the verdict names the suspension, and no rank is blamed;
* a rank that SIGKILLs its own agent: the verdict names the agent's death by signal 9
  (sender unknown), and not the innocent rank beside it.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
from test_liveness_lab import freeze, launches, rank_pids  # noqa: F401  (the fixture)
from test_reliability import cluster_file, private_lab, wait_run_gone

from labutil import PROBE, wait_for

pytestmark = pytest.mark.lab

LEASE = 10.0
STOPPED_FOR = 25.0


@pytest.mark.timeout(150)
def test_a_launcher_stopped_longer_than_the_lease_gets_the_suspension_as_its_verdict(
        sshd_lab, launches, tmp_path: Path) -> None:  # noqa: F811
    lab = private_lab(sshd_lab, 2)
    cluster = cluster_file(lab, elastic={"heartbeat_timeout": LEASE})
    run = launches(cluster, "--cmd", f"python3 {PROBE} --sleep 300")
    run.wait_line("hello from rank 1")
    ranks = wait_for(lambda: len(rank_pids(run.run_id)) == 2 and rank_pids(run.run_id), 20,
                     "both ranks")
    stopped_at = time.monotonic()
    freeze(run, run.proc.pid)  # SIGCONT at teardown, whatever happens
    try:
        # Every agent stops its ranks once the lease runs out, while the launcher sleeps.
        wait_for(lambda: not any(p.is_running() for p in ranks.values()), LEASE + 10,
                 "the agents to stop their ranks on their own")
        time.sleep(max(0.0, STOPPED_FOR - (time.monotonic() - stopped_at)))
    finally:
        run.signal(signal.SIGCONT)
    assert run.finish(60) == 1, run.err
    last = run.err_lines()[-1]
    assert "the launcher was suspended for" in last and \
        "longer than the agents' lease (10 s): every host stopped its ranks" in last, run.err
    assert "root cause" not in run.err, "no rank did it"
    assert "stopped by its agent's lease" in run.err, run.err
    assert re.search(r"rank 0 of lab1 exited with .*\(stopped by its agent's lease\)",
                     run.err), run.err
    assert "terminating all still-running ranks" not in run.err, "the agents had stopped them"
    assert "it was stopped or suspended" in run.err, "the agents' own line names it too"
    wait_run_gone(run.run_id, 10)


#: Rank 1 says goodbye and SIGKILLs its agent (its parent); rank 0 just runs.
KILLS_ITS_AGENT = """\
import os, sys, time
rank = os.environ["RANK"]
print(f"rank {rank} running", flush=True)
if rank == "1":
    time.sleep(1.0)
    print("rank 1 kills its agent now", flush=True)
    time.sleep(0.5)
    os.kill(os.getppid(), 9)
time.sleep(300)
"""


@pytest.mark.timeout(90)
def test_a_rank_that_kills_its_agent_gets_no_innocent_rank_blamed(
        sshd_lab, launches, tmp_path: Path) -> None:  # noqa: F811
    lab = private_lab(sshd_lab, 1)
    prog = tmp_path / "kills_agent.py"
    prog.write_text(KILLS_ITS_AGENT)
    cluster = cluster_file(lab, nproc=2)
    logs = tmp_path / "logs"
    run = launches(cluster, "--log-dir", str(logs), "--cmd", f"python3 {prog}")
    assert run.finish(60) == 1, run.err
    last = run.err_lines()[-1]
    assert "the agent of lab1 was killed by signal 9 (sender unknown)" in last, run.err
    assert "root cause: rank 0" not in run.err, "rank 0 did nothing"
    assert "rank 1 kills its agent now" in "\n".join(run.stdout_lines), "its last line is kept"
    kept = list(logs.glob("**/r1/stdout.log"))
    assert kept and "rank 1 kills its agent now" in kept[0].read_text(), "in --log-dir too"
    wait_run_gone(run.run_id, 10)
