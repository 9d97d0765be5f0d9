"""Workers that dial in (issue 36), through the real thing: ``fdl-fabric launch`` with a
``controller.join`` window, and ``fdl-fabric join`` processes, each its own worker —
pods as network namespaces where the lab can make them, else processes on loopback.

The window forms with its quorum and trains gloo DDP to exit 0; a wrong token and a
duplicate host are refused that attempt only; a quorum unmet at the cap ends the
launch 1 with flodl's words; the target closes the window early; a manual window waits
for ``fdl-fabric start``; a joiner that dials before the launcher is up joins once it
is; a launcher SIGKILLed leaves no rank of a walk-in behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import psutil
import pytest
import yaml

from fdl_fabric import joinwire
from fdl_fabric.testing import NetnsLab
from fdl_fabric.testing.launches import LiveProcess
from fdl_fabric.testing.netns import netns_available
from fdl_fabric.testing.processes import free_port, master_port
from labutil import ROOT, gloo_run_completed, wait_for

pytestmark = [pytest.mark.lab, pytest.mark.timeout(150)]

FDL = (sys.executable, "-m", "fdl_fabric")
DDP = str(ROOT / "examples" / "ddp_torch.py")
SLEEPER = "import os, time; print('rank', os.environ['RANK'], 'pid', os.getpid(), " \
          "flush=True); time.sleep(300)"


class Joiners:
    """The joiners a test started; each killed with its process group at the end."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.started: list[LiveProcess] = []
        self.token = folder / "join.token"
        joinwire.write_token_file(str(self.token), joinwire.new_token())

    def start(self, port: int, host: str, *flags: str, netns: Optional[str] = None,
              address: str = "127.0.0.1", token: Optional[Path] = None) -> LiveProcess:
        argv = [*FDL, "join", f"{address}:{port}", "--token-file", str(token or self.token),
                "--host", host, *(flags or ("--nproc", "1")), "--path", str(self.folder)]
        if netns is not None:
            argv = ["ip", "netns", "exec", netns, *argv]
        joiner = LiveProcess(argv, cwd=self.folder)
        self.started.append(joiner)
        return joiner

    def stop(self) -> None:
        for joiner in self.started:
            joiner.kill()


@pytest.fixture
def joiners(tmp_path: Path) -> Iterator[Joiners]:
    made = Joiners(tmp_path)
    try:
        yield made
    finally:
        made.stop()


def window_file(folder: Path, token: Path, *, bind: str = "127.0.0.1",
                workers: Optional[list[dict[str, Any]]] = None,
                env: Optional[dict[str, str]] = None, **join: Any) -> tuple[Path, int]:
    """A cluster file whose world comes from its join window; the window's port."""
    port = free_port("127.0.0.1")
    doc: dict[str, Any] = {
        "controller": {"host": "127.0.0.1", "port": free_port("127.0.0.1"),
                       "join": {"port": port, "bind": bind, "token_file": str(token),
                                **({"discovery": True} if workers is None else {}), **join}},
        "kill_grace": 2,
        "agent_timeout": 6,
        "master_port": master_port(),  # torch's store: this test worker's
    }
    if env:
        doc["env"] = env
    if workers is not None:
        doc["workers"] = workers
    path = folder / "cluster.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path, port


def launch(cluster: Path, *command: str) -> LiveProcess:
    return LiveProcess([*FDL, "launch", "-c", str(cluster), "--", *command],
                       cwd=cluster.parent)


# -- the window forms, and trains ----------------------------------------------------------

def test_four_pods_in_a_discovery_window_train_gloo_ddp_to_exit_0(
        netns_lab: Any, joiners: Joiners, tmp_path: Path) -> None:
    """Four network namespaces each run ``fdl-fabric join`` to the launcher (the root
    namespace); a pod with a wrong token and one with a taken name are refused that
    attempt only, and the run goes on to gloo DDP's identical parameters everywhere."""
    if netns_available() is not None:
        pytest.skip(str(netns_available()))
    lab: NetnsLab = netns_lab(n_hosts=4, routed=True, host_ifnames={i: "eth7" for i in range(4)})
    cluster, port = window_file(tmp_path, joiners.token, bind="0.0.0.0", min_ranks=4,
                                join_timeout=60, env={"GLOO_SOCKET_IFNAME": "eth7"})
    run = launch(cluster, sys.executable, DDP, "--steps", "5", "--out", str(tmp_path / "out"))
    run.wait_line(r"cluster join: window open", timeout=30)
    nets = [lab._nets[h.name] for h in lab.hosts]
    pods = [joiners.start(port, f"pod-{i}", netns=net.name, address=net.root_addr)
            for i, net in enumerate(nets[:3])]
    stranger = tmp_path / "other.token"
    joinwire.write_token_file(str(stranger), joinwire.new_token())
    wrong = joiners.start(port, "pod-x", netns=nets[3].name, address=nets[3].root_addr,
                          token=stranger)
    assert wrong.finish(30) == 2
    assert "did not prove it holds this token" in wrong.err
    twin = joiners.start(port, "pod-0", netns=nets[3].name, address=nets[3].root_addr)
    assert twin.finish(30) == 2 and "already joined this run" in twin.err
    pods.append(joiners.start(port, "pod-3", netns=nets[3].name, address=nets[3].root_addr))
    assert run.finish(120) == 0, run.err
    assert gloo_run_completed(run.stderr_lines[-1], 4), run.err
    assert "cluster join: world formed — 4 rank(s) across 4 host(s)" in run.err
    assert "refused a join attempt of 10." in run.err and "a wrong token" in run.err
    params = [json.loads(p.read_text()) for p in (tmp_path / "out").glob("params-r*.json")]
    assert sorted(p["rank"] for p in params) == [0, 1, 2, 3]
    assert len({p["fingerprint"] for p in params}) == 1, "DDP: the same parameters everywhere"
    for pod in pods:
        assert pod.finish(30) == 0, pod.err
        assert "the run's agent ended; done" in pod.err


def test_a_quorum_unmet_at_the_cap_ends_the_launch_1_and_tells_the_joiner(
        joiners: Joiners, tmp_path: Path) -> None:
    cluster, port = window_file(tmp_path, joiners.token, min_ranks=2, join_timeout=1,
                                max_join_timeout=3)
    run = launch(cluster, "true")
    run.wait_line(r"cluster join: window open", timeout=30)
    lone = joiners.start(port, "pod-a")
    assert run.finish(30) == 1
    assert run.stderr_lines[-1] == ("cluster launcher: failed: quorum not met: 1/2 ranks "
                                    "joined within the join window's max_join_timeout hard "
                                    "cap (3s)")
    assert lone.finish(20) == 1, "a transient end: --persist would dial again"
    assert "the window failed: quorum not met" in lone.err


def test_the_target_closes_the_window_long_before_its_time(joiners: Joiners,
                                                          tmp_path: Path) -> None:
    cluster, port = window_file(tmp_path, joiners.token, min_ranks=1, target_ranks=2,
                                join_timeout=300)
    run = launch(cluster, sys.executable, "-c", "print('hi')")
    run.wait_line(r"cluster join: window open", timeout=30)
    started = time.monotonic()
    for host in ("pod-a", "pod-b"):
        joiners.start(port, host)
    assert run.finish(60) == 0, run.err
    assert time.monotonic() - started < 60
    assert "(target ranks reached)" in run.err


def test_a_manual_window_waits_for_fdl_fabric_start(joiners: Joiners, tmp_path: Path) -> None:
    cluster, port = window_file(tmp_path, joiners.token, min_ranks=1, start="manual",
                                join_timeout=120)
    run = launch(cluster, sys.executable, "-c", "print('after the start')")
    run.wait_line(r"cluster join: window open", timeout=30)
    early = subprocess.run([*FDL, "start"], capture_output=True, text=True, timeout=30,
                           cwd=tmp_path)
    assert early.returncode == 1 and "quorum not met (0/1 ranks)" in early.stderr
    joiners.start(port, "pod-a")
    run.wait_line(r"host 'pod-a' joined", timeout=30)
    time.sleep(1.5)
    assert "world formed" not in run.err, "manual never closes by itself"
    here = subprocess.run([*FDL, "status"], capture_output=True, text=True, timeout=30,
                          cwd=tmp_path)
    assert re.search(r"join window of run \S+ at 127\.0\.0\.1:\d+: staging — 1 rank\(s\) in "
                     r"\(quorum 1, target none\), start manual; \d+s left in the window",
                     here.stdout), here.stdout + here.stderr
    assert re.search(r"^  pod-a  1 rank\(s\)  from 127\.0\.0\.1$", here.stdout, re.M)
    there = subprocess.run([*FDL, "status", "--controller", f"127.0.0.1:{port}",
                            "--token-file", str(joiners.token), "--json"],
                           capture_output=True, text=True, timeout=30, cwd=tmp_path)
    window = json.loads(there.stdout)["join_window"]["window"]
    assert (window["phase"], window["ranks_in"], window["start"]) == ("staging", 1, "manual")
    started = subprocess.run([*FDL, "start"], capture_output=True, text=True, timeout=30,
                             cwd=tmp_path)
    assert started.returncode == 0, started.stderr
    assert run.finish(60) == 0, run.err
    assert "(operator start)" in run.err and "cluster join: operator start received" in run.err


def test_a_joiner_that_dials_before_the_launcher_is_up_joins_once_it_is(
        joiners: Joiners, tmp_path: Path) -> None:
    cluster, port = window_file(tmp_path, joiners.token, min_ranks=1, target_ranks=1)
    early = joiners.start(port, "pod-a")
    early.wait_line(r"nothing answers at 127\.0\.0\.1:\d+ yet", timeout=30)
    time.sleep(3)
    run = launch(cluster, sys.executable, "-c", "print('joined late')")
    assert run.finish(60) == 0, run.err
    assert early.finish(30) == 0, early.err


def test_a_launcher_sigkilled_leaves_no_rank_of_a_walk_in_behind(joiners: Joiners,
                                                                 tmp_path: Path) -> None:
    """The connection is the leash: when the launcher dies, each joiner closes its
    agent's input and the agent stops its ranks, within the lease at the latest."""
    cluster, port = window_file(tmp_path, joiners.token, min_ranks=2, target_ranks=2)
    run = launch(cluster, sys.executable, "-c", SLEEPER)
    run.wait_line(r"cluster join: window open", timeout=30)
    pods = [joiners.start(port, host) for host in ("pod-a", "pod-b")]
    pids = [int(run.wait_line(rf"\[pod-{h}:cpu:r{r}\] rank {r} pid (\d+)", timeout=60)
                .group(1)) for h, r in (("a", 0), ("b", 1))]
    os.kill(run.pid, signal.SIGKILL)
    run.finish(10)
    wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() !=
                             psutil.STATUS_ZOMBIE for p in pids), 35,
             "every walk-in's ranks stopped")
    for pod in pods:
        assert pod.finish(30) in (0, 1), pod.err


# -- a walk-in lost, and the next attempt --------------------------------------------------

ATTEMPTS = ("import os, sys, time; attempt = os.environ['TORCHELASTIC_RESTART_COUNT']; "
            "print('rank', os.environ['RANK'], 'attempt', attempt, 'pid', os.getpid(), "
            "flush=True); time.sleep(300 if attempt == '0' else 0); "
            "sys.exit(1 if attempt == '1' and os.environ['RANK'] == '0' else 0)")


#: Attempt 0 runs until stopped; any later one exits 0 at once.
UNTIL_RESTARTED = ("import os, time; attempt = os.environ['TORCHELASTIC_RESTART_COUNT']; "
                   "print('rank', os.environ['RANK'], 'attempt', attempt, 'pid', os.getpid(), "
                   "flush=True); time.sleep(300 if attempt == '0' else 0)")


def _agent_of(joiner: LiveProcess) -> psutil.Process:
    def found() -> Optional[psutil.Process]:
        return next((p for p in psutil.Process(joiner.pid).children(recursive=True)
                     if "fdl_fabric.agent.main" in " ".join(p.cmdline())), None)
    agent: psutil.Process = wait_for(found, 30, "the joiner's agent")
    return agent


def _three_walk_ins(joiners: Joiners, tmp_path: Path, restarts: int,
                    program: str = ATTEMPTS) -> tuple[LiveProcess, list[LiveProcess]]:
    cluster, port = window_file(tmp_path, joiners.token, min_ranks=2, target_ranks=3,
                                join_timeout=8)
    doc = yaml.safe_load(cluster.read_text())
    doc["elastic"] = {"max_restarts": restarts, "min_hosts": 2}
    cluster.write_text(yaml.safe_dump(doc, sort_keys=False))
    run = launch(cluster, sys.executable, "-c", program)
    run.wait_line(r"cluster join: window open", timeout=30)
    pods = [joiners.start(port, f"pod-{h}", "--nproc", "1", "--persist") for h in "abc"]
    for r in range(3):
        run.wait_line(rf"rank {r} attempt 0 pid", timeout=60)
    return run, pods


def test_a_walk_in_whose_agent_dies_sits_out_an_attempt_then_joins_the_next(
        joiners: Joiners, tmp_path: Path) -> None:
    """Its joiner (--persist) outlives its agent and dials again at once; as any lost
    host, it sits out the next attempt (min_hosts: 2), and the one after runs on the
    whole world again."""
    run, pods = _three_walk_ins(joiners, tmp_path, restarts=2)
    _agent_of(pods[1]).kill()
    assert run.finish(120) == 0, run.err
    assert "cluster join: host 'pod-b' joined again" in run.err
    assert run.stderr_lines[-1] == "cluster launcher: run completed — all 3 ranks exited 0"
    assert run.wait_line(r"\(restart 1 of 2\) on 2 of 3 hosts \(pod-a, pod-c\)", timeout=1)
    assert run.wait_line(r"\(restart 2 of 2\) on 3 of 3 hosts", timeout=1)


def test_a_walk_in_that_is_gone_is_a_lost_host_and_the_others_run_the_next_attempt(
        joiners: Joiners, tmp_path: Path) -> None:
    """A walk-in whose joiner is killed is a lost host (its agent stops its ranks: the
    connection was its leash); the next attempt runs on the two that joined again
    (min_hosts: 2), and the run completes DEGRADED."""
    run, pods = _three_walk_ins(joiners, tmp_path, restarts=1, program=UNTIL_RESTARTED)
    os.killpg(pods[2].pid, signal.SIGKILL)
    assert run.finish(90) == 0, run.err
    assert "cluster join: host 'pod-a' joined again" in run.err
    assert run.stderr_lines[-1] == ("cluster launcher: run completed on 2 of 3 hosts (pod-c "
                                    "lost in attempt 0) — DEGRADED: 2 ranks in the last "
                                    "attempt")


def test_ssh_hosts_and_walk_ins_share_one_run_roster_first(
        sshd_lab: Any, joiners: Joiners, tmp_path: Path) -> None:
    """Two sshd lab hosts (the roster, reached over SSH) and two walk-ins: the window
    counts the walk-ins, the world is the roster in its order, then the walk-ins by
    name."""
    lab = sshd_lab(n_hosts=2)
    port = free_port("127.0.0.1")
    cluster = lab.write_cluster(
        [lab.worker(h, nproc=1) for h in lab.hosts],
        controller={"host": "127.0.0.1", "port": free_port("127.0.0.1"),
                    "join": {"discovery": True, "min_ranks": 2, "target_ranks": 2,
                             "port": port, "token_file": str(joiners.token)}})
    run = launch(cluster, "python3", "-c", "import os; print('rank', os.environ['RANK'], "
                 "'of', os.environ['WORLD_SIZE'])")
    run.wait_line(r"cluster join: window open", timeout=30)
    for host in ("walk-z", "walk-a"):
        joiners.start(port, host)
    assert run.finish(90) == 0, run.err
    assert run.stderr_lines[-1] == "cluster launcher: run completed — all 4 ranks exited 0"
    names = [h.name for h in lab.hosts]
    assert (f"4 rank(s) on 4 host(s) ({names[0]}: r0, {names[1]}: r1, walk-a: r2, "
            "walk-z: r3)") in run.err
    assert sorted(run.stdout_lines) == sorted(
        [f"[{names[0]}:cpu:r0] rank 0 of 4", f"[{names[1]}:cpu:r1] rank 1 of 4",
         "[walk-a:cpu:r2] rank 2 of 4", "[walk-z:cpu:r3] rank 3 of 4"])


#: Idle and garbage connections to a port from 127.0.0.2, as fast as they go, until
#: killed; prints how many it opened on TERM.
JUNK = r"""
import os, signal, socket, sys, threading
port, counts = int(sys.argv[1]), [0]
def report(*_):
    print(counts[0], flush=True)
    os._exit(0)
def flood(garbage):
    while True:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=2,
                                         source_address=("127.0.0.2", 0))
            counts[0] += 1
            if garbage:
                s.sendall(os.urandom(256))
            s.close()
        except OSError:
            pass
signal.signal(signal.SIGTERM, report)
for n in range(4):
    threading.Thread(target=flood, args=(n % 2,), daemon=True).start()
print("flooding", flush=True)
signal.pause()
"""


def test_a_junk_flood_during_the_window_does_not_fail_it(joiners: Joiners,
                                                         tmp_path: Path) -> None:
    """Thousands of junk connections from another address while the window is open:
    the joiners are admitted, the world forms, the run ends 0, and the refusals are
    said a few times, then counted."""
    cluster, port = window_file(tmp_path, joiners.token, min_ranks=2, target_ranks=2)
    run = launch(cluster, sys.executable, "-c", "print('through the flood')")
    run.wait_line(r"cluster join: window open", timeout=30)
    flood = LiveProcess([sys.executable, "-c", JUNK, str(port)])
    try:
        flood.wait_line("flooding", timeout=10)
        time.sleep(3)
        for host in ("pod-a", "pod-b"):
            joiners.start(port, host)
        assert run.finish(60) == 0, run.err
    finally:
        if flood.proc.poll() is None:
            flood.signal(signal.SIGTERM)
        flood.finish(10)
    opened = int(flood.stdout_lines[-1])
    assert opened > 500, "the premise: a flood"
    said = [line for line in run.stderr_lines if "refused a join attempt of 127.0.0.2" in line]
    assert 1 <= len(said) <= 3
    assert "cluster join: world formed — 2 rank(s) across 2 host(s)" in run.err


@pytest.mark.timeout(200)
def test_a_joiner_that_dials_90_s_before_the_launcher_joins_once_it_is_up(
        joiners: Joiners, tmp_path: Path) -> None:
    """torchrun's store fails a node that starts more than 60 s before it
    (pytorch/pytorch#107021); a joiner with --persist dials for 60 s, waits 5 s, dials
    again, and joins the window whenever it opens."""
    cluster, port = window_file(tmp_path, joiners.token, min_ranks=1, target_ranks=1)
    early = joiners.start(port, "pod-a", "--nproc", "1", "--persist")
    time.sleep(90)
    assert early.proc.poll() is None, early.err
    assert "nothing answered at 127.0.0.1" in early.err and "dialling again in 5s" in early.err
    run = launch(cluster, sys.executable, "-c", "print('ninety seconds late')")
    assert run.finish(60) == 0, run.err
    assert "[pod-a:cpu:r0] ninety seconds late" in run.stdout_lines
    early.wait_line(r"the run's agent ended; done", timeout=30)


def test_stacks_of_a_run_whose_hosts_dial_in_are_asked_of_its_launcher(
        joiners: Joiners, tmp_path: Path) -> None:
    """``fdl-fabric stacks`` cannot reach a walk-in: it asks the run's launcher, as
    Ctrl-\\\\ does, and shows the view it recorded; the run goes on."""
    cluster, port = window_file(tmp_path, joiners.token, min_ranks=2, target_ranks=2)
    run = launch(cluster, sys.executable, "-c", SLEEPER)
    run.wait_line(r"cluster join: window open", timeout=30)
    for host in ("pod-a", "pod-b"):
        joiners.start(port, host)
    for h, r in (("a", 0), ("b", 1)):
        run.wait_line(rf"\[pod-{h}:cpu:r{r}\] rank {r} pid", timeout=60)
    shown = subprocess.run([*FDL, "stacks", "-c", str(cluster)], capture_output=True,
                           text=True, timeout=90, cwd=tmp_path)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "asked of its launcher (its hosts dial in)" in shown.stdout
    assert re.search(r"ranks 0, 1 \(pod-a, pod-b\): ", shown.stdout), shown.stdout
    assert "attempt_0/stacks/r0.txt" in shown.stdout
    assert run.proc.poll() is None, "the run goes on"
    os.kill(run.pid, signal.SIGTERM)
    assert run.finish(60) == 143


def test_a_joiner_told_to_stop_stops_its_ranks_and_does_not_dial_again(
        joiners: Joiners, tmp_path: Path) -> None:
    """TERM to a joiner (systemctl stop, a pod's end) goes to its agent, which stops its
    ranks and says so: the run's verdict names the signal and the host, as for a
    scancel; with --persist the joiner still exits, once."""
    cluster, port = window_file(tmp_path, joiners.token, min_ranks=1, target_ranks=1)
    run = launch(cluster, sys.executable, "-c", SLEEPER)
    run.wait_line(r"cluster join: window open", timeout=30)
    pod = joiners.start(port, "pod-a", "--nproc", "1", "--persist")
    pid = int(run.wait_line(r"\[pod-a:cpu:r0\] rank 0 pid (\d+)", timeout=60).group(1))
    os.kill(pod.pid, signal.SIGTERM)
    assert pod.finish(30) in (0, 1), pod.err
    assert "dialling again" not in pod.err
    wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() ==
             psutil.STATUS_ZOMBIE, 15, "its rank stopped")
    assert run.finish(60) == 143, run.err
    assert run.stderr_lines[-1] == ("cluster launcher: interrupted by SIGTERM on pod-a — every "
                                    "rank was stopped")


def test_a_walk_in_run_keeps_its_logs_and_json_and_a_hang_is_found(
        joiners: Joiners, tmp_path: Path) -> None:
    """The rest holds for walk-ins: ``--log-dir`` keeps each rank's output and the
    timeline with the window's events, ``--json`` ends with the verdict record, and a
    run whose ranks go silent past ``hang_timeout`` ends hung, its stacks collected."""
    cluster, port = window_file(tmp_path, joiners.token, min_ranks=2, target_ranks=2)
    doc = yaml.safe_load(cluster.read_text())
    doc["hang_timeout"] = 3
    cluster.write_text(yaml.safe_dump(doc, sort_keys=False))
    logs = tmp_path / "logs"
    silent = ("import os, time; print('rank', os.environ['RANK'], 'says one line', "
              "flush=True); time.sleep(300)")
    run = LiveProcess([*FDL, "launch", "-c", str(cluster), "--log-dir", str(logs), "--json",
                       "--", sys.executable, "-c", silent], cwd=tmp_path)
    wait_for(lambda: any('"join_window_open"' in line for line in run.stdout_lines), 30,
             "the window's record")
    for host in ("pod-a", "pod-b"):
        joiners.start(port, host)
    assert run.finish(90) == 1, run.err
    records = [json.loads(line) for line in run.stdout_lines]
    assert records[-1]["name"] == "verdict" and records[-1]["data"]["verdict"] == "hung"
    names = [r["name"] for r in records]
    assert {"join_window_open", "join_admitted", "join_world_formed", "stacks"} <= set(names)
    [folder] = [p for p in logs.iterdir() if p.is_dir() and not p.is_symlink()]
    timeline = [json.loads(line)["name"] for line in
                (folder / "events.jsonl").read_text().splitlines()]
    assert "join_world_formed" in timeline and timeline[-1] == "verdict"
    for r in (0, 1):
        assert (folder / "attempt_0" / f"r{r}" / "stdout.log").read_text() == \
            f"rank {r} says one line\n"
