"""Issue 4, "No orphans, ever": the fault matrix of docs/reliability.md, pinned.

Every test drives the real thing: `inv launch`, `inv cleanup` and `fab cleanup` as
processes, real OpenSSH sshd hosts (the sshd lab), real signals. The lab hosts run with
``private_registry=True``: each has a run registry of its own, as on a real cluster,
and a sweep of "every run" on a lab host can never touch ranks that other test runs
keep in this machine's real registry. Clusters that use ``--all`` or ``fab cleanup``
therefore have lab hosts only; the local worker's registry is the real one, and only
run- or cluster-scoped cleanups (unique to each test) run against it.

All lab hosts are this machine, so "no process of run R remains on any host" is a scan
of /proc for FLODL_INTERNAL_RUN_ID=R (``fdl_fabric.testing.processes_of_run``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import psutil
import pytest

from fdl_fabric.agent import procs
from fdl_fabric.clusterfile import load_cluster
from fdl_fabric.commands.cleanup import sweep_request, sweep_with_agents
from fdl_fabric.planning.plan import cluster_key
from fdl_fabric.testing import REGISTRY_MOUNTPOINT, LabHost, SshdLab
from fdl_fabric.transport import for_cluster
from fdl_fabric.transport.fanout import close_all, connect_all
from fdl_fabric.transport.sshconfig import resolve_all_settings
from labutil import (
    PROBE,
    ROOT,
    SIGPROBE,
    LiveLaunch,
    alive,
    processes_of_run,
    wait_for,
)

pytestmark = pytest.mark.lab

KILL_GRACE = 1.0
#: The issue's bound for "gone": the kill grace plus 2 s.
GONE_BOUND = KILL_GRACE + 2.0


# --------------------------------------------------------------------------------------
# Helpers: launches, registry records, hand-made leftovers
# --------------------------------------------------------------------------------------


@pytest.fixture
def launches() -> Iterator[Callable[..., LiveLaunch]]:
    """Start launches; at teardown, SIGKILL any still running and reap their runs."""
    started: list[LiveLaunch] = []

    def start(cluster: Path, *args: str, **kw: Any) -> LiveLaunch:
        launch = LiveLaunch(cluster, *args, **kw)
        started.append(launch)
        return launch

    yield start
    for launch in started:
        run = None
        with contextlib.suppress(AssertionError):
            run = launch.run_id
        if launch.proc.poll() is None:
            launch.proc.kill()
            launch.proc.wait(10)
        if run:
            kill_run(run)


def kill_run(run: str) -> None:
    """SIGKILL every process carrying this run's id: only what our own tests started."""
    for proc in processes_of_run(run):
        with contextlib.suppress(psutil.Error):
            proc.kill()


def wait_run_gone(run: str, timeout: float, stable: float = 0.3) -> float:
    """Seconds until no process carries the run's id, and none shows up for ``stable``
    seconds more (a remote wrapper's ``sleep`` ticks carry the id it exported)."""
    t0 = time.monotonic()
    empty_since: Optional[float] = None
    left: list[psutil.Process] = []
    while time.monotonic() - t0 < timeout + stable:
        left = processes_of_run(run)
        now = time.monotonic()
        if left:
            empty_since = None
        elif empty_since is None:
            empty_since = now
        elif now - empty_since >= stable:
            return empty_since - t0
        time.sleep(0.02)
    if empty_since is not None and empty_since - t0 <= timeout:
        return empty_since - t0
    raise AssertionError(f"processes of run {run} still there after {timeout}s: "
                         f"{[(p.pid, p.name()) for p in left]}")


def start_time(pid: int) -> int:
    """Field 22 of /proc/<pid>/stat: the start time in clock ticks since boot."""
    data = Path(f"/proc/{pid}/stat").read_text()
    return int(data[data.rindex(")") + 2:].split()[19])


def read_record(folder: str, run: str, host: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(Path(procs.record_path(run, host, folder)).read_text())
    return data


def write_record(folder: str, *, pgid: int, start: int, run: str, cluster: str, host: str,
                 rank: int) -> Path:
    """A run's registry record on one host, exactly as the agent writes it (mode 0600)."""
    record = {"version": procs.RECORD_VERSION, "run": run, "cluster": cluster, "host": host,
              "agent": 0, "ranks": [{"rank": rank, "pid": pgid, "start": start}]}
    return Path(procs.write_record(record, folder))


def run_env(run: str, cluster: str, host: str, rank: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_")}
    env.update(FLODL_INTERNAL_RUN_ID=run, FLODL_INTERNAL_CLUSTER_KEY=cluster,
               FLODL_HOST_NAME=host, RANK=str(rank), PYTHONUNBUFFERED="1")
    return env


def starts(folder: Path, rank: object) -> list[dict[str, Any]]:
    found = []
    for p in sorted(folder.glob(f"start-r{rank}-*.json")):
        with contextlib.suppress(ValueError, OSError):
            found.append(json.loads(p.read_text()))
    return found


def wait_start(folder: Path, rank: object, timeout: float = 20) -> dict[str, Any]:
    got: list[dict[str, Any]] = wait_for(lambda: starts(folder, rank), timeout,
                                         f"rank {rank} to start (in {folder})")
    return got[-1]


def signals(folder: Path, rank: object) -> list[tuple[str, int, str, float]]:
    """Lines of sigprobe's marker file: (role, pid, SIGNAME, time.time())."""
    path = folder / f"sig-r{rank}.log"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        role, pid, name, when = line.split()
        out.append((role, int(pid), name, float(when)))
    return out


def start_leftover(spawned: list[subprocess.Popen[bytes]], registry: str, out: Path, *,
                   run: str, cluster: str, host: str, rank: int, ignore_term: bool = False,
                   extra: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """A rank whose wrapper died: the run's env, its own session/group, a registry record."""
    argv = [sys.executable, SIGPROBE, str(out), "--sleep", "300", *extra]
    if ignore_term:
        argv.append("--ignore-term")
    proc = subprocess.Popen(argv, env=run_env(run, cluster, host, rank), start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    spawned.append(proc)
    wait_for(lambda: any(s["pid"] == proc.pid for s in starts(out, rank)), 20,
             "the leftover to install its signal handlers")
    write_record(registry, pgid=proc.pid, start=start_time(proc.pid), run=run, cluster=cluster,
                 host=host, rank=rank)
    return proc


def local_worker(nproc: int = 1, **fields: Any) -> dict[str, Any]:
    return {"host": "localhost", "nproc": nproc, "path": str(ROOT), **fields}


def cluster_file(lab: SshdLab, *, local: int = 0, nproc: int = 1, hosts: Optional[Sequence[
        LabHost]] = None, filename: str = "cluster.yml", **top: Any) -> Path:
    workers = [local_worker(local)] if local else []
    workers += [lab.worker(h, nproc=nproc) for h in (lab.hosts if hosts is None else hosts)]
    top.setdefault("kill_grace", KILL_GRACE)
    return lab.write_cluster(workers, filename=filename, **top)


def key_of(path: Path) -> str:
    return cluster_key(load_cluster(str(path)))


def inv_cleanup(cluster: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "invoke", "--search-root", str(ROOT), "cleanup",
            "--cluster", str(cluster), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT),
                          stdin=subprocess.DEVNULL)


def fab_cleanup(lab: SshdLab, hosts: Sequence[LabHost], home: Path, *args: str,
                timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`fab -H root@addr:port,... -i KEY cleanup` from the repo root, with a private HOME.

    fab has no cluster.yml to read: the lab's user, address, port and key go on its
    command line, and the host keys go to $HOME/.ssh/known_hosts (accept-new, the policy
    `adhoc_cleanup` installs), so a private HOME keeps the real one untouched.
    """
    targets = ",".join(f"{lab.user}@{h.addr}:{h.port}" for h in hosts)
    env = {**os.environ, "HOME": str(home), "SSH_AUTH_SOCK": ""}
    fab = [sys.executable, "-m", "fabric"]  # the `fab` console script, same interpreter
    return subprocess.run([*fab, "-H", targets, "-i", lab.identity_file, "cleanup", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=str(ROOT),
                          env=env, stdin=subprocess.DEVNULL)


def records_of(run: str, registries: Sequence[str]) -> list[Path]:
    return [p for r in registries for p in Path(r).glob(f"{run}@*.json")]


def private_lab(sshd_lab: Callable[..., SshdLab], n_hosts: int) -> SshdLab:
    """Lab hosts with a registry each (see the module docstring).

    That takes a mount namespace per host, so root (CI runs as root). Without it these
    tests skip rather than sweep "every run" in the real registry of a developer who
    may have a job running.
    """
    if os.geteuid() != 0:
        pytest.skip("per-host registries need root (a mount namespace per lab host)")
    return sshd_lab(n_hosts=n_hosts, private_registry=True, kill_grace=1.0)


# --------------------------------------------------------------------------------------
# 1. The registry
# --------------------------------------------------------------------------------------


def test_a_running_run_is_recorded_per_host_as_json_with_each_ranks_pid_and_start_time(
        sshd_lab, launches, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 1)
    (h,) = lab.hosts
    cluster = cluster_file(lab, local=1)
    run_launch = launches(cluster, "--cmd", f"python3 {SIGPROBE} {tmp_path}/d --sleep 300")
    d = tmp_path / "d"
    ranks = {0: wait_start(d, 0), 1: wait_start(d, 1)}
    run = ranks[0]["run"]
    assert run == run_launch.run_id and ranks[1]["run"] == run
    where = {0: (REGISTRY_MOUNTPOINT, "localhost"), 1: (h.registry, h.name)}
    for rank, (folder, host) in where.items():
        path = Path(procs.record_path(run, host, folder))
        wait_for(path.exists, 10, f"the registry record {path}")
        rec = read_record(folder, run, host)
        pid = ranks[rank]["pid"]
        assert (rec["run"], rec["cluster"], rec["host"]) == (run, key_of(cluster), host)
        assert rec["ranks"] == [{"rank": rank, "pid": pid, "start": start_time(pid)}]
        assert ranks[rank]["pgid"] == pid, "the rank leads its own process group"
        st, dst = path.stat(), Path(folder).stat()
        assert (st.st_mode & 0o777, st.st_uid) == (0o600, os.getuid()), oct(st.st_mode)
        assert (dst.st_mode & 0o777, dst.st_uid) == (0o700, os.getuid()), oct(dst.st_mode)

    run_launch.signal(signal.SIGTERM)
    assert run_launch.wait(20) == 143, run_launch.err
    assert records_of(run, [REGISTRY_MOUNTPOINT, h.registry]) == []
    assert processes_of_run(run) == []


def test_the_agent_creates_a_missing_registry_0700_and_its_record_0600_whatever_the_umask(
        tmp_path: Path) -> None:
    """On a host that never ran a rank: a fresh /tmp (a tmpfs in a private mount
    namespace), umask 000. The rank program lists the registry while it runs."""
    from fdl_fabric.agent import wire
    from fdl_fabric.transport import bundle

    if os.geteuid() != 0:
        pytest.skip("needs root for a private mount namespace")
    show = ('r=/tmp/fdl-fabric-$(id -u); for i in $(seq 100); do '
            '[ -n "$(ls -A "$r" 2>/dev/null)" ] && break; sleep 0.05; done; '
            'stat -c "%a %u %n" "$r" "$r"/*')
    script = ('mount -t tmpfs -o mode=1777 fdlt-tmp /tmp && umask 000 && '
              + bundle.local_command(sys.executable))
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                             script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    run = "20990101-000000-0badc0de"
    spec = {"version": wire.VERSION, "run_id": run, "cluster": "", "host": "nowhere",
            "kill_grace": 1, "cwd": "/", "argv": ["bash", "-c", show],
            "env": {"FLODL_INTERNAL_RUN_ID": run}, "ranks": [{"rank": 3, "env": {}}],
            "start_now": True}
    timer = threading.Timer(20, proc.kill)
    timer.start()
    assert proc.stdin is not None and proc.stdout is not None
    reader = wire.Reader(wire.UP_TYPES, handshake=True)
    out = b""
    try:
        # The input stays open while the rank runs: EOF would mean "stop".
        proc.stdin.write(bundle.payload() + wire.message(wire.SPEC, spec))
        proc.stdin.flush()
        done = False
        while not done:
            data = os.read(proc.stdout.fileno(), 65536)
            assert data, "the agent ended early"
            for kind, body in reader.feed(data):
                if kind == wire.OUTPUT:
                    out += wire.parse_output(body)[3]
                done = done or kind == wire.DONE
    finally:
        timer.cancel()
        proc.stdin.close()
        proc.wait(10)
    stderr = b""
    uid = os.getuid()
    assert out.decode().splitlines() == [
        f"700 {uid} /tmp/fdl-fabric-{uid}",
        f"600 {uid} /tmp/fdl-fabric-{uid}/{run}@nowhere.json",
    ], stderr


def test_inv_cleanup_sweeps_a_stale_record_and_never_signals_a_recycled_pid(
        sshd_lab, spawned, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 1)
    (h,) = lab.hosts
    cluster = cluster_file(lab, local=1)
    remote_only = cluster_file(lab, filename="remote.yml")
    key = key_of(cluster)
    # A pid that belonged to a rank which is gone now.
    gone = subprocess.Popen(["true"])
    gone.wait()
    # A process fdl-fabric never started, now holding a pid a record names; the record's
    # start time is the (earlier) one of the process that had the pid before.
    plain_env = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_")}
    bystander = subprocess.Popen([sys.executable, SIGPROBE, str(tmp_path / "by")],
                                 start_new_session=True, env={**plain_env, "RANK": "9"})
    spawned.append(bystander)
    wait_start(tmp_path / "by", 9)
    recycled_start = start_time(bystander.pid) - 100

    uniq = uuid.uuid4().hex[:8]
    stale_run, old_run = f"stale-{uniq}", f"old-{uniq}"

    def plant(registry: str, host: str, rank: int) -> list[Path]:
        return [
            write_record(registry, pgid=gone.pid, start=12345, run=stale_run, cluster=key,
                         host=host, rank=rank),
            write_record(registry, pgid=bystander.pid, start=recycled_start, run=old_run,
                         cluster=key, host=host, rank=rank),
        ]

    modes = [(cluster, ()), (cluster, ("--run-id", old_run)), (remote_only, ("--all",))]
    for path, args in modes:
        planted = plant(h.registry, h.name, 1)
        if path == cluster and not args:
            planted += plant(REGISTRY_MOUNTPOINT, "localhost", 0)
        if args:  # --run-id / --all: the stale record is someone else's business now
            planted[0].unlink()
            planted = planted[1:]
        out = inv_cleanup(path, *args)
        assert out.returncode == 0, (args, out.stdout, out.stderr)
        assert "verified" in out.stderr
        assert [p for p in planted if p.exists()] == [], f"records left after {args}"
        assert bystander.poll() is None, f"cleanup {args} killed a recycled pid's process"
        assert signals(tmp_path / "by", 9) == [], f"cleanup {args} signalled a recycled pid"


# --------------------------------------------------------------------------------------
# 2. Cleanup around every launch
# --------------------------------------------------------------------------------------


def _orphan_the_ranks(launch: LiveLaunch, rank_pids: Sequence[int]) -> None:
    """Make ranks outlive their launcher, agents and watchdogs, like a machine crash.

    The launcher is frozen first, so it cannot react to its agents dying; then every
    agent's watchdog (the agent's child that is no rank), every agent (the ranks'
    parent) and finally the launcher get SIGKILL.
    """
    agents = {psutil.Process(pid).ppid() for pid in rank_pids}
    watchdogs = [c.pid for a in agents for c in psutil.Process(a).children()
                 if c.pid not in rank_pids]
    launch.signal(signal.SIGSTOP)
    for pid in [*watchdogs, *agents]:
        os.kill(pid, signal.SIGKILL)
    launch.signal(signal.SIGKILL)
    launch.wait(10)


def test_leftovers_of_an_earlier_run_of_the_same_cluster_are_stopped_before_the_next_spawn(
        sshd_lab, launches, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 2)
    cluster = cluster_file(lab, local=1)
    first = launches(cluster, "--cmd", f"python3 {SIGPROBE} {tmp_path}/old --sleep 300")
    old = {r: wait_start(tmp_path / "old", r) for r in range(3)}
    run = old[0]["run"]
    _orphan_the_ranks(first, [s["pid"] for s in old.values()])
    time.sleep(0.5)
    assert all(alive(s["pid"]) for s in old.values()), "the leftovers should be running"
    registries = [REGISTRY_MOUNTPOINT, *(h.registry for h in lab.hosts)]
    assert len(records_of(run, registries)) == 3

    second = launches(cluster, "--cmd", f"python3 {SIGPROBE} {tmp_path}/new --sleep 0.5")
    assert second.wait(30) == 0, second.err
    for host in ("localhost", "lab1", "lab2"):
        assert f"stopped leftovers of an earlier run of this cluster on {host}: run {run} " \
            in second.err, second.err
    first_spawn = min(s["time"] for r in range(3) for s in starts(tmp_path / "new", r))
    for r, s in old.items():
        assert not alive(s["pid"])
        terms = [t for role, _, name, t in signals(tmp_path / "old", r) if name == "SIGTERM"]
        assert terms and terms[0] < first_spawn, f"rank {r} of {run} was stopped after the spawn"
    assert records_of(run, registries) == []
    assert processes_of_run(run) == []
    assert processes_of_run(second.run_id) == []


def test_after_a_run_nothing_of_it_remains_on_any_host(sshd_lab, launches, tmp_path: Path) -> None:
    """Each rank forks a grandchild that outlives it; the run ends with status 0."""
    lab = private_lab(sshd_lab, 2)
    cluster = cluster_file(lab, local=1)
    run_launch = launches(cluster, "--cmd", f"python3 {PROBE} --dump {tmp_path}/d --fork")
    assert run_launch.wait(30) == 0, run_launch.err
    run = run_launch.run_id
    assert len(re.findall(r"\] forked \d+", "\n".join(
        line for _, _, line in run_launch.lines))) == 3
    assert processes_of_run(run) == []
    assert records_of(run, [REGISTRY_MOUNTPOINT, *(h.registry for h in lab.hosts)]) == []


def test_sweeping_four_hosts_takes_about_as_long_as_sweeping_one(
        sshd_lab, spawned, tmp_path: Path) -> None:
    """Every host has a leftover that ignores TERM, so each sweep waits its 1 s grace:
    in series four hosts would take four times as long."""
    lab = private_lab(sshd_lab, 4)
    cluster = cluster_file(lab)
    key = key_of(cluster)
    parsed = load_cluster(str(cluster))
    transports = for_cluster(parsed, resolve_all_settings(parsed))
    connect_all(transports)
    try:
        timings = {}
        for n in (1, 4):
            hosts = lab.hosts[:n]
            leftovers = [start_leftover(spawned, h.registry, tmp_path / f"l{n}",
                                        run=f"old-{n}", cluster=key, host=h.name, rank=i,
                                        ignore_term=True)
                         for i, h in enumerate(hosts)]
            t0 = time.monotonic()
            reports = sweep_with_agents([transports[h.name] for h in hosts],
                                        sweep_request(cluster=key))
            timings[n] = time.monotonic() - t0
            assert [r.host for r in reports] == [h.name for h in hosts]
            assert all(r.clean and len(r.stopped) == 1 for r in reports), reports
            assert all(p.wait(5) == -signal.SIGKILL for p in leftovers)
    finally:
        close_all(transports.values())
    print(f"\nsweep of 1 lab host: {timings[1]:.2f}s; of 4 lab hosts: {timings[4]:.2f}s")
    assert timings[1] >= 1.0, "each sweep waits the grace for a TERM-ignoring leftover"
    assert timings[4] < 2 * timings[1] + 1.0, timings


# --------------------------------------------------------------------------------------
# 3. inv cleanup, fab cleanup, --pattern, and the decoy
# --------------------------------------------------------------------------------------


def test_inv_cleanup_prints_per_host_what_it_stopped_and_verifies_nothing_remains(
        sshd_lab, spawned, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 2)
    lab1, lab2 = lab.hosts
    cluster = cluster_file(lab, local=1)
    remote_only = cluster_file(lab, filename="remote.yml")
    key = key_of(cluster)
    me = "localhost"
    uniq = uuid.uuid4().hex[:8]
    run_a, run_b, run_c = f"old-a-{uniq}", f"old-b-{uniq}", f"other-{uniq}"
    out_dir = tmp_path / "left"
    a = {host: start_leftover(spawned, reg, out_dir, run=run_a, cluster=key, host=host, rank=i)
         for i, (host, reg) in enumerate([(me, REGISTRY_MOUNTPOINT), ("lab1", lab1.registry),
                                          ("lab2", lab2.registry)])}
    b = start_leftover(spawned, lab2.registry, out_dir, run=run_b, cluster=key, host="lab2",
                       rank=5)
    c = start_leftover(spawned, lab1.registry, out_dir, run=run_c, cluster="another-cluster",
                       host="lab1", rank=6)

    out = inv_cleanup(cluster, "--run-id", run_a)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    for i, host in enumerate((me, "lab1", "lab2")):
        want = f"cleanup: {host}: stopped run {run_a} ranks [{i}] (pids [{a[host].pid}])"
        assert want in lines, out.stderr
    assert lines[-1].startswith("cleanup: verified — nothing of the selected runs remains on 3 "
                                "host(s) (3 run(s) stopped)"), out.stderr
    assert all(p.poll() is not None for p in a.values())
    assert b.poll() is None and c.poll() is None, "--run-id stops that run only"

    out = inv_cleanup(cluster)
    assert out.returncode == 0, out.stderr
    assert f"cleanup: lab2: stopped run {run_b} ranks [5] (pids [{b.pid}])" in out.stderr
    assert f"cleanup: {me}: nothing to stop" in out.stderr
    assert b.wait(5) is not None and c.poll() is None, "the default is this cluster's runs"

    out = inv_cleanup(remote_only, "--all")
    assert out.returncode == 0, out.stderr
    assert f"cleanup: lab1: stopped run {run_c} ranks [6] (pids [{c.pid}])" in out.stderr
    assert c.wait(5) is not None
    assert records_of(run_a, [REGISTRY_MOUNTPOINT, lab1.registry, lab2.registry]) == []


@pytest.fixture
def freezer() -> Iterator[Callable[[int], None]]:
    """Freeze processes (cgroup v1 freezer): a frozen process ignores even SIGKILL until
    thawed, like one stuck in uninterruptible sleep on a dead NFS server."""
    base = Path("/sys/fs/cgroup/freezer")
    if os.geteuid() != 0 or not base.is_dir():
        pytest.skip("no cgroup v1 freezer (root only) here to make an unkillable process")
    group = base / f"fdlt-{uuid.uuid4().hex[:8]}"
    group.mkdir()

    def freeze(pid: int) -> None:
        (group / "cgroup.procs").write_text(str(pid))
        (group / "freezer.state").write_text("FROZEN")
        wait_for(lambda: (group / "freezer.state").read_text().strip() == "FROZEN", 5, "freeze")

    try:
        yield freeze
    finally:
        (group / "freezer.state").write_text("THAWED")
        deadline = time.monotonic() + 5
        while (group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(OSError):
            group.rmdir()


def test_inv_cleanup_exits_non_zero_when_a_leftover_survives_the_sweep(
        sshd_lab, spawned, freezer, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 1)
    (h,) = lab.hosts
    cluster = cluster_file(lab)
    stuck = start_leftover(spawned, h.registry, tmp_path / "s", run="stuck-run",
                           cluster=key_of(cluster), host=h.name, rank=0)
    freezer(stuck.pid)
    out = inv_cleanup(cluster)
    assert out.returncode == 1, out.stderr
    assert "cleanup: lab1: stopped run stuck-run ranks [0]" in out.stderr
    assert "LEFTOVER" in out.stderr and str(stuck.pid) in out.stderr
    assert out.stderr.splitlines()[-1] == "cleanup: FAILED — leftovers or errors on lab1"
    assert Path(procs.record_path("stuck-run", h.name, h.registry)).exists(), \
        "a survivor keeps its record"


def test_fab_cleanup_works_from_the_repo_root_without_a_cluster_file(
        sshd_lab, spawned, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 2)
    home = tmp_path / "home"
    home.mkdir()
    procs = {h.name: start_leftover(spawned, h.registry, tmp_path / "l", run=f"r-{h.name}",
                                    cluster="whatever", host=h.name, rank=i)
             for i, h in enumerate(lab.hosts)}
    out = fab_cleanup(lab, lab.hosts[:1], home, "--run-id", "r-lab2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"cleanup: {lab.hosts[0].addr}: nothing to stop" in out.stderr
    assert all(p.poll() is None for p in procs.values())

    out = fab_cleanup(lab, lab.hosts, home)
    assert out.returncode == 0, out.stdout + out.stderr
    for h in lab.hosts:
        want = f"cleanup: {h.addr}: stopped run r-{h.name} ranks "
        assert want in out.stderr, out.stderr
        assert procs[h.name].wait(5) is not None
    known = (home / ".ssh" / "known_hosts").read_text()
    assert all(h.host_key_pub.split()[1] in known for h in lab.hosts), "accept-new records keys"

    # accept-new, not fab's AutoAddPolicy: a host whose key changed is refused, untouched.
    lab2 = lab.hosts[1]
    lab2.regenerate_host_key()
    victim = start_leftover(spawned, lab2.registry, tmp_path / "l", run="r-again",
                            cluster="whatever", host=lab2.name, rank=7)
    out = fab_cleanup(lab, [lab2], home)
    assert out.returncode != 0, out.stdout + out.stderr
    said = out.stdout + out.stderr
    assert re.search(r"BadHostKeyException|does not match|CHANGED", said), said
    assert victim.poll() is None


def test_a_decoy_with_a_rank_command_line_survives_every_cleanup_mode_except_pattern(
        sshd_lab, launches, spawned, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 1)
    (h,) = lab.hosts
    cluster = cluster_file(lab, local=1)
    remote_only = cluster_file(lab, filename="remote.yml")
    d = tmp_path / "d"
    cmd = f"python3 {SIGPROBE} {d} --sleep 300"
    first = launches(cluster, "--cmd", cmd)
    rank = wait_start(d, 1)
    rank_proc = psutil.Process(rank["pid"])
    argv, cwd = rank_proc.cmdline(), rank_proc.cwd()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_")}
    env["RANK"] = "decoy"
    decoy = subprocess.Popen(argv, cwd=cwd, env=env, start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    spawned.append(decoy)
    wait_start(d, "decoy")
    assert psutil.Process(decoy.pid).cmdline() == argv, "the decoy's command line is a rank's"

    def decoy_untouched(after: str) -> None:
        assert decoy.poll() is None, f"{after} killed the decoy"
        assert signals(d, "decoy") == [], f"{after} signalled the decoy"

    out = inv_cleanup(cluster, "--run-id", first.run_id)
    assert out.returncode == 0 and "stopped run" in out.stderr, out.stderr
    first.wait(20)
    decoy_untouched("inv cleanup --run-id")
    second = launches(cluster, "--cmd", f"python3 {SIGPROBE} {tmp_path}/d2 --sleep 0.3")
    assert second.wait(30) == 0, second.err
    decoy_untouched("the pre- and post-launch sweeps")
    for path, args in ((cluster, ()), (remote_only, ("--all",))):
        out = inv_cleanup(path, *args)
        assert out.returncode == 0, out.stderr
        decoy_untouched(f"inv cleanup {' '.join(args)}")
    out = fab_cleanup(lab, [h], tmp_path / "home")
    assert out.returncode == 0, out.stdout + out.stderr
    decoy_untouched("fab cleanup")

    pattern = re.escape(f"sigprobe.py {d} --sleep 300")
    out = inv_cleanup(cluster, "--pattern", pattern)
    assert out.returncode == 0, out.stderr
    assert "process(es) matching" in out.stderr
    assert decoy.wait(5) is not None, "--pattern is the opt-in to pkill -f"
    assert [name for _, _, name, _ in signals(d, "decoy")] == ["SIGTERM"]


# --------------------------------------------------------------------------------------
# 4. Launcher death
# --------------------------------------------------------------------------------------


def test_sigkill_of_the_launcher_leaves_no_process_of_the_run_on_any_host(
        sshd_lab, launches, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 2)
    cluster = cluster_file(lab, local=1)
    run_launch = launches(cluster, "--cmd",
                          f"python3 {PROBE} --dump {tmp_path}/d --fork --sleep 300")
    d = tmp_path / "d"
    wait_for(lambda: all((d / f"env-r{r}.json").exists() for r in range(3)), 20, "3 ranks")
    run = run_launch.run_id
    # Every rank and its forked grandchild carry the run id.
    wait_for(lambda: len(processes_of_run(run)) >= 6, 10, "ranks and grandchildren")
    hosts = set()
    for proc in processes_of_run(run):
        with contextlib.suppress(psutil.Error):
            hosts.add(proc.environ().get("FLODL_HOST_NAME"))
    assert hosts == {"localhost", "lab1", "lab2"}
    run_launch.signal(signal.SIGKILL)
    elapsed = wait_run_gone(run, GONE_BOUND)
    print(f"\nlauncher SIGKILL: every process of the run gone after {elapsed:.2f}s")
    wait_for(lambda: not records_of(run, [REGISTRY_MOUNTPOINT, *(h.registry for h in
                                                                  lab.hosts)]), 2, "records")


# --------------------------------------------------------------------------------------
# 5. Signals
# --------------------------------------------------------------------------------------


def _watch_gone(pids: Sequence[int], until: Callable[[], bool]) -> dict[int, float]:
    """Poll until ``until()``; the monotonic time at which each pid was first seen gone."""
    gone: dict[int, float] = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for pid in pids:
            if pid not in gone and not alive(pid):
                gone[pid] = time.monotonic()
        if len(gone) == len(pids) or until():
            break
        time.sleep(0.02)
    return gone


def test_first_sigint_reaches_every_rank_group_as_sigint_then_term_then_kill_and_exits_130(
        sshd_lab, launches, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 1)
    cluster = cluster_file(lab, local=2, kill_grace=1.5)
    d = tmp_path / "d"
    run_launch = launches(cluster, "--cmd",
                          f"python3 {SIGPROBE} {d} --fork --ignore-term-ranks 2 --sleep 300")
    ranks = {r: wait_start(d, r) for r in range(3)}
    pids = [s["pid"] for s in ranks.values()]
    t0 = run_launch.signal(signal.SIGINT)
    gone = _watch_gone(pids, lambda: run_launch.proc.poll() is not None)
    assert run_launch.wait(20) == 130, run_launch.err
    status = [line for line in run_launch.err_lines() if "SIGINT received" in line]
    assert len(status) == 1, run_launch.err
    assert "stopping 3 running rank(s) (INT, TERM after 0.75s, KILL after 1.5s)" in status[0], \
        status
    assert run_launch.err_lines()[-1] == \
        "cluster launcher: interrupted by SIGINT — every rank was stopped"
    for r in range(3):  # INT went to the group first: the rank and its forked child got it
        got = [(role, name) for role, _, name, _ in signals(d, r)]
        assert {("rank", "SIGINT"), ("child", "SIGINT")} <= set(got), (r, got)
    # The TERM-ignoring rank then got TERM, half the grace after the INT, and KILL.
    stubborn_signals = [(name, when) for role, _pid, name, when in signals(d, 2)
                        if role == "rank"]
    assert [name for name, _ in stubborn_signals] == ["SIGINT", "SIGTERM"], stubborn_signals
    stubborn = gone[ranks[2]["pid"]] - t0
    print(f"\nTERM-ignoring rank killed {stubborn:.2f}s after SIGINT (kill_grace 1.5)")
    assert 1.5 - 0.2 <= stubborn <= 1.5 + 2.0
    assert processes_of_run(run_launch.run_id) == []


def test_sigterm_to_the_launcher_stops_every_rank_and_exits_143(
        sshd_lab, launches, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 1)
    cluster = cluster_file(lab, local=1)
    d = tmp_path / "d"
    run_launch = launches(cluster, "--cmd", f"python3 {SIGPROBE} {d} --sleep 300")
    for r in range(2):
        wait_start(d, r)
    run_launch.signal(signal.SIGTERM)
    assert run_launch.wait(20) == 143, run_launch.err
    assert [line for line in run_launch.err_lines() if "SIGTERM received" in line]
    assert run_launch.err_lines()[-1] == \
        "cluster launcher: interrupted by SIGTERM — every rank was stopped"
    for r in range(2):
        assert [name for _, _, name, _ in signals(d, r)] == ["SIGTERM"]
    assert processes_of_run(run_launch.run_id) == []


def test_a_second_sigint_kills_every_rank_at_once(sshd_lab, launches, tmp_path: Path) -> None:
    """kill_grace is 30 s and every rank ignores TERM: only the second Ctrl-C ends them."""
    lab = private_lab(sshd_lab, 1)
    cluster = cluster_file(lab, local=1, kill_grace=30)
    d = tmp_path / "d"
    run_launch = launches(cluster, "--cmd", f"python3 {SIGPROBE} {d} --ignore-term --sleep 300")
    pids = [wait_start(d, r)["pid"] for r in range(2)]
    run_launch.signal(signal.SIGINT)
    run_launch.wait_line("SIGINT received", timeout=5)
    wait_for(lambda: all(signals(d, r) for r in range(2)), 5, "TERM to reach both ranks")
    t1 = run_launch.signal(signal.SIGINT)
    gone = _watch_gone(pids, lambda: time.monotonic() - t1 > 2.5)
    took = {pid: round(t - t1, 2) for pid, t in gone.items()}
    print(f"\nsecond SIGINT: ranks gone after {took}")
    assert sorted(gone) == sorted(pids), f"ranks still alive 2.5 s after the second SIGINT: {took}"
    assert run_launch.wait(10) == 130, run_launch.err
    assert "second interrupt — killing every rank's process group now" in run_launch.err


def test_sigusr1_and_sigusr2_reach_every_rank_local_and_remote(
        sshd_lab, launches, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 2)
    cluster = cluster_file(lab, local=1)
    d = tmp_path / "d"
    run_launch = launches(cluster, "--cmd", f"python3 {SIGPROBE} {d} --fork --sleep 300")
    for r in range(3):
        wait_start(d, r)
    run_launch.signal(signal.SIGUSR1)
    run_launch.signal(signal.SIGUSR2)
    want = {(role, name) for role in ("rank", "child") for name in ("SIGUSR1", "SIGUSR2")}
    for r in range(3):
        wait_for(lambda r=r: want <= {(role, n) for role, _, n, _ in signals(d, r)}, 5,
                 f"USR1 and USR2 to reach rank {r} and its child")
    assert run_launch.proc.poll() is None, "USR1/USR2 do not stop the run"
    run_launch.signal(signal.SIGTERM)
    assert run_launch.wait(20) == 143, run_launch.err


# --------------------------------------------------------------------------------------
# 6a. Connection faults: the sshd serving a host dies
# --------------------------------------------------------------------------------------


def test_killing_the_sshd_serving_a_host_reports_its_ranks_lost_stops_every_rank_and_exits_1(
        sshd_lab, launches, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 2)
    lab1 = lab.hosts[0]
    cluster = cluster_file(lab, local=1)
    d = tmp_path / "d"
    run_launch = launches(cluster, "--cmd", f"python3 {SIGPROBE} {d} --fork --sleep 300")
    ranks = {r: wait_start(d, r) for r in range(3)}
    on_lab1 = [ranks[1]["pid"], ranks[1]["child"]]
    serving = lab1.session_pids()
    assert serving, "the launcher's connection to lab1"
    t0 = time.monotonic()
    for pid in serving:
        os.kill(pid, signal.SIGKILL)
    gone = _watch_gone(on_lab1, lambda: time.monotonic() - t0 > GONE_BOUND)
    assert sorted(gone) == sorted(on_lab1), "lab1's rank outlived its connection"
    print(f"\nsshd of lab1 killed: its rank gone after {max(gone.values()) - t0:.2f}s")
    assert run_launch.wait(20) == 1, run_launch.err
    err = run_launch.err
    lost = "rank 1 of lab1 exited with no exit status (agent lost: the SSH session or " \
        "connection was lost)"
    assert lost in err, err
    assert "peer failure — terminating all still-running ranks" in err
    for r in (0, 2):  # kill-all: the local rank and lab2's got TERM from the launcher
        assert ("rank", "SIGTERM") in {(role, n) for role, _, n, _ in signals(d, r)}, r
    assert run_launch.err_lines()[-1] == f"cluster launcher: failed: {lost}"
    wait_run_gone(run_launch.run_id, GONE_BOUND)


# --------------------------------------------------------------------------------------
# Faults that exposed launcher bugs (docs/reliability.md, "Bugs these tests found")
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["local", "remote"])
def test_when_an_agent_is_sigkilled_its_ranks_are_gone_within_the_grace_and_the_launch_ends(
        where: str, sshd_lab, launches, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 1)
    cluster = cluster_file(lab, local=1)
    d = tmp_path / "d"
    run_launch = launches(cluster, "--cmd", f"python3 {SIGPROBE} {d} --fork --ignore-term "
                          "--sleep 60")
    ranks = {r: wait_start(d, r) for r in range(2)}
    victim = ranks[0 if where == "local" else 1]
    t0 = time.monotonic()
    os.kill(psutil.Process(victim["pid"]).ppid(), signal.SIGKILL)
    gone = _watch_gone([victim["pid"], victim["child"]],
                       lambda: time.monotonic() - t0 > GONE_BOUND + 1)
    assert len(gone) == 2 and max(gone.values()) - t0 <= GONE_BOUND, gone
    assert run_launch.wait(KILL_GRACE + 8) == 1, run_launch.err
    host = "localhost" if where == "local" else "lab1"
    rank = 0 if where == "local" else 1
    # The agent's death is the cause; its rank did not fail (issue 34).
    assert run_launch.err_lines()[-1] == (
        f"cluster launcher: failed: the agent of {host} was killed by signal 9 (sender "
        f"unknown): rank {rank} was lost with it, and what it wrote after its last frame "
        "is lost too"), run_launch.err
    assert f"rank {rank} of {host} exited with no exit status (agent lost: " in \
        run_launch.err, run_launch.err
    wait_run_gone(run_launch.run_id, 1.0)


def test_a_sweep_also_stops_what_a_leftover_starts_while_it_is_being_stopped(
        sshd_lab, spawned, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 1)
    (h,) = lab.hosts
    cluster = cluster_file(lab)
    run = f"spawner-{uuid.uuid4().hex[:8]}"
    start_leftover(spawned, h.registry, tmp_path / "s", run=run, cluster=key_of(cluster),
                   host=h.name, rank=0, extra=["--spawn-on-term"])
    try:
        out = inv_cleanup(cluster)
        assert (tmp_path / "s" / "spawned-r0").exists(), "the leftover started its helper"
        assert out.returncode == 0, out.stderr
        wait_run_gone(run, 1.0)
    finally:
        kill_run(run)


def test_fab_cleanup_sweeps_every_host_even_when_one_fails(
        sshd_lab, spawned, tmp_path: Path) -> None:
    lab = private_lab(sshd_lab, 2)
    down, up = lab.hosts
    leftover = start_leftover(spawned, up.registry, tmp_path / "l", run="r-up", cluster="c",
                              host=up.name, rank=1)
    down.stop()
    out = fab_cleanup(lab, [down, up], tmp_path / "home")
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"cleanup: {down.addr}: cleanup FAILED" in out.stderr, out.stdout + out.stderr
    assert f"cleanup: {up.addr}: stopped run r-up ranks [1]" in out.stderr, out.stderr
    assert leftover.wait(5) is not None
