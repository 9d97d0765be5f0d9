#!/usr/bin/env python3
"""Issue 22: heartbeat latency and join time while 300 idle peers flood the coordinator.

Prints, per tree and scenario, the medians, p99 and max over every heartbeat of every
run; it is a script, not a test, so no timing is ever asserted. Scenarios, round-robin
over ``--repeat`` rounds:

* **quiet**: ``--ranks`` rank processes join a coordinator and send heartbeats;
* **flood**: the same, while a flooder process (``--threads`` threads; connect() releases
  the GIL) opens TCP connections to the coordinator's port as fast as it can, holding the
  last ``--hold`` (300) and sending nothing. It starts ``--warm`` s before the ranks, so
  the join happens under the flood too;
* **cpu hog**: the control: as many processes spinning in ``while True: pass`` as the
  flooder has threads, and no connection. A flooder on the same machine takes CPU from
  the ranks and the coordinator; this scenario shows what that alone costs.

``--pin`` puts the flooder (or the hog) on the last CPU and the coordinator and the ranks
on the others (``taskset``), as for a flooder on another machine.

Measured:

* **heartbeat latency**: when the coordinator handled a heartbeat (its `_handle`, the
  same call that refreshes the rank's liveness) minus when the rank sent it (just before
  `_Client.send` framed it; only frames that send wrote count); both are
  ``time.monotonic()``, CLOCK_MONOTONIC, one clock for every process of the machine.
  Frames are matched by rank and sequence number. It
  includes the loopback transfer and the rank's own scheduling after the timestamp; the
  coordinator's "one tick late" bound is 50 ms. Ranks beat every ``--interval`` s (0.1;
  a real rank beats every 1 s: more samples, the same path). **lost** = heartbeats sent
  and never handled;
* **join**: from the rank's call of `rank.join()` to its return (dials, hello, welcome;
  redials when turned away);
* the flooder's connects per second, what the coordinator refused or dropped (its
  events' counts), the coordinator process's CPU while the ranks ran (% of one core),
  and ranks declared dead (``heartbeat_timeout`` 30 s: none expected).

The coordinator runs alone in a process of its own (`Coordinator` with a `_handle` that
notes heartbeats), not inside a whole launch: `tests/test_flood_lab.py` covers the
launch. ``--baseline REF`` runs the same rounds against the coordinator and rank client
of an older commit too (``git archive`` into the scratch folder; processes started with
``PYTHONPATH`` on it, checked before use), e.g. the last commit before issue 22's fix.

Run ``python3 bench/flood.py`` (``--help`` for options). Every process it starts runs in
a process group of its own, and only those are stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TextIO

import benchlib

from fdl_fabric.testing.flood import FLOODER, HOLD

ROOT = benchlib.ROOT
SALT = bytes(range(16))
RUN_ID = "20250101-000000-f100d22"

#: The coordinator's process: prints its port, runs until stdin closes, then prints what
#: it heard (rank, sequence number, monotonic time of each heartbeat) and what it said.
SERVER = r"""
import json, sys, time
from fdl_fabric.events import EventBus, EventLog, Name
from fdl_fabric.supervision.coordinator import Coordinator, CoordinatorSpec
world, timeout, run_id = int(sys.argv[1]), float(sys.argv[2]), sys.argv[4]
salt = bytes.fromhex(sys.argv[3])
if len(sys.argv) > 5 and sys.argv[5]:
    import fdl_fabric.supervision.coordinator as module
    module.ACCEPT_PER_TURN = int(sys.argv[5])
heard = []
class Noting(Coordinator):
    def _handle(self, conn, message):
        if message.get("type") == "heartbeat":
            heard.append((conn.rank, conn.rx_seq - 1, time.monotonic()))
        super()._handle(conn, message)
log = EventLog()
coord = Noting(CoordinatorSpec(run_id=run_id, salt=salt, world_size=world, bind_host="127.0.0.1",
                               port=0, heartbeat_timeout=timeout), EventBus(log))
coord.start()
print(json.dumps({"port": coord.port, "module": sys.modules[Coordinator.__module__].__file__}),
      flush=True)
sys.stdin.read()
coord.stop()
refused = sum(e.data.get("refused", 0) for e in log.events
              if e.name in (Name.PEER_DROPPED, Name.PEERS_REFUSED))
print(json.dumps({"heard": heard, "refused": refused, "formed": coord.cohort_formed,
                  "dead": [e.rank for e in log.events if e.name is Name.RANK_DECLARED_DEAD]}),
      flush=True)
"""

#: A rank: notes the time of each heartbeat it sends, joins, beats for a while, exits
#: cleanly, and prints its join time and its notes.
RANK = r"""
import json, sys, time
import fdl_fabric.rank as rank
rank.HEARTBEAT_INTERVAL = float(sys.argv[1])
seconds = float(sys.argv[2])
sent = []
send = rank._Client.send
def noting_send(self, message):
    seq, now = self.tx_seq, time.monotonic()
    done = send(self, message)
    if done and message.get("type") == "heartbeat":  # not one that exiting() overtook
        sent.append((seq, now))
    return done
rank._Client.send = noting_send
started = time.monotonic()
try:
    me = rank.join(timeout=30)
except RuntimeError as exc:
    print(json.dumps({"error": str(exc), "join": time.monotonic() - started}), flush=True)
    sys.exit(1)
joined = time.monotonic()
time.sleep(seconds)
rank.exiting()
print(json.dumps({"rank": me.rank, "join": joined - started, "sent": sent}), flush=True)
"""


SCENARIOS = ("quiet", "flood", "cpu hog")
#: The control: as many spinning processes as the flooder has threads, and no connection.
HOG = "while True: pass"


@dataclass
class Sample:
    tree: str
    scenario: str
    rep: int
    ok: bool = True
    error: str = ""
    latencies: list[float] = field(default_factory=list)
    lost: int = 0
    joins: list[float] = field(default_factory=list)
    connects_per_s: Optional[float] = None
    refused: int = 0
    dead: list[int] = field(default_factory=list)
    #: The coordinator process's CPU while the ranks ran, % of one core.
    cpu: Optional[float] = None


def _envelope(port: int, world: int, ranks: Sequence[int]) -> str:
    from fdl_fabric.planning.envelope import SlimEnvelope

    return SlimEnvelope(run_id=RUN_ID, controller_host="127.0.0.1", controller_port=port,
                        world_size=world, num_workers=1, host="localhost", ranks=tuple(ranks),
                        local_devices=None, nccl_socket_ifname=None, path="/tmp",
                        salt=SALT).to_hex()


def _env(tree: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_")}
    env.update({"PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"})
    return env


def _json_line(proc: subprocess.Popen[bytes], what: str, timeout: float) -> dict[str, Any]:
    """The next stdout line of ``proc`` as JSON (read in a thread-free way: the process
    prints one line and waits, so a blocking read with a watchdog is enough)."""
    import select

    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise benchlib.BenchError(f"no line from the {what} within {timeout:g}s")
    line = proc.stdout.readline()
    if not line:
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        raise benchlib.BenchError(f"the {what} exited without a line: {err[-500:]}")
    result: dict[str, Any] = json.loads(line)
    return result


@dataclass(frozen=True)
class Pinning:
    """``taskset`` prefixes: the flooder (or hog) on the last CPU, the coordinator and the
    ranks on the others (``--pin``); empty when not pinned."""

    attacker: tuple[str, ...] = ()
    victim: tuple[str, ...] = ()


def pinning(args: argparse.Namespace) -> Pinning:
    cpus = sorted(os.sched_getaffinity(0))
    if not args.pin or len(cpus) < 2:
        return Pinning()
    rest = ",".join(str(c) for c in cpus[:-1])
    return Pinning(("taskset", "-c", str(cpus[-1])), ("taskset", "-c", rest))


def run_once(args: argparse.Namespace, tree_name: str, tree: Path, scenario: str,
             rep: int) -> Sample:
    sample = Sample(tree_name, scenario, rep)
    pin = pinning(args)
    env = _env(tree)
    # Its own session, as benchlib.start does, but with a pipe on stdin: it runs until EOF.
    server = benchlib.adopt(subprocess.Popen(
        [*pin.victim, sys.executable, "-c", SERVER, str(args.ranks), "30", SALT.hex(), RUN_ID,
         str(args.accept_per_turn or "")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        cwd=str(tree), start_new_session=True))
    flooder: Optional[subprocess.Popen[bytes]] = None
    ranks: list[subprocess.Popen[bytes]] = []
    hogs: list[subprocess.Popen[bytes]] = []
    try:
        hello = _json_line(server, "coordinator", 20)
        port = int(hello["port"])
        if not str(hello["module"]).startswith(str(tree)):
            raise benchlib.BenchError(f"the coordinator came from {hello['module']}, not {tree}")
        flood_started = 0.0
        if scenario == "cpu hog":
            hogs = [benchlib.start([*pin.attacker, sys.executable, "-I", "-S", "-c", HOG])
                    for _ in range(args.threads)]
            time.sleep(args.warm)
        if scenario == "flood":
            flooder = benchlib.start([*pin.attacker, sys.executable, "-I", "-S", "-c", FLOODER,
                                      "127.0.0.1", str(port), str(args.hold),
                                      str(args.threads)])
            assert flooder.stdout is not None
            if flooder.stdout.readline() != b"flooding\n":
                raise benchlib.BenchError("the flooder did not start")
            flood_started = time.monotonic()
            time.sleep(args.warm)
        for r in range(args.ranks):
            renv = {**env, "FLODL_INTERNAL_CLUSTER_JSON":
                    _envelope(port, args.ranks, range(args.ranks)),
                    "RANK": str(r), "FLODL_INTERNAL_LOCAL_RANK": str(r)}
            ranks.append(benchlib.start([*pin.victim, sys.executable, "-c", RANK,
                                         str(args.interval), str(args.seconds)],
                                        env=renv, cwd=str(tree)))
        cpu0, t0 = benchlib.cpu_seconds(server.pid), time.monotonic()
        said = [_json_line(p, f"rank {r}", args.seconds + 60) for r, p in enumerate(ranks)]
        cpu1 = benchlib.cpu_seconds(server.pid)
        if cpu0 is not None and cpu1 is not None:
            sample.cpu = 100 * (cpu1 - cpu0) / (time.monotonic() - t0)
        for p in ranks:
            p.wait(10)
            benchlib.forget(p)
        for p in hogs:
            benchlib.stop(p, grace=2.0)
        if flooder is not None:
            benchlib.stop(flooder, grace=5.0)
            assert flooder.stdout is not None
            counts = json.loads(flooder.stdout.read().decode().strip().splitlines()[-1])
            sample.connects_per_s = counts["connected"] / (time.monotonic() - flood_started)
            flooder = None
        assert server.stdin is not None
        server.stdin.close()
        heard = _json_line(server, "coordinator", 20)
        server.wait(10)
        benchlib.forget(server)
        sample.refused, sample.dead = int(heard["refused"]), list(heard["dead"])
        handled = {(r, seq): t for r, seq, t in heard["heard"]}
        errors = [s["error"] for s in said if "error" in s]
        if errors:
            raise benchlib.BenchError("join failed: " + errors[0])
        for s in said:
            sample.joins.append(float(s["join"]))
            for seq, t in s["sent"]:
                got = handled.get((s["rank"], seq))
                if got is None:
                    sample.lost += 1
                else:
                    sample.latencies.append(got - t)
    except (benchlib.BenchError, OSError, ValueError, KeyError,
            subprocess.SubprocessError) as exc:
        sample.ok, sample.error = False, f"{type(exc).__name__}: {exc}"
    finally:
        for p in [*ranks, *hogs, *([flooder] if flooder else []), server]:
            if p.poll() is None or p.pid in benchlib._LIVE:
                benchlib.stop(p, grace=2.0)
    return sample


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def report(args: argparse.Namespace, samples: Sequence[Sample], trees: Sequence[str],
           out: TextIO) -> None:
    head = ["tree", "scenario", "beats", "lost", "latency p50 ms", "p99 ms", "max ms",
            "join p50 ms", "join max ms", "connects/s", "refused", "coord CPU %", "dead",
            "runs"]
    rows = [head]
    p99: dict[tuple[str, str], float] = {}
    for tree in trees:
        for scenario in SCENARIOS:
            got = [s for s in samples if s.tree == tree and s.scenario == scenario and s.ok]
            lat = [x for s in got for x in s.latencies]
            joins = [x for s in got for x in s.joins]
            rates = [s.connects_per_s for s in got if s.connects_per_s is not None]
            cpus = [s.cpu for s in got if s.cpu is not None]
            failed = sum(1 for s in samples if s.tree == tree and s.scenario == scenario
                         and not s.ok)
            if lat:
                p99[(tree, scenario)] = _pct(lat, 0.99)
            rows.append([
                tree, scenario, str(len(lat)), str(sum(s.lost for s in got)),
                _ms(statistics.median(lat)) if lat else "-",
                _ms(_pct(lat, 0.99)) if lat else "-", _ms(max(lat)) if lat else "-",
                _ms(statistics.median(joins)) if joins else "-",
                _ms(max(joins)) if joins else "-",
                f"{statistics.median(rates):.0f}" if rates else "-",
                str(sum(s.refused for s in got)),
                f"{statistics.median(cpus):.0f}" if cpus else "-",
                str(sum(len(s.dead) for s in got)),
                f"{len(got)}" + (f" (+{failed} failed)" if failed else "")])
    out.write(f"\nHeartbeat latency (coordinator handled - rank sent) and join time: "
              f"{args.ranks} ranks beating every {args.interval:g} s for {args.seconds:g} s "
              f"a run; flood = {args.threads}-thread flooder holding the last {args.hold} "
              f"idle connections, from {args.warm:g} s before the ranks start\n\n")
    out.write(benchlib.table(rows, [False, False] + [True] * (len(head) - 2)) + "\n")
    for tree in trees:
        quiet, flood = p99.get((tree, "quiet")), p99.get((tree, "flood"))
        if quiet and flood:
            verdict = "met" if flood <= 2 * quiet else "NOT met"
            out.write(f"\n{tree}: target p99 under flood <= 2 x quiet p99: {_ms(flood)} ms vs "
                      f"2 x {_ms(quiet)} ms: {verdict} ({flood / quiet:.2f}x)")
        elif quiet:
            out.write(f"\n{tree}: no heartbeat handled under flood")
    out.write("\n")
    for s in samples:
        if not s.ok:
            out.write(f"\n{s.tree} {s.scenario} run {s.rep + 1} FAILED: {s.error}")
    out.write("\n")


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="rounds of every scenario (3)")
    ap.add_argument("--ranks", type=int, default=4, help="rank processes (4)")
    ap.add_argument("--seconds", type=float, default=20.0,
                    help="how long each rank beats after joining (20)")
    ap.add_argument("--interval", type=float, default=0.1,
                    help="the ranks' heartbeat interval in s (0.1; a real rank: 1)")
    ap.add_argument("--hold", type=int, default=HOLD, help=f"idle connections held ({HOLD})")
    ap.add_argument("--threads", type=int, default=2, help="flooder threads (2)")
    ap.add_argument("--warm", type=float, default=1.0,
                    help="seconds of flood before the ranks start (1)")
    ap.add_argument("--pin", action="store_true",
                    help="flooder (or hog) on the last CPU, coordinator and ranks on the "
                         "others: what the flood costs the coordinator, not the CPU it takes")
    ap.add_argument("--accept-per-turn", type=int, metavar="N",
                    help="set the coordinator's ACCEPT_PER_TURN (this tree; to explore)")
    ap.add_argument("--baseline", metavar="REF",
                    help="also run the coordinator and rank client of this commit")
    ap.add_argument("--wait-load", type=float, metavar="L",
                    help="wait until the 1-minute load average is at most L")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args(argv)
    if args.repeat < 1 or args.ranks < 1 or args.threads < 1:
        ap.error("--repeat, --ranks and --threads must be at least 1")
    return args


def _bench(args: argparse.Namespace, tmp: Path, out: TextIO) -> int:
    trees: dict[str, Path] = {"this tree": ROOT}
    if args.baseline:
        old = tmp / "baseline"
        old.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.baseline],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        commit = benchlib.tool_version(["git", "-C", str(ROOT), "rev-parse", "--short",
                                        args.baseline])
        trees[f"baseline {commit}"] = old
    load_start = benchlib.wait_for_quiet(args.wait_load, out)
    started = time.monotonic()
    samples: list[Sample] = []
    for rep in range(args.repeat):
        for name, tree in trees.items():
            for scenario in SCENARIOS:
                s = run_once(args, name, tree, scenario, rep)
                samples.append(s)
                if s.ok:
                    status = (f"p99 {_ms(_pct(s.latencies, 0.99)) if s.latencies else '-'} ms, "
                              f"join max {_ms(max(s.joins)) if s.joins else '-'} ms, "
                              f"lost {s.lost}, dead {len(s.dead)}")
                else:
                    status = "FAILED: " + s.error
                out.write(f"  round {rep + 1} {name} {scenario}: {status}  "
                          f"(load {benchlib.loadavg()})\n")
                out.flush()
    report(args, samples, list(trees), out)
    benchlib.write_machine_notes(out, load_start, started)
    return 0 if all(s.ok for s in samples if s.tree == "this tree") else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    return benchlib.run_in_scratch("fdl-flood-", parse_args(argv), _bench, benchlib.stop_all)


if __name__ == "__main__":
    sys.exit(main())
