"""Issue 35, through the real thing: ranks reach the coordinator through their host's agent.

Three sshd lab hosts run two ranks each of the toy trainer (`rank.join()`, a step loop,
a checkpoint on save-and-shutdown). Every rank dials its agent's Unix socket; the agent
speaks for its ranks on its session; the launcher holds no TCP connection from any rank.
The cohort's rules hold: a SIGSTOPped rank is declared dead within ``heartbeat_timeout``
+ 1 s and the run completes DEGRADED; a SIGSTOPped agent is found within
``agent_timeout`` + 1 s; a save-and-shutdown reaches every survivor.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import time
from pathlib import Path

import psutil
import pytest
from test_reliability import private_lab

from fdl_fabric.testing import SshdLab
from labutil import ROOT, LiveLaunch, processes_of_run, wait_for

pytestmark = [pytest.mark.lab, pytest.mark.timeout(120)]

TOY = str(ROOT / "examples" / "toy_train.py")
HEARTBEAT_TIMEOUT = 4.0
AGENT_TIMEOUT = 6.0


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cluster(lab: SshdLab, port: int, **elastic: object) -> Path:
    return lab.write_cluster([lab.worker(h, nproc=2) for h in lab.hosts], kill_grace=1,
                             controller={"host": "127.0.0.1", "port": port},
                             agent_timeout=AGENT_TIMEOUT,
                             elastic={"heartbeat_timeout": HEARTBEAT_TIMEOUT, **elastic})


def _toy(ck: Path, steps: int = 400) -> list[str]:
    return ["--cmd", f"python3 {TOY} --steps {steps} --step-time 0.05 --checkpoint-dir {ck}"]


def _pid_of(run: LiveLaunch, rank: int) -> int:
    m = run.wait_line(rf":r{rank}\] rank {rank}/\d+ joined on .* \(pid (\d+)\)")
    return int(m.group(1))


def _coordinator_peers(port: int) -> list[int]:
    """Pids of processes of this machine with a TCP connection to the coordinator's port."""
    found = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.raddr and conn.raddr.port == port and conn.status == psutil.CONN_ESTABLISHED:
            found.append(conn.pid or -1)
    return found


def test_the_cohort_forms_through_the_agents_and_no_rank_holds_a_connection_to_the_launcher(
        sshd_lab, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 3)
    port = _port()
    run = LiveLaunch(_cluster(lab, port), *_toy(tmp_path / "ck", steps=60))
    try:
        run.wait_line("cohort formed — 6 ranks", stderr=True)
        ranks = [_pid_of(run, r) for r in range(6)]
        assert _coordinator_peers(port) == [], "no TCP connection to the coordinator at all"
        for pid in ranks:
            unix = [c for c in psutil.Process(pid).net_connections(kind="unix")]
            inet = [c for c in psutil.Process(pid).net_connections(kind="inet")
                    if c.raddr and c.raddr.port == port]
            assert unix and not inet, (pid, unix, inet)
        launcher = psutil.Process(run.proc.pid)
        assert not [c for c in launcher.net_connections(kind="tcp")
                    if c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED]
        assert run.finish(60) == 0, run.err
    finally:
        run.kill()
    assert run.err_lines()[-1].startswith("cluster launcher: run completed"), run.err


def test_a_stopped_rank_is_declared_dead_within_the_heartbeat_timeout_and_the_run_completes(
        sshd_lab, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 3)
    run = LiveLaunch(_cluster(lab, _port()), *_toy(tmp_path / "ck", steps=200))
    frozen = 0
    try:
        run.wait_line("cohort formed — 6 ranks", stderr=True)
        frozen = _pid_of(run, 3)
        os.kill(frozen, signal.SIGSTOP)
        stopped_at = time.monotonic()
        run.wait_line(r"rank 3 declared dead", stderr=True, timeout=HEARTBEAT_TIMEOUT + 10)
        took = run.line_time("rank 3 declared dead") - stopped_at
        code = run.finish(90)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(frozen, signal.SIGCONT)
        run.kill()
    print(f"\nfrozen rank declared dead {took:.2f}s after SIGSTOP "
          f"(heartbeat_timeout {HEARTBEAT_TIMEOUT:g})")
    assert took <= HEARTBEAT_TIMEOUT + 1.0, took
    assert code == 0, run.err
    assert run.err_lines()[-1].startswith("cluster launcher: run completed DEGRADED"), run.err


def test_a_stopped_agent_is_found_within_the_agent_timeout(sshd_lab, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 3)
    run = LiveLaunch(_cluster(lab, _port()), *_toy(tmp_path / "ck", steps=400))
    agent = 0
    try:
        run.wait_line("cohort formed — 6 ranks", stderr=True)
        agent = psutil.Process(_pid_of(run, 5)).ppid()
        os.kill(agent, signal.SIGSTOP)
        stopped_at = time.monotonic()
        run.wait_line(r"host 'lab3' unresponsive", stderr=True, timeout=AGENT_TIMEOUT + 10)
        took = run.line_time("host 'lab3' unresponsive") - stopped_at
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(agent, signal.SIGCONT)
        run.kill()
    print(f"\nfrozen agent found {took:.2f}s after SIGSTOP (agent_timeout {AGENT_TIMEOUT:g})")
    assert took <= AGENT_TIMEOUT + 1.0, took


def test_save_and_shutdown_reaches_every_survivor_through_its_agent(
        sshd_lab, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 3)
    ck = tmp_path / "ck"
    run = LiveLaunch(_cluster(lab, _port(), max_failure=1), *_toy(ck, steps=400))
    try:
        run.wait_line("cohort formed — 6 ranks", stderr=True)
        os.kill(_pid_of(run, 2), signal.SIGKILL)
        code = run.finish(60)
    finally:
        run.kill()
    assert code == 1, run.err
    for r in (0, 1, 3, 4, 5):
        saved = json.loads((ck / f"checkpoint-r{r}.json").read_text())
        assert saved["reason"] == "shutdown", (r, saved)
    assert not re.search(r"rank [01345] of \S+ exited with signal", run.err), run.err
    wait_for(lambda: not processes_of_run(run.run_id), 15, "nothing of the run left")


def test_through_a_gateway_tree_the_cohort_forms_and_a_death_is_tolerated(
        sshd_lab, tmp_path: Path) -> None:
    """``fanout: 2``, 5 hosts: three leaves start through the gateways' relays, and their
    ranks' cohort frames travel inside the relays' streams like any other agent frame."""
    lab = private_lab(sshd_lab, 5)
    port = _port()
    cluster = lab.write_cluster([lab.worker(h, nproc=1) for h in lab.hosts], kill_grace=1,
                                fanout=2, controller={"host": "127.0.0.1", "port": port},
                                elastic={"heartbeat_timeout": HEARTBEAT_TIMEOUT})
    run = LiveLaunch(cluster, *_toy(tmp_path / "ck", steps=120))
    try:
        run.wait_line("cohort formed — 5 ranks", stderr=True)
        assert _coordinator_peers(port) == []
        os.kill(_pid_of(run, 4), signal.SIGKILL)  # a leaf's rank
        code = run.finish(60)
    finally:
        run.kill()
    assert code == 0, run.err
    assert "rank 4 of lab5 exited with signal 9 — tolerating" in run.err, run.err
    assert run.err_lines()[-1].startswith("cluster launcher: run completed DEGRADED"), run.err


#: A rank whose library says another protocol than its agent's.
OTHER_LIBRARY = """\
import sys
from fdl_fabric import rank
rank.PROTOCOL = 99
try:
    rank.join(timeout=10)
except RuntimeError as exc:
    print(exc, file=sys.stderr, flush=True)
    sys.exit(3)
"""


def test_a_rank_library_of_another_version_is_refused_with_the_words_that_say_so(
        sshd_lab, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 1)
    prog = tmp_path / "other_library.py"
    prog.write_text(OTHER_LIBRARY)
    run = LiveLaunch(_cluster(lab, _port()), "--cmd", f"python3 {prog}")
    try:
        code = run.finish(60)
    finally:
        run.kill()
    assert code == 1, run.err
    assert "rank library protocol 99, agent speaks 1: the rank imported another fdl-fabric " \
        "than the agent's (install the same version on every host)" in run.err, run.err


#: Connects to a Unix socket; prints what happened: refused (and why), closed, or open.
DIAL = """\
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(5)
try:
    s.connect(sys.argv[1])
except OSError as exc:
    print("refused", type(exc).__name__)
    sys.exit(0)
try:
    print("closed" if s.recv(1) == b"" else "open")
except socket.timeout:
    print("open")
"""


def test_another_local_user_cannot_reach_an_agents_rank_socket_and_a_stranger_of_ours_is_shut_out(
        sshd_lab, tmp_path: Path) -> None:
    import pwd
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("useradd", "userdel",
                                                              "setpriv", "nsenter")) \
            or not os.access("/usr/bin/python3", os.X_OK):
        pytest.fail("this test needs root with useradd, userdel and setpriv (CI runs as root)")
    lab = private_lab(sshd_lab, 1)
    run = LiveLaunch(_cluster(lab, _port()), *_toy(tmp_path / "ck", steps=400))
    name = f"fdlsock{os.getpid() % 100000}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
                    "--shell", "/usr/sbin/nologin", name], check=True, capture_output=True)
    try:
        run.wait_line("cohort formed — 2 ranks", stderr=True)
        rank = psutil.Process(_pid_of(run, 1))
        path = rank.environ()["FLODL_INTERNAL_AGENT_SOCKET"]
        # The lab host's registry is private to its mount namespace: dial from inside it.
        inside = ["nsenter", f"--target={rank.pid}", "--mount", "--"]
        user = pwd.getpwnam(name)
        other = subprocess.run([*inside, "setpriv", f"--reuid={user.pw_uid}",
                                f"--regid={user.pw_gid}",
                                "--clear-groups", "--", "/usr/bin/python3", "-I", "-S", "-c", DIAL,
                                path], capture_output=True, text=True, timeout=30)
        assert other.stdout.strip() == "refused PermissionError", other
        ours = subprocess.run([*inside, sys.executable, "-I", "-S", "-c", DIAL, path],
                              capture_output=True, text=True, timeout=30)
        assert ours.stdout.strip() == "closed", "a process of ours that is no rank: shut out"
        mode = subprocess.run([*inside, "stat", "-c", "%a", os.path.dirname(path)],
                              capture_output=True, text=True, timeout=30).stdout.strip()
        assert mode == "700", mode
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)
        run.kill()
