"""A rank program for the reliability tests: it writes down every signal it receives.

Usage: sigprobe.py DIR [--sleep S] [--ignore-term | --ignore-term-ranks R,R] [--fork]
  [--spawn-on-term]

- On start it writes DIR/start-r<RANK>-<pid>.json: pid, pgid, sid, start time
  (``time.time()``), run id, and the pid of its child with --fork.
- Every TERM, INT, HUP, USR1 and USR2 it receives appends one line
  ``<role> <pid> <SIGNAME> <time.time()>`` to DIR/sig-r<RANK>.log (role ``rank``, or
  ``child`` for the process made by --fork). The marker file is how a test sees that
  a signal reached a rank, on any host.
- TERM and INT end it (status 0) unless --ignore-term, or --ignore-term-ranks names
  its RANK (then only KILL does); USR1, USR2 and HUP do not.
- --fork: fork one child, in the same process group, that behaves the same way.
- --spawn-on-term: on TERM, first start a helper (``sleep 300``, same process group,
  same environment) and only then exit, like a job that launches a checkpoint
  upload when it is told to stop. The helper's pid goes to DIR/spawned-r<RANK>.
- --sleep: how long to live (default 300 s). It prints one line when it is ready and
  nothing after that, so it survives losing its stdout (an orphaned remote rank).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

RECORDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--sleep", type=float, default=300.0)
    p.add_argument("--ignore-term", action="store_true")
    p.add_argument("--ignore-term-ranks", default="")
    p.add_argument("--fork", action="store_true")
    p.add_argument("--spawn-on-term", action="store_true")
    a = p.parse_args()
    rank = os.environ.get("RANK", "x")
    ignore_term = a.ignore_term or rank in a.ignore_term_ranks.split(",")
    os.makedirs(a.dir, exist_ok=True)
    log = os.path.join(a.dir, f"sig-r{rank}.log")
    role = "rank"

    def record(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        line = f"{role} {os.getpid()} {name} {time.time():.6f}\n".encode()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        if name == "SIGTERM" and a.spawn_on_term:
            helper = subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            with open(os.path.join(a.dir, f"spawned-r{rank}"), "w", encoding="utf-8") as fh:
                fh.write(f"{helper.pid}\n")
        if name in ("SIGTERM", "SIGINT") and not ignore_term:
            os._exit(0)

    for name in RECORDED:
        signal.signal(getattr(signal, name), record)

    child = 0
    if a.fork:
        child = os.fork()
        if child == 0:
            role = "child"
    if child or not a.fork:
        info = {"pid": os.getpid(), "pgid": os.getpgid(0), "sid": os.getsid(0),
                "time": time.time(), "run": os.environ.get("FLODL_INTERNAL_RUN_ID", ""),
                "child": child or None, "host": os.environ.get("FLODL_HOST_NAME", "")}
        path = os.path.join(a.dir, f"start-r{rank}-{os.getpid()}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(info, fh)
        os.replace(path + ".tmp", path)
        print(f"sigprobe rank {rank} ready", flush=True)
        sys.stdout.flush()
    deadline = time.monotonic() + a.sleep
    while time.monotonic() < deadline:
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
