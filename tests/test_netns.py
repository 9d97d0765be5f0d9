"""A network partition, for real: a lab host in its own network namespace loses its link.

The host (``fdl_fabric.testing.NetnsLab``) is an sshd inside a namespace we create,
reached over a veth pair; ``link_down`` sets the root-side end down, so packets stop in
both directions without a FIN or an RST, as when a switch port or a cable dies. Every
address involved is a private /30 inside our own namespaces (see NetnsLab).

Needs root (CI runs as root); elsewhere the ``netns_lab`` fixture skips with the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import psutil
import pytest

from fdl_fabric.testing import LabHost, NetnsLab
from labutil import ROOT, alive, launch_argv, processes_of_run, wait_for

pytestmark = pytest.mark.lab

SIGPROBE = str(ROOT / "tests" / "progs" / "sigprobe.py")
KILL_GRACE = 1.0
ALIVE_INTERVAL, ALIVE_COUNT = 1, 3
#: The launcher closes a connection after interval x count silent seconds; its monitor
#: ticks every 0.2 s and a ping in flight may have started up to one interval earlier.
DETECT_BOUND = ALIVE_INTERVAL * ALIVE_COUNT + ALIVE_INTERVAL + 0.5


class _Lines:
    """A process's stderr, line by line, with the monotonic time each line arrived."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def when(self, needle: str) -> Optional[float]:
        return next((t for t, line in list(self.lines) if needle in line), None)

    def text(self) -> str:
        return "\n".join(line for _, line in list(self.lines))

    def join(self) -> None:
        self._thread.join(5)


def _run_pids_in(lab: NetnsLab, host: LabHost, run: str) -> list[int]:
    """Live processes inside the host's namespace that carry the run's id."""
    found = []
    for pid in lab.namespace_pids(host):
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE and \
                    proc.environ().get("FLODL_INTERNAL_RUN_ID") == run:
                found.append(pid)
    return found


def _wait_stably_empty(scan: Callable[[], Sequence[object]], timeout: float, what: str,
                       stable: float = 0.3) -> None:
    """Until ``scan()`` is empty and stays empty for ``stable`` s: a remote wrapper's last
    ``sleep`` ticks carry the run id it exported, and come and go while it finishes."""
    deadline = time.monotonic() + timeout
    empty_since: Optional[float] = None
    left: Sequence[object] = ()
    while time.monotonic() < deadline + stable:
        left = scan()
        now = time.monotonic()
        if left:
            empty_since = None
        elif empty_since is None:
            empty_since = now
        elif now - empty_since >= stable:
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}: {left}")


def test_a_partitioned_host_is_detected_within_the_keepalive_time_and_leaves_no_orphan(
        netns_lab, spawned, tmp_path: Path) -> None:
    lab: NetnsLab = netns_lab(n_hosts=1, private_registry=True,
                              client_alive_interval=ALIVE_INTERVAL,
                              client_alive_count_max=ALIVE_COUNT)
    (host,) = lab.hosts
    opts = [*lab.ssh_options(), f"ServerAliveInterval={ALIVE_INTERVAL}",
            f"ServerAliveCountMax={ALIVE_COUNT}"]
    cluster = lab.write_cluster(
        [{"host": "localhost", "nproc": 1, "path": str(ROOT)},
         lab.worker(host, nproc=1, ssh={"options": opts})], kill_grace=KILL_GRACE)
    d = tmp_path / "d"
    proc = subprocess.Popen(
        launch_argv(cluster, "--cmd", f"python3 {SIGPROBE} {d} --fork --sleep 300"),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        cwd=str(ROOT), start_new_session=True)
    spawned.append(proc)
    err = _Lines(proc.stderr)
    run = ""
    try:
        def started(rank: int) -> Optional[dict[str, Any]]:
            for p in d.glob(f"start-r{rank}-*.json"):
                with contextlib.suppress(ValueError, OSError):
                    data: dict[str, Any] = json.loads(p.read_text())
                    return data
            return None

        remote = wait_for(lambda: started(1), 20, "the rank on the namespace host")
        local = wait_for(lambda: started(0), 20, "the local rank")
        run = remote["run"]
        in_ns = _run_pids_in(lab, host, run)
        assert remote["pid"] in in_ns and remote["child"] in in_ns, (remote, in_ns)

        t0 = time.monotonic()
        lab.link_down(host)
        detected = wait_for(lambda: err.when("stopped answering keepalives"), DETECT_BOUND + 2,
                            "the launcher to notice the partition")
        rc = proc.wait(timeout=20)  # nothing hangs
        ended = time.monotonic()
        err.join()
        # The server side gives up on the silent client by itself (ClientAlive), so the
        # ranks behind the partition stop even before the link comes back.
        behind = [remote["pid"], remote["child"]]
        remote_gone = wait_for(lambda: not any(alive(p) for p in behind) and time.monotonic(),
                               ALIVE_INTERVAL * (ALIVE_COUNT + 2) + KILL_GRACE + 5,
                               "the ranks behind the partition to stop")
        print(f"\npartition: detected after {detected - t0:.2f}s, launch ended after "
              f"{ended - t0:.2f}s, remote ranks gone after {remote_gone - t0:.2f}s")
        assert detected - t0 <= DETECT_BOUND, err.text()
        assert rc == 1, err.text()
        verdict = err.text().splitlines()[-1]
        assert verdict == ("cluster launcher: failed: rank 1 of ns1 exited with no exit status "
                           "(agent lost: the SSH session or connection was lost)"), err.text()
        assert re.search(r"host 'ns1' stopped answering keepalives for \d+s", err.text())
        assert not alive(local["pid"]), "kill-all: the local rank was stopped too"

        lab.link_up(host)
        t_up = time.monotonic()
        _wait_stably_empty(lambda: _run_pids_in(lab, host, run), 10,
                           "no process of the run inside the namespace after the link is back")
        print(f"after the link came back: no process of the run in the namespace "
              f"({time.monotonic() - t_up:.2f}s)")
        _wait_stably_empty(lambda: processes_of_run(run), 5, "no process of the run anywhere")
    finally:
        with contextlib.suppress(Exception):
            lab.link_up(host)
        if run:
            for p in processes_of_run(run):
                with contextlib.suppress(psutil.Error):
                    p.kill()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)


def test_a_host_that_cannot_reach_the_coordinators_port_joins_through_its_agent(
        netns_lab, tmp_path: Path) -> None:
    """The namespace host cannot reach the controller's loopback, where the coordinator
    listens, and has no tunnel: its ranks join through their agent, on its SSH session."""
    lab: NetnsLab = netns_lab(n_hosts=1)
    (host,) = lab.hosts
    cluster = lab.write_cluster(
        [{"host": "localhost", "nproc": 1, "path": str(ROOT)},
         lab.worker(host, nproc=2)], kill_grace=KILL_GRACE)
    assert "host: 127.0.0.1" in cluster.read_text(), "the coordinator on loopback"
    toy = ROOT / "examples" / "toy_train.py"
    out = subprocess.run(
        launch_argv(cluster, "--cmd", f"python3 {toy} --steps 3 --step-time 0.05 "
                    f"--checkpoint-dir {tmp_path}/ck"),
        stdin=subprocess.DEVNULL, capture_output=True, text=True, cwd=str(ROOT), timeout=90)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cohort formed — 3 ranks" in out.stderr
    for r in (1, 2):
        assert f"[ns1:cpu:r{r}] rank {r}/3 joined on ns1" in out.stdout
    saved = json.loads((tmp_path / "ck" / "checkpoint-r2.json").read_text())
    assert saved["reason"] == "done"
