#!/usr/bin/env python3
"""Issue 36: workers that dial in. Two measures, each beside a peer measured in the same
run; medians (min-max) over ``--repeat`` runs; never an assertion on a timing.

* **formed** (``--sizes 4,16,64``): a discovery window (``min_ranks`` = ``target_ranks``
  = N) opened in this process as a launch opens it (`commands.joinwindow.Window`, the
  real `transport.joinport` on loopback), and N emulated joiners, one thread each, that
  run the real joiner's code (`commands.join`: dial, TLS, the proofs, the hello) and
  then wait for the start. Measured: from the last admission to the world formed
  (**headline**, target <= 1 s at 64), and each joiner's join, from its dial to its
  accept (p50, max). The peer: torch's `TCPStore` (torchrun's c10d store), one master
  and N client threads that each connect and ``add("joined", 1)``; from the last add to
  the master's ``wait`` on the key the last client sets.
* **death** (``--death``): a lost worker, to the next attempt running, walk-ins against
  SSH hosts (issue 20's bench, `elasticlib`), 4 hosts x 2 ranks, ``min_hosts: 3``,
  ``kill_grace: 1``, ``max_restarts: 1``. Walk-ins: four ``fdl-fabric join --persist``
  processes; at ``t0`` one is killed with its process group (its agent with it), as a
  pod that goes. SSH: four sshd lab hosts; at ``t0`` one is stopped (its sshd and
  sessions). Measured from ``t0``: the last of the 6 ``start attempt 1`` lines.

Run ``python3 bench/join.py --help``.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d's warnings about loopback

import benchlib  # noqa: E402
import elasticlib  # noqa: E402
import yaml

from fdl_fabric import joinwire
from fdl_fabric.commands import join as joiner
from fdl_fabric.commands.joinwindow import Window
from fdl_fabric.events import Event, EventBus, Name
from fdl_fabric.planning.joinwindow import WindowState


def cell(values: list[Optional[float]], digits: int = 2, scale: float = 1.0) -> str:
    """``median (min-max)`` of the values that are not None, times ``scale``."""
    clean = [v * scale for v in values if v is not None]
    if not clean:
        return "n/a"
    return (f"{statistics.median(clean):.{digits}f} ({min(clean):.{digits}f}-"
            f"{max(clean):.{digits}f})")


class Times:
    """The window's events, timed as they are emitted."""

    def __init__(self) -> None:
        self.events: list[tuple[float, Event]] = []

    def emit(self, event: Event) -> None:
        self.events.append((time.monotonic(), event))

    def at(self, name: Name) -> list[float]:
        return [t for t, e in self.events if e.name is name]


def formed_once(n: int, folder: Path) -> dict[str, float]:
    """One window of ``n`` emulated joiners: seconds from the last admission to formed,
    and each joiner's join (dial to accept)."""
    token_file = folder / f"token-{n}"
    if not token_file.exists():
        joinwire.write_token_file(str(token_file), joinwire.new_token())
    cluster_file = folder / f"window-{n}.yml"
    cluster_file.write_text(yaml.safe_dump({"controller": {"host": "127.0.0.1", "join": {
        "discovery": True, "min_ranks": n, "target_ranks": n, "port": elasticlib.free_port(),
        "token_file": str(token_file), "max_ranks_per_host": 1}}}))
    from fdl_fabric.clusterfile import load_cluster

    cluster = load_cluster(str(cluster_file))
    times = Times()
    bus = EventBus()
    bus.add(times)
    window = Window(cluster, f"bench-{n}", folder, bus)
    window.open()
    assert window.port is not None
    token = joinwire.read_token_file(str(token_file))
    joins: list[float] = []
    streams: list[Any] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        req = joiner.JoinRequest(address="127.0.0.1", port=window.port.port,  # type: ignore
                                 token=token, host=f"walk-{i}", nproc=1, path=str(folder))
        started = time.monotonic()
        stream = joiner.connect(req, lambda _: None)
        joiner._admission(stream, req)
        with lock:
            joins.append(time.monotonic() - started)
            streams.append(stream)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    decision = window.wait()
    for t in threads:
        t.join(30)
    window.close()
    for s in streams:
        s.close()
    if decision.state is not WindowState.FORMED or len(joins) != n:
        raise benchlib.BenchError(f"the window of {n} did not form ({decision})")
    admitted = times.at(Name.JOIN_ADMITTED)
    formed = times.at(Name.JOIN_WORLD_FORMED)[0]
    return {"formed": formed - max(admitted), "join_p50": statistics.median(joins),
            "join_max": max(joins)}


def store_once(n: int) -> Optional[dict[str, float]]:
    """torch's TCPStore: from the last client's add to the master seeing the world, and
    each client's join (connect and add); no TLS, no authentication."""
    try:
        from torch.distributed import TCPStore
    except ImportError:
        return None
    port = elasticlib.free_port()
    master = TCPStore("127.0.0.1", port, n + 1, True, wait_for_workers=False)
    last: list[float] = []
    joins: list[float] = []
    lock = threading.Lock()

    def one() -> None:
        started = time.monotonic()
        client = TCPStore("127.0.0.1", port, n + 1, False)
        count = client.add("joined", 1)
        with lock:
            last.append(time.monotonic())
            joins.append(last[-1] - started)
        if count == n:
            client.set("formed", "1")

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    master.wait(["formed"])
    seen = time.monotonic()
    for t in threads:
        t.join(30)
    del master
    return {"formed": seen - max(last), "join_p50": statistics.median(joins),
            "join_max": max(joins)}


def formed(args: Any, folder: Path) -> None:
    rows = [["walk-ins", "tool", "last join -> formed (ms)", "join p50 (ms)",
             "join max (ms)", "runs"]]
    for n in args.sizes:
        samples = [formed_once(n, folder) for _ in range(args.repeat)]
        rows.append([str(n), "fdl-fabric join",
                     cell([s["formed"] for s in samples], 1, 1000),
                     cell([s["join_p50"] for s in samples], 1, 1000),
                     cell([s["join_max"] for s in samples], 1, 1000), str(len(samples))])
        peer = [p for p in (store_once(n) for _ in range(args.repeat)) if p is not None]
        if peer:
            rows.append([str(n), "torch TCPStore (no TLS, no auth)",
                         cell([p["formed"] for p in peer], 1, 1000),
                         cell([p["join_p50"] for p in peer], 1, 1000),
                         cell([p["join_max"] for p in peer], 1, 1000), str(len(peer))])
    benchlib.write_table(sys.stdout, rows, [False, False, True, True, True, True])


# -- a lost walk-in, to the next attempt -----------------------------------------------------

class WalkIns:
    """Four ``fdl-fabric join --persist`` workers of 2 ranks; one killed at ``t0``."""

    hosts, per_host = 4, 2

    def __init__(self, args: Any, folder: Path) -> None:
        self.args, self.folder = args, folder
        self.token = folder / "death.token"
        if not self.token.exists():
            joinwire.write_token_file(str(self.token), joinwire.new_token())
        prog = folder / "rank.py"
        prog.write_text(elasticlib.RANK)
        self.command = [sys.executable, "-u", str(prog), f"{elasticlib.LONG_SLEEP:g}", "3"]

    def run(self) -> Optional[float]:
        port = elasticlib.free_port()
        cluster = self.folder / "walk-ins.yml"
        world = self.hosts * self.per_host
        cluster.write_text(yaml.safe_dump({
            "controller": {"host": "127.0.0.1", "port": elasticlib.free_port(), "join": {
                "discovery": True, "min_ranks": world, "target_ranks": world,
                "join_timeout": 30, "port": port, "token_file": str(self.token)}},
            "kill_grace": 1, "elastic": {"min_hosts": self.hosts - 1, "max_restarts": 1}}))
        run = elasticlib.Launch([sys.executable, "-m", "fdl_fabric", "launch", "-c",
                                 str(cluster), "--", *self.command], cwd=self.folder)
        pods = [elasticlib.Launch([sys.executable, "-m", "fdl_fabric", "join",
                                   f"127.0.0.1:{port}", "--token-file", str(self.token),
                                   "--host", f"walk-{i}", "--nproc", str(self.per_host),
                                   "--persist", "--path", str(self.folder)], cwd=self.folder)
                for i in range(self.hosts)]
        try:
            benchlib.wait_until(lambda: len(elasticlib.Fdl.starts(run, 0)) >= world,
                                "attempt 0 up", self.args.timeout)
            elasticlib.settle()
            t0 = time.monotonic()
            os.killpg(pods[-1].pid, signal.SIGKILL)
            want = world - self.per_host
            benchlib.wait_until(lambda: len(elasticlib.Fdl.starts(run, 1)) >= want,
                                "attempt 1 up", self.args.timeout)
            return max(t for t, _ in elasticlib.Fdl.starts(run, 1).values()) - t0
        except benchlib.BenchError as exc:
            print(f"  walk-ins: {exc}: {run.tail()}", file=sys.stderr)
            return None
        finally:
            run.stop()
            for pod in pods:
                pod.stop(grace=5)


def death(args: Any, folder: Path) -> None:
    walk = WalkIns(args, folder)
    ssh_args = type("A", (), {"hosts": 4, "per_host": 2, "min_hosts": 3, "kill_grace": 1.0,
                              "short": 3.0, "timeout": args.timeout})()
    lab = benchlib.start_lab(folder / "lab", 4, sys.stdout)
    elasticlib.LABS.append(lab)
    ssh = elasticlib.Fdl(ssh_args, folder, lab)
    walked, sshed = [], []
    for _ in range(args.repeat):  # interleaved
        walked.append(walk.run())
        sample = ssh.run(0)
        sshed.append(sample.s.get("all_started") if sample.ok else None)
    rows = [["workers", "t0 -> every rank of the next attempt up (s)", "runs"],
            ["walk-ins (fdl-fabric join --persist)", cell(walked, 2),
             str(sum(w is not None for w in walked))],
            ["SSH hosts (issue 20)", cell(sshed, 2),
             str(sum(s is not None for s in sshed))]]
    benchlib.write_table(sys.stdout, rows, [False, True, True])
    print(f"ratio walk-ins / SSH: {benchlib.ratio(benchlib.med(walked), benchlib.med(sshed))}")


def main() -> int:
    parser = benchlib.arg_parser(__doc__)
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                        default=[4, 16, 64])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--death", action="store_true", help="also the death bench")
    parser.add_argument("--only-death", action="store_true")
    parser.add_argument("--timeout", type=float, default=90.0)
    args = parser.parse_args()
    print(f"load {benchlib.loadavg()}")
    with benchlib.terminate_gracefully(), tempfile.TemporaryDirectory(
            prefix="fdl-join-bench-") as tmp:
        folder = Path(tmp)
        try:
            if not args.only_death:
                formed(args, folder)
            if args.death or args.only_death:
                death(args, folder)
        finally:
            elasticlib.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
