"""flood.py's machinery: the coordinator and rank programs (run from a given tree: this
one or ``--baseline``), the flooder and CPU hog beside them, and one measured run
(`run_once`)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import benchlib

from fdl_fabric.testing.flood import FLOODER

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
    import fdl_fabric.supervision.connections as module
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


def _start_flooder(args: argparse.Namespace, pin: Any, port: int) -> subprocess.Popen[bytes]:
    """The flooder, once it says it floods."""
    flooder = benchlib.start([*pin.attacker, sys.executable, "-I", "-S", "-c", FLOODER,
                              "127.0.0.1", str(port), str(args.hold), str(args.threads)])
    assert flooder.stdout is not None
    if flooder.stdout.readline() != b"flooding\n":
        raise benchlib.BenchError("the flooder did not start")
    return flooder


def _beats(sample: Sample, said: list[dict[str, Any]],
           handled: dict[tuple[int, int], float]) -> None:
    """Each rank's join time, and each beat it sent: handled (its latency) or lost."""
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


def _start_ranks(args: argparse.Namespace, pin: Any, env: dict[str, str], port: int,
                 tree: Path) -> list[subprocess.Popen[bytes]]:
    ranks = []
    for r in range(args.ranks):
        renv = {**env, "FLODL_INTERNAL_CLUSTER_JSON":
                _envelope(port, args.ranks, range(args.ranks)),
                "RANK": str(r), "FLODL_INTERNAL_LOCAL_RANK": str(r)}
        ranks.append(benchlib.start([*pin.victim, sys.executable, "-c", RANK,
                                     str(args.interval), str(args.seconds)],
                                    env=renv, cwd=str(tree)))
    return ranks


def _stop_flooder(flooder: subprocess.Popen[bytes], started: float) -> float:
    """Stop the flooder; the connections it made a second."""
    benchlib.stop(flooder, grace=5.0)
    assert flooder.stdout is not None
    counts = json.loads(flooder.stdout.read().decode().strip().splitlines()[-1])
    return float(counts["connected"]) / (time.monotonic() - started)


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
            flooder = _start_flooder(args, pin, port)
            flood_started = time.monotonic()
            time.sleep(args.warm)
        ranks += _start_ranks(args, pin, env, port, tree)
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
            sample.connects_per_s = _stop_flooder(flooder, flood_started)
            flooder = None
        assert server.stdin is not None
        server.stdin.close()
        heard = _json_line(server, "coordinator", 20)
        server.wait(10)
        benchlib.forget(server)
        sample.refused, sample.dead = int(heard["refused"]), list(heard["dead"])
        handled = {(r, seq): t for r, seq, t in heard["heard"]}
        _beats(sample, said, handled)
    except (benchlib.BenchError, OSError, ValueError, KeyError,
            subprocess.SubprocessError) as exc:
        sample.ok, sample.error = False, f"{type(exc).__name__}: {exc}"
    finally:
        for p in [*ranks, *hogs, *([flooder] if flooder else []), server]:
            if p.poll() is None or p.pid in benchlib._LIVE:
                benchlib.stop(p, grace=2.0)
    return sample
