"""Issue 23, item 2: the gateway tree, through the real thing.

Beyond ``fanout`` SSH hosts the launcher connects to a few gateways only; each gateway's
relay starts its leaves' agents with the host's OpenSSH client (`fdl_fabric.agent.relay`,
`fdl_fabric.transport.gateway`). Real sshd hosts (the lab), real ssh clients on the
gateway (this machine), real signals. Every lab host is this machine, so "nothing of
run R is left" is one scan of /proc, and the launcher's connections are its sockets.

The leaves' ssh reads the lab's key and known_hosts from the worker entries
(`SshdLab.worker`: ``identity_file`` and ``UserKnownHostsFile``), as it would from a
gateway with keys of its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from test_liveness_lab import launches  # noqa: F401  (the fixture)
from test_reliability import inv_cleanup, private_lab, wait_run_gone

from fdl_fabric.testing import MARKER_ENV, LabHost, SshdLab
from labutil import PROBE, ROOT, LiveLaunch, alive, wait_for

INV = (sys.executable, "-m", "invoke", "--search-root", str(ROOT))

pytestmark = [pytest.mark.lab, pytest.mark.timeout(240)]

#: A rank: dumps its environment, one rank prints many numbered lines, then it sleeps.
RANK_SCRIPT = """\
import json, os, sys, time
rank = int(os.environ["RANK"])
folder, lines, talker, sleep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
with open(os.path.join(folder, "env-r%d.json" % rank), "w") as fh:
    json.dump({"env": dict(os.environ), "cwd": os.getcwd()}, fh)
if rank == talker:
    sys.stdout.write("".join("line %d\\n" % i for i in range(lines)))
    sys.stdout.flush()
time.sleep(sleep)
"""


def _cluster(lab: SshdLab, fanout: int, nproc: int = 1) -> Path:
    workers = [lab.worker(h, nproc=nproc) for h in lab.hosts]
    return lab.write_cluster(workers, fanout=fanout, kill_grace=1)


def _launcher_peers(pid: int, lab: SshdLab) -> set[str]:
    """The lab hosts the launcher holds a TCP connection to."""
    where = {(h.addr, h.port): h.name for h in lab.hosts}
    peers = set()
    for conn in psutil.Process(pid).net_connections(kind="tcp"):
        if conn.raddr and (conn.raddr.ip, conn.raddr.port) in where:
            peers.add(where[(conn.raddr.ip, conn.raddr.port)])
    return peers


def _relays(lab: SshdLab) -> dict[str, psutil.Process]:
    """The relay process of each gateway of this lab, by host name."""
    markers = {h.marker: h.name for h in lab.hosts}
    found = {}
    for proc in psutil.process_iter(["cmdline"]):
        try:
            argv = proc.info["cmdline"] or []
            if argv[-1:] != ["relay"] or "-c" not in argv:
                continue
            host = markers.get(proc.environ().get(MARKER_ENV, ""))
        except psutil.Error:
            continue
        if host is not None and proc.status() != psutil.STATUS_ZOMBIE:
            found[host] = proc
    return found


def _dumps(folder: Path, count: int, timeout: float = 60) -> dict[int, dict[str, Any]]:
    def ready() -> Any:
        files = list(folder.glob("env-r*.json"))
        if len(files) < count:
            return None
        try:
            return {int(p.stem[5:]): json.loads(p.read_text()) for p in files}
        except ValueError:
            return None

    found: dict[int, dict[str, Any]] = wait_for(ready, timeout, f"{count} rank dumps")
    return found


def _assert_environments(lab: SshdLab, dumps: dict[int, dict[str, Any]], nproc: int) -> None:
    world = len(lab.hosts) * nproc
    assert sorted(dumps) == list(range(world))
    for rank, dump in dumps.items():
        host: LabHost = lab.hosts[rank // nproc]
        env = dump["env"]
        assert (env["RANK"], env["WORLD_SIZE"]) == (str(rank), str(world))
        assert env["FLODL_HOST_NAME"] == host.name
        assert env[MARKER_ENV] == host.marker, "the rank ran on its own host's sshd"
        assert dump["cwd"] == host.path


def test_nine_hosts_through_two_gateways_every_rank_runs_and_output_is_exact(
        sshd_lab, launches, tmp_path: Path) -> None:  # noqa: F811
    lab = sshd_lab(n_hosts=9)
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    dumps, logs = tmp_path / "d", tmp_path / "logs"
    dumps.mkdir()
    lines = 1_000_000
    run: LiveLaunch = launches(_cluster(lab, fanout=2), "--log-dir", str(logs), "--cmd",
                               f"python3 {script} {dumps} {lines} 8 4")
    _assert_environments(lab, _dumps(dumps, 9), 1)
    assert _launcher_peers(run.pid, lab) == {"lab1", "lab2"}, \
        "the launcher connects to the gateways only"
    assert set(_relays(lab)) == {"lab1", "lab2"}
    assert run.finish(90) == 0, run.err
    assert run.err_lines()[-1] == "cluster launcher: run completed — all 9 ranks exited 0"
    (run_dir,) = [p for p in logs.iterdir() if not p.is_symlink()]
    out = (run_dir / "attempt_0" / "r8" / "stdout.log").read_bytes()
    assert out == "".join(f"line {i}\n" for i in range(lines)).encode(), \
        "a leaf's output arrives whole, in order, byte for byte"
    wait_for(lambda: not _relays(lab), 15, "every relay gone")


def test_a_leaf_ranks_death_stops_every_rank_and_the_verdict_names_the_leaf(
        sshd_lab, launches, tmp_path: Path) -> None:  # noqa: F811
    lab = sshd_lab(n_hosts=9)
    run: LiveLaunch = launches(_cluster(lab, fanout=2), "--cmd",
                               f"python3 {PROBE} --sleep 300 --exit-rank 8 --exit-code 3 "
                               "--exit-after 3")
    assert run.finish(90) == 1, run.err
    verdict = run.err_lines()[-1]
    assert verdict == "cluster launcher: failed: rank 8 of lab9 exited with status 3", run.err
    rows = [x.split() for x in run.err_lines() if x[:1].isdigit()]
    assert {r[1] for r in rows} == {h.name for h in lab.hosts}
    assert wait_run_gone(run.run_id, 15) < 15


def test_a_gateways_relay_killed_its_leaves_stop_by_the_leash_and_the_verdict_names_it(
        sshd_lab, launches, tmp_path: Path) -> None:  # noqa: F811
    lab = sshd_lab(n_hosts=9)
    dumps = tmp_path / "d"
    run: LiveLaunch = launches(_cluster(lab, fanout=2), "--cmd",
                               f"python3 {PROBE} --dump {dumps} --sleep 300")
    ranks = _dumps(dumps, 9)
    relay = _relays(lab)["lab1"]
    leaves = [ranks[r]["pid"] for r in (2, 3, 4, 5)]  # lab3..lab6: lab1's leaves
    relay.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    assert run.finish(60) == 1, run.err
    err = run.err
    assert "lost with its gateway 'lab1'" in err and "killed by signal 9" in err, err
    verdict = run.err_lines()[-1]
    assert "lost with its gateway 'lab1'" in verdict, verdict
    wait_for(lambda: not any(alive(p) for p in leaves), 15, "lab1's leaves' ranks stopped")
    assert time.monotonic() - t0 < 30
    assert wait_run_gone(run.run_id, 15) < 15


def test_a_gateway_host_lost_its_leaves_stop_by_the_leash(
        sshd_lab, launches, tmp_path: Path) -> None:  # noqa: F811
    """The whole gateway gone at once (its sshd and every session it served SIGKILLed):
    its relay's stdin ends, it closes every leaf's stdin, and each leaf agent stops its
    ranks itself; the launcher, which cannot reach them any more, names the gateway."""
    lab = sshd_lab(n_hosts=9)
    dumps = tmp_path / "d"
    run: LiveLaunch = launches(_cluster(lab, fanout=2), "--cmd",
                               f"python3 {PROBE} --dump {dumps} --sleep 300")
    ranks = _dumps(dumps, 9)
    lab.hosts[0].lose()
    leaves = [ranks[r]["pid"] for r in (2, 3, 4, 5)]
    wait_for(lambda: not any(alive(p) for p in leaves), 20, "lab1's leaves' ranks stopped")
    assert run.finish(60) == 1, run.err
    verdict = run.err_lines()[-1]  # whichever loss was heard first: lab1's, or a leaf's
    assert "of lab1 " in verdict or "gateway 'lab1'" in verdict, run.err
    assert wait_run_gone(run.run_id, 15) < 15


def test_the_launcher_sigkilled_leaves_nothing_anywhere(
        sshd_lab, launches, tmp_path: Path) -> None:  # noqa: F811
    lab = sshd_lab(n_hosts=9)
    dumps = tmp_path / "d"
    run: LiveLaunch = launches(_cluster(lab, fanout=2), "--cmd",
                               f"python3 {PROBE} --dump {dumps} --sleep 300")
    _dumps(dumps, 9)
    run_id = run.run_id
    relays = _relays(lab)
    assert set(relays) == {"lab1", "lab2"}
    os.kill(run.pid, signal.SIGKILL)
    run.finish(10)
    assert wait_run_gone(run_id, 20) < 20
    wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                             for p in relays.values()), 20, "the relays gone")
    wait_for(lambda: not [p for p in psutil.process_iter(["cmdline"])
                          if (p.info["cmdline"] or [""])[0] == "ssh"
                          and lab.identity_file in (p.info["cmdline"] or [])], 20,
             "no leaf ssh left")


def test_status_and_cleanup_go_through_the_tree(
        sshd_lab, launches, tmp_path: Path) -> None:  # noqa: F811
    lab = private_lab(sshd_lab, 9)  # each host lists and sweeps its own registry only
    dumps = tmp_path / "d"
    cluster = _cluster(lab, fanout=2)
    run: LiveLaunch = launches(cluster, "--cmd", f"python3 {PROBE} --dump {dumps} --sleep 300")
    ranks = _dumps(dumps, 9)
    status = subprocess.run([*INV, "status", "--cluster", str(cluster), "--json"],
                            capture_output=True, text=True, timeout=60, cwd=str(ROOT),
                            stdin=subprocess.DEVNULL)
    assert status.returncode == 0, status.stdout + status.stderr
    (listed,) = json.loads(status.stdout)["runs"]
    assert listed["run"] == run.run_id
    assert {h: [r["rank"] for r in rs] for h, rs in listed["hosts"].items()} == {
        h.name: [i] for i, h in enumerate(lab.hosts)}, "every host asked, leaves through lab1/2"
    done = inv_cleanup(cluster, "--run-id", run.run_id)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert "nothing of the selected runs remains on 9 host(s)" in said, said
    wait_for(lambda: not any(alive(d["pid"]) for d in ranks.values()), 20,
             "every rank stopped")
    run.finish(60)
    assert wait_run_gone(run.run_id, 15) < 15


def test_36_hosts_as_4_gateways_of_8_leaves(
        sshd_lab, launches, tmp_path: Path) -> None:  # noqa: F811
    lab = sshd_lab(n_hosts=36)
    dumps = tmp_path / "d"
    run: LiveLaunch = launches(_cluster(lab, fanout=4), "--cmd",
                               f"python3 {PROBE} --dump {dumps} --sleep 3")
    _assert_environments(lab, _dumps(dumps, 36, timeout=90), 1)
    assert _launcher_peers(run.pid, lab) == {"lab1", "lab2", "lab3", "lab4"}
    assert set(_relays(lab)) == {"lab1", "lab2", "lab3", "lab4"}
    assert run.finish(90) == 0, run.err
    assert run.err_lines()[-1] == "cluster launcher: run completed — all 36 ranks exited 0"


#: A rank of the re-planning test: attempt 0 sleeps (until its gateway is lost), attempt 1
#: dumps its environment and ends after a few seconds.
REPLAN_RANK = """\
import json, os, sys, time
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
rank = os.environ["RANK"]
with open(os.path.join(sys.argv[1], "a%s-r%s.json" % (attempt, rank)), "w") as fh:
    json.dump({"env": dict(os.environ)}, fh)
time.sleep(300 if attempt == "0" else 6)
"""


def test_a_lost_gateway_is_planned_out_and_the_next_attempt_runs_through_the_others(
        sshd_lab, launches, tmp_path: Path) -> None:  # noqa: F811
    """Issue 23 with issue 20: gateway lab1 lost with everything it served; the next
    attempt plans the tree without it (gateways lab2 and lab3 start lab1's old leaves),
    tries lab1 directly, leaves it out, and completes on the 8 hosts that answer."""
    lab = sshd_lab(n_hosts=9)
    workers = [lab.worker(h, nproc=1) for h in lab.hosts]
    cluster = lab.write_cluster(workers, fanout=2, kill_grace=1,
                                elastic={"min_hosts": 4, "heartbeat_timeout": 10})
    script, dumps, logs = tmp_path / "rank.py", tmp_path / "d", tmp_path / "logs"
    script.write_text(REPLAN_RANK)
    dumps.mkdir()
    run: LiveLaunch = launches(cluster, "--max-restarts", "1", "--log-dir", str(logs),
                               "--cmd", f"python3 {script} {dumps}")

    def attempt(n: int, count: int) -> dict[str, str]:
        def ready() -> Any:
            files = list(dumps.glob(f"a{n}-r*.json"))
            return files if len(files) >= count else None

        files = wait_for(ready, 60, f"{count} ranks of attempt {n}")
        return {json.loads(p.read_text())["env"]["FLODL_HOST_NAME"]: p.name for p in files}

    assert len(attempt(0, 9)) == 9
    lab.hosts[0].lose()
    try:
        hosts = attempt(1, 8)
    except AssertionError:
        run.finish(30)
        raise AssertionError(run.err) from None
    assert set(hosts) == {h.name for h in lab.hosts[1:]}
    assert _launcher_peers(run.pid, lab) == {"lab2", "lab3"}, \
        "the launcher connects to the new gateways only"
    assert run.finish(90) == 0, run.err
    (line,) = [x for x in run.err_lines() if "planned again" in x]
    assert "without the lost gateway(s) lab1" in line and "gateways now lab2, lab3" in line
    (run_dir,) = [p for p in logs.iterdir() if not p.is_symlink()]
    records = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    (replanned,) = [r["data"] for r in records if r["name"] == "tree_replanned"]
    assert replanned["tree"]["gateways"] == {"lab2": ["lab4", "lab5", "lab6"],
                                             "lab3": ["lab7", "lab8", "lab9"]}
    assert run.err_lines()[-1].startswith("cluster launcher: run completed on 8 of 9 hosts "
                                          "(lab1 "), run.err
    assert wait_run_gone(run.run_id, 15) < 15


#: Threads of a flat launch besides one per host: the main thread, the console's, the
#: log writer, the channel reader, the coordinator's and the keepalive monitor.
FIXED_THREADS = 6


def test_a_flat_launch_holds_one_thread_per_host(
        sshd_lab, launches, tmp_path: Path) -> None:  # noqa: F811
    """Issue 23's quick cut: paramiko's transport thread is a host's only thread; one
    selector thread reads every agent session (`transport.channels`), where invoke
    spent two reading threads per session (3 a host)."""
    lab = sshd_lab(n_hosts=8)
    dumps = tmp_path / "d"
    run: LiveLaunch = launches(_cluster(lab, fanout=64), "--cmd",
                               f"python3 {PROBE} --dump {dumps} --sleep 300")
    _dumps(dumps, 8)
    # The fewest over a second: a keepalive's ping runs on a thread of its own for as long
    # as its host takes to answer, and a loaded machine can catch one in flight.
    process = psutil.Process(run.pid)
    counts = []
    for _ in range(20):
        counts.append(process.num_threads())
        time.sleep(0.05)
    threads = min(counts)
    assert threads <= len(lab.hosts) + FIXED_THREADS, threads
    run.signal(signal.SIGINT)
    assert run.finish(30) == 130, run.err
    assert wait_run_gone(run.run_id, 15) < 15


@pytest.fixture
def ssh_agent(tmp_path: Path) -> Any:
    """A real ssh-agent of the test's own (stopped by pid), and its socket."""
    sock = tmp_path / "agent.sock"
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(sock.exists, 10, "ssh-agent's socket")
        yield sock
    finally:
        agent.kill()
        agent.wait()


def _agent_cluster(lab: SshdLab, forward: str) -> Path:
    """Gateways lab1 and lab2 (fanout 2 of 5 hosts) with their key and ``ForwardAgent``;
    leaves with no key at all: only an agent can get their ssh in."""
    workers = []
    for i, host in enumerate(lab.hosts):
        worker = lab.worker(host, nproc=1)
        if i < 2:
            worker["ssh"]["options"] = [*worker["ssh"]["options"], f"ForwardAgent={forward}"]
        else:
            del worker["ssh"]["identity_file"]
        workers.append(worker)
    return lab.write_cluster(workers, fanout=2, kill_grace=1)


def test_forward_agent_on_a_gateway_lets_its_leaves_in_with_the_controllers_keys(
        sshd_lab, launches, ssh_agent: Path, tmp_path: Path) -> None:  # noqa: F811
    """Issue 23's trust note: a gateway needs SSH to its leaves, from keys of its own or,
    with ``ForwardAgent=yes`` on the gateway, from the controller's ssh-agent."""
    lab = sshd_lab(n_hosts=5)
    env = {"SSH_AUTH_SOCK": str(ssh_agent)}
    subprocess.run(["ssh-add", "-q", lab.identity_file], env={**os.environ, **env},
                   check=True, capture_output=True, timeout=20)
    dumps = tmp_path / "d"
    run: LiveLaunch = launches(_agent_cluster(lab, "yes"), "--cmd",
                               f"python3 {PROBE} --dump {dumps} --sleep 1", env=env)
    assert run.finish(60) == 0, run.err
    ranks = _dumps(dumps, 5)
    assert {ranks[r]["env"]["FLODL_HOST_NAME"] for r in (2, 3, 4)} == {"lab3", "lab4", "lab5"}

    refused: LiveLaunch = launches(_agent_cluster(lab, "no"), "--cmd", "true", env=env)
    assert refused.finish(60) != 0
    assert "Permission denied" in refused.err and "lab3" in refused.err, refused.err


def test_a_leaf_that_does_not_answer_is_left_out_of_an_elastic_launch(
        sshd_lab, launches, tmp_path: Path) -> None:  # noqa: F811
    """A leaf's connect only makes sure its gateway's relay runs; an elastic launch asks
    the leaf itself (one ``ssh <leaf> exit 0`` through the relay), so a dead leaf is left
    out, as a dead flat host is, instead of failing every start."""
    lab = sshd_lab(n_hosts=9)
    down = lab.hosts[4]
    down.sshd.kill()
    down.sshd.wait()
    workers = [lab.worker(h, nproc=1) for h in lab.hosts]
    cluster = lab.write_cluster(workers, fanout=2, kill_grace=1, elastic={"min_hosts": 4})
    dumps = tmp_path / "d"
    run: LiveLaunch = launches(cluster, "--cmd", f"python3 {PROBE} --dump {dumps} --sleep 1")
    assert run.finish(60) == 0, run.err
    assert run.err_lines()[-1].startswith(
        "cluster launcher: run completed on 8 of 9 hosts (lab5 unreachable"), run.err
    assert "through gateway 'lab1'" in run.err, run.err
